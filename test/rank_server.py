"""One rank of the example kept across tests (test/rank_pool.py starts it).

    python -u test/rank_server.py RANK WORLD_SIZE

It imports the example once (torch, DCP, pipelining: about 2.5 s of CPU),
then runs the example's ``main`` for each request read from stdin, one JSON
line ``{"argv": [...], "port": N, "cwd": "...", "out": "...", "err": "..."}``:
in the environment torchrun gives a worker (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), its stdout and stderr (file descriptors 1 and 2) written to
``out`` and ``err``. It answers each with one line, ``{"code": N}``, the
exit status the run would have had. A run is a process of its own in all but
its start: the same rank each time (the example's logging format names it),
warnings shown again, fsspec's cached file systems dropped, the default
process group destroyed by ``main``.
"""

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))


def run(request: dict) -> int:
    """The example's main on ``request``; its exit status."""
    import warnings

    import torch.distributed as dist

    import pippy_dcp

    assert not dist.is_initialized(), "the last run left its process group"
    _forget_file_systems()
    os.environ["MASTER_PORT"] = str(request["port"])
    os.chdir(request["cwd"])
    for module in list(sys.modules.values()):  # warnings shown once per run
        registry = getattr(module, "__dict__", {}).get("__warningregistry__")
        if isinstance(registry, dict):
            registry.clear()
    warnings.resetwarnings()
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


def _forget_file_systems() -> None:
    """Drops fsspec's cached file systems (and their listings), as a new
    process starts without them."""
    from fsspec.spec import AbstractFileSystem

    classes = [AbstractFileSystem]
    while classes:
        cls = classes.pop()
        cls.clear_instance_cache()
        classes += cls.__subclasses__()


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
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(err, 2)
        try:
            code = run(request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.close(out)
            os.close(err)
        answer.write(json.dumps({"code": code}) + "\n")
        answer.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
