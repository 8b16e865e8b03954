"""Plots the loss of an uninterrupted run against runs resumed on other layouts.

    python examples/checkpoint/plot_resume.py   # writes resume_losses.png beside it

Runs pippy_dcp.py with torchrun: 40 steps on 4 ranks without a stop; 20 steps
on 4 ranks, stopped; then that checkpoint resumed to step 40, separately, on
each layout of LAYOUTS: 4 ranks, 2 ranks, 2 pipelines x 2 stages (DDP, FSDP2),
2 ranks x 2 interleaved stages, 1 rank. Prints the largest loss difference of
each and writes the plot. Takes about 2.5 min on a 2-core CPU machine.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

EXAMPLE = Path(__file__).with_name("pippy_dcp.py")
LOSS = re.compile(r"^step\s+(\d+) \| loss ([\d.]+)", re.MULTILINE)
LAYOUTS = {  # label: (ranks, flags), each resumed from the same step-20
    "4 ranks": (4, []),
    "2 ranks": (2, []),
    "2 x 2, DDP": (4, ["--dp", "2"]),
    "2 x 2, FSDP2": (4, ["--dp", "2", "--fsdp"]),
    "2 ranks x 2 stages": (2, ["--stages-per-rank", "2", "--schedule", "looped-bfs"]),
    "1 rank": (1, []),
}


def run(nproc: int, checkpoint_dir: Path, *flags: str) -> dict[int, float]:
    """Runs the example; returns {step: loss} from its progress lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", str(EXAMPLE), "--checkpoint-dir"]
    cmd += [str(checkpoint_dir), "--steps", "40", "--save-every", "10", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return {int(s): float(loss) for s, loss in LOSS.findall(out.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).with_name("resume_losses.png")
    parser.add_argument("--out", default=str(default), help="PNG to write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        straight = run(4, root / "straight")
        first_half = run(4, root / "half", "--stop-after", "20")
        curves = {
            "uninterrupted, 4 ranks": straight,
            "stopped at 20, 4 ranks": first_half,
        }
        for i, (label, (nproc, flags)) in enumerate(LAYOUTS.items()):
            shutil.copytree(root / "half", root / f"resumed-{i}")
            resumed = run(nproc, root / f"resumed-{i}", *flags)
            curves[f"resumed on {label}"] = resumed
    for name, curve in curves.items():
        worst = max(abs(curve[s] - straight[s]) for s in curve)
        print(f"{name}: largest difference from uninterrupted {worst:.4f}")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = [{"lw": 3, "alpha": 0.4}, {"ls": "", "marker": ".", "color": "k"}]
    styles += [{"ls": "", "marker": m, "fillstyle": "none"} for m in "os^vDx"]
    for (name, curve), style in zip(curves.items(), styles, strict=True):
        ax.plot(list(curve), list(curve.values()), label=name, **style)
    ax.axvline(20, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="training loss (printed, 4 decimals)")
    ax.set_title("pippy_dcp.py: stopped at 20 on 4 ranks, resumed on other layouts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
