"""Repeat saves with a kept plan, on real ranks; launched with torchrun.

    torchrun --nproc-per-node 2 test/repeat_checks.py CHECK[,CHECK...] OUT_DIR

As test/dist_checks.py: each rank writes OUT_DIR/<check>-rank<R>.json. Every
save's expected state is also written with torch.save, to
OUT_DIR/expected/<folder>-<N>-rank<R>.pt, for the test to compare with what plain
DCP reads.
"""

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint import plan_reuse  # noqa: E402
from pippy.checkpoint.manifest import ManifestWriter  # noqa: E402
from pippy.checkpoint.publishing import publish_step  # noqa: E402

from helpers import run_checks  # noqa: E402

_MESH = []


def shared(step, placement):
    """``model.shared.w``, one DTensor over both ranks, placed as asked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (dist.get_world_size(),)))
    full = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
    return distribute_tensor(full, _MESH[0], [placement])


def stage(
    rank,
    step,
    *,
    dtype=torch.float32,
    b_len=4,
    added=False,
    removed=False,
    frozen=False,
    note="short",
    keys_of=None,
    placement=None,
):
    """A rank's state at a step: values new at every step, layout as asked."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    owner = rank if keys_of is None else keys_of
    model = {} if placement is None else {"shared.w": shared(step, placement)}
    if not removed:
        model[f"layers.{owner}.w"] = torch.randn(4, 4, generator=g).to(dtype)
    model[f"layers.{owner}.b"] = torch.randn(b_len, generator=g).requires_grad_(frozen)
    if added:
        model[f"layers.{owner}.extra"] = torch.randn(3, generator=g)
    return {"model": model, "notes": {f"rank{owner}": note}, "step": step}


def _whole(value):
    """A leaf as saved: a DTensor whole (a collective), a tensor detached."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor().detach()
    return value.detach() if torch.is_tensor(value) else value


def flat(state):
    """The state's leaves under DCP's dotted keys, whole and detached."""
    out = {}
    for section, value in state.items():
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{section}.{k}"] = _whole(v)
        else:
            out[section] = value
    return out


#: (step, the change on each rank that has one, the writer, expected outcome).
#: Every change is on one rank only: the others' layouts stay equal to their
#: kept plans, and must plan afresh too.
SEQUENCE = [
    (1, {}, None, "fresh"),  # nothing kept yet
    (2, {}, None, "reused"),
    (3, {1: dict(dtype=torch.float64)}, None, "fresh"),  # a dtype
    (4, {1: dict(dtype=torch.float64)}, None, "reused"),
    (5, {}, None, "fresh"),  # back
    (6, {1: dict(b_len=6)}, None, "fresh"),  # a shape
    (7, {}, None, "fresh"),
    (8, {1: dict(added=True)}, None, "fresh"),  # a key added
    (9, {}, None, "fresh"),
    (10, {1: dict(removed=True)}, None, "fresh"),  # a key removed
    (11, {}, None, "fresh"),
    (12, {0: dict(dtype=torch.bfloat16)}, None, "fresh"),  # on the coordinator
    (13, {}, None, "fresh"),
    (14, {1: dict(frozen=True)}, None, "fresh"),  # requires_grad, in .metadata
    (15, {}, None, "fresh"),
    (16, {0: dict(keys_of=1), 1: dict(keys_of=0)}, None, "fresh"),  # keys swapped
    (17, {}, None, "fresh"),
    # A non-tensor value of another length: same plan, new storage offsets.
    (18, {0: dict(note="a longer note " * 20), 1: dict(note="")}, None, "reused"),
    (19, {}, "threads2", "fresh"),  # the writer's settings
    (20, {}, "threads2", "reused"),
    (21, {}, None, "fresh"),
    # A DTensor over both ranks: its chunking changes, then it is replicated
    # (each rank offers it whole; DCP's global plan has one rank write it).
    (22, {r: dict(placement=Shard(0)) for r in (0, 1)}, None, "fresh"),
    (23, {r: dict(placement=Shard(0)) for r in (0, 1)}, None, "reused"),
    (24, {r: dict(placement=Shard(1)) for r in (0, 1)}, None, "fresh"),
    (25, {r: dict(placement=Replicate()) for r in (0, 1)}, None, "fresh"),
    (26, {r: dict(placement=Replicate()) for r in (0, 1)}, None, "reused"),
    (27, {}, None, "fresh"),
    (28, {1: dict(forget=True)}, None, "fresh"),  # rank 1 dropped its plan
    (29, {}, None, "reused"),
]


def writer_for(kind, out, step):
    """The storage writer of a save (save_stage points it at the staging folder)."""
    if kind == "threads2":
        return ManifestWriter(out, step=step, thread_count=2)
    if kind == "per_item":
        return FileSystemWriter(out, single_file_per_rank=False)
    return None


class Said(logging.Handler):
    """The records pippy.checkpoint.plan_reuse logs, kept."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []
        logger = logging.getLogger("pippy.checkpoint.plan_reuse")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())


SAID = Said()


def _save(cache, out, rank, step, changes, kind, group=None, folder="ckpt"):
    """One save_stage with the cache; its expected state and the cache's counts."""
    change = dict(changes.get(rank, {}))
    if change.pop("forget", False):
        cache.forget()
    state = stage(rank, step, **change)
    made, reused = cache.plans_made, cache.plans_reused
    SAID.lines.clear()
    if "placement" in changes.get(rank, {}):
        # A DTensor under one key on both ranks, which check_keys would take
        # for a collision without a mesh of pipeline and data-parallel dims:
        # the save sequence spelled out, the cache in place of dcp.save.
        with publish_step(out / folder, step) as writer:
            cache.save(state, storage_writer=writer, checkpoint_id=writer.path)
    else:
        checkpoint.save_stage(
            state,
            out / folder,
            step=step,
            plan_cache=cache,
            storage_writer=writer_for(kind, out / "unused", step),
            process_group=group,
        )
    torch.save(flat(state), out / "expected" / f"{folder}-{step}-rank{rank}.pt")
    return {
        "step": step,
        "made": cache.plans_made - made,
        "reused": cache.plans_reused - reused,
        "said": list(SAID.lines),
    }


def check_sequence(out: Path, rank: int, world_size: int) -> dict:
    """Saves of SEQUENCE, then a change of the group, then mixed-up caches."""
    (out / "expected").mkdir(exist_ok=True)
    cache = plan_reuse.SavePlanCache()
    saves = [_save(cache, out, rank, s, c, k) for s, c, k, _ in SEQUENCE]
    # What dcp.save itself writes for the states of two reused saves.
    for step in (2, 18):
        changes = dict(SEQUENCE[step - 1][1]).get(rank, {})
        writer = ManifestWriter(out / f"plain-{step}", step=step)
        dcp.save(stage(rank, step, **changes), storage_writer=writer)
    # The ranks change: rank 0 saves alone (rank 1's plan stays as it was).
    alone = dist.new_group([0])
    if rank == 0:
        saves.append(_save(cache, out, rank, 30, {}, None, group=alone))
    dist.barrier()
    saves += [_save(cache, out, rank, s, {}, None) for s in (31, 32)]
    # Two caches, each planned for its own layout; then each rank passes
    # another: every local plan equals its kept one, but they belong to
    # different saves.
    other = plan_reuse.SavePlanCache()
    wide = {1: dict(dtype=torch.float64)}
    saves.append(_save(other, out, rank, 40, wide, None))
    saves.append(_save(cache, out, rank, 41, {}, None))
    mixed = cache if rank == 0 else other
    saves.append(_save(mixed, out, rank, 42, wide, None))
    # A writer that cannot keep a plan (a file per item): always afresh.
    saves += [_save(cache, out, rank, s, {}, "per_item") for s in (50, 51)]
    return {"saves": saves}


def check_failure(out: Path, rank: int, world_size: int) -> dict:
    """A repeat save that fails on rank 1 only reaches every rank; the next plans."""
    (out / "expected").mkdir(exist_ok=True)
    cache = plan_reuse.SavePlanCache()
    saves = [_save(cache, out, rank, s, {}, None, folder="failing") for s in (1, 2)]
    state = stage(rank, 3, note=(lambda: None) if rank == 1 else "short")
    reused = cache.plans_reused
    try:
        checkpoint.save_stage(state, out / "failing", step=3, plan_cache=cache)
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    # The state it saves next must be written: nothing kept, a fresh plan.
    saves.append(_save(cache, out, rank, 4, {}, None, folder="failing"))
    return {
        "saves": saves,
        "error": error,
        "reused_by_failed": cache.plans_reused - reused,
        "published": sorted(p.name for p in (out / "failing").glob("step-*")),
    }


def check_async(out: Path, rank: int, world_size: int) -> dict:
    """AsyncSaver with a cache: repeats reuse the plan, a dtype change plans."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    (out / "expected").mkdir(exist_ok=True)
    cache = plan_reuse.SavePlanCache()
    stager = DefaultStager(StagingOptions(False, False, False, False))
    saver = checkpoint.AsyncSaver(out / "async", plan_cache=cache, async_stager=stager)
    wide = {1: dict(dtype=torch.float64)}
    saves = []
    for step, changes in ((1, {}), (2, {}), (3, wide), (4, wide)):
        state = stage(rank, step, **changes.get(rank, {}))
        made, reused = cache.plans_made, cache.plans_reused
        saver.save(state, step)
        saver.wait()
        saves.append(
            {
                "step": step,
                "made": cache.plans_made - made,
                "reused": cache.plans_reused - reused,
            }
        )
        torch.save(flat(state), out / "expected" / f"async-{step}-rank{rank}.pt")
    saver.close()
    return {"saves": saves}


CHECKS = {"sequence": check_sequence, "failure": check_failure, "async": check_async}

if __name__ == "__main__":
    run_checks(CHECKS)
