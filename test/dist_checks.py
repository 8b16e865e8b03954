"""Checks that run on real ranks; launched by the tests with torchrun.

    torchrun --nproc-per-node N test/dist_checks.py CHECK OUT_DIR

Each rank writes what it found to OUT_DIR/<check>-rank<R>.json and the test
asserts on it, so a failure shows the values, not just an exit code. Several
checks share one launch of ranks: starting ranks is the slow part here.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
import pippy_dcp  # noqa: E402

from pippy import checkpoint  # noqa: E402

TINY = ["--n-layers", "4", "--dim", "32", "--seq-len", "32", "--batch-size", "8"]
DEVICE = torch.device("cpu")


def build(args, rank, world_size, seed):
    stage = pippy_dcp.build_stage(args, rank, world_size, DEVICE, seed=seed)
    state = pippy_dcp.build_state(args, stage, pippy_dcp.load_text(None))
    return stage, state


def check_keys(out: Path, rank: int, world_size: int) -> dict:
    """Each rank's keys for both split methods, and the collision check's verdicts."""
    result = {}
    for split in ("manual", "trace"):
        args = pippy_dcp.parse_args([*TINY, "--split", split])
        _, state = build(args, rank, world_size, seed=0)
        sd = state.state_dict()
        checkpoint.check_keys(sd)  # must not raise on a correct split
        result[split] = {
            "model": sorted(sd["model"]),
            "optim": sorted(k for k, _ in checkpoint._leaves(sd["optim"])),
        }
    # A stage built from layers[i] without the global index: every stage has
    # "layers.0". The check must refuse it on every rank.
    args = pippy_dcp.parse_args(TINY)
    _, state = build(args, rank, world_size, seed=0)
    layers = state.module.layers
    renumbered = {str(i): layer for i, layer in enumerate(layers.values())}
    state.module.layers = torch.nn.ModuleDict(renumbered)
    try:
        checkpoint.check_keys(state.state_dict())
        result["renumbered_error"] = None
    except checkpoint.KeyCollisionError as e:
        result["renumbered_error"] = str(e)
    return result


def train_steps(state, stage, schedule, n):
    return [pippy_dcp.train_step(state, stage, schedule, DEVICE) for _ in range(n)]


def check_train(out: Path, rank: int, world_size: int) -> dict:
    """Round trip and exact resume, for both schedules.

    Run A trains 3 steps, saves, trains 3 more. Run B builds fresh stages from
    another seed, loads the step-3 checkpoint and trains 3 steps. B must equal A
    bit for bit: at the load (model, optimizer, scheduler, data state) and after.
    """
    result = {}
    for schedule_name in ("gpipe", "1f1b"):
        args = pippy_dcp.parse_args([*TINY, "--schedule", schedule_name])
        args.microbatches = 4
        cls = pippy_dcp.SCHEDULES[schedule_name]
        stage, state = build(args, rank, world_size, seed=0)
        schedule = cls(stage, n_microbatches=4, loss_fn=pippy_dcp.loss_fn)
        train_steps(state, stage, schedule, 3)
        saved = copy.deepcopy(state.state_dict())
        folder = out / schedule_name
        with checkpoint.publish_step(folder, state.step) as checkpoint_id:
            dcp.save(state.state_dict(), checkpoint_id=checkpoint_id)
        losses_a = train_steps(state, stage, schedule, 3)

        stage_b, state_b = build(args, rank, world_size, seed=1)
        schedule_b = cls(stage_b, n_microbatches=4, loss_fn=pippy_dcp.loss_fn)
        before = checkpoint.diff_state_dicts(state_b.state_dict(), saved)
        sd = state_b.state_dict()
        latest = checkpoint.find_latest_step(folder)
        dcp.load(
            sd,
            storage_reader=checkpoint.SafeFileSystemReader(latest),
            planner=checkpoint.SafeLoadPlanner(),
        )
        state_b.load_state_dict(sd)
        after_load = checkpoint.diff_state_dicts(state_b.state_dict(), saved)
        losses_b = train_steps(state_b, stage_b, schedule_b, 3)
        final = checkpoint.diff_state_dicts(state_b.state_dict(), state.state_dict())
        result[schedule_name] = {
            "differ_before_load": before,
            "differ_after_load": after_load,
            "losses_a": losses_a,
            "losses_b": losses_b,
            "differ_final": final,
            "tensors": checkpoint.state_dict_size(saved)[0],
        }
    return result


CHECKS = {"keys": check_keys, "train": check_train}

if __name__ == "__main__":
    check, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        result = CHECKS[check](out, rank, world_size)
        (out / f"{check}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
