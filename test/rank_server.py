"""One rank of the example kept across tests (test/rank_pool.py starts it).

    python -u test/rank_server.py RANK WORLD_SIZE

It imports the example once (torch, DCP, pipelining: about 2.5 s of CPU),
then, for each request read from stdin, one JSON line ``{"argv": [...],
"port": N, "cwd": "...", "out": "...", "err": "..."}``, forks a process that
runs the example's ``main`` in the environment torchrun gives a worker (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), its stdout and stderr (file
descriptors 1 and 2) written to ``out`` and ``err``, and ends as a process
does (atexit, threads joined). It answers each with one line, ``{"code":
N}``: that process's exit status (-N for signal N). A run is a process of
its own in all but its start, and one that fails leaves the server as it
was.
"""

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))


def run(request: dict) -> int:
    """The example's main on ``request``; its exit status."""
    import pippy_dcp

    os.environ["MASTER_PORT"] = str(request["port"])
    os.chdir(request["cwd"])
    sys.argv = [pippy_dcp.__file__, *request["argv"]]
    try:
        pippy_dcp.main(pippy_dcp.parse_args(request["argv"]))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: B036 (as an uncaught error ends a process)
        traceback.print_exc()
        return 1


def serve(rank: int, world_size: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    import pippy_dcp  # noqa: F401 (the import that costs, once)

    answer = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the run's process: its output to its files, then exit
            os.dup2(os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            sys.exit(run(request))  # as a process ends: atexit, threads joined
        status = os.waitpid(pid, 0)[1]
        code = os.waitstatus_to_exitcode(status)
        answer.write(json.dumps({"code": code}) + "\n")
        answer.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
