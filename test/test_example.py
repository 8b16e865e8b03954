"""The reference example, stopped and resumed as users run it (on pools of rank
processes that start it as torchrun does: test_preemption and test_edges
launch it with torchrun itself, where the launcher or the process is what
they test)."""

import shutil
import subprocess

import pytest

import pippy
from pippy.checkpoint import offline
from pippy.checkpoint.checks import state_dict_size
from pippy.checkpoint.reader import read_metadata

import pippy_dcp
from gpt import GPT, ModelArgs
from helpers import (
    FOUR_RANK_FLAGS,
    TINY_FLAGS,
    TINY_RUN_FLAGS,
    example,
    examples,
    loss_lines,
)

STEPS = ["--steps", "6", "--save-every", "3"]


def load_whole(step_folder):
    """Every tensor and value of a checkpoint, read in one plain process under
    pippy's restricted unpickling rules (so this also shows they accept it)."""
    return offline.read_checkpoint(step_folder)


def stop_and_resume(world_size, flags, resumed, first=None):
    """The run stopped after step 3 (`first`, if it ran already), then resumed:
    the resumed run's process."""
    if first is None:
        stop = ("--checkpoint-dir", resumed, "--stop-after", 3)
        first = example(world_size, *flags, *stop)
    assert "stopping after step 3 (--stop-after)" in first.stdout
    assert "resuming" not in first.stdout
    for rank in range(world_size):
        assert f"[rank {rank}] stage {rank}: saved " in first.stdout
    assert sorted(p.name for p in resumed.iterdir()) == ["step-3"]

    return example(world_size, *flags, "--checkpoint-dir", resumed)


def test_checkpoint_layout_one_file_per_rank_and_original_fqns(four_rank_run):
    # A step of the example on 4 ranks, the default model (conftest.py).
    world_size = 4
    assert "--n-layers" not in FOUR_RANK_FLAGS and "--dim" not in FOUR_RANK_FLAGS
    folder = four_rank_run[0] / "step-6"
    files = sorted(p.name for p in folder.iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)] + [
        "manifest.json"
    ]

    metadata = read_metadata(folder)
    keys = set(metadata.state_dict_metadata)
    model = GPT(ModelArgs())
    assert {k for k in keys if k.startswith("model.")} == {
        f"model.{k}" for k in model.state_dict()
    }
    # Every layer's weights sit in the file of the rank whose stage owns it,
    # under the layer's global index.
    files_of = {}
    for index, info in metadata.storage_data.items():
        files_of.setdefault(index.fqn, set()).add(info.relative_path)
    for rank in range(world_size):
        for layer in pippy.layer_range(rank, world_size, 8):
            key = f"model.layers.{layer}.qkv.weight"
            assert files_of[key] == {f"__{rank}_0.distcp"}
            assert files_of[f"optim.state.layers.{layer}.qkv.weight.exp_avg"] == {
                f"__{rank}_0.distcp"
            }
    assert files_of["model.tok_embeddings.weight"] == {"__0_0.distcp"}
    assert files_of["model.output.weight"] == {f"__{world_size - 1}_0.distcp"}


@pytest.fixture
def shared_runs(request, world_size):
    """The session's runs (conftest.py), started in this test's setup if not
    yet: on 4 ranks {"stopped": ..., "run": ...}, on 2 {"run": tiny_run}."""
    if world_size == 4:
        return {
            "stopped": request.getfixturevalue("four_rank_stopped"),
            "run": request.getfixturevalue("four_rank_run"),
        }
    return {"run": request.getfixturevalue("tiny_run")}


@pytest.mark.launches
@pytest.mark.parametrize(
    "world_size, split, schedule", [(4, "manual", "gpipe"), (2, "trace", "1f1b")]
)
def test_stopped_and_resumed_run_equals_uninterrupted_run(
    shared_runs, tmp_path, world_size, split, schedule
):
    """Stopped at step 3 and resumed, a run ends bitwise where an uninterrupted
    one does. On 2 ranks the uninterrupted run is the shared tiny run, split
    by hand and run with GPipe: a traced split under 1F1B computes the same
    bits, so resuming it is held to that run."""
    flags = [*STEPS, "--split", split, "--schedule", schedule]
    if world_size == 2:  # a tiny model: the same property, less to compute
        flags = [*TINY_FLAGS, *flags]
    resumed = tmp_path / "resumed"

    if world_size == 4:  # these two runs are test_topology's too: conftest.py
        assert FOUR_RANK_FLAGS == flags
        stopped, out = shared_runs["stopped"]
        assert sorted(p.name for p in stopped.iterdir()) == ["step-3"]
        shutil.copytree(stopped, resumed)
        first = subprocess.CompletedProcess([], 0, stdout=out)
        second = stop_and_resume(world_size, flags, resumed, first)
    else:
        assert TINY_RUN_FLAGS == [*TINY_FLAGS, *STEPS]  # manual, gpipe: defaults
        second = stop_and_resume(world_size, flags, resumed)
    straight, out = shared_runs["run"]
    third = subprocess.CompletedProcess([], 0, stdout=out)
    assert f"resuming from {resumed / 'step-3'}" in second.stdout
    assert "step   3 |" not in second.stdout and "step   4 |" in second.stdout
    assert f"verified: {resumed / 'step-6'} loaded into fresh stages" in second.stdout

    assert "verified:" in third.stdout
    # Same losses, printed by the last stage, for the steps both runs trained.
    assert loss_lines(second.stdout) == loss_lines(third.stdout)[3:]

    a = load_whole(resumed / "step-6")
    b = load_whole(straight / "step-6")
    assert state_dict_size(a)[0] > 0
    assert offline.diff_state_dicts(a, b) == []
    assert a["step"] == 6


@pytest.mark.launches
def test_the_example_says_what_happened(tmp_path):
    import re

    ckpt = tmp_path / "ckpt"
    flags = [*TINY_FLAGS, "--steps", "4", "--save-every", "2", "--keep-last", "1"]
    nowhere = (
        "--init-from",
        tmp_path / "nowhere",
        "--checkpoint-dir",
        tmp_path / "new",
    )
    run, sync, failed = examples(
        (2, *flags, "--async-save", "--checkpoint-dir", ckpt),
        (2, *flags, "--checkpoint-dir", tmp_path / "sync"),
        (2, *flags, *nowhere),
        expect_ok=[True, True, False],
    )
    out = run.stdout
    # A background save says when it is published, and how long it took.
    for step in (2, 4):
        assert re.search(
            rf"^\[rank 0\] published step-{step}, saved in the background in "
            r"\d+\.\d\d s$",
            out,
            re.M,
        ), out
    assert "[rank 0] removed step-2 (keeping the newest 1)" in out  # --keep-last
    assert sorted(p.name for p in ckpt.iterdir()) == [".owner.json", "step-4"] or (
        sorted(p.name for p in ckpt.iterdir()) == ["step-4"]
    )
    # Saved and loaded lines count a rank's state alike: its tensors, its MB.
    sync = sync.stdout
    count = r"(\d+) tensors(?: \(\d+ written here\))?, ([\d.]+) MB"
    held = re.findall(rf"^\[rank (\d)\] stage \d: saved {count}", sync, re.M)
    loaded = re.findall(rf"^\[rank (\d)\] stage \d: loaded {count}", sync, re.M)
    assert sorted(set(held)) == sorted(set(loaded)) and len(set(held)) == 2
    # A run whose --init-from fails leaves no checkpoint folder behind.
    assert failed.returncode != 0
    assert (
        f"error: no checkpoint folder at {str(tmp_path / 'nowhere')!r}" in failed.stdout
    )
    assert not (tmp_path / "new").exists()


def test_a_raised_steps_resumes_onto_the_new_schedule(tmp_path, tiny_run):
    # 6 steps, saved at 3 and 6 (a run shared with other modules), then 10.
    assert TINY_RUN_FLAGS == [*TINY_FLAGS, "--steps", "6", "--save-every", "3"]
    shutil.copytree(tiny_run[0], tmp_path, dirs_exist_ok=True)
    flags = [*TINY_FLAGS, "--save-every", "3", "--checkpoint-dir", tmp_path]
    lines = loss_lines(example(2, *flags, "--steps", "10").stdout)
    printed = [line.split("| lr ")[1].split()[0] for line in lines]
    lr = pippy_dcp.parse_args(["--steps", "10"]).lr
    # Step s trains at the schedule's value after s - 1 scheduler steps.
    assert printed == [
        f"{lr * pippy_dcp.lr_factor(s - 1, 10):.2e}" for s in (7, 8, 9, 10)
    ]
    assert printed[0] == "4.72e-04"  # not 6 steps' last value, 1.86e-04


@pytest.mark.parametrize("steps", ["3", "2"])
def test_steps_at_or_below_the_saved_step_end_at_once_and_cleanly(
    tmp_path, tiny_run, steps
):
    """Nothing to train (--steps at or below the saved step-3 of 6 steps,
    whose schedule --steps 3 or 2 would change): exit 0, the line that says
    so, nothing saved."""
    shutil.copytree(tiny_run[0] / "step-3", tmp_path / "step-3")
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-3").iterdir()}
    flags = [*TINY_FLAGS, "--save-every", "3", "--checkpoint-dir", tmp_path]
    run = example(2, *flags, "--steps", steps)
    assert f"already at step 3 of {steps}: nothing to train" in run.stdout
    assert "differ" not in run.stdout and loss_lines(run.stdout) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-3").iterdir()} == before
