"""The coordinator's planning at scale, without a cluster.

DCP gathers every rank's local plan to one rank, which plans the save (or the
load) for all; pippy's checks run there too. This builds the local plans of N
ranks in one process, a pipeline of ``--stages`` stages of ``--keys`` keys
each, every stage replicated over N / stages data-parallel ranks, and times
the coordinator's ``create_global_plan`` of pippy's save planner
(``CheckedSavePlanner``: the key and replica checks, then DCP's) against DCP's
``DefaultSavePlanner`` on the same plans, and pippy's load planner
(``SafeLoadPlanner``: every key read by some rank) against DCP's
``DefaultLoadPlanner`` (the coordinator's own local plan and the global plan:
DCP's global load plan alone does nothing). Time: the best of ``--repeats``;
memory: the peak Python allocations (tracemalloc) of the call.

    python bench/coordinator.py --ranks 64 256 1024 --out-dir bench/results-coordinator

Each rank's offer is made as ``offer_keys`` makes it on a (dp, pp) mesh
(``checks.offer_keys``, run on each simulated rank's state).
"""

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pippy.checkpoint import checks  # noqa: E402
from pippy.checkpoint.safe_load import SafeLoadPlanner  # noqa: E402
from pippy.checkpoint.save import CheckedSavePlanner, _Checked  # noqa: E402


def stage_state(stage: int, keys: int) -> dict:
    """One stage's state: ``keys`` parameters and their AdamW moments, small
    (planning does not depend on sizes), and the step."""
    model = {f"layers.{stage}.p{i}": torch.zeros(4) for i in range(keys)}
    optim = {f"state.layers.{stage}.p{i}.exp_avg": torch.zeros(4) for i in range(keys)}
    return {"model": model, "optim": optim, "step": 1}


class _Mesh:
    """What offer_keys reads of a (dp, pp) DeviceMesh, for a simulated rank."""

    def __init__(self, ranks: int, stages: int, rank: int) -> None:
        self.mesh_dim_names = ("dp", "pp")
        self._sizes, self._pp = (ranks // stages, stages), rank % stages

    def size(self, dim: int | None = None) -> int:
        return self._sizes[0] * self._sizes[1] if dim is None else self._sizes[dim]

    def get_local_rank(self, name: str) -> int:
        return self._pp


def local_plans(ranks: int, stages: int, keys: int) -> tuple[list, list]:
    """Each rank's local save plan: (DCP's, pippy's with its offer)."""
    plain, ours = [], []
    states = [stage_state(s, keys) for s in range(stages)]
    for rank in range(ranks):
        state = states[rank % stages]
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, None, rank == 0)
        plan = planner.create_local_plan()
        mesh = _Mesh(ranks, stages, rank)
        with mock.patch.object(dist, "get_world_size", return_value=ranks):
            offer = checks.offer_keys(state, mesh=mesh)  # type: ignore[arg-type]
        plain.append(plan)
        checked = _Checked(offer, 1, plan.planner_data)  # as its create_local_plan
        ours.append(dataclasses.replace(plan, planner_data=checked))
    return plain, ours


def measured(fn, repeats: int) -> tuple[float, int]:
    """(best wall time in s, peak traced bytes) of ``fn()``."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak


def load_plans(metadata, ranks: int, stages: int, keys: int, cls) -> list:
    """Each rank's local load plan of its stage's state, by ``cls``."""
    plans = []
    states = [stage_state(s, keys) for s in range(stages)]
    for rank in range(ranks):
        planner = cls()
        planner.set_up_planner(states[rank % stages], metadata, rank == 0)
        plans.append(planner.create_local_plan())
    return plans


def run(ranks: int, stages: int, keys: int, repeats: int) -> dict:
    """The four timings and peaks at ``ranks`` ranks."""
    plain, ours = local_plans(ranks, stages, keys)
    row = {"ranks": ranks, "stages": stages, "keys_per_stage": keys}
    row["save_dcp"] = measured(
        lambda: DefaultSavePlanner().create_global_plan(plain), repeats
    )
    row["save_pippy"] = measured(
        lambda: CheckedSavePlanner(step=1).create_global_plan(ours), repeats
    )
    _, metadata = DefaultSavePlanner().create_global_plan(plain)
    for name, cls in (
        ("load_dcp", DefaultLoadPlanner),
        ("load_pippy", SafeLoadPlanner),
    ):
        plans = load_plans(metadata, ranks, stages, keys, cls)

        def coordinate(cls=cls, plans=plans):  # its own local plan, then all
            coordinator = cls()
            coordinator.set_up_planner(stage_state(0, keys), metadata, True)
            coordinator.create_local_plan()
            coordinator.create_global_plan(plans)

        row[name] = measured(coordinate, repeats)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--keys", type=int, default=300, help="keys per stage's model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    # refuse_losses needs a process group; a 1-rank one names ranks by index
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        rows = [run(n, args.stages, args.keys, args.repeats) for n in args.ranks]
    finally:
        dist.destroy_process_group()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| ranks | save: DCP s | pippy s | ratio | peak MB DCP | pippy | ratio "
        "| load: DCP s | pippy s | ratio | peak MB DCP | pippy | ratio |",
        "|" + " --- |" * 13,
    ]
    for row in rows:
        cells = [str(row["ranks"])]
        for phase in ("save", "load"):
            (t0, m0), (t1, m1) = row[f"{phase}_dcp"], row[f"{phase}_pippy"]
            cells += [f"{t0:.3f}", f"{t1:.3f}", f"{t1 / t0:.2f}x"]
            cells += [f"{m0 / 1e6:.2f}", f"{m1 / 1e6:.2f}", f"{m1 / max(m0, 1):.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (args.out_dir / "results.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
