"""Helpers shared by the tests: launching real ranks with torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "checkpoint" / "pippy_dcp.py"
DIST_CHECKS = Path(__file__).with_name("dist_checks.py")

sys.path.insert(0, str(EXAMPLE.parent))  # `import pippy_dcp` in tests


def torchrun(nproc, script, *args, timeout=240, expect_ok=True):
    """Runs `script` on `nproc` gloo ranks with torchrun; returns the process.

    Each launch gets a timeout, so a hung collective fails the test instead of
    stalling the suite. With expect_ok, a non-zero exit fails the test and shows
    the tail of the output.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    if expect_ok and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def loss_lines(stdout):
    """The "step N | loss X | lr Y" part of the example's progress lines."""
    lines = stdout.splitlines()
    return [line.rsplit("|", 1)[0] for line in lines if line.startswith("step ")]
