"""pippy.checkpoint in one process: step folders, comparisons, traced stages."""

import copy
import gc
import logging
import subprocess
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ranks import run_ranks
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
)

from pippy import SplitPoint, checkpoint, pipeline
from pippy.checkpoint import offline
from pippy.checkpoint.reader import read_metadata
from pippy.checkpoint.save import publish_step
from pippy.checkpoint.steps import is_complete, list_steps, wait_for_deletions
from pippy.checkpoint.storage import LocalStorage
from pippy.stages import (
    TiedParametersError,
    check_untied,
    restore_non_persistent_buffers,
)

from helpers import tiny_gpt


def tiny_model():
    return tiny_gpt(max_seq_len=16)


def save_step(root, step, module):
    checkpoint.save_stage({"model": module.state_dict()}, root, step=step)


def test_publish_step_writes_a_complete_step_folder(tmp_path):
    save_step(tmp_path, 5, tiny_model())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]
    assert is_complete(LocalStorage(), tmp_path / "step-5")
    assert checkpoint.find_latest_step(tmp_path) == tmp_path / "step-5"


def test_the_writer_publishes_the_step_inside_dcp_save(tmp_path):
    """Publishing rides DCP's last step (the writer's finish on the coordinator):
    when dcp.save returns, step-<N> is there, the staging folder gone."""
    state = {"model": tiny_model().state_dict()}
    with publish_step(tmp_path, 3, keep_last=1) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
        assert is_complete(LocalStorage(), tmp_path / "step-3")
    with publish_step(tmp_path, 4, keep_last=1) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        wait_for_deletions()  # step-3's files: deleted by a thread
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]  # pruned


def test_publish_step_never_overwrites_a_step(tmp_path):
    save_step(tmp_path, 5, tiny_model())
    before = (tmp_path / "step-5" / ".metadata").read_bytes()
    with pytest.raises(checkpoint.CheckpointDirError, match="never overwritten") as e:
        save_step(tmp_path, 5, tiny_model())
    assert str(e.value).startswith(f"{str(tmp_path / 'step-5')!r} already exists")
    assert (tmp_path / "step-5" / ".metadata").read_bytes() == before
    (tmp_path / "file").touch()  # a checkpoint folder that is a file
    with pytest.raises(checkpoint.CheckpointDirError, match="is a file") as e:
        save_step(tmp_path / "file", 1, tiny_model())
    assert str(e.value).startswith("checkpoint dir ")  # its reason alone


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_overwrite_option_is_refused_not_ignored(tmp_path, overwrite):
    """DCP's writer option means nothing for a step written into a folder of
    its own: refused, before anything is made."""
    with pytest.raises(ValueError, match=rf"overwrite={overwrite} cannot be honoured"):
        with publish_step(tmp_path / "ckpt", 1, overwrite=overwrite):
            pass
    assert not (tmp_path / "ckpt").exists()


def test_a_step_another_save_published_meanwhile_is_kept_and_named(tmp_path):
    """Two saves of one step into one folder at once (two process groups, or a
    job without FolderOwner): the one that publishes second is discarded with
    that cause, and the first one's step is kept as it was."""

    class Rival(DefaultSavePlanner):
        def finish_plan(self, new_plan):  # while this save writes, another publishes
            checkpoint.save_stage({"w": torch.zeros(2)}, tmp_path, step=1)
            return super().finish_plan(new_plan)

    with pytest.raises(checkpoint.CheckpointDirError) as raised:
        checkpoint.save_stage({"w": torch.ones(2)}, tmp_path, step=1, planner=Rival())
    assert str(raised.value) == (
        f"{str(tmp_path / 'step-1')!r} was published by another save while this one "
        "wrote (a second process group or job saving into this folder?): this save "
        "is discarded. Give each its own folder"
    )
    kept = {"w": torch.ones(2)}
    dcp.load(kept, checkpoint_id=tmp_path / "step-1", no_dist=True)
    assert torch.equal(kept["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # no staging


def test_a_step_path_of_none_is_named(tmp_path):
    """find_latest_step's None passed on to a load: named, not a TypeError."""
    state = checkpoint.StageState(tiny_model())
    for call in (checkpoint.load_stage, lambda _, path: checkpoint.open_step(path)):
        with pytest.raises(checkpoint.CheckpointNotFoundError, match="no step to load"):
            call(state, checkpoint.find_latest_step(tmp_path))


def test_a_step_path_of_none_is_named_on_every_rank(tmp_path):
    def on_rank(rank, world):
        state = checkpoint.StageState(tiny_model())
        with pytest.raises(checkpoint.CheckpointNotFoundError, match="no step to load"):
            checkpoint.load_stage(state, checkpoint.find_latest_step(tmp_path))
        with pytest.raises(checkpoint.CheckpointNotFoundError, match="no step to load"):
            with checkpoint.load_into(state, None):
                pass

    run_ranks(2, on_rank)


def test_failed_save_publishes_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with publish_step(tmp_path, 7):
            raise RuntimeError("boom")
    assert list_steps(LocalStorage(), tmp_path) == {}
    assert checkpoint.find_latest_step(tmp_path) is None
    save_step(tmp_path, 7, tiny_model())  # the stale staging folder is replaced
    assert checkpoint.find_latest_step(tmp_path) == tmp_path / "step-7"


def test_latest_step_skips_incomplete_folders(tmp_path, caplog):
    save_step(tmp_path, 2, tiny_model())
    save_step(tmp_path, 10, tiny_model())
    (tmp_path / "step-20").mkdir()  # crashed before .metadata was written
    (tmp_path / "step-9x").mkdir()  # not a step folder
    (tmp_path / "step-30").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="pippy.checkpoint"):
        assert checkpoint.find_latest_step(tmp_path) == tmp_path / "step-10"
    assert "step-20" in caplog.text
    assert list(list_steps(LocalStorage(), tmp_path)) == [2, 10, 20]


def test_a_run_folder_where_a_step_is_wanted_names_a_step(tmp_path):
    save_step(tmp_path, 4, tiny_model())
    with pytest.raises(
        checkpoint.CheckpointNotFoundError, match="pass one of its steps, e.g. .*step-4"
    ):
        read_metadata(tmp_path)


def test_missing_dir_has_no_steps_and_a_file_is_refused(tmp_path):
    assert checkpoint.find_latest_step(tmp_path / "nope") is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        checkpoint.find_latest_step(tmp_path / "file")
    with pytest.raises(NotADirectoryError):
        save_step(tmp_path / "file", 1, tiny_model())


def test_diff_state_dicts_is_bitwise():
    a = {"model": {"w": torch.zeros(3)}, "step": 1}
    assert (
        offline.diff_state_dicts(a, {"model": {"w": torch.zeros(3)}, "step": 1}) == []
    )
    assert offline.diff_state_dicts(a, {"model": {"w": torch.zeros(3)}, "step": 2}) == [
        "step"
    ]
    tiny = torch.tensor([0.0, 0.0, 1e-45])
    assert offline.diff_state_dicts(a, {"model": {"w": tiny}, "step": 1}) == ["model.w"]
    as_double = torch.zeros(3, dtype=torch.float64)
    assert offline.diff_state_dicts(a, {"model": {"w": as_double}, "step": 1}) == [
        "model.w"
    ]
    assert offline.diff_state_dicts(a, {"model": {}, "step": 1}) == ["model.w"]
    nan = {"w": torch.tensor([float("nan"), 1.0])}
    assert offline.diff_state_dicts(nan, {"w": nan["w"].clone()}) == []  # bitwise
    assert offline.diff_state_dicts(
        {"w": torch.tensor([0.0])}, {"w": torch.tensor([-0.0])}
    ) == ["w"]


def test_restore_non_persistent_buffers_on_traced_stages():
    model = tiny_model()
    expected = set(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pipe = pipeline(
            model,
            mb_args=(torch.zeros(2, 16, dtype=torch.long),),
            split_spec={"layers.2": SplitPoint.BEGINNING},
        )
    keys = []
    for index in range(2):
        stage_module = pipe.get_stage_module(index)
        assert "rope" in stage_module.state_dict()  # what tracing does
        assert restore_non_persistent_buffers(stage_module, model) == ["rope"]
        assert "rope" not in stage_module.state_dict()
        assert torch.equal(stage_module.get_buffer("rope"), model.rope)  # still used
        keys.append(set(stage_module.state_dict()))
    assert keys[0].isdisjoint(keys[1]) and keys[0] | keys[1] == expected


def test_stage_state_rejects_reserved_extra_names():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="reserved"):
        checkpoint.StageState(model, optimizer, extra={"step": object()})


def test_keys_that_no_rank_reads_are_an_error_not_a_silent_drop(tmp_path):
    """E.g. per-stage state of a stage that no longer exists after a change of
    pipeline degree, or layers the model no longer has."""
    extra = {"stage_3": {"rng": torch.arange(3)}}
    folder = checkpoint.save_stage(
        {"model": tiny_model().state_dict(), **extra}, tmp_path, step=1
    )

    def load(**kwargs):
        checkpoint.load_stage({"model": tiny_model().state_dict()}, folder, **kwargs)

    dcp.load({"model": tiny_model().state_dict()}, checkpoint_id=folder)  # DCP: fine
    with pytest.raises(checkpoint.CheckpointError, match=r"1 key\(s\).*'stage_3.rng'"):
        load()
    load(must_read=("model.",))  # explicitly partial


def test_a_tensor_of_no_element_needs_no_reader(tmp_path):
    """A saved tensor of no element has nothing to read: no rank's plan reads
    it, and the every-key-read check lets it be."""
    state = {"model": {"weight": torch.randn(3), "empty": torch.empty(0, 4)}}
    folder = checkpoint.save_stage(state, tmp_path, step=1)
    into = {"model": {"weight": torch.zeros(3), "empty": torch.empty(0, 4)}}
    checkpoint.load_stage(into, folder)
    assert torch.equal(into["model"]["weight"], state["model"]["weight"])


def test_tied_weights_are_refused_before_splitting():
    model = tiny_model()
    check_untied(model)  # untied: fine
    model.output.weight = model.tok_embeddings.weight
    with pytest.raises(
        TiedParametersError,
        match="'output.weight' is 'tok_embeddings.weight'",
    ):
        check_untied(model)


def test_a_model_with_fewer_layers_is_refused_naming_the_keys_no_rank_reads(tmp_path):
    state = {"model": tiny_gpt(n_layers=4).state_dict(), "step": 1}
    checkpoint.save_stage(state, tmp_path, step=1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_stage(
            checkpoint.StageState(tiny_gpt(n_layers=2)), tmp_path / "step-1"
        )
    assert "read by no rank and would be dropped ('model.layers.2" in str(e.value)


class GcProbe:
    """A Stateful that records whether Python's cyclic GC is on when called."""

    def __init__(self):
        self.seen = []

    def state_dict(self):
        self.seen.append(gc.isenabled())
        return {"n": 1}

    def load_state_dict(self, state_dict):
        self.seen.append(gc.isenabled())


def test_the_cyclic_gc_is_paused_in_a_save_and_a_load_and_on_again_after(tmp_path):
    """A save's and a load's many small objects (a .metadata of 657 items: 230
    collections) would start the collector over the trainer's whole heap."""
    probe = GcProbe()
    state = checkpoint.StageState(torch.nn.Linear(2, 2), extra={"probe": probe})
    step = checkpoint.save_stage(state, tmp_path)
    checkpoint.load_stage(state, step)  # takes the state, then applies it
    other = checkpoint.StageState(torch.nn.Linear(3, 3), extra={"probe": probe})
    with pytest.raises(checkpoint.CheckpointError, match="shape"):
        checkpoint.load_stage(other, step)  # takes the state, then refuses
    assert probe.seen == [False] * 4
    assert gc.isenabled()
    # Opening a step of 400 items (open_step, as load_into does): at most the one
    # collection once the collector is on again (10 without the pause).
    layers = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(200)))
    step = checkpoint.save_stage(checkpoint.StageState(layers), tmp_path / "big")
    started = []
    gc.callbacks.append(collecting := lambda phase, _: started.append(phase))
    try:
        checkpoint.open_step(step)
    finally:
        gc.callbacks.remove(collecting)
    assert started.count("start") <= 1


def test_load_into_opens_the_step_or_takes_another_reader(tmp_path):
    """load_into opens a step for pippy's reader and planner, filling a stage or
    a plain state_dict in place; given another reader, it applies after it."""
    probe = GcProbe()
    state = checkpoint.StageState(torch.nn.Linear(2, 2), extra={"probe": probe})
    step = checkpoint.save_stage(state, tmp_path)
    with checkpoint.load_into(state, step) as (state_dict, reader, planner):
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    assert len(probe.seen) == 3  # the save's, then taken and applied
    plain = {"step": -1}  # a plain state_dict, filled in place
    with checkpoint.load_into(plain, step, must_read=("step",)) as (sd, reader, p):
        dcp.load(sd, storage_reader=reader, planner=p)
    assert plain == {"step": 0}
    plain = {"step": -1}
    with checkpoint.load_into(plain, FileSystemReader(step)) as (sd, reader, p):
        assert p is None
        dcp.load(sd, storage_reader=reader, planner=p)
    assert plain == {"step": 0}


def test_the_reader_and_writer_refuse_to_be_used_other_than_as_made(tmp_path):
    """load_into's reader: not with a planner that unpickles items with plain
    pickle (unless trusted), not for another checkpoint_id, and load_into
    raises if the body read without it; publish_step raises if the body saved
    without its writer or elsewhere. Each leaves what was saved as it was."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2), step=1)  # step: pickled
    one = checkpoint.save_stage(state, tmp_path)
    state.step = 2
    two = checkpoint.save_stage(state, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    fresh = checkpoint.StageState(torch.nn.Linear(2, 2))
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="planner load_into"):
        with checkpoint.load_into(fresh, one) as (state_dict, reader, _):
            dcp.load(state_dict, storage_reader=reader, planner=DefaultLoadPlanner())
    with pytest.raises(ValueError, match="opened for .*step-1, not .*step-2"):
        with checkpoint.load_into(fresh, one) as (state_dict, reader, _):
            dcp.load(state_dict, checkpoint_id=two, storage_reader=reader)
    weights = copy.deepcopy(fresh.module.state_dict())
    with pytest.raises(checkpoint.CheckpointError, match="another storage reader"):
        with checkpoint.load_into(fresh, one) as (state_dict, reader, planner):
            plain = FileSystemReader(one)  # refused before it reads
            dcp.load(state_dict, storage_reader=plain, planner=planner)
    assert all(torch.equal(weights[k], v) for k, v in fresh.module.state_dict().items())
    reader, planner = checkpoint.open_step(one)  # its planner, likewise (in DCP's)
    with pytest.raises(CheckpointException, match="another storage reader"):
        dcp.load(
            fresh.state_dict(), storage_reader=FileSystemReader(one), planner=planner
        )
    assert all(torch.equal(weights[k], v) for k, v in fresh.module.state_dict().items())
    with pytest.raises(ValueError, match="did not read with its reader.*unchecked"):
        with checkpoint.load_into(fresh, one) as (state_dict, reader, _):
            dcp.load(state_dict, checkpoint_id=two)  # plain DCP's reader and planner
    assert fresh.step == 0  # nothing applied
    with checkpoint.load_into(fresh, one) as (state_dict, reader, planner):
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    assert fresh.step == 1
    with checkpoint.load_into(fresh, two, trusted=True) as (state_dict, reader, _):
        dcp.load(state_dict, storage_reader=reader, planner=DefaultLoadPlanner())
    assert fresh.step == 2
    state.step = 3
    state_dict, step, _ = checkpoint.take_state(state)
    with pytest.raises(ValueError, match="step-3 is not saved"):
        with checkpoint.publish_step(tmp_path, step):
            pass
    with pytest.raises(ValueError, match="saves .*step-3, not .*elsewhere"):
        with checkpoint.publish_step(tmp_path, step) as writer:
            dcp.save(
                state_dict, checkpoint_id=tmp_path / "elsewhere", storage_writer=writer
            )
    assert not (tmp_path / "step-3").exists() and not (tmp_path / "elsewhere").exists()
    assert before == {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("keep_last", [0, -1, "2", 1.5, True])
def test_a_bad_keep_last_is_refused_before_anything_is_written(tmp_path, keep_last):
    """It was checked only while pruning, after the step was published."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2), step=1)
    message = f"keep_last must be None or a whole number >= 1, not {keep_last!r}"
    with pytest.raises(ValueError) as e:
        checkpoint.save_stage(state, tmp_path, keep_last=keep_last)
    assert str(e.value) == message
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.AsyncSaver(tmp_path, keep_last=keep_last)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("step", [-1, True, "7", 2.0])
def test_a_step_that_is_not_a_whole_number_is_refused(tmp_path, step):
    """step--1, step-True, step-7 (a str in its manifest), step-2.0 were written."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError) as e:
        checkpoint.save_stage(state, tmp_path, step=step)
    assert str(e.value) == f"a step is a whole number >= 0, not {step!r}"
    with pytest.raises(ValueError, match="a step is a whole number"):
        with checkpoint.publish_step(tmp_path, step):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_folder_inside_a_step_is_refused(tmp_path):
    """As FolderOwner refuses it: a save would nest a step in a published one."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2), step=1)
    step = checkpoint.save_stage(state, tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    state.step = 2
    for inside in (step, step / "sub", tmp_path / "step-9"):
        with pytest.raises(checkpoint.CheckpointDirError, match="lies in the step"):
            checkpoint.save_stage(state, inside)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_save_whose_pruning_fails_is_saved_and_says_so(tmp_path, caplog):
    """An old step that cannot be removed (immutable) leaves the save published,
    with a warning; it was a 'cannot publish' error for a step that was."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2), step=1)
    first = checkpoint.save_stage(state, tmp_path)
    subprocess.run(["chattr", "+i", first], check=True)
    try:
        state.step = 2
        with caplog.at_level(logging.WARNING, logger="pippy.checkpoint.save"):
            second = checkpoint.save_stage(state, tmp_path, keep_last=1)
    finally:
        subprocess.run(["chattr", "-i", first], check=True)
    assert checkpoint.find_latest_step(tmp_path) == second
    assert first.is_dir()
    assert f"saved {second}, but could not remove the steps beyond keep_last=1" in (
        caplog.text
    )


def test_a_state_list_a_thread_count_of_0_a_closed_saver_and_a_dict_extra_are_named(
    tmp_path,
):
    """Each was a bare error from deep inside (AttributeError, min() of an empty
    sequence, a closed thread pool's RuntimeError)."""
    with pytest.raises(TypeError, match="a StageState or a state_dict .*not a list"):
        checkpoint.save_stage([torch.ones(2)], tmp_path, step=1)
    state = checkpoint.StageState(torch.nn.Linear(2, 2), step=1)
    with pytest.raises(ValueError, match="thread_count must be a whole number >= 1"):
        checkpoint.save_stage(state, tmp_path, thread_count=0)
    assert list(tmp_path.iterdir()) == []
    saver = checkpoint.AsyncSaver(tmp_path)
    saver.close()
    with pytest.raises(RuntimeError, match="this AsyncSaver is closed"):
        saver.save(state)
    assert list(tmp_path.iterdir()) == []
    state.extra["sampler"] = {"epoch": 3}  # not a Stateful: could not be loaded back
    with pytest.raises(
        TypeError, match="extra state 'sampler' is a dict, not a Stateful"
    ):
        checkpoint.save_stage(state, tmp_path)
    assert list(tmp_path.iterdir()) == []
