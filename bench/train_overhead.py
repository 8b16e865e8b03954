"""What saving costs a training run: step times with and without checkpoints.

Trains the example's GPT (``examples/checkpoint/gpt.py``, split like the
example's manual split, GPipe, AdamW) on real ranks, once per mode, and
records every step's time, the save included (8 sequences of 128 bytes
per step for the example's model, as the example trains; of 32 for the
larger one). The modes take turns, 10 steps
at a time (in a shuffled order per round), so that other work on the machine
falls on all of them alike:

* ``none``: no saving;
* ``sync/N``: ``checkpoint.save_stage`` after every N-th step;
* ``async/N``: ``checkpoint.AsyncSaver`` (the example's ``--async-save``:
  ``save``, which checks the keys; ``poll()`` on the other steps),
  its last save waited for at the end of each 10 steps, inside their time;
* ``sync/1+freeze``: ``sync/1`` after ``gc.freeze()`` (the objects built at
  setup moved out of the garbage collector's reach);
* ``sync/1+gc``: ``sync/1`` without ``save_stage``'s pause of the garbage
  collector (its undecorated function, ``save_stage.__wrapped__``).

The figure a user feels is the mean step time over the run (its total time,
the waits for async saves included, over its steps) against the run without
saving. Each launch runs all modes in the same processes, after warm-up
steps, on a model of the example's size (``--dim 128``) and
one of about ``--mb-per-rank`` MB of weights and AdamW state per rank.

    python bench/train_overhead.py --out-dir bench/results-train

writes ``results.json`` (every step of every mode), ``results.md`` (the
table) and ``step_times.png``. Compare ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import MB, ROOT, dim_for

from pippy import PipelineStage, ScheduleGPipe, checkpoint

sys.path.insert(0, str(ROOT / "examples" / "checkpoint"))
from pippy.checkpoint.checks import state_dict_size

from gpt import GPT, ModelArgs, init_weights, rope_table  # noqa: E402
from pippy_dcp import split_manual  # noqa: E402

MODES = ["none", "sync/1", "async/1", "sync/10", "async/10", "sync/1+freeze"]
MODES += ["sync/1+gc"]
BATCH, MICROBATCHES, N_LAYERS, WARMUP = 8, 4, 8, 3
# The example's sequences for its model; shorter ones for the larger model,
# so that its steps take about a second on these CPUs.
SEQ_LEN = {128: 128}
ROUND = 10  # steps of one mode in a row


# --------------------------------------------------------------------------
# On each rank
# --------------------------------------------------------------------------


def build(dim: int, seq_len: int, rank: int, world: int):
    """This rank's stage of the example's GPT, its schedule and its state."""
    margs = ModelArgs(n_layers=N_LAYERS, dim=dim, max_seq_len=seq_len)
    with torch.device("meta"):
        model = GPT(margs)
    module = split_manual(model, rank, world)
    module.to_empty(device="cpu")
    init_weights(module, 0)
    module.get_buffer("rope").copy_(rope_table(margs))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    return stage, schedule, checkpoint.StageState(module, optimizer)


def train_step(stage, schedule, state, generator: torch.Generator) -> None:
    """One optimizer step over random tokens (every rank draws the same)."""
    seq_len = state.module.get_buffer("rope").shape[1]
    tokens = torch.randint(256, (BATCH, seq_len + 1), generator=generator)
    args = (tokens[:, :-1],) if stage.is_first else ()
    kwargs = {"target": tokens[:, 1:]} if stage.is_last else {}
    schedule.step(*args, **kwargs)
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.step += 1


def run_mode(mode: str, parts, steps: int, folder: Path, saver) -> list[float]:
    """``steps`` steps in ``mode``: each step's seconds; an async save's final
    wait is added to the last step."""
    stage, schedule, state = parts
    kind, _, every = mode.partition("/")
    every_n = int(every.split("+")[0]) if every else 0
    # +gc: save_stage without its pause of the garbage collector
    save = (
        checkpoint.save_stage.__wrapped__
        if mode.endswith("+gc")
        else checkpoint.save_stage
    )
    generator = torch.Generator().manual_seed(1)
    times = []
    dist.barrier()
    for _ in range(steps):
        start = time.perf_counter()
        train_step(stage, schedule, state, generator)
        due = every_n and state.step % every_n == 0
        if due and kind == "sync":
            save(state, folder, keep_last=2)
        elif due:
            saver.save(state)
        elif kind == "async":
            saver.poll()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    if kind == "async":
        saver.wait()  # a run is over once its last save is on disk
    times[-1] += time.perf_counter() - start
    return times


def rank_main(opts: argparse.Namespace) -> None:
    """The modes in rounds of 10 steps each, interleaved (so that other work on
    the machine falls on all alike); rank 0 writes each rank's step times."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = build(opts.dim, opts.seq_len, rank, world)
    work = Path(opts.work_dir)
    saver = checkpoint.AsyncSaver(work / "async", keep_last=2)
    # warm-up: steps, and a save of each kind (the first of a process is slower)
    for mode in ("none", "sync/1", "async/1"):
        run_mode(mode, parts, WARMUP, work / "warmup", saver)
    out: dict[str, list] = {mode: [[] for _ in range(world)] for mode in MODES}
    for round_ in range(opts.steps // ROUND):
        for mode in random.Random(round_).sample(MODES, len(MODES)):
            if mode.endswith("+freeze"):
                gc.collect()
                gc.freeze()
            folder = work / mode.replace("/", "-")
            times = run_mode(mode, parts, ROUND, folder, saver)
            gc.unfreeze()
            everyone: list = [None] * world
            dist.all_gather_object(everyone, times)
            for mine, theirs in zip(out[mode], everyone, strict=True):
                mine += theirs
            if rank == 0:
                seconds = max(map(sum, everyone))
                print(
                    f"dim {opts.dim} P={world} round {round_} {mode}: {seconds:.2f} s"
                )
    saver.close()
    nbytes = state_dict_size(parts[2].state_dict())[1]
    sizes: list = [None] * world
    dist.all_gather_object(sizes, nbytes)
    if rank == 0:
        result = {"dim": opts.dim, "seq_len": opts.seq_len, "ranks": world}
        result["bytes_per_rank"] = max(sizes)
        Path(opts.result).write_text(json.dumps(result | {"modes": out}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# The driver: launches, table, plot
# --------------------------------------------------------------------------


def launch(opts: argparse.Namespace, dim: int, ranks: int, work: Path) -> dict:
    """One launch of ``ranks`` ranks at width ``dim``; their results."""
    result = work / f"result-{dim}-{ranks}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={ranks}", __file__, "--rank-run"]
    cmd += ["--dim", str(dim), "--seq-len", str(SEQ_LEN.get(dim, 32))]
    cmd += ["--steps", str(opts.steps)]
    cmd += ["--work-dir", str(work / f"{dim}-{ranks}"), "--result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, timeout=opts.timeout, cwd=ROOT)
    return json.loads(result.read_text())


def summarize(run: dict) -> dict[str, dict]:
    """Per mode: each step's time (slowest rank), mean step time, ratio to none."""
    modes = {}
    for mode, ranks in run["modes"].items():
        steps = [max(r[i] for r in ranks) for i in range(len(ranks[0]))]
        modes[mode] = {"steps": steps, "mean_s": max(map(sum, ranks)) / len(steps)}
    for m in modes.values():
        m["x_none"] = m["mean_s"] / modes["none"]["mean_s"]
    return modes


def table(runs: list[dict]) -> str:
    """Mean step time per mode and its ratio to no saving, one row per run."""
    head = ["P", "model", "MB/rank", *MODES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        modes = summarize(run)
        cells = [str(run["ranks"]), f"dim {run['dim']}, seq {run['seq_len']}"]
        cells.append(f"{run['bytes_per_rank'] / MB:.0f}")
        cells += [f"{modes[m]['mean_s']:.3f} ({modes[m]['x_none']:.2f})" for m in MODES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    """Step time against step: none, sync and async, saving every step and every 10."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs, strict=True):
        modes = summarize(run)
        mb = run["bytes_per_rank"] / MB
        for ax, every in zip(row, ("1", "10"), strict=True):
            for mode in ("none", f"sync/{every}", f"async/{every}"):
                times = modes[mode]["steps"]
                label = f"{mode} (mean x{modes[mode]['x_none']:.2f})"
                ax.plot(range(1, len(times) + 1), times, marker=".", label=label)
            ax.set_title(f"P={run['ranks']}, {mb:.0f} MB/rank, save every {every}")
            ax.set_xlabel("step of the mode (rounds of 10, interleaved)")
            ax.set_ylabel("step time, s")
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--out-dir", default="bench/results-train", help="results.json, .md, .png")
    add("--ranks", type=int, nargs="+", default=[2], help="pipeline degrees to run")
    add("--steps", type=int, default=30, help="timed steps per mode, rounds of 10")
    add("--mb-per-rank", type=float, default=150, help="the larger model; 0: none")
    add("--timeout", type=int, default=600, help="seconds per launch")
    add("--rank-run", action="store_true", help=argparse.SUPPRESS)
    add("--dim", type=int, default=128, help=argparse.SUPPRESS)
    add("--seq-len", type=int, default=128, help=argparse.SUPPRESS)
    add("--work-dir", help=argparse.SUPPRESS)
    add("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    opts = parse_args()
    if opts.rank_run:
        return rank_main(opts)
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="train-overhead-"))
    start, runs = time.perf_counter(), []
    try:
        for ranks in opts.ranks:
            dims = [128]
            if opts.mb_per_rank:
                dims.append(dim_for(opts.mb_per_rank, ranks, N_LAYERS))
            runs += [launch(opts, dim, ranks, work) for dim in dims]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python bench/train_overhead.py " + " ".join(sys.argv[1:])
    seconds = time.perf_counter() - start
    text = (
        f"Command: `{command.strip()}`, {seconds:.0f} s, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs.\n\nMean step time, s (x no saving):\n\n"
        f"{table(runs)}\n"
    )
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"runs": runs}, indent=1))
    plot(runs, out / "step_times.png")
    print(text)


if __name__ == "__main__":
    main()
