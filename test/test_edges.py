"""Never lose or mix data at the edges: one writer per folder, verified content,
step identity, contained reads, param-group order, disk full, preemption.

Where plain DCP loses or mixes data quietly, each test shows that first, so
that pippy's refusal is shown to matter.
"""

import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ranks import run_ranks
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.errors import MOVE_ASIDE
from pippy.checkpoint.manifest import MANIFEST_FILE, read_manifest
from pippy.checkpoint.owner import OWNER_FILE
from pippy.checkpoint.reader import SafeFileSystemReader, read_metadata
from pippy.checkpoint.safe_load import SafeLoadPlanner
from pippy.checkpoint.steps import list_steps, remove_old_steps, wait_for_deletions
from pippy.checkpoint.storage import LocalStorage
from pippy.cli import main

import helpers
from helpers import (
    EXAMPLE,
    TINY_FLAGS,
    TINY_RUN_FLAGS,
    TwoHeads,
    example,
    examples,
    linear_state,
)

# --------------------------------------------------------------------------
# Verified content and step identity
# --------------------------------------------------------------------------


def saved_linear(root, step=1):
    state = linear_state()
    state.step = step
    return state, checkpoint.save_stage(state, root)


def flip_bit(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def place(folder, key):
    """(file, offset, length) of a key's (first) item, from .metadata."""
    metadata = read_metadata(folder)
    [info] = [i for k, i in metadata.storage_data.items() if k.fqn == key]
    return folder / info.relative_path, info.offset, info.length


def test_a_flipped_bit_in_a_tensor_loads_silently_in_dcp_and_is_refused(tmp_path):
    saved, folder = saved_linear(tmp_path)
    path, offset, length = place(folder, "model.weight")
    raw = path.read_bytes()
    at = raw.index(saved.module.weight.detach().numpy().tobytes(), offset)
    flip_bit(path, at + 17)  # one bit of the tensor's data
    plain = {"model": {"weight": torch.empty(4, 4), "bias": torch.empty(4)}}
    dcp.load(plain, checkpoint_id=folder)  # DCP: no error
    assert not torch.equal(plain["model"]["weight"], saved.module.weight)
    with pytest.raises(
        checkpoint.CheckpointError,
        match="item 'model.weight' of __0_0.distcp is damaged: its bytes do not "
        "match their checksum in manifest.json",
    ):
        checkpoint.load_stage(linear_state(), folder)
    with pytest.raises(checkpoint.CheckpointError, match="'model.weight'"):
        offline.verify_step(folder)


@pytest.mark.parametrize("where", ["data", "padding", "cut short after opening"])
def test_damage_in_a_large_tensor_read_into_its_storage_is_refused(tmp_path, where):
    # Items of 1 MiB or more are checked as torch.load reads them, straight
    # into the tensor; the padding before the data it never reads (plain DCP
    # loads a step damaged there), and the checksum covers that too.
    torch.manual_seed(0)
    big = checkpoint.StageState(torch.nn.Linear(1024, 512, bias=False), step=1)
    folder = checkpoint.save_stage(big, tmp_path)
    path, offset, length = place(folder, "model.weight")
    assert length > 2**21
    intact = checkpoint.StageState(torch.nn.Linear(1024, 512, bias=False))
    checkpoint.load_stage(intact, folder)  # every byte checked, the skipped too
    assert torch.equal(intact.module.weight, big.module.weight)
    fresh = checkpoint.StageState(torch.nn.Linear(1024, 512, bias=False))
    raw = path.read_bytes()
    data = raw.index(big.module.weight.detach().numpy().tobytes(), offset)
    if where == "data":
        flip_bit(path, data + 1000)
    elif where == "padding":
        flip_bit(path, data - 1)  # the zip record's alignment padding
    if where != "cut short after opening":
        plain = {"model": {"weight": torch.empty(512, 1024)}}
        dcp.load(plain, checkpoint_id=folder)  # DCP: no error
    fix = "Restore the file" if where == "cut short after opening" else "checksum"
    with pytest.raises(checkpoint.CheckpointError, match=f"'model.weight'.*{fix}"):
        with checkpoint.load_into(fresh, folder) as (state_dict, reader, planner):
            if where == "cut short after opening":
                path.write_bytes(raw[: data + 1000])  # once the step was opened
            dcp.load(state_dict, storage_reader=reader, planner=planner)
    assert not torch.equal(fresh.module.weight, big.module.weight)
    if where != "cut short after opening":
        with pytest.raises(checkpoint.CheckpointError, match="'model.weight'"):
            checkpoint.load_stage(fresh, folder)


def test_a_flipped_bit_in_the_step_is_refused(tmp_path):
    _, folder = saved_linear(tmp_path, step=2)
    path, offset, length = place(folder, "step")
    raw = path.read_bytes()
    # The pickled int 2 (BININT1 2) becomes 3: DCP reads step 3 without a word.
    at = raw.index(b"K\x02", offset, offset + length)
    flip_bit(path, at + 1)
    plain = {"step": 0}
    dcp.load(plain, checkpoint_id=folder)
    assert plain["step"] == 3
    with pytest.raises(checkpoint.CheckpointError, match="item 'step' of .* damaged"):
        offline.read_checkpoint(folder)


@pytest.fixture(scope="module")
def two_ranks(two_rank_checks):
    """The launch of 2 ranks that ran twins (equal-size rank files, and an
    async poll) and one_fails, with other modules' checks (conftest.py)."""
    return two_rank_checks["dist_checks"]


def test_swapped_rank_files_of_equal_size_mix_silently_in_dcp_and_are_refused(
    two_ranks, tmp_path
):
    folder = tmp_path / "step-1"
    shutil.copytree(two_ranks / "twins" / "step-1", folder)
    original = offline.read_checkpoint(folder)
    a, b = folder / "__0_0.distcp", folder / "__1_0.distcp"
    assert a.stat().st_size == b.stat().st_size
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    plain = {"model": {"w0": torch.empty(8, 8), "w1": torch.empty(8, 8)}}
    dcp.load(plain, checkpoint_id=folder)  # DCP: w0 now holds w1's values
    assert torch.equal(plain["model"]["w0"], original["model.w1"])
    with pytest.raises(
        checkpoint.CheckpointError, match=r"item '(model.w.|step)' of __._0.distcp"
    ):
        offline.read_checkpoint(folder)


def test_a_setup_error_on_one_rank_stops_every_rank_with_its_message(two_ranks):
    errors = [
        json.loads((two_ranks / f"one_fails-rank{rank}.json").read_text())["error"]
        for rank in range(2)
    ]
    missing = two_ranks / "missing.txt"
    assert (
        errors[1]
        == f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'"
    )
    assert (
        errors[0]
        == f"CheckpointError: setting up failed on 1 rank(s):\n  rank 1: {errors[1]}"
    )


def test_an_async_save_is_published_as_soon_as_it_is_on_disk(two_ranks):
    for rank in range(2):
        r = json.loads((two_ranks / f"twins-rank{rank}.json").read_text())
        assert r["published"].endswith("step-2")
        assert r["listed"] == [2]  # published by poll(), keep_last applied then


def test_a_step_folder_holding_another_step_is_never_taken_for_it(tmp_path):
    _, step_2 = saved_linear(tmp_path, step=2)
    copied = tmp_path / "step-10"  # a copy, or data that lost its step
    shutil.copytree(step_2, copied)
    plain = {"step": 0}
    dcp.load(plain, checkpoint_id=copied)
    assert plain["step"] == 2  # DCP: whatever the name says
    assert checkpoint.find_latest_step(tmp_path) == step_2
    with pytest.raises(
        checkpoint.CheckpointError, match="'.*step-10' holds step 2 by its manifest"
    ):
        checkpoint.load_stage(linear_state(), copied)
    # --keep-last 1 ranks steps by what they hold: the step just published is
    # kept (it used to be deleted at once: step-10 looked newer).
    state = linear_state()
    state.step = 3
    published = checkpoint.save_stage(state, tmp_path, keep_last=1)
    wait_for_deletions()  # step-2's files: deleted by a thread
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-3"]
    assert checkpoint.find_latest_step(tmp_path) == published


def test_a_copied_step_in_the_way_is_moved_aside_and_the_save_goes_on(tmp_path):
    _, step_2 = saved_linear(tmp_path, step=2)
    shutil.copytree(step_2, tmp_path / "step-3")  # the next step's name, taken
    state = linear_state()
    state.step = 3
    published = checkpoint.save_stage(state, tmp_path)  # it used to be refused
    assert offline.read_checkpoint(published)["step"] == 3
    [aside] = tmp_path.glob(".step-3.incomplete-*")
    assert read_manifest(LocalStorage(), aside).step == 2  # kept, not deleted


def test_a_manifest_edited_to_match_its_folder_is_refused(tmp_path):
    _, step_2 = saved_linear(tmp_path, step=2)
    copied = tmp_path / "step-10"
    shutil.copytree(step_2, copied)
    manifest = json.loads((copied / "manifest.json").read_text())
    manifest["step"] = 10
    (copied / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        checkpoint.CheckpointError, match="holds step 2, its manifest.json says 10"
    ):
        checkpoint.load_stage(linear_state(), copied)


@pytest.mark.parametrize("text", ['{"format": "pippy-manif', '{"format": "other/1"}'])
def test_a_step_whose_manifest_is_damaged_is_refused_not_passed_over(tmp_path, text):
    """A damaged manifest is damage, not an unfinished save: the step is still
    the newest, its load is refused naming the manifest (no silent step back),
    and only verified=True passes it over, moved aside as damaged."""
    _, step_1 = saved_linear(tmp_path, step=1)
    _, step_2 = saved_linear(tmp_path, step=2)
    (step_2 / MANIFEST_FILE).write_text(text)
    assert checkpoint.find_latest_step(tmp_path) == step_2
    with pytest.raises(
        checkpoint.CheckpointError, match="manifest.json is damaged .*: restore it"
    ):
        checkpoint.load_stage(linear_state(), step_2)
    assert main(["inspect", str(tmp_path), "--verify"]) == 2  # not step-1, silently
    assert checkpoint.find_latest_step(tmp_path, verified=True) == step_1
    [aside] = tmp_path.glob(".step-2.damaged-*")
    assert (aside / MANIFEST_FILE).read_text() == text  # kept, not deleted


def test_the_plugins_refuse_what_take_state_would_and_a_step_is_no_run_folder(
    tmp_path,
):
    """DCP's plug-ins used by name check what take_state checks: a StepWriter
    of several ranks with DCP's own planner (which would keep one of two ranks'
    copies of a key), a planner and a writer of other steps, a state holding
    another step; nothing is published. find_latest_step refuses a step folder for its run's."""
    state = {"model": {"w": torch.ones(2)}, "step": 1}

    def two_ranks_plain_planner(rank, nproc):  # both offer "model.w"
        with pytest.raises(CheckpointException, match="save with pippy's Checked"):
            dcp.save(state, storage_writer=checkpoint.StepWriter(tmp_path / "two", 1))

    run_ranks(2, two_ranks_plain_planner)
    assert not (tmp_path / "two").exists() or not any((tmp_path / "two").iterdir())
    refusals = [
        (
            checkpoint.CheckedSavePlanner(step=1),
            5,
            "planner saves step 1 and the writer",
        ),
        (checkpoint.CheckedSavePlanner(step=5), 5, "holds step 1; it cannot be step-5"),
    ]
    for planner, step, refusal in refusals:
        with pytest.raises(CheckpointException, match=re.escape(refusal)):
            dcp.save(
                state,
                storage_writer=checkpoint.StepWriter(tmp_path, step),
                planner=planner,
            )
    assert not list(tmp_path.glob("step-*"))
    writer = checkpoint.StepWriter(tmp_path, 1)
    dcp.save(state, storage_writer=writer, planner=checkpoint.CheckedSavePlanner())
    with pytest.raises(checkpoint.CheckpointDirError, match="is or lies in the step"):
        checkpoint.find_latest_step(tmp_path / "step-1")
    with pytest.raises(checkpoint.CheckpointDirError, match="is or lies in the step"):
        checkpoint.find_latest_step(tmp_path / "step-1", verified=True)


def test_two_names_for_one_step_are_refused(tmp_path):
    _, folder = saved_linear(tmp_path, step=8)
    shutil.copytree(folder, tmp_path / "step-08")
    with pytest.raises(
        checkpoint.CheckpointDirError, match="'.*step-08' is not a step folder name"
    ):
        checkpoint.find_latest_step(tmp_path)


def test_a_state_saved_under_another_step_is_refused(tmp_path):
    state = linear_state()
    state.step = 5
    with pytest.raises(ValueError, match="holds step 5; it cannot be step-6"):
        checkpoint.save_stage(state, tmp_path, step=6)
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_without_manifest_needs_an_explicit_opt_out(tmp_path):
    _, folder = saved_linear(tmp_path)
    (folder / MANIFEST_FILE).unlink()
    with pytest.raises(
        checkpoint.CheckpointError, match="has no manifest.json.*verify=False"
    ):
        checkpoint.load_stage(linear_state(), folder)
    reader = SafeFileSystemReader(folder, verify=False)
    state = {"model": {"weight": torch.empty(4, 4), "bias": torch.empty(4)}}
    dcp.load(
        state,
        storage_reader=reader,
        planner=SafeLoadPlanner(must_read=("model.",)),
    )


# --------------------------------------------------------------------------
# Contained, bounded reads of a crafted .metadata
# --------------------------------------------------------------------------


def craft(folder, edit):
    """Rewrites .metadata with `edit(metadata)` applied (our own file)."""
    path = folder / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def repoint(new_name):
    def edit(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = new_name(info.relative_path)

    return edit


READ_PATHS = {
    "load_stage": lambda f: checkpoint.load_stage(linear_state(), f),
    "load_model": lambda f: offline.load_model(f, torch.nn.Linear(4, 4)),
    "read_checkpoint": offline.read_checkpoint,
    "read_metadata": read_metadata,  # inspect and export start here
}


@pytest.mark.parametrize("read", READ_PATHS.values(), ids=READ_PATHS.keys())
@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_data_files_outside_the_step_folder_are_refused(tmp_path, read, where):
    _, folder = saved_linear(tmp_path / "ckpt")
    outside = tmp_path / "outside.distcp"
    shutil.copy(folder / "__0_0.distcp", outside)
    if where == "symlink":
        (folder / "__0_0.distcp").unlink()
        (folder / "__0_0.distcp").symlink_to(outside)
    else:
        name = "../../outside.distcp" if where == "parent" else str(outside)
        craft(folder, repoint(lambda _: name))
        plain = {"model": {"weight": torch.empty(4, 4), "bias": torch.empty(4)}}
        dcp.load(plain, checkpoint_id=folder)  # DCP reads the file out there
    data = folder / "__0_0.distcp"
    refused = (
        f"refused to read {str(data)!r}: it is a link to {str(outside)!r}"
        if where == "symlink"
        else "not a plain file name inside the step folder"
    )
    with pytest.raises(checkpoint.UnsafeCheckpointError, match=re.escape(refused)):
        read(folder)


def link_out(folder, name, outside):
    """Moves a step's file `name` to `outside`, leaving a link to it in its place."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(folder / name, outside)
    (folder / name).symlink_to(outside)
    return f"refused to read {str(folder / name)!r}: it is a link to {str(outside)!r}"


LINKED_READS = {  # each (step folder, an output folder that does not exist)
    "load_stage": lambda f, out: checkpoint.load_stage(linear_state(), f),
    "load_model": lambda f, out: offline.load_model(f, torch.nn.Linear(4, 4)),
    "inspect --verify": lambda f, out: main(["inspect", str(f), "--verify"]),
    "export": lambda f, out: main(["export", str(f), "--out", str(out)]),
    "convert": lambda f, out: main(
        ["convert", str(f), "--to", "torchtitan", "--out", str(out)]
    ),
}


@pytest.mark.parametrize("read", LINKED_READS.values(), ids=LINKED_READS.keys())
@pytest.mark.parametrize("name", [".metadata", MANIFEST_FILE])
def test_a_step_file_linked_out_of_the_step_folder_is_refused(
    tmp_path, capsys, read, name
):
    _, folder = saved_linear(tmp_path / "ckpt")
    refused = link_out(folder, name, tmp_path / "elsewhere" / name)
    if name == ".metadata":  # DCP reads it wherever the link leads
        plain = {"model": {"weight": torch.empty(4, 4), "bias": torch.empty(4)}}
        dcp.load(plain, checkpoint_id=folder)
    out = tmp_path / "out"
    try:
        status = read(folder, out)
    except checkpoint.UnsafeCheckpointError as e:
        assert str(e).startswith(refused)
    else:  # the command line: one error line, exit status 2
        assert status == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: {refused}")
    assert not out.exists()


def test_a_step_whose_manifest_links_out_is_refused_as_the_one_to_resume(tmp_path):
    for step in (1, 2):
        saved_linear(tmp_path / "ckpt", step)
    ckpt = tmp_path / "ckpt"
    refused = link_out(ckpt / "step-2", MANIFEST_FILE, tmp_path / MANIFEST_FILE)
    for verified in (False, True):  # not passed over as damage: refused
        with pytest.raises(checkpoint.UnsafeCheckpointError, match=re.escape(refused)):
            checkpoint.find_latest_step(ckpt, verified=verified)
    assert main(["inspect", str(ckpt)]) == 2  # the step it would detail
    # Retention neither counts nor deletes it.
    assert remove_old_steps(LocalStorage(), ckpt, 1) == []
    assert sorted(list_steps(LocalStorage(), ckpt)) == [1, 2]


def test_the_example_refuses_to_resume_from_a_step_file_linked_out(tmp_path, tiny_run):
    # The example's own step-6 (a tiny run shared with other modules, copied).
    names = (".metadata", MANIFEST_FILE)
    refused = {}
    for name in names:
        shutil.copytree(tiny_run[0], tmp_path / name / "ckpt")
        step = tmp_path / name / "ckpt" / "step-6"
        refused[name] = link_out(step, name, tmp_path / name / "elsewhere" / name)
    runs = examples(
        *[
            (2, *TINY_FLAGS, "--steps", "7")
            + ("--checkpoint-dir", tmp_path / name / "ckpt")
            for name in names
        ],
        expect_ok=False,
    )
    for name, run in zip(names, runs, strict=True):
        assert run.returncode != 0, run.stdout
        for rank in range(2):
            assert f"[rank {rank}] error: {refused[name]}" in run.stdout
        assert not (tmp_path / name / "ckpt" / "step-7").exists()


def _negative(metadata):  # a shape no tensor has, its chunk filling it
    item = metadata.state_dict_metadata["model.weight"]
    item.size = item.chunks[0].sizes = torch.Size([-4, 4])


def _unlisted(metadata):  # stored (and in the manifest), but not a key to load
    del metadata.state_dict_metadata["model.bias"]


@pytest.mark.parametrize(
    "edit, damage",
    [
        (_negative, "'model.weight' has shape [-4, 4]"),
        (_unlisted, "it stores 'model.bias' but lists no such key"),
    ],
)
def test_a_crafted_metadata_that_misshapes_or_hides_a_key_is_damage(
    tmp_path, capsys, edit, damage
):
    _, folder = saved_linear(tmp_path / "ckpt")
    craft(folder, edit)
    for read in READ_PATHS.values():
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(damage)) as e:
            read(folder)
        assert str(e.value).endswith(f"Restore it, or {MOVE_ASIDE}")  # the fix
    for argv in (["inspect", "--verify"], ["export", "--out", str(tmp_path / "m.pt")]):
        assert main([argv[0], str(folder), *argv[1:]]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and damage in line
    assert not (tmp_path / "m.pt").exists()


def _retyped(metadata):  # the bytes stay float32
    metadata.state_dict_metadata["model.weight"].properties.dtype = torch.int32


def _reshaped(metadata):  # 16 elements as before, in one dim
    item = metadata.state_dict_metadata["model.weight"]
    item.size, item.chunks[0] = (
        torch.Size([16]),
        ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([16])),
    )
    for index in [i for i in metadata.storage_data if i.fqn == "model.weight"]:
        info = metadata.storage_data.pop(index)
        metadata.storage_data[replace(index, offset=torch.Size([0]))] = info


@pytest.mark.parametrize(
    "edit, stored",
    [
        (_retyped, "torch.float32 [4, 4], its .metadata says torch.int32 [4, 4]"),
        (_reshaped, "torch.float32 [4, 4], its .metadata says torch.float32 [16]"),
    ],
)
def test_a_metadata_that_misdescribes_its_items_is_damage_never_cast(
    tmp_path, capsys, edit, stored
):
    """A .metadata edited to another dtype or shape of the same size: refused by
    its checksum in the manifest (verified reads, inspect --verify, export), and
    unverified by each item's own dtype and shape as stored; never cast."""
    _, folder = saved_linear(tmp_path / "ckpt")
    craft(folder, edit)
    edited = "its .metadata does not match its checksum in manifest.json"
    verified = [READ_PATHS[name] for name in ("load_stage", "load_model")]
    for read in [*verified, offline.read_checkpoint, offline.verify_step]:
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(edited)):
            read(folder)
    for argv in (["inspect", "--verify"], ["export", "--out", str(tmp_path / "m.pt")]):
        assert main([argv[0], str(folder), *argv[1:]]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and edited in line
    assert not (tmp_path / "m.pt").exists()
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(stored)):
        offline.read_checkpoint(folder, verify=False)


def test_a_metadata_that_is_no_file_is_refused_or_damage(tmp_path):
    _, folder = saved_linear(tmp_path / "a")
    (folder / ".metadata").unlink()
    (folder / ".metadata").symlink_to("/dev/zero")
    with pytest.raises(
        checkpoint.UnsafeCheckpointError, match="it is a link to '/dev/zero'"
    ):
        read_metadata(folder)
    _, folder = saved_linear(tmp_path / "b")
    (folder / ".metadata").unlink()
    os.mkfifo(folder / ".metadata")
    with pytest.raises(
        checkpoint.CheckpointError, match="is damaged: it is not a file"
    ):
        read_metadata(folder)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_parameter_of_no_element_saves_and_loads(tmp_path):
    def state(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 0))
        return checkpoint.StageState(model, torch.optim.AdamW(model.parameters()))

    saved = state(0)
    step = checkpoint.save_stage(saved, tmp_path)
    fresh = state(1)
    checkpoint.load_stage(fresh, step)
    assert offline.diff_state_dicts(fresh.state_dict(), saved.state_dict()) == []
    assert main(["export", str(step), "--out", str(tmp_path / "m.pt")]) == 0
    exported = torch.load(tmp_path / "m.pt")
    assert exported["1.weight"].shape == (0, 4)


def test_a_tensor_larger_than_its_place_is_refused_before_allocation(tmp_path):
    _, folder = saved_linear(tmp_path)

    def huge(metadata):  # 4 TiB of float32
        item = metadata.state_dict_metadata["model.weight"]
        item.size = torch.Size([2**20, 2**20])
        item.chunks[0].sizes = torch.Size([2**20, 2**20])

    craft(folder, huge)
    for read in READ_PATHS.values():
        with pytest.raises(
            checkpoint.CheckpointError,
            match="'model.weight' declares 4398046511104 bytes",
        ):
            read(folder)


def test_an_item_longer_than_written_is_refused_before_reading(tmp_path):
    state = linear_state()
    state.extra["note"] = Note()
    folder = checkpoint.save_stage(state, tmp_path)
    path, offset, _ = place(folder, "note.text")

    def stretch(metadata):  # the item claims 256 MiB of a sparse file
        for key, info in metadata.storage_data.items():
            if key.fqn == "note.text":
                info.length = 2**28

    craft(folder, stretch)
    with open(path, "r+b") as f:
        f.truncate(offset + 2**28)  # sparse: no disk, but DCP would read it all
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"__0_0.distcp has \d+ bytes, manifest.json says",
    ):
        offline.read_checkpoint(folder)


class Note:
    def __init__(self):
        self.text = "hello"

    def state_dict(self):
        return {"text": self.text}

    def load_state_dict(self, state_dict):
        self.text = state_dict["text"]


def test_items_swapped_in_metadata_load_silently_in_dcp_and_are_refused(tmp_path):
    saved, folder = saved_linear(tmp_path)
    a, b = "optim.state.weight.exp_avg", "optim.state.weight.exp_avg_sq"

    def swap(metadata):
        [ka] = [k for k in metadata.storage_data if k.fqn == a]
        [kb] = [k for k in metadata.storage_data if k.fqn == b]
        storage = metadata.storage_data
        storage[ka], storage[kb] = storage[kb], storage[ka]

    craft(folder, swap)
    plain = {"optim": {"state.weight.exp_avg": torch.empty(4, 4)}}
    dcp.load(plain, checkpoint_id=folder)  # DCP: exp_avg_sq's values, no word
    moments = saved.optimizer.state[saved.module.weight]
    assert torch.equal(plain["optim"]["state.weight.exp_avg"], moments["exp_avg_sq"])
    with pytest.raises(
        checkpoint.CheckpointError, match=f"disagree on where '{a}', '{b}' are stored"
    ):
        checkpoint.load_stage(linear_state(), folder)


def larger_than_its_chunk(metadata):
    """4 TiB of float32 declared, the stored chunk unchanged."""
    metadata.state_dict_metadata["model.weight"].size = torch.Size([2**20] * 2)


def moved(offsets):
    """The chunk moved to `offsets`, its place with it; the tensor unchanged."""

    def move(metadata):
        metadata.state_dict_metadata["model.weight"].chunks[0].offsets = offsets
        storage = metadata.storage_data
        [old] = [k for k in storage if k.fqn == "model.weight"]
        storage[MetadataIndex("model.weight", offsets)] = storage.pop(old)

    return move


@pytest.mark.parametrize(
    "edit, shape",
    [
        (larger_than_its_chunk, [2**20] * 2),
        (moved((0,)), [4, 4]),
        (moved((4, 0)), [4, 4]),
    ],
    ids=["larger", "one dim", "outside"],
)
def test_a_tensor_its_chunks_do_not_fill_is_refused_before_allocation(
    tmp_path, edit, shape
):
    _, folder = saved_linear(tmp_path)
    craft(folder, edit)
    for read in READ_PATHS.values():
        with pytest.raises(
            checkpoint.CheckpointError,
            match=rf"'model.weight' declares shape {re.escape(str(shape))}, which "
            "its stored chunks do not fill",
        ):
            read(folder)


def test_crafted_metadata_tables_are_damage_not_key_errors(tmp_path):
    _, folder = saved_linear(tmp_path)

    def lose_an_entry(metadata):
        key = next(k for k in metadata.storage_data if k.fqn == "model.bias")
        del metadata.storage_data[key]

    craft(folder, lose_an_entry)
    for read in READ_PATHS.values():
        with pytest.raises(
            checkpoint.CheckpointError, match="is damaged: no file holds 'model.bias'"
        ):
            read(folder)

    def lose_an_attribute(metadata):  # what a flipped bit in a name can do
        del metadata.state_dict_metadata["model.weight"].size

    _, folder = saved_linear(tmp_path / "again")
    craft(folder, lose_an_attribute)
    for read in READ_PATHS.values():
        with pytest.raises(checkpoint.CheckpointError, match="is damaged: Attribute"):
            read(folder)


# --------------------------------------------------------------------------
# Param groups are matched by their parameters, LR schedulers included
# --------------------------------------------------------------------------


def scheduled(order):
    model = TwoHeads()
    lrs = {"a": 0.1, "b": 0.2}
    groups = [{"params": getattr(model, n).parameters(), "lr": lrs[n]} for n in order]
    optimizer = torch.optim.AdamW(groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    state = checkpoint.StageState(model, optimizer, scheduler)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state.step = 1
    return state


def lr_of(state, head):
    param = getattr(state.module, head).weight
    groups = state.optimizer.param_groups
    return next(g["lr"] for g in groups if any(p is param for p in g["params"]))


def test_groups_in_another_order_would_swap_scheduled_lrs_and_are_refused(tmp_path):
    saved = scheduled("ab")
    folder = checkpoint.save_stage(saved, tmp_path)
    # What DCP's own helpers do with the same state_dict: the optimizer's
    # groups load by their parameters, the scheduler's base_lrs by position.
    swapped = scheduled("ba")
    state_dict = offline.read_checkpoint(folder)
    swapped.lr_scheduler.load_state_dict(
        {
            k.removeprefix("lr_scheduler."): v
            for k, v in state_dict.items()
            if k.startswith("lr_scheduler.")
        }
    )
    swapped.lr_scheduler.step()
    assert lr_of(swapped, "a") == 0.2 * 0.25  # a now follows b's schedule
    with pytest.raises(
        checkpoint.CheckpointError,
        match="param group 0 here holds 'b.weight', which was in group 1 when saved",
    ):
        checkpoint.load_stage(scheduled("ba"), folder)
    same = scheduled("ab")
    checkpoint.load_stage(same, folder)
    same.lr_scheduler.step()
    saved.lr_scheduler.step()
    assert [lr_of(same, h) for h in "ab"] == [lr_of(saved, h) for h in "ab"]


# --------------------------------------------------------------------------
# One writer per folder
# --------------------------------------------------------------------------


def dead_pid():
    proc = subprocess.Popen(["true"])  # a process, ended
    proc.wait()
    return proc.pid


def test_a_second_owner_is_refused_and_a_dead_ones_record_taken_over(tmp_path, caplog):
    with checkpoint.job.FolderOwner(tmp_path) as first:
        record = json.loads((tmp_path / OWNER_FILE).read_text())
        assert record["pid"] == os.getpid() and record["token"] == first.token
        with pytest.raises(  # another process: test_two_jobs_on_one_folder_...
            checkpoint.CheckpointDirInUseError,
            match=f"already owned by this process \\(host '.*', pid {os.getpid()}, "
            "started .*\\), by a FolderOwner not yet released: use that one",
        ):
            checkpoint.job.FolderOwner(tmp_path).acquire()
        with pytest.raises(
            checkpoint.CheckpointDirInUseError, match="not yet released"
        ):
            first.acquire()  # refused again: and still holds the folder
        first.check()
    assert not (tmp_path / OWNER_FILE).exists()  # released

    record.update(pid=dead_pid(), token="deadjob")
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))
    (tmp_path / ".step-4.partial-0123abcd").mkdir()  # the dead job's half save
    with caplog.at_level("WARNING", logger="pippy.checkpoint.owner"):
        with checkpoint.job.FolderOwner(tmp_path):
            pass
    assert "taking over" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # owner alone now

    record.update(host="another-host", pid=os.getpid())  # cannot tell: refuse
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))
    with pytest.raises(checkpoint.CheckpointDirInUseError, match="another-host"):
        checkpoint.job.FolderOwner(tmp_path).acquire()
    (tmp_path / OWNER_FILE).write_text("[1]")  # not ours: never taken
    with pytest.raises(checkpoint.CheckpointDirInUseError, match="not an owner record"):
        checkpoint.job.FolderOwner(tmp_path).acquire()


def test_a_slurm_job_requeued_onto_other_nodes_takes_its_folder_back(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "north")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with checkpoint.job.FolderOwner(tmp_path):
        record = json.loads((tmp_path / OWNER_FILE).read_text())
    assert record["slurm"] == ["north", "4242", 0]
    record.update(host="node-a", token="killed")  # its rank 0 ran on another node
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))
    for cluster, job, restarts in (  # the same run; another job, here or there
        ("north", "4242", "0"),
        ("north", "4343", "1"),
        ("south", "4242", "1"),
    ):
        monkeypatch.setenv("SLURM_CLUSTER_NAME", cluster)
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
        with pytest.raises(checkpoint.CheckpointDirInUseError, match="node-a"):
            checkpoint.job.FolderOwner(tmp_path).acquire()
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "north")  # requeued: Slurm ended it
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with caplog.at_level("WARNING", logger="pippy.checkpoint.owner"):
        with checkpoint.job.FolderOwner(tmp_path):
            assert json.loads((tmp_path / OWNER_FILE).read_text())["slurm"] == [
                "north",
                "4242",
                1,
            ]
    assert "taking over" in caplog.text and "'node-a'" in caplog.text


def test_an_owner_whose_record_was_taken_over_writes_nothing_more(tmp_path):
    """A job taken for gone (a Slurm requeue while a cut-off node still ran):
    its next save stops at the record, instead of writing beside the new owner."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2))
    with checkpoint.job.FolderOwner(tmp_path) as owner:
        state.step = 1
        checkpoint.save_stage(state, tmp_path, owner=owner)
        record = json.loads((tmp_path / OWNER_FILE).read_text())
        record.update(host="node-b", token="newowner")  # the other job's now
        (tmp_path / OWNER_FILE).write_text(json.dumps(record))
        with pytest.raises(
            checkpoint.CheckpointDirInUseError,
            match=f"this job lost {re.escape(str(tmp_path))}: another job took it "
            r"over \(host 'node-b'",
        ):
            state.step = 2
            checkpoint.save_stage(state, tmp_path, owner=owner)
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER_FILE, "step-1"]
    assert json.loads((tmp_path / OWNER_FILE).read_text())["token"] == "newowner"


def test_a_save_is_given_its_folders_owner_or_refused(tmp_path):
    """The owner reaches the save as an argument: a save given none into a
    folder that holds an owner record is refused naming the owner (so is an
    offline tool's write there), one given another folder's owner or a
    released one too; nothing is written."""
    state = checkpoint.StageState(torch.nn.Linear(2, 2), step=1)
    with checkpoint.job.FolderOwner(tmp_path / "run") as owner:
        with pytest.raises(
            checkpoint.CheckpointDirInUseError,
            match=f"{re.escape(str(tmp_path / 'run'))} is owned by a job's "
            rf"FolderOwner \(host '.*', pid {os.getpid()}, started .*\), so only "
            "that job's saves, given it as owner=, write there: pass owner= that",
        ):
            checkpoint.save_stage(state, tmp_path / "run")
        with pytest.raises(ValueError, match="was never acquired, so it holds nothing"):
            checkpoint.save_stage(
                state, tmp_path / "run", owner=checkpoint.job.FolderOwner(tmp_path)
            )
        for other in (tmp_path / "other", tmp_path / "run" / "step-1"):
            with pytest.raises(ValueError, match="the owner given holds .*run, not"):
                checkpoint.save_stage(state, other, owner=owner)
            with pytest.raises(ValueError, match="the owner given holds .*run, not"):
                checkpoint.AsyncSaver(other, owner=owner)
        src = checkpoint.save_stage(state, tmp_path / "src")  # offline tools too
        for write in (
            lambda: offline.export_weights(src, tmp_path / "run" / "w.pt"),
            lambda: offline.convert_layout(
                src, tmp_path / "run" / "step-1", to="torchtitan"
            ),
        ):
            with pytest.raises(
                checkpoint.CheckpointDirInUseError, match="is owned by a job's"
            ):
                write()
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [OWNER_FILE]
        (tmp_path / "link").symlink_to(tmp_path / "run")  # the folder, by a link
        checkpoint.save_stage(state, tmp_path / "link", owner=owner)
    state.step = 2
    with pytest.raises(checkpoint.CheckpointDirInUseError, match="was released"):
        checkpoint.save_stage(state, tmp_path / "run", owner=owner)
    with checkpoint.AsyncSaver(tmp_path / "run", owner=owner) as saver:
        with pytest.raises(checkpoint.CheckpointDirInUseError, match="was released"):
            saver.save(state)  # at the call, not at the next wait()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-1"]
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("how", ["itself", "inside", "symlink"])
def test_a_step_folder_is_refused_as_a_run_folder(tmp_path, how):
    _, folder = saved_linear(tmp_path / "run")
    root = {"itself": folder, "inside": folder / "sub", "symlink": tmp_path / "ln"}
    if how == "symlink":
        root[how].symlink_to(folder)
    with pytest.raises(
        checkpoint.CheckpointDirError,
        match="is or lies in the step folder .*, not a run's checkpoint folder",
    ):
        checkpoint.job.FolderOwner(root[how]).acquire()
    assert sorted(p.name for p in folder.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "manifest.json",
    ]


def launch(*flags, stdout=subprocess.PIPE):
    """The example on 2 ranks with a tiny model, in the background."""
    return helpers.launch(
        2,
        EXAMPLE,
        *TINY_FLAGS,
        *flags,
        text=True,
        stdout=stdout,
        stderr=subprocess.STDOUT,
    )


def wait_for(path, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


def _workers(pid):
    """The processes below `pid` (a launcher's workers), from this host's /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *_workers(int(child))]
    return found


def test_two_jobs_on_one_folder_the_second_is_refused(tmp_path, tiny_run):
    flags = ["--steps", "6", "--save-every", "3"]
    # The same job alone in a folder of its own, the reference: a run shared
    # with other modules (conftest.py).
    assert TINY_RUN_FLAGS == [*TINY_FLAGS, *flags]
    alone = tiny_run[0]
    first = launch(*flags, "--checkpoint-dir", tmp_path / "shared")
    paused = []
    try:
        wait_for(tmp_path / "shared" / ".owner.json", first)
        # The first job holds still while the second starts: it could
        # otherwise finish its 6 steps first.
        paused = _workers(first.pid)
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        second = helpers.example(  # a pool's ranks: the same host, other pids
            2,
            *TINY_FLAGS,
            *flags,
            "--checkpoint-dir",
            tmp_path / "shared",
            expect_ok=False,
        )
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        out, _ = first.communicate(timeout=240)
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        first.kill()
    assert first.returncode == 0, out
    assert second.returncode != 0
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: {tmp_path / 'shared'} is in use by another job"
            in second.stdout
        )
    assert "step   1 |" not in second.stdout
    for step in (3, 6):  # the first job's steps are its own, bit for bit
        shared = offline.read_checkpoint(tmp_path / "shared" / f"step-{step}")
        reference = offline.read_checkpoint(alone / f"step-{step}")
        assert offline.diff_state_dicts(shared, reference) == []


def example_ranks(folder):
    """The pids of the example's ranks that write into `folder`."""
    found = subprocess.run(
        ["pgrep", "-f", f"pippy_dcp.py.*{folder}"], capture_output=True, text=True
    )
    return [int(p) for p in found.stdout.split()]


@pytest.mark.launches
def test_ranks_whose_launcher_is_killed_stop_and_publish_nothing_more(tmp_path):
    job = launch(
        "--steps",
        "100000",
        "--save-every",
        "20",
        "--checkpoint-dir",
        tmp_path,
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(tmp_path / "step-20", job)
        job.send_signal(signal.SIGKILL)  # the launcher only
        job.wait(timeout=30)
        deadline = time.monotonic() + 10
        while example_ranks(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert example_ranks(tmp_path) == []  # without the watch: they train on
        steps = sorted(list_steps(LocalStorage(), tmp_path))
        time.sleep(2)
        assert sorted(list_steps(LocalStorage(), tmp_path)) == steps
    finally:
        for pid in example_ranks(tmp_path):
            os.kill(pid, signal.SIGKILL)
    # The next job takes the folder over from the dead one and resumes.
    run = example(
        2,
        *TINY_FLAGS,
        "--steps",
        str(steps[-1] + 1),
        "--checkpoint-dir",
        tmp_path,
    )
    assert f"resuming from {tmp_path / f'step-{steps[-1]}'}" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# --------------------------------------------------------------------------
# Preemption, disk full, argument errors
# --------------------------------------------------------------------------


@pytest.mark.launches
def test_sigterm_saves_the_current_step_and_the_next_run_resumes_there(tmp_path):
    job = launch(
        "--steps", "100000", "--save-every", "1000", "--checkpoint-dir", tmp_path
    )
    try:
        marker = "step   5 |"
        lines = []
        for line in job.stdout:
            lines.append(line)
            if line.startswith(marker):
                job.send_signal(signal.SIGTERM)  # as a scheduler preempting the job
                break
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    out = "".join(lines) + out
    [line] = [x for x in out.splitlines() if "SIGTERM received" in x]
    step = int(line.split()[3].rstrip(":"))
    saved = f"SIGTERM received by ranks 0, 1, step-{step} saved in "
    assert step >= 5 and line.startswith(f"stopping after step {step}: {saved}")
    for rank in (0, 1):
        assert f"[rank {rank}] stage {rank}: saved" in out
    # No verification load inside the launcher's grace period (a normal run
    # verifies: test_example), one line saying so.
    assert "verified:" not in out and "loaded" not in out
    skipped = f"not verifying {tmp_path / f'step-{step}'}: stopped by a signal"
    assert skipped in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{step}"]
    run = example(
        2, *TINY_FLAGS, "--steps", str(step + 1), "--checkpoint-dir", tmp_path
    )
    assert f"resuming from {tmp_path / f'step-{step}'}" in run.stdout


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def big_state():
    model = torch.nn.Linear(256, 512)  # ~0.5 MB, with AdamW ~1.5 MB
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return checkpoint.StageState(model, optimizer, step=2)


def test_a_full_disk_says_so_and_leaves_no_partial_folder(small_disk):
    with pytest.raises(CheckpointException) as plain:  # DCP: an obscure error
        dcp.save(big_state().state_dict(), checkpoint_id=small_disk / "plain")
    assert "no space" not in str(plain.value).lower()
    shutil.rmtree(small_disk / "plain")
    state = linear_state()
    state.step = 1
    kept = checkpoint.save_stage(state, small_disk)
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    with pytest.raises(checkpoint.CheckpointError, match="no space left on device"):
        checkpoint.save_stage(big_state(), small_disk)
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-1"]
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before


@pytest.mark.launches
def test_keep_last_below_one_is_refused_before_training(tmp_path):
    run = example(
        2,
        *TINY_FLAGS,
        "--keep-last",
        "0",
        "--checkpoint-dir",
        tmp_path,
        expect_ok=False,
    )
    assert run.returncode != 0
    assert (
        run.stderr.count("error: argument --keep-last: must be 1 or more, not 0") == 1
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
