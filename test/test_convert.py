"""python -m pippy convert on the example's own checkpoint: pippy -> torchtitan ->
pippy gives the step back, key for key and bit for bit, and the example resumes
from it; the torchtitan step holds the model's weights, and nothing else, at its
root."""

import shutil

import pytest
import torch

import helpers
from gpt import GPT, ModelArgs
from helpers import (
    TINY_FLAGS,
    TINY_RUN_FLAGS,
    examples,
    loss_lines,
    plain_read,
)

RUN = [*TINY_FLAGS, "--save-every", "2"]


def pippy_cli(*args):
    """Runs ``python -m pippy ARGS`` (in this process); returns its stdout."""
    proc = helpers.pippy_cli(*args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def assert_bitwise(got, expected):
    """The same keys; tensors of the same dtype, shape and bytes; equal objects."""
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            assert (other.dtype, other.shape) == (value.dtype, value.shape), key
            as_bytes = [t.reshape(-1).view(torch.uint8) for t in (other, value)]
            assert torch.equal(*as_bytes), key
        else:
            assert type(other) is type(value) and repr(other) == repr(value), key


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_run):
    """The example's step-6 (2 ranks, 6 steps: a run shared with other modules,
    conftest.py), converted to torchtitan's layout and back."""
    root = tmp_path_factory.mktemp("convert")
    assert TINY_RUN_FLAGS[: len(TINY_FLAGS)] == TINY_FLAGS
    step = tiny_run[0] / "step-6"
    titan, back = root / "titan" / "step-6", root / "back" / "step-6"
    pippy_cli("convert", step, "--to", "torchtitan", "--out", titan)
    pippy_cli("convert", titan, "--to", "pippy", "--out", back)
    return step, titan, back


def test_pippy_to_torchtitan_to_pippy_is_the_identity(converted):
    step, _, back = converted
    assert_bitwise(plain_read(back), plain_read(step))


def test_the_torchtitan_step_holds_the_model_at_its_root_and_the_rest_in_sections(
    converted, tmp_path
):
    _, titan, _ = converted
    saved = plain_read(titan)
    model = GPT(ModelArgs(n_layers=4, dim=32, max_seq_len=32))
    sections = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
    assert sorted(k for k in saved if not k.startswith(sections)) == sorted(
        model.state_dict()
    )
    # The data sampler's state is where torchtitan keeps its data loader's.
    assert saved["dataloader.data.rng_state"].dtype == torch.uint8
    assert saved["train_state.step"] == 6 and saved["train_state.ntokens_seen"] == 0
    out = tmp_path / "gpt.pt"
    printed = pippy_cli("export", titan, "--out", out)
    assert f"{len(model.state_dict())} tensors" in printed
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_the_example_resumes_from_the_round_tripped_step(converted, tmp_path):
    step, _, back = converted
    names = ("original", "round-tripped")
    for name, source in zip(names, (step, back), strict=True):
        shutil.copytree(source, tmp_path / name / "step-6")
    launched = examples(
        *[(2, *RUN, "--steps", 8, "--checkpoint-dir", tmp_path / n) for n in names]
    )
    runs = {name: run.stdout for name, run in zip(names, launched, strict=True)}
    for name in names:
        assert f"resuming from {tmp_path / name / 'step-6'}" in runs[name]
    losses = loss_lines(runs["round-tripped"])
    assert [line.split("|")[0].strip() for line in losses] == ["step   7", "step   8"]
    assert losses == loss_lines(runs["original"])
