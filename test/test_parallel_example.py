"""The example on parallel layouts, run as users run it: pipeline x data parallel
(DDP, FSDP2) and two stages per rank, each stopped and resumed on one
--checkpoint-dir, and resumed on another layout.

What the arithmetic makes equal: a layout without data parallelism (4 ranks,
2 ranks x 2 interleaved stages, 1 rank) computes bit for bit what the others
compute, and so do DDP and FSDP2 at one dp degree. A change of dp degree changes
the microbatches (each replica splits its slice of the global batch) and adds
a sum over replicas, so the order of accumulation changes: there the tensors
agree to a relative RESHARD_RTOL and the printed losses to their 4 decimals.
"""

import os
import re
import shutil

import pytest
import torch

from pippy.checkpoint import offline
from pippy.checkpoint.checks import named_leaves
from pippy.checkpoint.reader import read_metadata

import flags
import pippy_dcp
from gpt import GPT, ModelArgs
from helpers import (
    EXAMPLE,
    TINY_FLAGS,
    example,
    loss_lines,
    plain_read,
    torchrun,
)

FLAGS = [*TINY_FLAGS, "--steps", "6", "--save-every", "3"]
LAYOUTS = {  # name: (ranks, flags)
    "ddp": (4, ["--dp", "2"]),
    "fsdp": (4, ["--dp", "2", "--fsdp"]),
    "interleaved": (2, ["--stages-per-rank", "2", "--schedule", "interleaved-1f1b"]),
    "one rank": (1, []),
}
DP_LABELS = ["stage 0 (dp 0)", "stage 1 (dp 0)", "stage 0 (dp 1)", "stage 1 (dp 1)"]
LABELS = {  # what each rank's save line calls its stages
    "ddp": DP_LABELS,
    "fsdp": DP_LABELS,
    "interleaved": ["stages 0, 2", "stages 1, 3"],
    "one rank": ["stage 0"],
}
#: Largest difference of any float tensor, relative to the tensor's largest
#: value, after 3 steps on another dp degree. Measured: 1.5e-6.
RESHARD_RTOL = 1e-5
#: A rank's save line: its label, the tensors it holds, and those it wrote
#: when fewer ("saved 64 tensors (30 written here)").
SAVED = re.compile(
    r"^\[rank (\d+)\] (stages? [\d, ]+(?: \(dp \d\))?): saved (\d+) tensors"
    r"(?: \((\d+) written here\))?",
    re.M,
)


def run_layout(layout, folder, *flags, **options):
    """The example on `layout` (a pool of its ranks), its checkpoints in
    `folder`; `options`: helpers.example's."""
    ranks, layout_flags = LAYOUTS[layout]
    argv = (*FLAGS, *layout_flags, "--checkpoint-dir", folder, *flags)
    return example(ranks, *argv, **options)


def assert_nothing_left_for_finalization(layout, stdout):
    """Each rank's modules, and with them its process groups, were freed
    before interpreter finalization, where freeing them can abort it."""
    alive = dict(
        re.findall(r"\[rank (\d+)\] at exit: (\d+) torch modules alive", stdout)
    )
    assert alive == {str(rank): "0" for rank in range(LAYOUTS[layout][0])}


def launched_at_once(tmp_path_factory, runs):
    """`runs` ({name: (layout, flags)}) from nothing, on pools of rank
    processes, in turn: {name: (folder, stdout)}."""
    folders = {name: tmp_path_factory.mktemp("run") for name in runs}
    return {
        name: (folders[name], run_layout(layout, folders[name], *flags).stdout)
        for name, (layout, flags) in runs.items()
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """6 steps with and without data parallelism: {"dp" | "pp": (folder, stdout)}."""
    runs = {"dp": ("ddp", ()), "pp": ("one rank", ())}
    return launched_at_once(tmp_path_factory, runs)


@pytest.fixture(scope="module")
def from_scratch(tmp_path_factory):
    """Each tested layout stopped after step 3: {layout: (folder, stdout)}."""
    runs = {layout: (layout, ("--stop-after", "3")) for layout in LABELS}
    del runs["one rank"]
    return launched_at_once(tmp_path_factory, runs)


@pytest.fixture(scope="module")
def uninterrupted(references):
    """The references' folders and loss lines."""
    return {
        name: (folder, loss_lines(stdout))
        for name, (folder, stdout) in references.items()
    }


def losses(lines):
    return [float(line.split("| loss ")[1].split()[0]) for line in lines]


def assert_close(actual, expected, rtol):
    """Every float tensor within rtol of the other's largest value; the rest equal."""
    expected = dict(named_leaves(expected))
    for key, a in named_leaves(actual):
        b = expected[key]
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            scale = b.abs().max().clamp_min(1e-12)
            assert ((a - b).abs().max() / scale).item() <= rtol, key
        elif not isinstance(a, torch.Tensor):
            assert a == b, key


@pytest.mark.launches
def test_references_agree_across_dp_degrees_and_load_into_the_plain_model(
    uninterrupted,
):
    (dp, dp_losses), (pp, pp_losses) = uninterrupted["dp"], uninterrupted["pp"]
    assert losses(dp_losses) == pytest.approx(losses(pp_losses), abs=1e-4)
    # The DDP run's files, read with plain DCP in this process, hold what
    # pippy reads; and the checkpoint loads into the un-split model.
    plain = plain_read(dp / "step-6")
    ours = dict(named_leaves(offline.read_checkpoint(dp / "step-6")))
    assert offline.diff_state_dicts(plain, ours) == []  # every item
    model = GPT(ModelArgs(4, 32, max_seq_len=32))
    assert offline.load_model(dp / "step-6", model) == 6
    weights = {k: v for k, v in ours.items() if k.startswith("model.")}
    assert (
        offline.diff_state_dicts(
            {f"model.{k}": v for k, v in model.state_dict().items()}, weights
        )
        == []
    )
    assert_close(
        offline.read_checkpoint(dp / "step-6"),
        offline.read_checkpoint(pp / "step-6"),
        RESHARD_RTOL,
    )


@pytest.mark.launches
@pytest.mark.parametrize(
    "layout, reference, other, other_reference",
    [
        ("ddp", "dp", "interleaved", "pp"),
        ("fsdp", "dp", "one rank", "pp"),
        ("interleaved", "pp", "fsdp", "dp"),
    ],
)
def test_stopped_resumed_and_resumed_on_another_layout(
    tmp_path, from_scratch, uninterrupted, layout, reference, other, other_reference
):
    here, there = tmp_path / "here", tmp_path / "there"
    stopped, first = from_scratch[layout]  # stopped after step 3
    shutil.copytree(stopped, here)
    # Every rank names its stages and writes its share: with DDP each
    # replicated item is written by one replica, with FSDP2 each rank its shards.
    saved = sorted(SAVED.findall(first))
    assert [label for _, label, _, _ in saved] == LABELS[layout]
    metadata = read_metadata(here / "step-3")
    chunks = [i for i in metadata.storage_data if i.offset is not None]
    wrote = [int(written or held) for _, _, held, written in saved]
    assert sum(wrote) == len(chunks)
    assert all(n > 0 for n in wrote)
    shutil.copytree(here, there)

    # Two resumes, each of its own copy. The same command again resumes
    # (each rank counting the torch modules alive at its exit); the arithmetic
    # is the same: bitwise.
    second = run_layout(layout, here, exit_check=True)
    moved = run_layout(other, there)
    assert f"resuming from {here / 'step-3'}" in second.stdout
    assert "verified:" in second.stdout
    assert_nothing_left_for_finalization(layout, second.stdout)
    folder, reference_losses = uninterrupted[reference]
    assert loss_lines(second.stdout) == reference_losses[3:]
    resumed = offline.read_checkpoint(here / "step-6")
    assert (
        offline.diff_state_dicts(resumed, offline.read_checkpoint(folder / "step-6"))
        == []
    )

    # Resumed on another layout: another dp degree, so within the tolerance.
    assert f"resuming from {there / 'step-3'}" in moved.stdout
    assert "verified:" in moved.stdout
    folder, other_losses = uninterrupted[other_reference]
    assert losses(loss_lines(moved.stdout)) == pytest.approx(
        losses(other_losses[3:]), abs=1e-4
    )
    assert_close(
        offline.read_checkpoint(there / "step-6"),
        offline.read_checkpoint(folder / "step-6"),
        RESHARD_RTOL,
    )


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (["--dp", "3"], 4, "argument --dp: must divide the 4 ranks, not 3"),
        (["--fsdp"], 4, "argument --fsdp: needs --dp 2 or more"),
        (
            ["--stages-per-rank", "2", "--schedule", "1f1b"],
            2,
            "argument --schedule: --stages-per-rank > 1 needs interleaved-1f1b|",
        ),
        (  # the schedule first: 1f1b's own need of microbatches is moot
            ["--stages-per-rank", "2", "--schedule", "1f1b", "--microbatches", "2"],
            2,
            "argument --schedule: --stages-per-rank > 1 needs interleaved-1f1b|",
        ),
        (
            ["--dp", "2", "--split", "trace"],
            4,
            "argument --split: trace builds one stage per rank",
        ),
        (
            ["--dp", "4", "--batch-size", "8", "--microbatches", "4"],
            4,
            "argument --microbatches: --dp x --microbatches (4 x 4) must divide "
            "--batch-size 8",
        ),
        (["--keep-last", "0"], 2, "argument --keep-last: must be 1 or more, not 0"),
        (
            ["--checkpoint-timeout", "inf"],
            2,
            "argument --checkpoint-timeout: must be in (0, 31536000] (365 days), not inf",
        ),
        (["--dim", "130"], 2, "argument --dim: must be a multiple of 4 (the heads)"),
        (["--n-layers", "3"], 4, "argument --n-layers: 3 layers cannot fill 4 stages"),
    ],
)
def test_impossible_layouts_are_one_error_line_naming_the_flag(
    monkeypatch, capsys, flags, world_size, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit):
        pippy_dcp.parse_args(flags)
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1
    monkeypatch.setenv("RANK", "1")  # other ranks exit quietly: rank 0 says it
    with pytest.raises(SystemExit):
        pippy_dcp.parse_args(flags)
    assert capsys.readouterr().err == ""


#: The ranks' sitecustomize.py in the test below: rank 0 starts once every
#: other rank has begun a long sleep (waiting to be stopped), or 8 s late.
LATE_RANK_0 = """
import os, time
from pathlib import Path

here, rank = Path(__file__).parent, os.environ.get("RANK")  # torchrun has none
if rank == "0":
    deadline = time.monotonic() + 8
    while len(list(here.glob("waiting-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
elif rank is not None:
    _sleep = time.sleep

    def sleep(seconds):
        if seconds >= 10:
            (here / f"waiting-{rank}").touch()
        _sleep(seconds)

    time.sleep = sleep
"""


@pytest.mark.launches
def test_a_flag_error_is_printed_even_when_rank_0_starts_last(tmp_path):
    """Under torchrun, a rank that exits stops the others: the ranks that do not
    print the error wait to be stopped, so rank 0, started after the others
    are waiting here (LATE_RANK_0), still prints it."""
    (tmp_path / "sitecustomize.py").write_text(LATE_RANK_0)
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    run = torchrun(
        4,
        EXAMPLE,
        *TINY_FLAGS,
        "--n-layers",
        "3",
        env={"PYTHONPATH": os.pathsep.join(path)},
        expect_ok=False,
    )
    assert run.returncode != 0
    message = "argument --n-layers: 3 layers cannot fill 4 stages"
    assert run.stderr.count(f"pippy_dcp.py: error: {message}\n") == 1


def test_stages_per_rank_alone_takes_a_looped_schedule(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = pippy_dcp.parse_args(["--dp", "2", "--stages-per-rank", "2"])
    assert args.schedule == "interleaved-1f1b"
    assert flags.N_HEADS == ModelArgs.n_heads
