"""python -m pippy convert on the example's own checkpoint: pippy -> torchtitan ->
pippy gives the step back, key for key and bit for bit, and the example resumes
from it; the torchtitan step holds the model's weights, and nothing else, at its
root."""

import shutil
import subprocess
import sys

import pytest
import torch

from gpt import GPT, ModelArgs
from helpers import EXAMPLE, ROOT, TINY_FLAGS, loss_lines, plain_read, torchrun

RUN = [*TINY_FLAGS, "--save-every", "2"]


def pippy_cli(*args):
    """Runs ``python -m pippy ARGS`` as a user would; returns its stdout."""
    cmd = [sys.executable, "-m", "pippy", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
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
def converted(tmp_path_factory):
    """The example's step-2 (2 ranks), converted to torchtitan's layout and back."""
    root = tmp_path_factory.mktemp("convert")
    torchrun(2, EXAMPLE, *RUN, "--steps", "2", "--checkpoint-dir", root / "run")
    step = root / "run" / "step-2"
    titan, back = root / "titan" / "step-2", root / "back" / "step-2"
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
    assert saved["train_state.step"] == 2 and saved["train_state.ntokens_seen"] == 0
    out = tmp_path / "gpt.pt"
    printed = pippy_cli("export", titan, "--out", out)
    assert f"{len(model.state_dict())} tensors" in printed
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)


def test_the_example_resumes_from_the_round_tripped_step(converted, tmp_path):
    step, _, back = converted
    runs = {}
    for name, source in (("original", step), ("round-tripped", back)):
        shutil.copytree(source, tmp_path / name / "step-2")
        args = ["--steps", "4", "--checkpoint-dir", tmp_path / name]
        runs[name] = torchrun(2, EXAMPLE, *RUN, *args).stdout
        assert f"resuming from {tmp_path / name / 'step-2'}" in runs[name]
    losses = loss_lines(runs["round-tripped"])
    assert [line.split("|")[0].strip() for line in losses] == ["step   3", "step   4"]
    assert losses == loss_lines(runs["original"])
