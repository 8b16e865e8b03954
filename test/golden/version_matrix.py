"""Before a release: pippy under several torch versions, and steps crossing them.

    python test/golden/version_matrix.py /tmp/t210/bin/python /tmp/t215/bin/python

Each argument is the python of a venv with one torch (``pip install torch==X
numpy google-crc32c safetensors``; torch 2.14 and 2.15 come from the registry
only as CUDA builds, about 5 GB each, which run on the CPU). For each, and for
the python running this script (the pinned torch), it runs the example on 2
ranks (save at step 2, stop; resume to step 4), reads every golden step of
test/golden/ with that torch against its digests, and reads the step that
torch wrote with the pinned torch and the other way round. It prints one
table. A run over 3 versions takes a few minutes on 2 cores.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "checkpoint" / "pippy_dcp.py"
TINY = ["--n-layers", "4", "--dim", "32", "--seq-len", "32", "--save-every", "2"]
READ = """
import json, sys
sys.path.insert(0, {golden!r})
from make_golden import digest
from pippy import checkpoint
values = checkpoint.read_checkpoint(sys.argv[1])
print(json.dumps({{k: digest(v) for k, v in sorted(values.items())}}))
"""


def run(python: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python args`` from the repository root, with pippy importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [python, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def torch_version(python: str) -> str:
    return run(python, "-c", "import torch; print(torch.__version__)").stdout.strip()


def example(python: str, folder: Path) -> bool:
    """The example saved at step 2 and stopped, then resumed to step 4, exactly."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    flags = [str(EXAMPLE), *TINY, "--checkpoint-dir", str(folder)]
    first = run(python, *launch, *flags, "--steps", "4", "--stop-after", "2")
    second = run(python, *launch, *flags, "--steps", "4")
    return first.returncode == 0 and "verified:" in second.stdout


def reads(python: str, step: Path) -> dict | str:
    """Every value of a step, digested, as ``python``'s torch reads it."""
    done = run(python, "-c", READ.format(golden=str(HERE)), str(step))
    if done.returncode:
        return (done.stderr.strip().splitlines() or ["failed"])[-1][:80]
    return json.loads(done.stdout)


def main() -> None:
    pinned = sys.executable
    rows = [
        [
            "torch",
            "example",
            *(p.parent.name for p in sorted(HERE.glob("torch-*/step-2"))),
            "pinned reads its step",
            "it reads pinned's step",
        ]
    ]
    with tempfile.TemporaryDirectory() as tmp:
        pinned_step = Path(tmp) / "pinned"
        example(pinned, pinned_step)
        for python in [pinned, *sys.argv[1:]]:
            folder = Path(tmp) / f"run-{len(rows)}"
            row = [torch_version(python), "ok" if example(python, folder) else "FAILED"]
            for step in sorted(HERE.glob("torch-*/step-2")):
                want = json.loads((step.parent / "digests.json").read_text())["items"]
                got = reads(python, step)
                row.append("bitwise" if got == want else f"no: {got}"[:40])
            theirs, ours = (
                reads(pinned, folder / "step-4"),
                reads(python, folder / "step-4"),
            )
            row.append("bitwise" if theirs == ours else f"no: {theirs}"[:40])
            a, b = (
                reads(python, pinned_step / "step-4"),
                reads(pinned, pinned_step / "step-4"),
            )
            row.append("bitwise" if a == b else f"no: {a}"[:40])
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
