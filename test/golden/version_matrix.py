"""Before a release: pippy under every torch it supports, and steps crossing them.

    python test/golden/version_matrix.py                 # 2.10 to 2.15, all six
    python test/golden/version_matrix.py --torch 2.10 2.15 --venvs /big/disk

Run it with the pinned torch (the README's venv, ``constraints.txt``). For each
requested torch it makes a venv under ``--venvs`` (``torch-2.10``, ...), or
reuses the one it made before: ``torch==X.*``, numpy, safetensors,
google-crc32c and pytest at the versions ``constraints.txt`` pins (all but its
torch pin), and pippy itself (``pip install -e <repo> --no-deps``). Those pins
replace any constraints file pip's own configuration names, so that a
machine-wide cap on torch does not hide a release. Then, with that torch:

* the example on 2 ranks: saved at step 2 and stopped, resumed to step 4 and
  verified bitwise;
* the fast test files, ``FAST_TESTS``: the golden steps, optimizer keys,
  one-process checkpointing, the safe reader, the private torch names pippy
  relies on, and torch.save's CRC-32 around a save (no SeaweedFS, no strace,
  no transformers; about 100 s on 2 idle cores);
* every golden step of ``test/golden/`` read against its digests;
* both crossing directions: the step this torch's example wrote, read with
  the pinned torch, and the step the pinned torch's example wrote, read with
  this torch, compared value by value.

It prints one table, and the time each version took. How long: the registry
serves torch 2.10, 2.11, 2.12, 2.14 and 2.15 for Linux only as CUDA builds
(they run on the CPU): each venv downloads about 4 GB and takes 5 to 7 GB of
disk (1 GB for a CPU build), 3 to 8 minutes each at about 20 MB/s; all six
took 25 minutes and 28 GB. The checks then took 73 to 183 s per version on 2
cores shared with other jobs, 17 minutes for all six, once the venvs existed.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "checkpoint" / "pippy_dcp.py"
VERSIONS = ["2.10", "2.11", "2.12", "2.13", "2.14", "2.15"]
RUNTIME = ["numpy", "safetensors", "google-crc32c", "pytest"]
# Test files that need neither SeaweedFS nor strace nor transformers, each in
# well under a minute on 2 cores (with the pinned torch, idle: 8, 8, 16, 36,
# 9 and 20 s). test_stages.py (2.5 min) and test_convert.py (77 s) take longer.
FAST_TESTS = [
    "test/test_golden.py",
    "test/test_optim_keys.py",
    "test/test_checkpoint.py",
    "test/test_safety.py",
    "test/test_torch_internals.py",
    "test/test_cost.py",
]
TINY = ["--n-layers", "4", "--dim", "32", "--seq-len", "32", "--save-every", "2"]
READ = """
import json, sys
sys.path.insert(0, {golden!r})
from make_golden import digest
from pippy.checkpoint import offline
values = offline.read_checkpoint(sys.argv[1])
print(json.dumps({{k: digest(v) for k, v in sorted(values.items())}}))
"""


def run(python: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python args`` from the repository root, pippy importable; never raises."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(
            [python, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(
            e.cmd, 124, "", f"timed out after {timeout} s"
        )


def last_line(done: subprocess.CompletedProcess) -> str:
    """The last line of what a failed command printed, for the table."""
    lines = (done.stderr + done.stdout).strip().splitlines()
    return lines[-1][:60] if lines else f"exit {done.returncode}"


def torch_version(python: str) -> str:
    """The torch version of ``python``, or '' where its venv is incomplete."""
    probe = "import google_crc32c, numpy, pytest, safetensors, torch; print(torch.__version__)"
    done = run(python, "-c", probe, timeout=120)
    return done.stdout.strip() if done.returncode == 0 else ""


def pins(folder: Path) -> Path:
    """``constraints.txt`` without its torch pin, written into ``folder``."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    kept = [line for line in lines if not re.match(r"torch\s*[=<>~!]", line)]
    path = folder / "constraints-without-torch.txt"
    path.write_text("\n".join(kept) + "\n")
    return path


def make_venv(version: str, venvs: Path, *, install: bool) -> tuple[str, str]:
    """The python of the venv for ``torch==version.*``, made unless already there.

    Returns:
        The venv's python, and its torch version ('' with the reason when the
        venv could not be made).
    """
    venv = venvs / f"torch-{version}"
    python = str(venv / "bin" / "python")
    have = torch_version(python) if Path(python).exists() else ""
    if have.startswith(version + ".") or not install:
        return python, have or "no venv"
    venvs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_CONSTRAINT": str(pins(venvs))}
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "-q", f"torch=={version}.*", *RUNTIME],
        [python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
    ]
    for step in steps:
        print(f"torch {version}: {' '.join(step[1:])}", flush=True)
        try:
            done = subprocess.run(
                step, env=env, capture_output=True, text=True, timeout=3600
            )
        except subprocess.TimeoutExpired:
            return python, "install timed out"
        if done.returncode:
            return python, f"install failed: {last_line(done)}"
    return python, torch_version(python) or "install incomplete"


def example(python: str, folder: Path) -> str:
    """The example saved at step 2 and stopped, then resumed to step 4, exactly."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    flags = [str(EXAMPLE), *TINY, "--checkpoint-dir", str(folder)]
    first = run(python, *launch, *flags, "--steps", "4", "--stop-after", "2")
    if first.returncode:
        return f"save: {last_line(first)}"
    second = run(python, *launch, *flags, "--steps", "4")
    if second.returncode or "resuming from" not in second.stdout:
        return f"resume: {last_line(second)}"
    return "ok" if "verified:" in second.stdout else "not verified"


def fast_tests(python: str) -> str:
    """The fast test files with this torch: 'N passed', or what failed."""
    done = run(
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_TESTS, timeout=600
    )
    summary = [
        line for line in done.stdout.splitlines() if re.search(r" in [\d.]+s", line)
    ]
    result = summary[-1].strip("= ") if summary else last_line(done)
    return re.sub(r", \d+ warnings?| in [\d.]+s.*", "", result)


def reads(python: str, step: Path) -> dict | str:
    """Every value of a step, digested, as ``python``'s torch reads it."""
    done = run(python, "-c", READ.format(golden=str(HERE)), str(step))
    return last_line(done) if done.returncode else json.loads(done.stdout)


def same(got: dict | str, want: dict | str) -> str:
    """'bitwise' where two reads agree, else what went wrong."""
    if isinstance(got, dict) and got == want:
        return "bitwise"
    if isinstance(got, str):
        return f"no: {got}"[:40]
    return "no: differs" if isinstance(want, dict) else f"no: {want}"[:40]


def check(python: str, version: str, pinned: str, pinned_step: Path, tmp: Path) -> list:
    """One row of the table: every check of one torch."""
    folder = tmp / f"run-{version}"
    row = [version, example(python, folder), fast_tests(python)]
    for step in sorted(HERE.glob("torch-*/step-2")):
        want = json.loads((step.parent / "digests.json").read_text())["items"]
        row.append(same(reads(python, step), want))
    theirs = folder / "step-4"
    row.append(same(reads(pinned, theirs), reads(python, theirs)))
    ours = pinned_step / "step-4"
    row.append(same(reads(python, ours), reads(pinned, ours)))
    return row


def parse_args() -> argparse.Namespace:
    """The flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--torch",
        nargs="+",
        default=VERSIONS,
        help="torch releases, X.Y (default: all six)",
    )
    parser.add_argument(
        "--venvs",
        type=Path,
        default=Path.home() / ".cache" / "pippy-version-matrix",
        help="folder of the venvs, one per torch (made once, then reused)",
    )
    parser.add_argument(
        "--skip-install",
        action="store_true",
        help="use the venvs already there; make none",
    )
    return parser.parse_args()


def main() -> None:
    """Make the venvs, check each torch, print the table."""
    args = parse_args()
    start = time.monotonic()
    pythons = {}
    for version in args.torch:
        pythons[version] = make_venv(version, args.venvs, install=not args.skip_install)
        print(f"torch {version}: {pythons[version][1]}", flush=True)
    golden = [p.parent.name for p in sorted(HERE.glob("torch-*/step-2"))]
    header = ["torch", "example", "fast tests", *golden, "pinned reads its step"]
    rows = [[*header, "it reads pinned's step", "time"]]
    pinned = sys.executable
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        pinned_example = example(pinned, tmp / "pinned")
        print(
            f"pinned torch {torch_version(pinned)}: example {pinned_example}",
            flush=True,
        )
        for version, (python, have) in pythons.items():
            began = time.monotonic()
            if not have.startswith(version + "."):
                rows.append([version, have, *[""] * (len(rows[0]) - 2)])
                continue
            row = check(python, have, pinned, tmp / "pinned", tmp)
            rows.append([*row, f"{time.monotonic() - began:.0f} s"])
            print(" | ".join(row), flush=True)
    print()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"\n{len(pythons)} versions in {time.monotonic() - start:.0f} s")
    good = ("ok", "bitwise", "passed", " s")
    failed = [r[0] for r in rows[1:] if not all(c.endswith(good) for c in r[1:])]
    if failed:  # a release check that fails must say so to a script too
        sys.exit(f"failed under torch {', '.join(failed)}: see the table")


if __name__ == "__main__":
    main()
