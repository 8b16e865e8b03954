"""A published step survives a power loss: proven by the syscall order of a save.

A real save on 2 ranks runs under ``strace -f -y``; the trace must show every
file under the checkpoint folder fsynced after its last write before it is
renamed (or its folder renamed), and the folder holding a new name fsynced
after every publishing rename; and no data file opened to be read back for
its checksums. The same checker, run on what a script without pippy writes
(``dcp.save`` into a folder, then a rename), finds the holes: on torch 2.13 ``.metadata.tmp`` is fsynced before its bytes are
written, and no folder is fsynced after a rename.
"""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import (
    STRACE_FD,
    STRACE_LINE,
    STRACE_QUOTED,
    _torchrun_command,
    require_strace,
    strace_command,
    strace_joined,
)

CHECKS = Path(__file__).with_name("seam_checks.py")
SYSCALLS = "openat,write,pwrite64,writev,fsync,fdatasync,rename,renameat,renameat2"


@pytest.fixture(autouse=True)
def _need_strace():
    require_strace()


def durability_holes(trace: str, root: Path) -> list[str]:
    """What in a trace of a save would not survive a power loss, one line each.

    Args:
        trace: The output of ``strace -f -y`` of the save.
        root: The checkpoint folder; only names under it are checked.
    """
    root_text = str(root)
    last_write, last_fsync, renames, holes = {}, {}, [], []
    for i, line in enumerate(strace_joined(trace.splitlines())):
        m = STRACE_LINE.match(line)
        if m is None or root_text not in line or int(m["ret"]) < 0:
            continue
        call, args = m["call"], m["args"]
        fd = STRACE_FD.match(args)
        if call in ("write", "pwrite64", "writev") and fd:
            last_write[fd["path"]] = i
        elif call in ("fsync", "fdatasync") and fd:
            last_fsync[fd["path"]] = i
        elif call == "openat" and "O_CREAT" in args:
            path = STRACE_QUOTED.findall(args)[0]
            last_write[str(Path(path).parent)] = i  # a new name in the folder
        elif call.startswith("rename"):
            src, dst = STRACE_QUOTED.findall(args)[:2]
            for path, written in list(last_write.items()):  # src and all inside it
                if path == src or path.startswith(src + "/"):
                    if last_fsync.get(path, -1) < written:
                        holes.append(f"{path} renamed before its last write is fsynced")
            last_write[str(Path(dst).parent)] = i
            last_write[str(Path(src).parent)] = i
            renames.append((i, dst))
    for i, dst in renames:
        folder = str(Path(dst).parent)
        if last_fsync.get(folder, -1) < i:
            holes.append(f"{folder} not fsynced after {Path(dst).name} was renamed in")
    if not renames:
        holes.append("no rename under the checkpoint folder: nothing was published")
    return holes


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """seam_checks.py's durable (pippy's save, into ckpt/) and plain (dcp.save
    and a rename, into plain/) checks, in one launch of 2 ranks under strace:
    (its trace, the folder)."""
    require_strace()
    out = tmp_path_factory.mktemp("traced")
    return traced_save("durable,plain", out), out


def traced_save(checks: str, out: Path) -> str:
    """Runs checks of seam_checks.py on 2 ranks under strace; its trace."""
    trace = out / "strace.txt"
    command = strace_command(SYSCALLS, trace)
    command += _torchrun_command(2, CHECKS, [checks, out])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=400, env=env, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return trace.read_text()


@pytest.mark.launches
def test_a_step_saved_by_pippy_is_durable_when_published(traced):
    trace, out = traced
    root = out / "ckpt"
    assert (root / "step-1" / ".metadata").is_file()
    assert durability_holes(trace, root) == []
    # The trace saw the publishing renames, so the check above has teeth.
    renamed = [ln for ln in trace.splitlines() if "rename" in ln and str(root) in ln]
    assert any('/.metadata"' in ln for ln in renamed)
    assert any('/manifest.json"' in ln for ln in renamed)
    assert any(f'"{root}/step-1"' in ln for ln in renamed)
    # The manifest's checksums are taken as the items are written: no data
    # file is opened to be read back.
    opened = [
        ln
        for ln in trace.splitlines()
        if "openat(" in ln and ".distcp" in ln and str(root) in ln
    ]
    assert any("O_CREAT" in ln for ln in opened), opened
    assert [ln for ln in opened if "O_RDONLY" in ln] == []
    # Each data file fsynced once (DCP's sync_files would add a second).
    fsyncs = {}
    for line in strace_joined(trace.splitlines()):
        m = STRACE_LINE.match(line)
        fd = m and m["call"] in ("fsync", "fdatasync") and STRACE_FD.match(m["args"])
        if fd and fd["path"].endswith(".distcp") and str(root) in fd["path"]:
            fsyncs[fd["path"]] = fsyncs.get(fd["path"], 0) + 1
    assert len(fsyncs) == 2 and set(fsyncs.values()) == {1}, fsyncs


@pytest.mark.launches
def test_the_checker_finds_the_holes_of_plain_dcp_and_a_rename(traced):
    trace, out = traced
    holes = durability_holes(trace, out / "plain")
    staging = out / "plain" / ".step-1.partial"
    assert f"{out / 'plain'} not fsynced after step-1 was renamed in" in holes
    assert f"{staging} not fsynced after .metadata was renamed in" in holes
    assert f"{staging} renamed before its last write is fsynced" in holes
    if torch.__version__ < (2, 14):  # 2.14 flushes .metadata before its fsync
        metadata = f"{staging}/.metadata.tmp renamed before its last write is fsynced"
        assert metadata in holes


def test_the_checker_reads_unfinished_calls_of_threads():
    trace = "\n".join(
        [
            '7 openat(AT_FDCWD</>, "/c/s/f", O_WRONLY|O_CREAT, 0666) = 3</c/s/f>',
            "7 write(3</c/s/f>, ..., 10 <unfinished ...>",
            "8 fsync(4</c/s>) = 0",
            "7 <... write resumed>) = 10",
            '7 rename("/c/s", "/c/step-1") = 0',
            "7 fsync(5</c>) = 0",
        ]
    )
    assert durability_holes(trace, Path("/c")) == [
        "/c/s/f renamed before its last write is fsynced"
    ]
