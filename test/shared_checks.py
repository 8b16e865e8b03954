"""Checks of several scripts (test/*_checks.py, test_cost.py) in one launch of
ranks; run by conftest.py.

    torchrun --nproc-per-node N test/shared_checks.py SCRIPT.CHECK[,...] OUT_DIR

Each check runs as its own script runs it, in the order given, with
OUT_DIR/SCRIPT as its folder: it writes OUT_DIR/SCRIPT/<check>-rank<R>.json
and whatever it saves there, so that checks of two scripts never share a
path. Starting ranks is the slow part of a check: one launch for the checks
of several test modules saves a launch per module.
"""

import importlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    names, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        for name in names.split(","):
            script, check = name.split(".")
            folder = out / script
            folder.mkdir(parents=True, exist_ok=True)
            checks = importlib.import_module(script).CHECKS
            result = checks[check](folder, rank, world_size)
            (folder / f"{check}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # As helpers.run_checks: skip the interpreter's finalization, where gloo's
    # threads can abort the process after the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
