"""One rank answers every question about the checkpoint folder; the others ask none.

The example resumes on 3 ranks, saves with ``--keep-last`` and verifies,
each rank under its own ``strace`` (one trace file per rank, so a call is
known by its rank). Only rank 0 may list the checkpoint folder, look at its
step folders, their ``.metadata`` and ``manifest.json``, or the owner record;
the others open only the data files their stage reads and the staging folder
they write. In a bucket, one run on 2 ranks (save, --keep-last, load the
newest step) counts s3fs's real requests per rank (its own log, one line per
request): only rank 0 lists the run or reads a manifest, or asks whether a
step has a ``.metadata`` yet; rank 1 writes and reads its items, nothing else.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers import _ENV, EXAMPLE, ROOT, TINY_FLAGS, example, s3_env

STRACE = shutil.which("strace")
SYSCALLS = "getdents64,openat,newfstatat,statx,stat,lstat,access"
NPROC = 3
FLAGS = [*TINY_FLAGS, "--steps", "4", "--save-every", "2", "--keep-last", "1"]
_CALL = re.compile(r"^\d+\s+(?P<call>\w+)\((?P<args>.*)")
_FD = re.compile(r"^\d+<(?P<path>[^>]*)>")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _example_per_rank(out, wrapper, *flags, env=None, nproc=NPROC, timeout=240):
    """Runs the example on NPROC ranks, each started by the shell line
    ``wrapper`` ($0: out, $RANK: its rank, "$@": the example and its flags)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "--no-python", "sh", "-c", wrapper]
    command += [str(out), str(EXAMPLE), *map(str, flags)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_ENV, **(env or {})},
        cwd=ROOT,
    )
    logs = "".join(p.read_text()[-2000:] for p in sorted(out.glob("*.log")))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + logs
    return result


def _traced_example(out: Path, *flags):
    """The example with each rank under strace, into out/rank-<R>."""
    wrapper = (
        f"exec {STRACE} -f -qq -y --seccomp-bpf -s 256 -e trace={SYSCALLS} "
        f'-o "$0/rank-$RANK" {sys.executable} -u "$@"'
    )
    return _example_per_rank(out, wrapper, *flags)


def folder_questions(trace: str, root: Path) -> Counter:
    """What one rank's trace asks about the folder, by kind.

    ``list``: a listing (``getdents64``) of the checkpoint folder itself;
    ``look``: any call on the folder itself, a step folder, its
    ``.metadata`` or ``manifest.json``, or the owner record; ``data``: the
    opening of a step's data file (a load, which every rank does).
    """
    data = re.compile(rf"^{re.escape(str(root))}/step-\d+/__\d+_\d+\.distcp$")
    root_text = str(root)
    step = re.compile(
        rf"^{re.escape(root_text)}(/step-\d+(/(\.metadata|manifest\.json))?"
        r"|/\.owner\.json)?/?$"
    )
    asked: Counter = Counter()
    for line in trace.splitlines():
        m = _CALL.match(line)
        if m is None:
            continue
        fd = _FD.match(m["args"])
        if m["call"] == "getdents64":
            asked["list"] += bool(fd and fd["path"] == root_text)
            continue
        paths = _QUOTED.findall(m["args"])[:1]  # the path the call is about
        if m["call"] in ("newfstatat", "statx", "openat") and fd and fd["path"] != "/":
            if paths and not paths[0].startswith("/"):  # relative to a folder fd
                paths = [f"{fd['path']}/{paths[0]}" if paths[0] else fd["path"]]
        asked["look"] += any(step.match(p) for p in paths)
        asked["data"] += m["call"] == "openat" and any(data.match(p) for p in paths)
    return asked


@pytest.fixture
def traced(tmp_path):
    if STRACE is None:
        if os.environ.get("CI"):  # the README's setup installs it: CI must have it
            pytest.fail("strace is not installed; the README's setup installs it")
        pytest.skip("strace is not installed (apt-get install strace)")
    return tmp_path


@pytest.fixture
def stopped_at_2(traced):
    """The example on NPROC ranks (a pool's), stopped after its save at step
    2: its checkpoint folder, in a `traced` folder."""
    root = (traced / "ckpt").resolve()
    example(NPROC, *FLAGS, "--stop-after", "2", "--checkpoint-dir", root)
    return root


@pytest.mark.launches
def test_only_rank_0_lists_or_looks_at_the_checkpoint_folder(traced, stopped_at_2):
    root = stopped_at_2
    out = traced / "traces"
    out.mkdir()
    second = _traced_example(out, *FLAGS, "--checkpoint-dir", root)
    assert f"resuming from {root}/step-2" in second.stdout
    assert "removed step-2 (keeping the newest 1)" in second.stdout
    assert f"verified: {root}/step-4" in second.stdout
    asked = {
        r: folder_questions((out / f"rank-{r}").read_text(), root) for r in range(NPROC)
    }
    print(asked)
    assert asked[0]["list"] >= 3  # resume, save, keep-last, verify: rank 0 asks
    assert asked[0]["look"] > 0
    for rank in range(1, NPROC):  # they load their items, and ask nothing
        assert asked[rank]["data"] > 0, rank
        assert (asked[rank]["list"], asked[rank]["look"]) == (0, 0), rank


_S3_CALL = re.compile(
    r"CALL: (?P<call>\w+) - .*'Bucket': 'one', '(?:Key|Prefix)': '(?P<key>[^']*)'"
)
DATA = "<a data file>"


def bucket_calls(log: str, run: str) -> Counter:
    """``(call, key)`` of each call a rank's s3fs made on the run's objects.

    The calls come from s3fs's own log (``S3FS_LOGGING_LEVEL=DEBUG``: one
    ``CALL:`` line per request); a data file's key is counted as DATA.
    """
    calls: Counter = Counter()
    for m in _S3_CALL.finditer(log):
        key = m["key"]
        if key.startswith(f"{run}/"):
            name = key.rstrip("/").rsplit("/", 1)[-1]
            calls[m["call"], DATA if name.endswith(".distcp") else key] += 1
    return calls


MAKE_BUCKET = (
    "import s3fs; fs = s3fs.S3FileSystem(); fs.exists('one') or fs.mkdir('one')"
)


@pytest.fixture
def bucket(s3_endpoint):
    """A bucket of its own on the session's S3 server (conftest.py)."""
    env = s3_env(s3_endpoint)
    for _ in range(50):  # the filer may still be starting
        made = subprocess.run(
            [sys.executable, "-c", MAKE_BUCKET],
            env={**_ENV, **env},
            capture_output=True,
            timeout=60,
        )
        if made.returncode == 0:
            break
        time.sleep(0.2)
    return env, "s3://one/run"


def test_only_rank_0_lists_the_bucket(bucket, tmp_path):
    # One run: it owns a new folder, saves step-2 and step-4 (--keep-last
    # then deletes step-2), and loads the newest step to verify it, by the
    # same find_latest_step and load_into as a resume.
    env, url = bucket
    logged = f'exec {sys.executable} -u "$@" 2>"$0/rank-$RANK.log"'
    env = {**env, "S3FS_LOGGING_LEVEL": "DEBUG"}
    run = _example_per_rank(
        tmp_path, logged, *FLAGS, "--checkpoint-dir", url, env=env, nproc=2
    )
    assert "removed step-2 (keeping the newest 1)" in run.stdout
    assert f"verified: {url}/step-4" in run.stdout
    calls = [
        bucket_calls((tmp_path / f"rank-{r}.log").read_text(), "run") for r in (0, 1)
    ]
    assert calls[0]["list_objects_v2", "run/"] >= 3  # owner, 2 saves, keep-last, verify
    assert calls[0]["get_object", "run/step-4/manifest.json"] >= 1
    assert calls[1]["get_object", DATA] > 0  # rank 1 loads its items
    # A save reads nothing back: the manifest's checksums are taken from the
    # bytes as they are written (step-2 is saved, then removed, never loaded).
    for rank in (0, 1):
        log = (tmp_path / f"rank-{rank}.log").read_text()
        assert not re.search(r"CALL: get_object .*'Key': 'run/step-2/__", log), rank
    asked = {call: n for call, n in calls[1].items() if call[1] != DATA}
    # ... and asks nothing else: not even whether the step it saves has a
    # .metadata yet, which DCP's own writer asks on every rank (a HEAD and a
    # listing each), and pippy's ManifestWriter leaves to the coordinator.
    assert asked == {}
