"""What the replica check costs a synchronous save with data-parallel replicas.

Two ranks hold the same stage (a ``("pp", "dp")`` mesh of 1 x 2, DDP's
layout): ``save_stage(state, folder, mesh=mesh)`` compares the replicas'
fingerprints of every replicated tensor (on the CPU a CRC-32C in chunks; on
a GPU a hash computed on the device, one host copy per device) and DCP writes
each replicated item once. The same save with the fingerprints left out
(``checks.digests`` gives none) is the baseline. Each save is a new step on
disk, fsynced, the two kinds alternating after one warm-up save of each;
the time of a save is its slowest rank's, the figure the median.

    python bench/replica_check.py --mb 256 --repeats 7 --out-dir bench/results-replica
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]


def worker(mb: float, repeats: int, folder: Path, out: Path) -> None:
    """Under torchrun, on 2 ranks: times both kinds of save, rank 0 reports."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pippy import checkpoint
    from pippy.checkpoint import checks

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)  # the same weights on both replicas
    dim = 1024
    layers = max(1, round(mb * 1e6 / (3 * 4 * dim * dim)))  # weights + 2 moments
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, dim)).sum().backward()
    optimizer.step()
    state = checkpoint.StageState(model, optimizer)
    _, nbytes = checks.state_dict_size(state.state_dict())
    times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    for step in range(1, 2 * (repeats + 1) + 1):
        kind = "checked" if step % 2 else "unchecked"
        state.step = step
        dist.barrier()
        start = time.perf_counter()
        if kind == "checked":
            checkpoint.save_stage(state, folder, mesh=mesh, keep_last=2)
        else:
            with mock.patch.object(checks, "digests", lambda values: {}):
                checkpoint.save_stage(state, folder, mesh=mesh, keep_last=2)
        seconds = [0.0] * dist.get_world_size()
        dist.all_gather_object(seconds, time.perf_counter() - start)
        if step > 2:  # the first of each kind warms the caches up
            times[kind].append(max(seconds))
    if dist.get_rank() == 0:
        result = {
            "mb_per_rank": nbytes / 1e6,
            "checked_s": statistics.median(times["checked"]),
            "unchecked_s": statistics.median(times["unchecked"]),
            "times": times,
        }
        result["ratio"] = result["checked_s"] / result["unchecked_s"]
        (out / "results.json").write_text(json.dumps(result, indent=1))
        table = (
            "| MB per rank | save with the check, s | without, s | ratio |\n"
            "|---|---|---|---|\n"
            f"| {result['mb_per_rank']:.0f} | {result['checked_s']:.3f} | "
            f"{result['unchecked_s']:.3f} | {result['ratio']:.3f}x |\n"
        )
        (out / "results.md").write_text(table)
        print(table, end="")
    dist.destroy_process_group()


def main() -> None:
    """Launches the two ranks (torchrun) and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256, help="MB per rank's stage")
    parser.add_argument("--repeats", type=int, default=7, help="saves of each kind")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench/results-replica")
    parser.add_argument("--work-dir", type=Path, help="where the steps go (a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.mb, args.repeats, args.work_dir, args.out_dir)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", __file__, "--worker", "--mb", str(args.mb)]
        cmd += ["--repeats", str(args.repeats), "--out-dir", str(args.out_dir)]
        cmd += ["--work-dir", str(Path(tmp, "steps"))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, check=True, env=env, timeout=1800)


if __name__ == "__main__":
    main()
