"""What the tests share: launching real ranks, the tiny model, planted pickles."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt import GPT, ModelArgs, init_weights

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "checkpoint" / "pippy_dcp.py"
DIST_CHECKS = Path(__file__).with_name("dist_checks.py")

#: The example's flags for a model of a few hundred KB.
TINY_FLAGS = ["--n-layers", "4", "--dim", "32", "--seq-len", "32"]


def tiny_gpt(n_layers=4, dim=32, max_seq_len=32, seed=0):
    """A small GPT with deterministic weights, built on the CPU."""
    model = GPT(ModelArgs(n_layers=n_layers, dim=dim, max_seq_len=max_seq_len))
    init_weights(model, seed)
    return model


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


class Payload:
    """Unpickling this creates a file: what an attacker's pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def poison_metadata(folder, marker):
    """Hides a payload in an otherwise valid .metadata: loads still work."""
    path = Path(folder) / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written just now
    metadata.storage_meta.modules.append(Payload(marker))
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def linear_state(optimizer_groups=None):
    """A StageState of one Linear(4, 4) with AdamW, stepped once."""
    from pippy import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    groups = optimizer_groups(model) if optimizer_groups else model.parameters()
    optimizer = torch.optim.AdamW(groups)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return checkpoint.StageState(model, optimizer)
