"""Checks of the one save and load sequence, on real ranks; launched with torchrun.

    torchrun --nproc-per-node 2 test/seam_checks.py CHECK[,CHECK...] OUT_DIR

As test/dist_checks.py: each rank writes OUT_DIR/<check>-rank<R>.json.
"""

import copy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint import offline  # noqa: E402
from pippy.checkpoint.steps import list_steps, step_dir  # noqa: E402
from pippy.checkpoint.storage import LocalStorage

import parallel  # noqa: E402
import pippy_dcp  # noqa: E402
from helpers import TINY_FLAGS, run_checks  # noqa: E402

DEVICE = torch.device("cpu")


def example_state(out: Path, seed: int, *flags: str):
    """The example's args, layout, stages and state, built as its main does."""
    args = pippy_dcp.parse_args([*TINY_FLAGS, "--checkpoint-dir", str(out), *flags])
    layout = parallel.build_layout(args, DEVICE)
    stages = pippy_dcp.build_stages(args, layout, DEVICE, seed=seed)
    state = pippy_dcp.build_state(args, stages, pippy_dcp.load_text(None))
    return args, layout, stages, state


def train(state, stages, steps: int = 1) -> None:
    """A few training steps of the example's schedule."""
    schedule = parallel.SCHEDULES["gpipe"](stages[0], 4, loss_fn=parallel.loss_fn)
    for _ in range(steps):
        parallel.train_step(state, stages, schedule, DEVICE)


def check_durable(out: Path, rank: int, world_size: int) -> dict:
    """save_stage of the example's state, for the test to trace with strace."""
    _, layout, stages, state = example_state(out / "unused", 0)
    train(state, stages)
    checkpoint.save_stage(state, out / "ckpt", mesh=layout.mesh)
    return {"steps": sorted(list_steps(LocalStorage(), out / "ckpt"))}


def check_plain(out: Path, rank: int, world_size: int) -> dict:
    """What a script without pippy writes: dcp.save into a folder, then a rename.

    The state is small: torch 2.13 fsyncs ``.metadata`` before its buffered
    bytes (up to 8 KiB) are written, so a small ``.metadata`` shows the hole.
    """
    staging, final = out / "plain" / ".step-1.partial", out / "plain" / "step-1"
    state_dict = {"model": {f"layers.{rank}.weight": torch.ones(4)}, "step": 1}
    dcp.save(state_dict, storage_writer=FileSystemWriter(staging))
    if rank == 0:
        staging.rename(final)
    dist.barrier()
    return {"published": final.is_dir()}


def check_same(out: Path, rank: int, world_size: int) -> dict:
    """The example's save and load against save_stage and load_stage."""
    args, layout, stages, state = example_state(out / "example", 0)
    train(state, stages, 2)
    pippy_dcp.save(state, args, layout.mesh, None)  # the example's own save
    checkpoint.save_stage(state, out / "library", mesh=layout.mesh)
    library_args, _, _, by_example = example_state(out / "library", 1)
    assert pippy_dcp.resume(by_example, library_args) == step_dir(out / "library", 2)
    _, _, _, by_library = example_state(out / "unused", 1)
    checkpoint.load_stage(by_library, step_dir(out / "example", 2))
    return {
        "example_vs_library": offline.diff_state_dicts(
            by_example.state_dict(), by_library.state_dict()
        ),
        "loaded_vs_saved": offline.diff_state_dicts(
            by_example.state_dict(), state.state_dict()
        ),
        "steps": [by_example.step, by_library.step],
    }


class PerRank:
    """Extra state that differs per rank: DCP would keep one rank's copy."""

    def __init__(self, rank: int) -> None:
        self.value = torch.tensor([float(rank)])

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state_dict) -> None:
        self.value = state_dict["value"]


def _error(fn) -> str | None:
    """``type: message`` of what ``fn()`` raised, or None."""
    try:
        fn()
    except (checkpoint.CheckpointError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_async_checks(out: Path, rank: int, world_size: int) -> dict:
    """AsyncSaver checks the step (at the call) and the keys (in the background,
    before writing), as save_stage."""
    _, layout, stages, state = example_state(out / "unused", 0)
    train(state, stages)
    saver = checkpoint.AsyncSaver(out / "async", mesh=layout.mesh)
    result = {
        "wrong_step": _error(lambda: saver.save(state.state_dict(), 5)),
        "steps_after_wrong_step": sorted(list_steps(LocalStorage(), out / "async")),
    }
    # A wrong step on rank 1 alone: it raises at once; rank 0 by a poll(), at
    # the same step of the training loop as rank 1's poll() that says nothing.
    result["one_wrong"] = _error(
        lambda: saver.save(state.state_dict(), state.step + 4 * rank)
    )
    result["polled"] = []
    for _ in range(100):
        result["polled"].append(_error(saver.poll))
        time.sleep(0.02)
    result["polled"] = [p for p in result["polled"] if p is not None]
    state.extra["per_rank"] = PerRank(rank)
    # Refused in the background, before anything is written: the next wait()
    # (or poll(), or save()) raises it on every rank.
    saver.save(state)
    result["collision"] = _error(saver.wait)
    result["steps_after_collision"] = sorted(list_steps(LocalStorage(), out / "async"))
    del state.extra["per_rank"]
    saver.save(state)
    saver.close()
    result["steps"] = sorted(list_steps(LocalStorage(), out / "async"))
    return result


def check_async_staging(out: Path, rank: int, world_size: int) -> dict:
    """A stager that copies in the background: wait_for_staging, then train on."""
    _, layout, stages, state = example_state(out / "unused", 0)
    train(state, stages)
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    saver = checkpoint.AsyncSaver(out / "staged", mesh=layout.mesh, async_stager=stager)
    snapshots, published = {}, []
    for _ in range(2):
        snapshots[state.step] = copy.deepcopy(state.state_dict())
        saver.save(state)
        saver.wait_for_staging()  # before the next step changes the state
        train(state, stages)
        published.append(str(saver.poll()))  # may or may not be done yet
    published.append(str(saver.wait()))
    saver.close()
    differ = {}
    for step in sorted(list_steps(LocalStorage(), out / "staged")):
        _, _, _, fresh = example_state(out / "unused", 1)
        checkpoint.load_stage(fresh, step_dir(out / "staged", step))
        differ[step] = offline.diff_state_dicts(fresh.state_dict(), snapshots[step])
    return {
        "steps": sorted(list_steps(LocalStorage(), out / "staged")),
        "differ": differ,
    }


CHECKS = {
    "durable": check_durable,
    "plain": check_plain,
    "same": check_same,
    "async_checks": check_async_checks,
    "async_staging": check_async_staging,
}

if __name__ == "__main__":
    run_checks(CHECKS)
