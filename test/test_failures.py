"""Never lose a checkpoint silently: bad input, partial saves, async saves, crashes.

Each protection has a test that fails without it; where DCP alone would lose
data quietly, the test shows that first.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ranks import run_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.errors import explain_failures
from pippy.checkpoint.reader import SafeFileSystemReader
from pippy.checkpoint.safe_load import SafeLoadPlanner
from pippy.checkpoint.save import publish_step
from pippy.checkpoint.steps import is_complete, list_steps, step_dir
from pippy.checkpoint.storage import LocalStorage
from pippy.cli import main as pippy_cli

from helpers import (
    EXAMPLE,
    TINY_RUN_FLAGS,
    PlainReader,
    TwoHeads,
    example,
    examples,
    launch,
    linear_state,
    plain_read,
    torchrun,
    torchrun_together,
)

TINY = [
    "--n-layers",
    "4",
    "--dim",
    "32",
    "--seq-len",
    "32",
    "--steps",
    "2",
    "--save-every",
    "1",
]


load = checkpoint.load_stage


def save(state, root, step=1):
    """Saves ``state`` as ``step-<step>``, its own step set to match."""
    if isinstance(state, checkpoint.StageState):
        state.step = step
    elif "step" in state:
        state["step"] = step
    return checkpoint.save_stage(state, root, step=step)


def test_a_stage_with_an_empty_param_group_saves_and_loads(tmp_path):
    def with_empty_group(model):
        return [{"params": list(model.parameters())}, {"params": [], "lr": 0.5}]

    saved = linear_state(with_empty_group)
    saved.optimizer.param_groups[0]["lr"] = 0.25  # as a scheduler would
    folder = save(saved, tmp_path)
    loaded = linear_state(with_empty_group)
    load(loaded, folder)  # torch 2.13's set_state_dict alone: IndexError
    assert offline.diff_state_dicts(loaded.state_dict(), saved.state_dict()) == []
    groups = loaded.optimizer.param_groups
    assert (
        groups[0]["lr"] == 0.25 and groups[1]["params"] == [] and groups[1]["lr"] == 0.5
    )


def test_missing_optimizer_state_is_an_error_not_fresh_moments(tmp_path):
    state = linear_state()
    state_dict = state.state_dict()
    del state_dict["optim"]["state.weight.exp_avg"]
    save(state_dict, tmp_path, step=1)
    with pytest.raises(
        checkpoint.CheckpointError, match="'optim.state.weight.exp_avg' is not in"
    ):
        load(linear_state(), step_dir(tmp_path, 1))


def test_optimizer_scalars_are_one_item_per_parameter_and_load_exactly(tmp_path):
    saved = linear_state()
    saved.optimizer.state[saved.module.weight]["step"] = torch.tensor(7.0)
    optim_sd = saved.state_dict()["optim"]
    # Two moments and one item of options and step per parameter, not fourteen.
    assert sorted(optim_sd) == [
        "scalars.bias",
        "scalars.weight",
        "state.bias.exp_avg",
        "state.bias.exp_avg_sq",
        "state.weight.exp_avg",
        "state.weight.exp_avg_sq",
    ]
    folder = save(saved, tmp_path)
    loaded = linear_state()
    loaded.optimizer.param_groups[0]["lr"] = 0.5
    load(loaded, folder)
    steps = {p: s["step"] for p, s in loaded.optimizer.state.items()}
    assert steps[loaded.module.weight].dtype == torch.float32
    assert [steps[loaded.module.weight].item(), steps[loaded.module.bias].item()] == [
        7.0,
        1.0,
    ]
    assert loaded.optimizer.param_groups[0]["lr"] == 1e-3
    assert offline.diff_state_dicts(loaded.state_dict(), saved.state_dict()) == []


def test_a_verified_load_unpickles_each_item_once(tmp_path, monkeypatch):
    folder = save(linear_state(), tmp_path)
    real, calls = torch.load, []

    def counted(*args, **kwargs):  # the real torch.load, counted
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    plain = linear_state().state_dict()
    dcp.load(plain, checkpoint_id=folder)
    by_dcp = len(calls)
    calls.clear()
    load(linear_state(), folder)
    # DCP's one per item, and the stored step checked against the manifest.
    assert len(calls) == by_dcp + 1


def test_an_optimizer_option_missing_from_the_checkpoint_is_an_error(tmp_path):
    folder = save(linear_state(), tmp_path)  # saved without an LR scheduler
    state = linear_state()
    state.lr_scheduler = torch.optim.lr_scheduler.StepLR(state.optimizer, 1)
    state_dict = state.state_dict()
    del state_dict["lr_scheduler"]
    load(state_dict, folder)  # read, not applied
    with pytest.raises(
        checkpoint.CheckpointError,
        match="has no 'param_groups.bias.initial_lr', 'param_groups.weight.initial_lr'",
    ):
        state.load_state_dict(state_dict)


def test_a_step_damaged_after_publishing_names_its_files_and_the_way_out(tmp_path):
    folder = save(linear_state(), tmp_path)
    (data,) = folder.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-100])  # a copy cut short
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"is damaged: {data.name} has \d+ bytes, its items need \d+.*earlier step",
    ):
        load(linear_state(), folder)
    data.unlink()  # a rank's file lost
    with pytest.raises(checkpoint.CheckpointError, match=f"{data.name} is missing"):
        offline.load_model(folder, linear_state().module)
    data.mkdir()  # a folder where the file was
    with pytest.raises(checkpoint.CheckpointError, match=f"{data.name} is not a file"):
        load(linear_state(), folder)


def test_another_optimizer_class_is_refused_not_loaded_with_wrong_options(tmp_path):
    folder = save(linear_state(), tmp_path)  # AdamW
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    radam = checkpoint.StageState(model, torch.optim.RAdam(model.parameters()))
    # Same tensor keys (step, exp_avg, exp_avg_sq): only the packed options differ.
    with pytest.raises(
        checkpoint.CheckpointError,
        match="has entries this one lacks: 'param_groups.bias.amsgrad'",
    ):
        load(radam, folder)


def adam_state(kind, params="all"):
    """A StageState of Linear(4, 4) with optimizer `kind` over its weight and bias,
    or its bias alone (the weight frozen), stepped once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    trained = [model.bias] if params == "bias" else list(model.parameters())
    optimizer = getattr(torch.optim, kind)(trained, lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return checkpoint.StageState(model, optimizer)


@pytest.mark.parametrize(
    "saved, loaded, expected",
    [  # AdamW is Adam with decoupled_weight_decay=True: same state, same options
        (
            ("AdamW",),
            ("Adam",),
            "param group 0 here has decoupled_weight_decay=False, the checkpoint "
            "decoupled_weight_decay=True for 'weight': it was saved by another "
            "optimizer class",
        ),
        (
            ("Adam",),
            ("NAdam",),
            "has no 'state.bias.mu_product', 'state.weight.mu_product', though it "
            "has other state of the same parameters: it was saved by another "
            "optimizer class (or edited)",
        ),
        (
            ("AdamW", "bias"),
            ("AdamW",),
            "only the optimizer differs from the checkpoint's: it holds other "
            "parameters than the saved one did",
        ),
        (
            ("AdamW", "bias"),
            ("AdamW",),
            "(one frozen in a run and trained in the other) or is of another class; "
            "build it over the same parameters as the run that saved it did (3 "
            "problem(s): ",
        ),
    ],
)
def test_another_optimizer_is_named_as_such(tmp_path, saved, loaded, expected):
    folder = save(adam_state(*saved), tmp_path)
    state = adam_state(*loaded)
    options = [dict(group) for group in state.optimizer.param_groups]
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(expected)):
        load(state, folder)
    assert [dict(group) for group in state.optimizer.param_groups] == options


_GROUP_DESTROYED_MID_SAVE = """
import sys, time, torch, torch.distributed as dist
import torch.distributed.checkpoint
from pippy import checkpoint

dist.init_process_group("gloo")
rank = dist.get_rank()
module = torch.nn.ModuleDict({f"l{rank}": torch.nn.Linear(4, 4)})  # a stage each
state = checkpoint.StageState(module, torch.optim.AdamW(module.parameters()), step=1)
saver = checkpoint.AsyncSaver(sys.argv[1], keep_last=1)
saver.save(state)
saver.wait()  # step-1: whole
state.step = 2
save = torch.distributed.checkpoint.save
def late_save(*args, **kwargs):  # the background save reaches dcp.save late ...
    time.sleep(3)
    return save(*args, **kwargs)
torch.distributed.checkpoint.save = late_save
saver.save(state)
time.sleep(1)
dist.destroy_process_group()  # ... after a script ended its group, no close()
try:
    saver._upload.result()
except BaseException as e:
    print(f"[rank {rank}] {type(e).__name__}: {e}")
"""


@pytest.mark.launches
def test_a_group_destroyed_while_a_background_save_is_in_flight_publishes_nothing(
    tmp_path,
):
    """Each rank's save then runs as one process's (DCP's no_dist): each
    published a step of its own stage alone, and keep_last deleted step-1."""
    script = tmp_path / "destroyed.py"
    script.write_text(_GROUP_DESTROYED_MID_SAVE)
    run = torchrun(2, script, tmp_path / "ckpt")
    for rank in (0, 1):
        assert (
            f"[rank {rank}] CheckpointError: saving step-2 in the background "
            "failed on 1 rank(s):" in run.stdout
        ), run.stdout
    assert "step-2 was to be saved by 2 ranks, but 1 took part" in run.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-1"]
    assert sorted(
        k for k in plain_read(tmp_path / "ckpt" / "step-1") if "model." in k
    ) == [
        "model.l0.bias",
        "model.l0.weight",
        "model.l1.bias",
        "model.l1.weight",
    ]


def test_a_checkpoint_from_before_the_packed_layout_says_so(tmp_path):
    state = linear_state()
    flat = get_optimizer_state_dict(
        state.module,
        state.optimizer,
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )
    folder = save({**state.state_dict(), "optim": flat}, tmp_path, step=0)
    with pytest.raises(
        checkpoint.CheckpointError,
        match="written by pippy before optimizer options were packed.*weights alone",
    ):
        load(linear_state(), folder)
    model = torch.nn.Linear(4, 4)
    assert offline.load_model(folder, model) == 0
    assert torch.equal(model.weight, state.module.weight)


def load_model_on_rank_0(rank, world_size, folder):
    """Rank 0 alone loads the un-split model; rank 1 does nothing."""
    if rank == 0:
        model = torch.nn.Linear(4, 4)
        return offline.load_model(folder, model), model.weight.detach().clone()
    return None


def test_load_model_on_one_rank_of_a_group_loads_alone(tmp_path):
    state = linear_state()
    folder = save(state, tmp_path, step=3)
    # a collective on rank 0 would wait for rank 1 until the run's timeout
    loaded = run_ranks(2, load_model_on_rank_0, folder, timeout=30)[0]
    assert loaded[0] == 3 and torch.equal(loaded[1], state.module.weight)


def test_dtype_mismatch_is_an_error_where_dcp_converts_silently(tmp_path):
    folder = save(linear_state(), tmp_path)
    state = linear_state()
    state.module.to(torch.bfloat16)
    state_dict = {"model": state.module.state_dict()}
    dcp.load(state_dict, checkpoint_id=folder)  # DCP: converts, no word
    with pytest.raises(
        checkpoint.CheckpointError,
        match="'model.weight' is torch.float32 in the checkpoint, torch.bfloat16 here",
    ):
        load(state_dict, folder, must_read=("model.",))


def test_an_explicitly_requested_step_must_exist_and_be_complete(tmp_path):
    save(linear_state(), tmp_path, step=1)
    (tmp_path / "step-2").mkdir()
    with pytest.raises(
        checkpoint.CheckpointNotFoundError, match="not a complete checkpoint"
    ):
        SafeFileSystemReader(tmp_path / "step-2")
    with pytest.raises(
        checkpoint.CheckpointNotFoundError, match="no checkpoint folder"
    ):
        SafeFileSystemReader(tmp_path / "step-3")


def test_an_incomplete_step_folder_is_moved_aside_not_written_into(tmp_path):
    (tmp_path / "step-1").mkdir()  # written by something else, never completed
    (tmp_path / "step-1" / "stray").write_text("kept")
    save(linear_state(), tmp_path, step=1)
    assert is_complete(LocalStorage(), tmp_path / "step-1")
    [aside] = tmp_path.glob(".step-1.incomplete-*")
    assert (aside / "stray").read_text() == "kept"


def test_keep_last_removes_old_steps_only_after_a_newer_one_is_published(tmp_path):
    state = linear_state()
    for step in (1, 2, 3):
        with publish_step(tmp_path, step, keep_last=2) as writer:
            # while step 3 is being written, steps 1 and 2 are both still there
            assert (
                list(list_steps(LocalStorage(), tmp_path)) == list(range(1, step))[-2:]
            )
            dcp.save(state.state_dict(), storage_writer=writer)
    assert list(list_steps(LocalStorage(), tmp_path)) == [2, 3]
    with pytest.raises(RuntimeError):
        with publish_step(tmp_path, 4, keep_last=1):
            raise RuntimeError("the save failed")
    assert list(list_steps(LocalStorage(), tmp_path)) == [2, 3]  # nothing removed


# A job's rank 0 pruning with keep_last=1, SIGKILLed as it starts its
# KILL_AT-th deletion (an audit hook: os.remove, os.rmdir, shutil.rmtree).
_KILLED_WHILE_PRUNING = """
import os, signal, sys
from pippy import checkpoint
from pippy.checkpoint.steps import remove_old_steps
from pippy.checkpoint.storage import storage_for

root, kill_at = sys.argv[1], int(sys.argv[2])
checkpoint.job.FolderOwner(root).acquire()  # killed: a dead job's record is left
deletions = 0

def kill_at_a_deletion(event, args):
    global deletions
    if event in ("os.remove", "os.rmdir", "shutil.rmtree"):
        deletions += 1
        if deletions == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(kill_at_a_deletion)
remove_old_steps(storage_for(root), root, keep_last=1)
"""


@pytest.mark.launches
def test_a_kill_while_keep_last_deletes_leaves_no_partial_step_folder(tmp_path, capsys):
    """keep_last=1 over steps 1-3, SIGKILLed as its deletion thread starts
    its 1st, 2nd or 4th deletion: right after step-1 and step-2 are renamed
    aside (both out of view at once), then with none and with two of
    step-1's files deleted (deleting in place: its manifest, then also a
    data file). Every folder named step-<N> is whole and loads with plain
    DCP in another process; no scan, listing or inspect shows the aside
    folders, and the folder's next owner deletes them."""
    state = linear_state()
    reader = PlainReader(tmp_path)
    try:
        for kill_at in (1, 2, 4):
            root = tmp_path / f"run-{kill_at}"
            for step in (1, 2, 3):
                save(state, root, step=step)
            before = reader.read([root / "step-3"])
            child = subprocess.run(
                [sys.executable, "-c", _KILLED_WHILE_PRUNING, str(root), str(kill_at)],
                capture_output=True,
                text=True,
                timeout=180,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert child.returncode == -signal.SIGKILL, child.stderr

            names = sorted(p.name for p in root.iterdir())
            steps = [n for n in names if re.fullmatch(r"step-[0-9]+", n)]
            for name in steps:  # each whole: nothing half-deleted under its name
                folder = root / name
                assert sorted(p.name for p in folder.iterdir()) == [
                    ".metadata",
                    "__0_0.distcp",
                    "manifest.json",
                ], f"kill at deletion {kill_at}: {name} is partial"
                assert offline.verify_step(folder) == 9
            assert steps == ["step-3"]
            assert re.fullmatch(r"\.step-1\.deleting-[0-9a-f]{12}", names[1])
            assert re.fullmatch(r"\.step-2\.deleting-[0-9a-f]{12}", names[2])
            assert names[0] == ".owner.json" and len(names) == 4
            after = reader.read([root / name for name in steps])
            assert [items["step"] for items in after] == [3]
            for old, new in zip(before, after, strict=True):  # as saved
                assert old.keys() == new.keys()
                for key, value in old.items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(value, new[key]), key
                    else:
                        assert value == new[key], key

            assert list(list_steps(LocalStorage(), root)) == [3]
            assert checkpoint.find_latest_step(root) == root / "step-3"
            assert pippy_cli(["inspect", str(root)]) == 0
            out = capsys.readouterr().out
            assert f"{root}: 1 step(s)" in out and "deleting" not in out

            with checkpoint.job.FolderOwner(root):  # the next job: takes over
                assert sorted(p.name for p in root.iterdir()) == [
                    ".owner.json",
                    "step-3",
                ]
    finally:
        reader.close()


@pytest.fixture(scope="module")
def two_ranks(two_rank_checks):
    """The launch of 2 ranks that ran the checks below, async and refusal,
    with other modules' (conftest.py: starting ranks is slow)."""
    return two_rank_checks["dist_checks"]


def test_async_save_keeps_the_values_of_the_call_and_reports_failures(two_ranks):
    for rank in range(2):
        r = json.loads((two_ranks / f"async-rank{rank}.json").read_text())
        assert r["steps"] == [4, 6]  # keep_last=2 removed step 2
        assert r["differ"] == {"4": [], "6": []}  # saved while training went on
        assert r["raised_in"] == "wait"
        assert "saving step-8 in the background failed" in r["error"]
        assert "pickle" in r["error"]
        assert r["after"] == [4, 6]  # the failed step is not published
        # Every saved tensor changed in place as soon as save() returned (by
        # optimizer.step(), by p.add_() after wait_for_staging()): plain
        # dcp.load reads each step back bitwise as it was at the call.
        assert r["at_once_unchanged"] == {"1": [], "2": []}
        assert r["at_once_differ"] == {"1": [], "2": []}


def test_a_load_one_rank_refuses_stops_every_rank_with_its_error(two_ranks):
    results = [
        json.loads((two_ranks / f"refusal-rank{rank}.json").read_text())
        for rank in range(2)
    ]
    for r in results:
        error = r["error"]
        assert error.startswith(f"loading {r['path']} failed on 1 rank(s):\n  rank 1: ")
        assert "CheckpointError: param group 0 here holds parameters saved " in error
        assert "'lr': lr 0.1 for 'stage1.a.weight', 0.2 for 'stage1.b.weight'" in error
    # A plain state_dict's Stateful that fails on rank 1 stops both ranks; its
    # error, which does not unpickle, reaches rank 0 as its line.
    line = "CheckpointError: _Unportable: code 7: the note is gone"
    assert [r["unportable"] for r in results] == [
        f"CheckpointError: saving step-1 failed on 1 rank(s):\n  rank 1: {line}",
        line,
    ]
    # On a load, of a plain state_dict and of a StageState, the same; a plain
    # state_dict's Stateful and top-level entry are loaded into it.
    for r in results:
        assert r["loaded"] == ["hello", 3]
    assert [r["unloaded"] for r in results] == [
        [
            f"CheckpointError: loading {step} failed on 1 rank(s):\n  rank 1: {line}"
            for step in results[0]["unloaded_from"]
        ],
        [line, line],
    ]
    # The same state_dict whose Stateful's load_state_dict fails on rank 1 (with
    # an error that does not unpickle): applied inside dcp.load, both ranks stop.
    line = "CheckpointError: _Unportable: code 8: the note cannot be read"
    noted = results[0]["unloaded_from"][0]
    for r in results:
        assert r["applied"] == (
            f"CheckpointError: loading {noted} failed on 1 rank(s):\n  rank 1: {line}"
        )
    # A crafted .metadata: refused on both ranks before its payload runs;
    # trusted, both load it.
    for r in results:
        assert r["crafted"] == [["UnsafeCheckpointError", False], ["loaded", True]]
    # Steps that differ between ranks: one error on both, nothing written.
    for rank, r in enumerate(results):
        assert r["drift"] == (
            f"CheckpointError: saving step-{5 + rank} failed on 1 rank(s):\n  rank 0: "
            "ValueError: the ranks save different steps (rank 0: 5, rank 1: 6); every "
            "rank must save the same step: keep one step counter for the job"
        )
        assert r["drift_folder"] == []
        # A folder per rank: the same error on both, no folder made.
        assert r["apart"] == (
            "CheckpointDirError: the ranks save into different step folders (rank "
            "0: 'apart0/step-1'; rank 1: 'apart1/step-1'): every rank must pass the "
            "same checkpoint folder and step"
        )
        assert r["apart_folders"] == []
        real = Path(r["path"]).parent.parent / ("real" if rank == 0 else "linked")
        assert r["linked"] == [str(real / "step-1"), ["step-1"]]
        two = Path(r["path"]).parent.parent / "two"  # steps 1 and 2, loaded by rank
        line = (
            f"ValueError: this rank opened '{two / 'step-2'}' and rank 0 "
            f"'{two / 'step-1'}': every rank must load the same step (one "
            "checkpoint_id for all ranks)"
        )
        assert (
            r["mixed"] == line
            if rank == 1
            else (
                f"CheckpointError: loading {two / 'step-1'} failed on 1 rank(s):\n  "
                f"rank 1: {line}"
            )
        )
    # Under a group of rank 1 alone: its global rank; rank 0 may not enter.
    assert [r["in_group"] for r in results] == [
        "ValueError: fail_together: rank 0 is not in the process group",
        "CheckpointError: in a group failed on 1 rank(s):\n"
        "  rank 1: RuntimeError: from the group",
    ]


def failing_examples(*launches, launcher=False):
    """Runs of the example that must fail, each ``(nproc, *flags)``, on a pool
    of rank processes or (`launcher`) under torchrun, at once (none writes
    what another reads); each fails without a traceback."""
    if launcher:
        runs = torchrun_together(
            *[(nproc, EXAMPLE, *flags) for nproc, *flags in launches], expect_ok=False
        )
    else:
        runs = examples(*launches, expect_ok=False)
    for run in runs:
        assert run.returncode != 0
        assert "Traceback" not in run.stdout
    return runs


def test_bad_input_gets_one_clear_error_and_loses_nothing(tmp_path, tiny_run):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    # A run of the same tiny model (TINY's flags), 6 steps saved at 3 and 6,
    # shared with other modules: its folder copied, resumed with --steps 7.
    # Two copies: one job per folder, and two of the runs below go at once (twice).
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    assert TINY_RUN_FLAGS == [*TINY[:6], "--steps", "6", "--save-every", "3"]
    for folder in (ckpt, other):
        shutil.copytree(tiny_run[0], folder)
    before = {p.name: p.read_bytes() for p in (ckpt / "step-6").iterdir()}
    # Flags that cannot work are argparse errors, printed once (by rank 0),
    # each naming its flag.
    bad_flags = [
        (["--n-layers", "2"], "argument --n-layers: 2 layers cannot fill 4 stages"),
        (
            ["--schedule", "1f1b", "--microbatches", "2"],
            "argument --microbatches: 1f1b needs at least one per stage (4)",
        ),
    ]
    # These runs read what they are given and change nothing; the flag errors
    # under torchrun, which is what prints them once.
    flag_runs = failing_examples(
        *[
            (4, *TINY, *flags, "--checkpoint-dir", tmp_path / "x")
            for flags, _ in bad_flags
        ],
        launcher=True,
    )
    fresh = ("--checkpoint-dir", tmp_path / "fresh", "--init-from", ckpt / "step-6")
    file_run, sub_run, dim_run, layers_run, init_run = failing_examples(
        (2, *TINY, "--checkpoint-dir", a_file),
        (2, *TINY, "--checkpoint-dir", a_file / "sub"),
        (2, *TINY, "--steps", "7", "--dim", "64", "--checkpoint-dir", ckpt),
        (2, *TINY, "--steps", "7", "--n-layers", "2", "--checkpoint-dir", other),
        (2, *TINY, "--steps", "2", "--dim", "64", *fresh),
    )

    assert (
        f"[rank 0] error: checkpoint dir {str(a_file)!r} is a file" in file_run.stdout
    )
    assert a_file.read_text() == "not a folder"

    assert "[rank 1] error: cannot write to" in sub_run.stdout
    assert "(--checkpoint-dir)" in sub_run.stdout  # the flag to change
    assert "step   1 |" not in sub_run.stdout  # refused before any training

    for (_, message), run in zip(bad_flags, flag_runs, strict=True):
        assert run.stderr.count(f"pippy_dcp.py: error: {message}\n") == 1
    assert not (tmp_path / "x").exists()

    # The example names the flag the checkpoint was saved with.
    assert (
        f"error: {ckpt / 'step-6'} was saved with --dim 32, this run has 64: pass "
        "--dim 32, or another --checkpoint-dir" in dim_run.stdout
    )
    assert (
        "was saved with --n-layers 4, this run has 2: pass --n-layers 4"
        in layers_run.stdout
    )
    assert (  # the weights of --init-from too
        f"error: {ckpt / 'step-6'} was saved with --dim 32, this run has 64: pass "
        "--dim 32, or another --init-from" in init_run.stdout
    )

    # Nothing that was saved before was lost or changed by the failed runs.
    for folder in (ckpt, other):
        assert {p.name: p.read_bytes() for p in (folder / "step-6").iterdir()} == (
            before
        )
        assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-6"]


@pytest.mark.launches
def test_a_damaged_step_gets_one_clear_error_and_loses_nothing(tmp_path, tiny_run):
    """A data file truncated in one copy of tiny_run's steps, missing in the
    other (both runs at once): every rank stops with the same line."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    for folder in (ckpt, other):
        shutil.copytree(tiny_run[0], folder)
    before = {p.name: p.read_bytes() for p in (ckpt / "step-6").iterdir()}
    data = [folder / "step-6" / "__1_0.distcp" for folder in (ckpt, other)]
    data[0].write_bytes(before["__1_0.distcp"][:1000])  # truncated
    data[1].unlink()  # missing
    run, missing_run = failing_examples(
        *[(2, *TINY, "--steps", "7", "--checkpoint-dir", f) for f in (ckpt, other)]
    )
    for rank in (0, 1):  # every rank stops with the same line, before loading
        assert f"[rank {rank}] error: " in run.stdout
    assert "step-6' is damaged: __1_0.distcp has 1000 bytes" in run.stdout
    assert "to resume from an earlier step" in run.stdout
    assert "is damaged: __1_0.distcp is missing" in missing_run.stdout
    for path in data:
        path.write_bytes(before["__1_0.distcp"])
    # Nothing that was saved before was lost or changed by the failed runs.
    for folder in (ckpt, other):
        assert {p.name: p.read_bytes() for p in (folder / "step-6").iterdir()} == (
            before
        )
        assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-6"]


@pytest.mark.launches
def test_a_rank_killed_mid_save_leaves_the_last_step_loadable(tmp_path):
    """SIGKILL one rank while step 4 is being written (a ~40 MB stage per rank,
    so the save takes long enough to be caught in the middle)."""
    flags = [
        "--n-layers",
        "4",
        "--dim",
        "512",
        "--seq-len",
        "32",
        "--steps",
        "4",
        "--save-every",
        "2",
    ]
    launcher = launch(
        2,
        EXAMPLE,
        *flags,
        "--checkpoint-dir",
        tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def staging():  # .step-4.partial-<token>
        return list(tmp_path.glob(".step-4.partial-*"))

    try:
        deadline = time.monotonic() + 180
        while not staging() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert staging(), "the save of step 4 never started"
        ranks = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
        ).stdout.split()
        os.kill(int(ranks[-1]), signal.SIGKILL)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert not (tmp_path / "step-4").exists()  # the partial save was never published
    assert checkpoint.find_latest_step(tmp_path) == tmp_path / "step-2"
    assert offline.read_checkpoint(tmp_path / "step-2")["step"] == 2

    run = example(2, *flags, "--checkpoint-dir", tmp_path)
    assert f"resuming from {tmp_path / 'step-2'}" in run.stdout
    assert "verified:" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]


def two_heads_state(optimizer_class=torch.optim.AdamW, **kwargs):
    model = TwoHeads()
    return checkpoint.StageState(model, optimizer_class(model.parameters(), **kwargs))


def train_step(state, use):
    torch.manual_seed(state.step)
    state.module(torch.randn(2, 4), use).sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def load_nested(state, folder):
    """Loads as DCP's tutorial does: the Stateful under a key, ``{"app": state}``."""
    reader = SafeFileSystemReader(folder)
    with explain_failures(f"loading {folder}"):
        dcp.load({"app": state}, storage_reader=reader, planner=SafeLoadPlanner())


def state_ids(state):
    return sorted(state.optimizer.state_dict()["state"])


@pytest.mark.parametrize(
    "optimizer_class, kwargs, nested",
    [
        (torch.optim.AdamW, {}, False),
        (torch.optim.AdamW, {}, True),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, False),
        (torch.optim.SGD, {"lr": 0.1}, False),  # no state for any parameter
    ],
)
def test_parameters_without_optimizer_state_load_and_resume_exactly(
    tmp_path, optimizer_class, kwargs, nested
):
    # An expert no token was routed to, a head not trained yet: its grad
    # stayed None, so the optimizer has no state for it.
    saved = two_heads_state(optimizer_class, **kwargs)
    train_step(saved, use=("a",))
    assert saved.module.b.weight not in saved.optimizer.state
    loaded = two_heads_state(optimizer_class, **kwargs)
    if nested:
        save({"app": saved}, tmp_path, step=1)
        load_nested(loaded, step_dir(tmp_path, 1))
    else:
        load(loaded, save(saved, tmp_path))
    assert loaded.module.b.weight not in loaded.optimizer.state
    assert state_ids(loaded) == state_ids(saved)
    assert offline.diff_state_dicts(loaded.state_dict(), saved.state_dict()) == []
    for state in (saved, loaded):  # now b trains too, from fresh state in both
        train_step(state, use=("a", "b"))
    assert offline.diff_state_dicts(loaded.state_dict(), saved.state_dict()) == []


def test_optimizer_state_the_optimizer_loaded_into_cannot_take_says_why(tmp_path):
    saved = two_heads_state()
    train_step(saved, use=("a", "b"))
    folder = save(saved, tmp_path)
    rolled_back = two_heads_state()
    train_step(rolled_back, use=("a",))  # has state for a only: none to fill for b
    with pytest.raises(
        checkpoint.CheckpointError,
        match="'optim.state.b.bias.exp_avg', .* optimizer state that the optimizer "
        "loaded into has no place for .* it has stepped only some parameters",
    ):
        load(rolled_back, folder)


def test_a_model_with_fewer_layers_is_told_so_before_its_optimizer_state(tmp_path):
    def layered(n):
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))
        optimizer = torch.optim.AdamW(model.parameters())
        sum(layer(torch.ones(1, 4)).sum() for layer in model.layers).backward()
        optimizer.step()
        return checkpoint.StageState(model, optimizer)

    folder = save(layered(2), tmp_path)
    with pytest.raises(checkpoint.CheckpointError) as e:
        load(layered(1), folder)
    split, optim = "does not match the checkpoint (fewer layers?", "has no place for"
    assert split in str(e.value) and optim in str(e.value)
    assert str(e.value).index(split) < str(e.value).index(optim)  # the cause first


def test_optimizer_state_with_its_tensors_lost_is_an_error_not_fresh_moments(
    tmp_path,
):
    state = two_heads_state()
    train_step(state, use=("a", "b"))
    state_dict = state.state_dict()
    del state_dict["optim"]["state.b.weight.exp_avg"]
    del state_dict["optim"]["state.b.weight.exp_avg_sq"]  # its step stays
    save(state_dict, tmp_path, step=1)
    with pytest.raises(
        checkpoint.CheckpointError, match="has no 'state.b.weight.exp_avg'"
    ):
        load(two_heads_state(), step_dir(tmp_path, 1))


def test_param_groups_joining_parameters_saved_with_other_options_are_refused(
    tmp_path,
):
    def per_head(lrs):
        def groups(model):
            return [
                {"params": getattr(model, name).parameters(), "lr": lr}
                for name, lr in zip("ab", lrs, strict=True)
            ]

        return groups

    def heads(groups):
        model = TwoHeads()
        state = checkpoint.StageState(model, torch.optim.AdamW(groups(model)))
        train_step(state, use=("a", "b"))
        return state

    def one_group(model):
        return [{"params": model.parameters(), "lr": 0.3}]

    saved = heads(per_head([0.1, 0.2]))
    folder = save(saved, tmp_path)
    # set_state_dict would give b the saved lr of a (0.1) without a word.
    with pytest.raises(
        checkpoint.CheckpointError,
        match="param group 0 here holds parameters saved with different 'lr': "
        "lr 0.1 for 'a.weight', 0.2 for 'b.weight'",
    ):
        load(heads(one_group), folder)
    # Parameters saved with equal options may be grouped otherwise.
    same = heads(per_head([0.1, 0.1]))
    loaded = heads(one_group)
    load(loaded, save(same, tmp_path, step=2))
    assert loaded.optimizer.param_groups[0]["lr"] == 0.1
    assert (
        offline.diff_state_dicts(
            loaded.state_dict()["model"], same.state_dict()["model"]
        )
        == []
    )
    # One saved group split in two with options of their own (a no-decay
    # group added): loading would give both the saved weight_decay.
    whole = heads(one_group)
    folder = save(whole, tmp_path, step=3)

    def no_decay_b(model):
        return [
            {"params": model.a.parameters(), "lr": 0.3},
            {"params": model.b.parameters(), "lr": 0.3, "weight_decay": 0.0},
        ]

    with pytest.raises(
        checkpoint.CheckpointError,
        match="param groups 0 and 1 here hold 'a.weight' and 'b.weight', saved in "
        "one group: loading would give both its weight_decay, not this run's",
    ):
        load(heads(no_decay_b), folder)
    # Split with the same options: nothing to lose, it loads.
    split = heads(per_head([0.3, 0.3]))
    load(split, folder)
    assert [g["lr"] for g in split.optimizer.param_groups] == [0.3, 0.3]


def lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)


def sequential_lr(optimizer):
    first = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    then = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, then], [2])


def on_plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def with_scheduler(make_scheduler, groups):
    model = TwoHeads()
    optimizer = torch.optim.AdamW(groups(model), lr=0.1)
    scheduler = make_scheduler(optimizer)
    state = checkpoint.StageState(model, optimizer, scheduler)
    train_step(state, use=("a", "b"))
    scheduler.step(*([1.0] if make_scheduler is on_plateau else []))
    return state


def two_groups(model):
    return [{"params": model.a.parameters()}, {"params": model.b.parameters()}]


@pytest.mark.parametrize(
    "make_scheduler, per_group_list",
    [(lambda_lr, "base_lrs"), (sequential_lr, "_last_lr"), (on_plateau, "min_lrs")],
)
def test_a_scheduler_saved_for_other_param_groups_is_refused(
    tmp_path, make_scheduler, per_group_list
):
    folder = save(with_scheduler(make_scheduler, two_groups), tmp_path)
    loaded = with_scheduler(make_scheduler, lambda model: model.parameters())
    # The options are equal, so the optimizer alone could be regrouped; but
    # LambdaLR and SequentialLR would fail at their first step (zip() of one
    # group and two lambdas), ReduceLROnPlateau run on with a stray min_lr.
    with pytest.raises(
        checkpoint.CheckpointError,
        match=f"LR scheduler was saved for 2 param group.s. .its '{per_group_list}'.,"
        " this one has 1",
    ):
        load(loaded, folder)


def test_a_group_added_after_its_scheduler_was_built_loads_into_the_same_build(
    tmp_path,
):
    def build():
        model = TwoHeads()
        optimizer = torch.optim.AdamW(model.a.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        optimizer.add_param_group({"params": model.b.parameters()})
        state = checkpoint.StageState(model, optimizer, scheduler)
        train_step(state, use=("a", "b"))
        scheduler.step()
        return state

    saved = build()
    loaded = build()
    load(loaded, save(saved, tmp_path))  # one scheduled group of two, both sides
    assert offline.diff_state_dicts(loaded.state_dict(), saved.state_dict()) == []


def test_regrouping_ignores_how_options_are_spelled_and_implementation_flags(
    tmp_path,
):
    def groups(model):
        return [
            {"params": model.a.parameters(), "betas": (0.9, 0.99), "foreach": None},
            {"params": model.b.parameters(), "betas": [0.9, 0.99], "foreach": False},
        ]

    saved = checkpoint.StageState(model := TwoHeads(), torch.optim.AdamW(groups(model)))
    train_step(saved, use=("a", "b"))
    folder = save(saved, tmp_path)
    model = TwoHeads()
    loaded = checkpoint.StageState(model, torch.optim.AdamW(model.parameters()))
    load(loaded, folder)
    assert list(loaded.optimizer.param_groups[0]["betas"]) == [0.9, 0.99]


def test_another_optimizer_or_scheduler_gets_an_error_that_says_so(tmp_path):
    saved = two_heads_state()
    train_step(saved, use=("a", "b"))
    folder = save(saved, tmp_path)
    sgd = two_heads_state(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(
        checkpoint.CheckpointError,
        match="only the optimizer's state differs from the checkpoint's: build "
        "the optimizer as the run that saved it did",
    ):
        load(sgd, folder)
    scheduled = two_heads_state()
    scheduled.lr_scheduler = lambda_lr(scheduled.optimizer)
    with pytest.raises(
        checkpoint.CheckpointError, match="LR scheduler differs .*: build it"
    ):
        load(scheduled, folder)
