"""The GPU check: the example on cuda with nccl, a resume, and async staging.

    bench/gpu_check.sh          # on a machine with CUDA GPUs (one is enough)
    bench/gpu_check.sh --dry    # on the CPU with gloo, tiny: what the tests run

Three checks, one table:

1. The example (examples/checkpoint/pippy_dcp.py) on every GPU (nccl; at most
   4 ranks, one per GPU): trains, saves, loads its last step into fresh stages
   and compares them bit for bit ("verified" line).
2. A stop/resume round trip: the same run stopped at half way (--stop-after)
   and resumed; its last step is compared tensor by tensor with the
   uninterrupted run's ("bitwise", or the number of tensors that differ: on a
   GPU, kernels that add with atomics, such as the embedding's backward, need
   not be bitwise repeatable).
3. The blocking part of an ``AsyncSaver`` save with pinned-memory staging
   (its default ``KeptBufferStager``, buffers kept across saves): ``save()``,
   then, after 0.2 s of a training step's compute that the copy overlaps,
   the wait that ``optimizer.step()`` would make (``wait_for_staging()``),
   against a bare device-to-host copy of the same tensors into pinned buffers
   allocated beforehand, both at 150 MB per rank (2 MB with --dry), median of 3.
   During the same saves: the longest stall of a thread that sleeps 1 ms at a
   time (the training thread, held by the GIL) while the save writes in the
   background; the stager's kept host buffers (pinned on a GPU) against the
   stage's bytes; and the device syncs that ``save()`` and its staging make
   (counted by CUDA's sync debug mode, on a GPU only).

On one H200 the whole check takes well under 5 minutes (3 example runs of a
few seconds each, one async run); --dry takes about a minute on 2 CPU cores.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "checkpoint" / "pippy_dcp.py"
DRY_FLAGS = ["--n-layers", "2", "--dim", "32", "--seq-len", "32", "--steps", "4"]
DRY_FLAGS += ["--save-every", "2"]
#: The compute of a training step that the async copy overlaps, seconds.
COMPUTE_S = 0.2


def torchrun(nproc: int, *args: str, env: dict, timeout: float):
    """Runs `args` under torchrun on nproc ranks; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def check_ok(proc, what: str) -> str:
    """proc's stdout, or exits naming `what` with the tail of its output."""
    if proc.returncode != 0:
        sys.exit(
            f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
            f"\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def compare_steps(a: Path, b: Path) -> str:
    """'bitwise' if every tensor of step folders a and b is equal, else a count."""
    import torch

    from pippy.checkpoint import offline

    left, right = offline.read_checkpoint(a), offline.read_checkpoint(b)
    if left.keys() != right.keys():
        return f"keys differ: {sorted(left.keys() ^ right.keys())[:3]}"
    differ = [
        k
        for k, v in left.items()
        if isinstance(v, torch.Tensor) and not torch.equal(v, right[k])
    ]
    return "bitwise" if not differ else f"{len(differ)} of {len(left)} differ"


def async_worker(mb: float) -> None:
    """Under torchrun: blocking part of AsyncSaver.save vs a bare copy."""
    import torch
    import torch.distributed as dist

    from pippy import checkpoint

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    dim = 1024 if mb >= 12 else 256  # one 1024-wide layer and moments: 12.6 MB
    layers = max(1, int(mb * 1e6 / (3 * 4 * dim * dim)))  # weights + 2 moments
    blocks = [torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]
    stage = torch.nn.Sequential(*blocks)  # a stage of its own FQNs on each rank
    model = torch.nn.ModuleDict({f"stage{dist.get_rank()}": stage}).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    stage(torch.ones(2, dim, device=device)).sum().backward()
    optimizer.step()
    state = checkpoint.StageState(model, optimizer)
    flat = list(_tensors(state.state_dict()))
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in flat]

    def bare_copy() -> float:
        start = time.perf_counter()
        for src, dst in zip(flat, pinned, strict=True):
            dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    folder = Path(os.environ["GPU_CHECK_DIR"])
    saver = checkpoint.AsyncSaver(folder)  # its stager pins its buffers on a GPU
    returned, blocked, stalls, syncs = [], [], [], []
    for step in range(1, 5):  # the first allocates the stager's buffers
        state.step = step
        dist.barrier()
        ticker = Ticker()  # the training thread: sleeps 1 ms at a time
        with warnings.catch_warnings(record=True) as warned:
            if cuda:  # a warning for each call that syncs the device
                torch.cuda.set_sync_debug_mode("warn")
            start = time.perf_counter()
            saver.save(state)  # the copy runs on while the next step computes
            returned.append(time.perf_counter() - start)
            time.sleep(COMPUTE_S)  # the next forward and backward, on the device
            start = time.perf_counter()
            saver.wait_for_staging()  # what the saver's optimizer.step() hook waits
            blocked.append(returned[-1] + time.perf_counter() - start)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in warned))
        saver.wait()  # the background write, while the ticker ticks
        stalls.append(ticker.stop())
    # the stager's buffers, kept across saves (pinned on a GPU)
    kept = sum(t.untyped_storage().nbytes() for _, t in saver._stager._buffers.values())
    saver.close()
    copies = [bare_copy() for _ in range(4)][1:]
    row = [statistics.median(blocked[1:]), statistics.median(copies), nbytes]
    row += [statistics.median(returned[1:]), max(stalls[1:]), kept, max(syncs[1:])]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, row)
    if dist.get_rank() == 0:
        worst = max(gathered, key=lambda r: r[0] / r[1])
        print("ASYNC", *worst)
    dist.destroy_process_group()


class Ticker:
    """A thread that sleeps 1 ms at a time; its longest wait is the GIL's stall."""

    def __init__(self) -> None:
        self.worst, self._done = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._tick)
        self._thread.start()

    def _tick(self) -> None:
        while not self._done.is_set():
            start = time.perf_counter()
            time.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - start)

    def stop(self) -> float:
        """Stops it; its longest wait, seconds."""
        self._done.set()
        self._thread.join()
        return self.worst


def _tensors(state_dict):
    """Every tensor of a nested state_dict."""
    import torch

    for value in state_dict.values():
        if isinstance(value, dict):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value


def main() -> None:
    """Runs the three checks and prints their table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, gloo, tiny")
    parser.add_argument("--worker-mb", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_mb is not None:
        return async_worker(args.worker_mb)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if args.dry:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU machine
        nproc, flags, mb, backend = 2, DRY_FLAGS, 2.0, "gloo, CPU"
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU here: run bench/gpu_check.sh --dry for the CPU")
        nproc, flags, mb = min(4, torch.cuda.device_count()), [], 150.0
        backend = f"nccl, {torch.cuda.get_device_name(0)}"
    steps = int(flags[flags.index("--steps") + 1]) if "--steps" in flags else 20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        whole, half = Path(tmp, "whole"), Path(tmp, "half")
        start = time.perf_counter()
        out = check_ok(
            torchrun(
                nproc,
                str(EXAMPLE),
                *flags,
                "--checkpoint-dir",
                str(whole),
                env=env,
                timeout=600,
            ),
            "the example",
        )
        seconds = time.perf_counter() - start
        verified = "verified" in out and "bitwise equal" in out
        rows.append(
            (
                f"example, {nproc} ranks ({backend})",
                f"{'ok, verified bitwise' if verified else 'NOT verified'}, "
                f"{seconds:.1f} s",
            )
        )
        stop = ["--stop-after", str(steps // 2)]
        common = [str(EXAMPLE), *flags, "--checkpoint-dir", str(half)]
        check_ok(torchrun(nproc, *common, *stop, env=env, timeout=600), "stop")
        out = check_ok(torchrun(nproc, *common, env=env, timeout=600), "resume")
        resumed = "resuming from" in out
        same = compare_steps(whole / f"step-{steps}", half / f"step-{steps}")
        rows.append(
            (
                f"stop at {steps // 2}, resume to {steps}",
                f"{'resumed' if resumed else 'DID NOT resume'}; last step {same}",
            )
        )
        env["GPU_CHECK_DIR"] = str(Path(tmp, "async"))
        out = check_ok(
            torchrun(
                min(nproc, 2), __file__, "--worker-mb", str(mb), env=env, timeout=600
            ),
            "the async check",
        )
        line = next(x for x in out.splitlines() if x.startswith("ASYNC"))
        blocked, copy, nbytes, returned, stall, kept, syncs = map(
            float, line.split()[1:]
        )
        staging = "pinned" if not args.dry else "pageable (no accelerator)"
        rows.append(("async save() returns", f"{returned:.3f} s"))
        rows.append(
            (
                f"async save blocks in all, {staging} staging",
                f"{blocked:.3f} s for {nbytes / 1e6:.0f} MB/rank "
                f"(save() and optimizer.step()'s wait, {COMPUTE_S:g} s of compute "
                "between)",
            )
        )
        rows.append(("bare device-to-host copy", f"{copy:.3f} s"))
        rows.append(("async blocking / bare copy", f"{blocked / copy:.2f}x"))
        rows.append(
            (
                "longest stall of a 1 ms ticking thread",
                f"{stall * 1e3:.1f} ms, during the background write",
            )
        )
        rows.append(
            (
                f"{'pinned' if not args.dry else 'kept'} host buffers / stage",
                f"{kept / nbytes:.2f}x ({kept / 1e6:.0f} of {nbytes / 1e6:.0f} MB)",
            )
        )
        sync_text = f"{syncs:.0f}" if not args.dry else "n/a (no accelerator)"
        rows.append(("device syncs in save() and its staging", sync_text))
    width = max(len(r[0]) for r in rows)
    print(f"{'check'.ljust(width)} | result")
    for name, result in rows:
        print(f"{name.ljust(width)} | {result}")


if __name__ == "__main__":
    main()
