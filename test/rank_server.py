"""One rank of the example kept across tests (test/rank_pool.py starts it).

    python -u test/rank_server.py RANK WORLD_SIZE

It imports the example once (torch, DCP, pipelining: about 2.5 s of CPU),
then, for each request read from stdin, one JSON line ``{"argv": [...],
"port": N, "cwd": "...", "out": "...", "err": "...", "exit_check": false,
"script": null, "env": {}}``, forks a process that runs the example's
``main`` (or ``script``, as ``python script ARGV`` would), with ``env``
added to the environment torchrun gives a worker (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), its stdout and stderr (file descriptors 1
and 2) written to ``out`` and ``err``, and ends as a process does (atexit, threads joined). With ``exit_check``, the
process's first exit handler prints how many torch modules are still alive,
before any other handler has run. It answers each with one line, ``{"code":
N}``: that process's exit status (-N for signal N). A run is a process of
its own in all but its start, and one that fails leaves the server as it
was.
"""

import atexit
import gc
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE_DIR = HERE.parent / "examples" / "checkpoint"
sys.path.insert(0, str(EXAMPLE_DIR))


def run(request: dict) -> int:
    """The example's main on ``request`` (or its ``script``); its exit status."""
    import pippy_dcp

    os.environ["MASTER_PORT"] = str(request["port"])
    os.environ.update(request.get("env") or {})
    os.chdir(request["cwd"])
    try:
        if request.get("script"):
            run_script(request["script"], request["argv"])
        else:
            sys.argv = [pippy_dcp.__file__, *request["argv"]]
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


def run_script(script: str, argv: list) -> None:
    """Runs ``script`` as ``python script *argv`` would: its folder first on
    the import path, and neither the example's modules nor the tests'
    importable (the server imported them; a script run as written could not)."""
    ours = {str(HERE), str(EXAMPLE_DIR)}
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + [
        p for p in sys.path if p not in ours
    ]
    for name, module in list(sys.modules.items()):
        where = os.path.dirname(getattr(module, "__file__", None) or "")
        if where in ours and name != "__main__":  # this server itself stays
            del sys.modules[name]
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def report_modules_alive() -> None:
    """Prints "[rank R] at exit: N torch modules alive". A module alive at
    exit is freed in interpreter finalization, and with it its process
    groups, which can abort the process (pytorch/pytorch#179291)."""
    import gc

    import torch

    alive = sum(isinstance(o, torch.nn.Module) for o in gc.get_objects())
    print(f"[rank {os.environ['RANK']}] at exit: {alive} torch modules alive")
    sys.stdout.flush()


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

    # The imports' objects out of the collector's sight (they live as long as
    # the server): a run's gc.collect() walks only what the run made, 0.15 s
    # of CPU less per rank than in a process of its own.
    gc.freeze()

    answer = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the run's process: its output to its files, then exit
            os.dup2(os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            if request.get("exit_check"):  # the last registered: it runs first
                atexit.register(report_modules_alive)
            sys.exit(run(request))  # as a process ends: atexit, threads joined
        status = os.waitpid(pid, 0)[1]
        code = os.waitstatus_to_exitcode(status)
        answer.write(json.dumps({"code": code}) + "\n")
        answer.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
