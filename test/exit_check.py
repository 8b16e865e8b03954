"""Runs a script as torchrun would (`exit_check.py SCRIPT ARGS...`), then, in
the interpreter's last exit handler, prints how many torch modules are still
alive: "[rank R] at exit: N torch modules alive". A module alive then is freed
in interpreter finalization, and with it its process groups, which can abort
the process (pytorch/pytorch#179291)."""

import atexit
import gc
import os
import runpy
import sys


def _report() -> None:
    """Counts the live torch modules; registered first, so it runs last."""
    import torch

    alive = sum(isinstance(o, torch.nn.Module) for o in gc.get_objects())
    print(f"[rank {os.environ['RANK']}] at exit: {alive} torch modules alive")
    sys.stdout.flush()


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
