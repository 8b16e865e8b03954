"""pippy's library on parallel layouts: pipeline x data parallel (DDP, FSDP2) on a
DeviceMesh, and several stages per rank. Checkpoints are read back here, in
the test's own process, with plain DCP."""

import json
from collections import Counter

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.manifest import read_manifest
from pippy.checkpoint.state import merge_parts
from pippy.checkpoint.storage import LocalStorage

from helpers import plain_read, tiny_gpt


def results(out, check, ranks):
    return [
        json.loads((out / f"{check}-rank{r}.json").read_text()) for r in range(ranks)
    ]


@pytest.fixture(scope="module")
def mesh_run(four_rank_checks):
    """4 ranks as 2 pipelines x 2 stages (mesh ("dp", "pp")), DDP then FSDP2;
    then as one HSDP stage, in the same launch."""
    out = four_rank_checks["layout_checks"]  # one launch with other checks
    return out, results(out, "mesh", 4)


def live(out, name, rank):
    return torch.load(out / f"{name}-live-{rank}.pt")


def test_ddp_replicas_are_saved_once_and_reload_bitwise(mesh_run):
    out, found = mesh_run
    for result in found:
        # Without the mesh, the replicas look like two stages offering one key.
        assert result["ddp_no_mesh"].startswith("KeyCollisionError: 176 ")
        assert "pass the mesh" in result["ddp_no_mesh"]
        assert result["ddp_reload_differ"] == []
        assert not any(k.startswith("module.") for k in result["ddp_keys"])
    saved = plain_read(out / "ddp" / "step-1")
    for rank in range(4):
        for key, value in live(out, "ddp", rank).items():
            assert torch.equal(saved[key], value), (rank, key)
    # DCP writes each replicated item once, spread over the replicas.
    files = {
        r: (out / "ddp" / "step-1" / f"__{r}_0.distcp").stat().st_size for r in range(4)
    }
    stage_bytes = {
        r: sum(v.numel() * v.element_size() for v in live(out, "ddp", r).values())
        for r in range(4)
    }
    for rank in range(4):
        assert 0.25 * stage_bytes[rank] < files[rank] < 0.75 * stage_bytes[rank], files


def test_a_save_on_a_dp_mesh_runs_no_collective_beside_dcps(mesh_run):
    """On 4 ranks, dp=2 x pp=2: save_stage runs no more collectives than a
    plain dcp.save of the same state, on every rank (collectives.py's store waits
    aside), for DDP replicas and FSDP2 shards."""
    _, found = mesh_run
    for rank, result in enumerate(found):
        plain = sum(result["dcp_ops"].values())
        for kind in ("ddp", "fsdp"):
            ours = {k: n for k, n in result[f"{kind}_ops"].items() if "." not in k}
            ours.pop("progress", None)
            assert sum(ours.values()) <= plain, (rank, kind, result[f"{kind}_ops"])


def test_a_load_on_a_dp_mesh_adds_one_broadcast_to_dcps_collectives(mesh_run):
    """On 4 ranks, dp=2 x pp=2: load_stage runs plain dcp.load's collectives
    and one broadcast_object_list more (the step's index from rank 0), on
    every rank, for DDP replicas and FSDP2 shards."""
    _, found = mesh_run
    for rank, result in enumerate(found):
        plain = Counter(result["dcp_load_ops"])
        for kind in ("ddp", "fsdp"):
            ours = Counter(
                {k: n for k, n in result[f"{kind}_load_ops"].items() if "." not in k}
            )
            ours.pop("progress", None)
            extra = ours - plain
            assert extra.total() <= 1, (rank, kind, result[f"{kind}_load_ops"])
            assert set(extra) <= {"broadcast_object_list"}, (rank, kind, extra)


def test_fsdp2_shards_are_saved_and_reload_bitwise(mesh_run):
    out, found = mesh_run
    assert all(r["fsdp_reload_differ"] == [] for r in found)
    assert all(r["fsdp_parts_reload_differ"] == [] for r in found)  # 2 stages/rank
    # The async saver stages DTensor shards as they are: its step holds the
    # same items, bytes and metadata as the sync save's.
    sync, staged = out / "fsdp" / "step-1", out / "fsdp-async" / "step-1"
    assert (
        read_manifest(LocalStorage(), staged).items
        == read_manifest(LocalStorage(), sync).items
    )
    assert (
        FileSystemReader(staged).read_metadata().state_dict_metadata
        == FileSystemReader(sync).read_metadata().state_dict_metadata
    )
    full = {f"model.{k}" for k in tiny_gpt().state_dict()}
    assert {k for k in plain_read(out / "fsdp-parts" / "step-1")} >= full
    saved = plain_read(out / "fsdp" / "step-1")
    for stage in (0, 1):  # dp replica 0 is rank `stage`, replica 1 rank `stage + 2`
        first, second = live(out, "fsdp", stage), live(out, "fsdp", stage + 2)
        for key, shard in first.items():
            if key.startswith("model.") and shard.dim() > 0:
                whole = torch.cat([shard, second[key]])  # FSDP2 shards dim 0
                assert torch.equal(saved[key], whole), key


def test_diverged_replicas_mix_in_plain_dcp_and_are_refused(mesh_run):
    out, found = mesh_run
    # Plain DCP: each key comes from one replica or the other, silently mixed.
    plain = plain_read(out / "diverged-plain")
    replica0, replica1 = live(out, "diverged", 0), live(out, "diverged", 2)
    model_keys = [k for k in replica0 if k.startswith("model.")]
    from0 = [k for k in model_keys if torch.equal(plain[k], replica0[k])]
    from1 = [k for k in model_keys if torch.equal(plain[k], replica1[k])]
    assert from0 and from1 and len(from0) + len(from1) == len(model_keys)
    # pippy: refused on every rank, naming keys and ranks; nothing written.
    for result in found:
        error = result["diverged"]
        assert error.startswith(
            "DivergedReplicasError: the data-parallel replicas differ"
        )
        assert "'model.layers.0.qkv.weight' (ranks [0, 2])" in error
        assert result["diverged_left"] is None  # refused in planning: no folder
        # A slice of the mesh would compare nothing: refused.
        assert result["slice"].startswith("ValueError: the mesh spans 2 ranks and 4")
        # A key that one replica lacks (stage 1's norm on dp rank 1).
        assert result["lacking"].startswith("DivergedReplicasError: ")
        assert "differ in 1 entr(ies)" in result["lacking"]
        assert "'model.norm.weight' (ranks [1, 3])" in result["lacking"]
        # The mesh on some ranks only: named, on every rank.
        assert result["mesh_some"] == (
            "ValueError: ranks 2, 3 passed a mesh and ranks 0, 1 did not: pass "
            "the same mesh on every rank"
        )


def test_hsdp_saves_reloads_and_refuses_diverged_replicate_groups(mesh_run):
    tmp_path = mesh_run[0]
    found = results(tmp_path, "hsdp", 4)
    assert found[0]["placements"] == "(Replicate(), Shard(dim=0))"
    saved = plain_read(tmp_path / "hsdp" / "step-1")
    # Ranks 0 and 1 shard the stage (dim 0); ranks 2 and 3 replicate them.
    first, second = live(tmp_path, "hsdp", 0), live(tmp_path, "hsdp", 1)
    for rank in (2, 3):
        twin = live(tmp_path, "hsdp", rank - 2)
        assert all(
            torch.equal(v, twin[k]) for k, v in live(tmp_path, "hsdp", rank).items()
        )
    for key, shard in first.items():
        if key.startswith("model.") and shard.dim() > 0:
            assert torch.equal(saved[key], torch.cat([shard, second[key]])), key
    for result in found:
        assert result["reload_differ"] == []
        assert result["diverged"] == (
            "DivergedReplicasError: the data-parallel replicas differ in 1 "
            "entr(ies) (in value, or held by some replicas only): "
            "'model.tok_embeddings.weight' (ranks [0, 1, 2, 3]). DCP writes one "
            "replica's value of each key, so the checkpoint would mix them. Keep "
            "the replicas in sync (wrap each stage in DDP or FSDP2 over the "
            "data-parallel dim, and step every replica's optimizer alike; FSDP2 "
            "leaves buffers, such as BatchNorm's running statistics, to you: "
            "SyncBatchNorm, or broadcast them), then save."
        )


def test_several_stages_per_rank_save_reload_and_load_unsplit(two_rank_checks):
    out = two_rank_checks["layout_checks"]  # one launch with other checks
    found = results(out, "parts", 2)
    # One AdamW over both parts saved; one AdamW per part loaded: bitwise.
    assert all(r["reload_differ"] == [] for r in found)
    step = out / "parts" / "step-1"
    saved = plain_read(step)
    full = tiny_gpt()
    assert {k for k in saved if k.startswith("model.")} == {
        f"model.{k}" for k in full.state_dict()
    }
    for rank in range(2):
        for key, value in live(out, "parts", rank).items():
            assert torch.equal(saved[key], value), (rank, key)
    # The same checkpoint into the un-split model, in this process.
    assert offline.load_model(step, full) == 1
    for key, value in full.state_dict().items():
        assert torch.equal(value, saved[f"model.{key}"]), key
    # Nested per stage: refused on both ranks before anything is written.
    for result in found:
        assert result["nested"].startswith("NestedStateError: model or optimizer")
        assert "'stage1' (ranks [1])" in result["nested"]
        assert result["nested_left"] is None  # refused in planning: no folder
    # One rank refuses to take its state: both stop, each with one line.
    assert found[0]["one_refuses"].startswith("CheckpointError: the LR schedulers")
    assert found[1]["one_refuses"] == (
        "CheckpointError: saving step-1 failed on 1 rank(s):\n  rank 0: CheckpointError: "
        + found[0]["one_refuses"].removeprefix("CheckpointError: ")
    )


def test_parts_holding_one_fqn_twice_are_refused():
    import pippy

    def stage(index, seed):
        model = tiny_gpt(seed=seed)
        first, last = ["tok_embeddings"], ["norm", "output"]
        return pippy.split_model(
            model, index, 4, layers="layers", first=first, last=last
        )

    # Two copies of stage 0: "tok_embeddings.weight" twice, different tensors.
    with pytest.raises(checkpoint.KeyCollisionError, match="'tok_embeddings.weight'"):
        checkpoint.StageState([stage(0, 0), stage(0, 1)])
    # A stage passed as extra state would save under "stage2.*": refused.
    with pytest.raises(ValueError, match="is a module or optimizer"):
        checkpoint.StageState(stage(0, 0), extra={"stage2": stage(2, 0)})
    # Two real parts: the union of their keys, the same tensors, no copies.
    parts = [stage(0, 0), stage(2, 0)]
    merged = merge_parts(parts).state_dict(keep_vars=True)
    expected = {k: v for p in parts for k, v in p.state_dict(keep_vars=True).items()}
    assert merged.keys() == expected.keys()
    assert all(merged[k] is v for k, v in expected.items())
