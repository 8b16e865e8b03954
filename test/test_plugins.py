"""pippy's DCP plug-ins by their public names, in DCP's own calls.

``dcp.save(sd, storage_writer=StepWriter(folder, step),
planner=CheckedSavePlanner(step=step))`` publishes ``step-<N>`` once complete
and refuses, inside DCP's planning, what DCP would lose;
``dcp.load(sd, storage_reader=SafeFileSystemReader(path),
planner=SafeLoadPlanner())`` reads it back. Ranks are threads (test/ranks.py).
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import run_ranks
from torch.distributed.checkpoint import CheckpointException

from pippy import checkpoint

from helpers import plain_read


def stage(rank):
    """A stage's state: its own keys, seeded by rank."""
    weights = torch.Generator().manual_seed(rank)
    return {
        "model": {f"layers.{rank}.weight": torch.randn(4, 3, generator=weights)},
        "step": 1,
    }


def failures_of(save):
    """The classes of the failures DCP reports, by rank; {} if it succeeds."""
    try:
        save()
    except CheckpointException as e:
        return {rank: type(wrapped[0]).__name__ for rank, wrapped in e.failures.items()}
    return {}


def plugins_on_rank(rank, world_size, folder):
    state = stage(rank)
    dcp.save(
        state,
        storage_writer=checkpoint.StepWriter(folder, 1),
        planner=checkpoint.CheckedSavePlanner(step=1),
    )
    published = sorted(p.name for p in folder.iterdir())
    # Two ranks offering one key with different values: DCP would keep one.
    colliding = {"model": {"layers.0.weight": torch.full((4, 3), float(rank))}}
    collided = failures_of(
        lambda: dcp.save(
            colliding,
            storage_writer=checkpoint.StepWriter(folder, 2),
            planner=checkpoint.CheckedSavePlanner(step=2),
        )
    )
    dist.barrier()
    after = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    loaded = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
    }
    dcp.load(
        loaded,
        storage_reader=checkpoint.SafeFileSystemReader(folder / "step-1"),
        planner=checkpoint.SafeLoadPlanner(),
    )
    return published, collided, after, loaded


def test_dcp_save_and_load_with_the_plugins_by_name(tmp_path):
    ranks = run_ranks(2, plugins_on_rank, tmp_path)
    for rank, (published, collided, after, loaded) in enumerate(ranks):
        assert "step-1" in published and after == ["step-1"]  # step-2 never was
        assert collided == {0: "KeyCollisionError"}  # the coordinator's planning
        assert loaded["step"] == 1
        assert torch.equal(  # bitwise, through pippy's reader and planner
            loaded["model"][f"layers.{rank}.weight"],
            stage(rank)["model"][f"layers.{rank}.weight"],
        )
    plain = plain_read(tmp_path / "step-1")  # and through plain DCP
    for rank in range(2):
        key = f"model.layers.{rank}.weight"
        assert torch.equal(plain[key], stage(rank)["model"][f"layers.{rank}.weight"])
