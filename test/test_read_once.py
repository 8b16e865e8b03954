"""A verified load reads each stored byte once: counted in its system calls.

The same step is loaded twice, each time in a process of its own under
``strace -f -y``: by ``load_stage`` (which checks every item against its
CRC-32C in ``manifest.json``) and by a plain ``dcp.load``. The bytes each
``read``/``pread64`` returns from the step's data files are added up; the
verified load may read at most 5% more. On an object store every byte read
twice is a second GET.

Run as a script, this module is the load that is traced:
``python test_read_once.py pippy|plain STEP OUT WIDTH``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    _ENV,
    EXAMPLE,
    ROOT,
    STRACE_FD,
    STRACE_LINE,
    plain_read,
    require_strace,
    strace_command,
    strace_joined,
)

READS = "read,pread64,readv,preadv,preadv2"
NOT_DATA = {".metadata", "manifest.json"}


def stage(seed, width):
    """A StageState of four Linear(width, width) and AdamW, stepped once.

    Width 256: 3 MB, every item read whole, then loaded; width 1024: 48 MB,
    items of 4 MB read by torch.load straight into their tensors.
    """
    from pippy import checkpoint

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return checkpoint.StageState(model, optimizer)


def data_bytes_read(trace, step):
    """Bytes the traced process read from the step's data files, by file."""
    read = {}
    for line in strace_joined(trace.splitlines()):
        m = STRACE_LINE.match(line)
        fd = m and STRACE_FD.match(m["args"])
        if fd and int(m["ret"]) > 0:
            path = Path(fd["path"])
            if path.parent == step and path.name not in NOT_DATA:
                read[path.name] = read.get(path.name, 0) + int(m["ret"])
    return read


def traced_load(how, step, out, width):
    """Loads `step` in another process under strace (pippy's or plain DCP's
    load); the bytes it read from each data file."""
    trace = out / f"{how}.strace"
    command = strace_command(READS, trace, strings=0)
    command += [sys.executable, __file__, how, str(step), str(out), str(width)]
    path = [ROOT, ROOT / "test", EXAMPLE.parent]  # pippy, helpers, gpt
    env = {**_ENV, "PYTHONPATH": os.pathsep.join(map(str, path))}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return data_bytes_read(trace.read_text(), step)


@pytest.fixture(autouse=True)
def _need_strace():
    require_strace()


@pytest.mark.launches
@pytest.mark.parametrize("width", [256, 1024])
def test_a_verified_load_reads_each_stored_byte_once(tmp_path, width):
    from pippy import checkpoint

    saved = stage(seed=0, width=width)
    saved.step = 1
    step = checkpoint.save_stage(saved, tmp_path / "ckpt")
    plain = traced_load("plain", step, tmp_path, width)
    verified = traced_load("pippy", step, tmp_path, width)
    # The load was whole and verified, not a read of nothing.
    loaded = torch.load(tmp_path / "pippy.pt", weights_only=True)
    for key, value in saved.module.state_dict().items():
        assert torch.equal(loaded[key], value), key
    stored = sum(p.stat().st_size for p in step.iterdir() if p.name not in NOT_DATA)
    assert plain.keys() == verified.keys() and sum(plain.values()) >= 0.9 * stored
    ratio = sum(verified.values()) / sum(plain.values())
    print(f"bytes read: load_stage {verified}, dcp.load {plain}: {ratio:.3f}x")
    assert ratio <= 1.05, (verified, plain)


def _load(how, step, out, width):
    """The traced load: `how` is pippy (load_stage) or plain (dcp.load)."""
    if how == "plain":
        plain_read(step)
        return
    from pippy import checkpoint

    state = stage(seed=1, width=width)
    checkpoint.load_stage(state, step)
    assert state.step == 1
    torch.save(state.module.state_dict(), out / "pippy.pt")


if __name__ == "__main__":
    _load(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
