"""Checks of pippy's library on parallel layouts; launched with torchrun (the tests
run them as threads, test/ranks.py's run_checks, with other scripts' checks).

    torchrun --nproc-per-node N test/layout_checks.py CHECK[,CHECK...] OUT_DIR

Like dist_checks.py: each rank writes OUT_DIR/<check>-rank<R>.json, and the
test reads the checkpoints back with plain DCP in its own process. The stages
are the tiny GPT of helpers.py cut with ``pippy.split_model``; the optimizer
steps on a fixed gradient, so replicas stay equal without a forward pass.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
import pippy  # noqa: E402
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint import offline  # noqa: E402
from pippy.checkpoint.checks import (
    check_keys,
    local,  # noqa: E402
    named_leaves,
)

from helpers import CountedOps, run_checks, tiny_gpt  # noqa: E402

N_STAGES = 4


def stage_module(stage_index, num_stages, seed=0):
    """Stage `stage_index` of the tiny GPT, keeping the un-split model's FQNs."""
    return pippy.split_model(
        tiny_gpt(seed=seed),
        stage_index,
        num_stages,
        layers="layers",
        first=["tok_embeddings"],
        last=["norm", "output"],
    )


def step_once(state):
    """One AdamW step on a fixed gradient, so moments and step are non-trivial."""
    for module in state.modules:
        for param in module.parameters():
            param.grad = torch.full_like(param, 0.01)
    for optimizer in state.optimizers:
        optimizer.step()
        optimizer.zero_grad()
    for scheduler in state.lr_schedulers:
        scheduler.step()
    state.step += 1


def dump(state, out, name, rank):
    """This rank's live state, model and optimizer tensors, for the test to compare."""
    leaves = named_leaves(state.state_dict())
    tensors = {k: local(v).clone() for k, v in leaves if isinstance(v, torch.Tensor)}
    torch.save(tensors, out / f"{name}-live-{rank}.pt")


def listing(folder):
    """What a folder holds, or None if there is no folder, once every rank is
    here (rank 0 discards a refused save's staging folder; the others may
    return before it has)."""
    dist.barrier()
    return sorted(os.listdir(folder)) if folder.exists() else None


def error_of(call):
    """The type and message a call raises, or None."""
    try:
        call()
    except checkpoint.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


def mesh_state(mesh, kind, seed=0):
    """This rank's pipeline stage of a dp x pp mesh, as DDP replicas or FSDP2 shards."""
    pp = mesh.size(mesh.mesh_dim_names.index("pp"))
    module = stage_module(mesh.get_local_rank("pp"), pp, seed=seed)
    if kind == "fsdp":
        fully_shard(module, mesh=mesh["dp"])
    else:
        module = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    return checkpoint.StageState(module, optimizer, scheduler)


def check_mesh(out: Path, rank: int, world_size: int) -> dict:
    """2 pipelines x 2 stages, DDP and FSDP2: saved, reloaded bitwise, and refused
    without the mesh or with diverged replicas."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "pp"))
    result = {}
    for kind in ("ddp", "fsdp"):
        state = mesh_state(mesh, kind)
        step_once(state)
        sd = state.state_dict()
        result[f"{kind}_keys"] = sorted(sd["model"])
        result[f"{kind}_no_mesh"] = error_of(lambda sd=sd: check_keys(sd))
        with CountedOps() as counted:
            checkpoint.save_stage(state, out / kind, mesh=mesh)
        result[f"{kind}_ops"] = dict(counted.counts)
        if kind == "ddp":  # plain DCP's operations, for the same state
            with CountedOps() as counted:
                dcp.save(state.state_dict(), checkpoint_id=out / "ops-plain")
            result["dcp_ops"] = dict(counted.counts)
        if kind == "fsdp":  # the same step, from the async saver's staged copy
            saver = checkpoint.AsyncSaver(out / "fsdp-async", mesh=mesh)
            saver.save(state)
            saver.close()
        dump(state, out, kind, rank)
        fresh = mesh_state(mesh, kind, seed=7)
        with CountedOps() as counted:
            checkpoint.load_stage(fresh, out / kind / "step-1")
        result[f"{kind}_load_ops"] = dict(counted.counts)
        if kind == "ddp":  # plain DCP's operations, loading the same state
            plain = mesh_state(mesh, kind, seed=7).state_dict()
            with CountedOps() as counted:
                dcp.load(plain, checkpoint_id=out / "ops-plain")
            result["dcp_load_ops"] = dict(counted.counts)
        result[f"{kind}_reload_differ"] = offline.diff_state_dicts(
            fresh.state_dict(), state.state_dict()
        )
    # Two stages per rank (stages p and p + 2 of 4), each sharded with FSDP2.
    pp = mesh.get_local_rank("pp")

    def sharded_parts(seed):
        parts = [stage_module(s, N_STAGES, seed=seed) for s in (pp, pp + 2)]
        for part in parts:
            fully_shard(part, mesh=mesh["dp"])
        optimizers = [torch.optim.AdamW(p.parameters()) for p in parts]
        return checkpoint.StageState(parts, optimizers)

    state = sharded_parts(0)
    step_once(state)
    checkpoint.save_stage(state, out / "fsdp-parts", mesh=mesh)
    fresh = sharded_parts(7)
    checkpoint.load_stage(fresh, out / "fsdp-parts" / "step-1")
    result["fsdp_parts_reload_differ"] = offline.diff_state_dicts(
        fresh.state_dict(), state.state_dict()
    )
    # Replicas that diverged (no gradient all-reduce, a bug in the DP setup):
    # plain DCP writes some keys from one replica, some from the other.
    state = mesh_state(mesh, "ddp")
    step_once(state)
    if mesh.get_local_rank("dp") == 1:
        with torch.no_grad():
            for param in state.module.parameters():
                param.add_(1.0)
    dump(state, out, "diverged", rank)
    dcp.save(state.state_dict(), checkpoint_id=out / "diverged-plain")
    result["diverged"] = error_of(
        lambda: checkpoint.save_stage(state, out / "diverged", mesh=mesh)
    )
    result["diverged_left"] = listing(out / "diverged")
    # A slice of the mesh would hide the replicas from each other.
    try:
        check_keys(state.state_dict(), mesh=mesh["pp"])
        result["slice"] = None
    except ValueError as e:
        result["slice"] = f"{type(e).__name__}: {e}"
    # A key that one replica has and the other lacks.
    state = mesh_state(mesh, "ddp")
    sd = state.state_dict()
    if mesh.get_local_rank("dp") == 1:
        sd["model"] = {k: v for k, v in sd["model"].items() if k != "norm.weight"}
    result["lacking"] = error_of(lambda: check_keys(sd, mesh=mesh))
    # The mesh passed on the second pipeline's ranks (2 and 3) only: named so,
    # not taken for diverged replicas.
    try:
        check_keys(sd, mesh=mesh if mesh.get_local_rank("dp") == 1 else None)
        result["mesh_some"] = None
    except ValueError as e:
        result["mesh_some"] = f"{type(e).__name__}: {e}"
    return result


def check_hsdp(out: Path, rank: int, world_size: int) -> dict:
    """HSDP on 4 ranks: each stage sharded over "dp_shard", replicated over
    "dp_replicate" (one pipeline stage here: pp = 1). Saved, reloaded bitwise;
    a replicate group that diverged is refused."""
    names = ("dp_replicate", "dp_shard", "pp")
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=names)

    def build(seed):
        module = stage_module(0, 1, seed=seed)
        fully_shard(module, mesh=mesh["dp_replicate", "dp_shard"])
        return checkpoint.StageState(module, torch.optim.AdamW(module.parameters()))

    state = build(0)
    step_once(state)
    checkpoint.save_stage(state, out / "hsdp", mesh=mesh)
    dump(state, out, "hsdp", rank)
    fresh = build(7)
    checkpoint.load_stage(fresh, out / "hsdp" / "step-1")
    result = {
        "placements": repr(next(state.module.parameters()).placements),
        "reload_differ": offline.diff_state_dicts(
            fresh.state_dict(), state.state_dict()
        ),
    }
    if mesh.get_local_rank("dp_replicate") == 1:
        with torch.no_grad():
            next(state.module.parameters()).to_local().add_(1.0)
    result["diverged"] = error_of(
        lambda: checkpoint.save_stage(state, out / "hsdp-diverged", step=1, mesh=mesh)
    )
    return result


def parts_state(parts, seed=0, per_part=False):
    """A StageState of several stages: one AdamW over all, or one per part."""
    modules = [stage_module(s, N_STAGES, seed=seed) for s in parts]
    if per_part:
        optimizer = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in modules]
        scheduler = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s) for o in optimizer
        ]
    else:
        params = [p for m in modules for p in m.parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.9**s)
    return checkpoint.StageState(modules, optimizer, scheduler)


def check_parts(out: Path, rank: int, world_size: int) -> dict:
    """Each rank holds stages rank and rank + world_size of 4 (as interleaved
    schedules place them): saved, reloaded bitwise with one optimizer per part,
    and a state nested per stage refused."""
    parts = [s for s in range(N_STAGES) if s % world_size == rank]
    state = parts_state(parts)
    step_once(state)
    checkpoint.save_stage(state, out / "parts")
    dump(state, out, "parts", rank)
    fresh = parts_state(parts, seed=7, per_part=True)
    checkpoint.load_stage(fresh, out / "parts" / "step-1")
    result = {
        "keys": sorted(state.state_dict()["model"]),
        "reload_differ": offline.diff_state_dicts(
            fresh.state_dict(), state.state_dict()
        ),
    }
    # What a user would try first: one state_dict per stage, nested by stage.
    nested = {
        f"stage{s}": checkpoint.StageState(m, o).state_dict()
        for s, m, o in zip(parts, fresh.modules, fresh.optimizers, strict=True)
    }
    result["nested"] = error_of(
        lambda: checkpoint.save_stage(nested, out / "nested", step=1)
    )
    result["nested_left"] = listing(out / "nested")
    # Rank 0's parts step their LR schedules apart: rank 0 refuses to take its
    # state, and the other rank stops too instead of waiting in a collective.
    if rank == 0:
        fresh.lr_schedulers[0].step()
    result["one_refuses"] = error_of(lambda: checkpoint.save_stage(fresh, out / "one"))
    return result


CHECKS = {"mesh": check_mesh, "hsdp": check_hsdp, "parts": check_parts}

if __name__ == "__main__":
    run_checks(CHECKS)
