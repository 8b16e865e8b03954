"""Repeat saves with a kept plan (plan_reuse.SavePlanCache), on real ranks.

One launch of 2 ranks (test/repeat_checks.py) saves a sequence of steps with
one cache: unchanged layouts reuse the plan, and every change (a dtype, a
shape, a key added or removed, requires_grad, keys moved between ranks, the
writer's settings, the group of ranks, caches of different saves, a
DTensor's chunking, a rank that forgot its plan) plans afresh on every
rank. Here, in another process, plain DCP (FileSystemReader,
no pippy) reads every step back, bitwise equal to what each rank saved.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from pippy import checkpoint
from pippy.checkpoint import plan_reuse

from helpers import plain_read, rank_results
from repeat_checks import SEQUENCE, flat, stage

#: Each step's expected outcome, on every rank that saved it.
EXPECTED = {step: outcome for step, _, _, outcome in SEQUENCE} | {
    30: "fresh",  # rank 0 alone: the ranks changed
    31: "fresh",  # both again: rank 0's kept plan is of the group of one
    32: "reused",
    40: "fresh",  # a second cache's first save
    41: "reused",  # the first cache again, its layout unchanged
    42: "fresh",  # each rank's plan unchanged, but kept by different saves
    50: "fresh",  # a writer that writes a file per item keeps no plan
    51: "fresh",
}
NO_MANIFEST = {50, 51}  # DCP's own FileSystemWriter


@pytest.fixture(scope="module")
def repeat_ranks(two_rank_checks):
    """The checks below (repeat_checks.py's sequence, failure, async) ran in
    one launch of 2 ranks with other modules' checks (conftest.py: starting
    ranks is slow); their folder."""
    return two_rank_checks["repeat_checks"]


def _expected(out, folder, step):
    """What the ranks saved at a step (torch.save'd by each), merged."""
    merged = {}
    for path in sorted((out / "expected").glob(f"{folder}-{step}-rank*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return merged


def _bitwise_diff(read, expected):
    """The keys whose values differ: dtype, shape or any bit."""
    differ = sorted(read.keys() ^ expected.keys())
    for key in read.keys() & expected.keys():
        a, b = read[key], expected[key]
        if torch.is_tensor(b):
            same = (
                torch.is_tensor(a)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and a.contiguous()
                .view(torch.uint8)
                .equal(b.contiguous().view(torch.uint8))
            )
        else:
            same = a == b and type(a) is type(b)
        if not same:
            differ.append(key)
    return sorted(differ)


def _outcome(save):
    return {(1, 0): "fresh", (0, 1): "reused"}.get((save["made"], save["reused"]))


def test_each_save_reuses_the_plan_only_if_no_rank_changed(repeat_ranks):
    for rank, result in enumerate(rank_results(repeat_ranks, "sequence")):
        got = {s["step"]: _outcome(s) for s in result["saves"]}
        want = {s: o for s, o in EXPECTED.items() if rank == 0 or s != 30}
        assert got == want


def test_every_step_reads_back_bitwise_with_plain_dcp(repeat_ranks):
    folder = repeat_ranks / "ckpt"
    steps = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*"))
    assert steps == sorted(EXPECTED)
    for step in steps:
        path = folder / f"step-{step}"
        expected = _expected(repeat_ranks, "ckpt", step)
        assert _bitwise_diff(plain_read(path), expected) == [], f"step-{step}"
        # No file left over from a refused reuse: only what .metadata names.
        metadata = FileSystemReader(path).read_metadata()
        named = {info.relative_path for info in metadata.storage_data.values()}
        extra = set() if step in NO_MANIFEST else {"manifest.json"}
        assert {p.name for p in path.iterdir()} == named | {".metadata"} | extra
        if step not in NO_MANIFEST:  # the manifest agrees with .metadata
            assert checkpoint.verify_step(path) == len(metadata.storage_data)


def test_a_reused_save_writes_the_metadata_dcp_save_writes(repeat_ranks):
    for step in (2, 18):  # 18: non-tensor items of new lengths, new offsets
        ours = FileSystemReader(repeat_ranks / "ckpt" / f"step-{step}").read_metadata()
        plain = FileSystemReader(repeat_ranks / f"plain-{step}").read_metadata()
        assert ours.state_dict_metadata == plain.state_dict_metadata
        assert ours.planner_data == plain.planner_data
        assert ours.storage_data == plain.storage_data
        assert ours.version == plain.version
        assert type(ours.storage_meta) is type(plain.storage_meta)
        assert ours.storage_meta.save_id != plain.storage_meta.save_id
    # The new lengths are this save's: the longer note moved the offsets.
    two = FileSystemReader(repeat_ranks / "ckpt" / "step-2").read_metadata()
    assert two.storage_data != ours.storage_data


def test_the_log_says_why_a_save_planned_afresh(repeat_ranks):
    said = {
        s["step"]: s["said"] for s in rank_results(repeat_ranks, "sequence")[0]["saves"]
    }
    f32, f64 = "torch.float32[4, 4]", "torch.float64[4, 4]"
    assert said[1] == [] and said[2] == []  # the first plan is no news
    assert said[3] == [
        f"planning afresh: rank 1: 'model.layers.1.w' changed ({f32} -> {f64})"
    ]
    assert said[6] == [
        "planning afresh: rank 1: 'model.layers.1.b' changed "
        "(torch.float32[4] -> torch.float32[6])"
    ]
    assert said[8] == ["planning afresh: rank 1: 'model.layers.1.extra' added"]
    assert said[10] == ["planning afresh: rank 1: 'model.layers.1.w' removed"]
    assert said[14] == [
        "planning afresh: rank 1: 'model.layers.1.b' changed (properties or chunks)"
    ]
    assert said[16] == [
        "planning afresh: rank 0: 'model.layers.1.b' added, 'model.layers.1.w' "
        "added, 'notes.rank1' added and 3 more; rank 1: 'model.layers.0.b' added, "
        "'model.layers.0.w' added, 'notes.rank0' added and 3 more"
    ]
    assert said[30] == [
        "planning afresh: rank 0: the ranks changed (rank 0 of [0, 1] is now "
        "rank 0 of [0])"
    ]
    assert said[31] == [  # rank 1's plan is unchanged, but of step 21's save
        "planning afresh: rank 0: the ranks changed (rank 0 of [0] is now "
        "rank 0 of [0, 1]); rank 1: its kept plan is another save's than the "
        "coordinator's"
    ]
    assert "storage writer changed" in said[19][0]
    assert said[24] == [
        "planning afresh: rank 0: 'model.shared.w' changed (properties or chunks); "
        "rank 1: 'model.shared.w' changed (properties or chunks)"
    ]
    assert said[28] == ["planning afresh: rank 1: no plan kept"]
    assert said[42] == [
        "planning afresh: rank 1: its kept plan is another save's than the "
        "coordinator's"
    ]


def test_a_failed_repeat_save_fails_on_every_rank_and_the_next_plans(repeat_ranks):
    for result in rank_results(repeat_ranks, "failure"):
        assert result["error"] == (
            "saving step-3 failed on 1 rank(s):\n  rank 1: AttributeError: Can't "
            "pickle local object 'check_failure.<locals>.<lambda>'"
        )
        assert result["reused_by_failed"] == 0
        assert result["published"] == ["step-1", "step-2", "step-4"]
        assert [_outcome(s) for s in result["saves"]] == ["fresh", "reused", "fresh"]
    step = repeat_ranks / "failing" / "step-4"
    expected = _expected(repeat_ranks, "failing", 4)
    assert _bitwise_diff(plain_read(step), expected) == []


def test_the_async_saver_reuses_the_plan_and_plans_on_a_change(repeat_ranks):
    for result in rank_results(repeat_ranks, "async"):
        got = [_outcome(s) for s in result["saves"]]
        assert got == ["fresh", "reused", "fresh", "reused"]
    for step in (1, 2, 3, 4):
        path = repeat_ranks / "async" / f"step-{step}"
        expected = _expected(repeat_ranks, "async", step)
        assert _bitwise_diff(plain_read(path), expected) == [], f"step-{step}"
        assert checkpoint.verify_step(path) > 0


def test_in_one_process_and_with_a_planner(tmp_path):
    cache = plan_reuse.SavePlanCache()
    for step in (1, 2):
        checkpoint.save_stage(stage(0, step), tmp_path, step=step, plan_cache=cache)
    assert (cache.plans_made, cache.plans_reused) == (1, 1)
    assert _bitwise_diff(plain_read(tmp_path / "step-2"), flat(stage(0, 2))) == []
    with pytest.raises(ValueError) as e:
        checkpoint.save_stage(
            stage(0, 3),
            tmp_path,
            step=3,
            plan_cache=cache,
            planner=dcp.DefaultSavePlanner(),
        )
    assert str(e.value) == (
        "save_stage: pass planner or plan_cache, not both (a kept plan is "
        "DefaultSavePlanner's); drop planner to reuse plans"
    )
