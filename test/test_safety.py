"""Loading a checkpoint must not run code from it.

Each attack is shown to work against plain DCP first, so that the tests of
pippy's refusal can fail.
"""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.reader import read_metadata

from helpers import TINY_FLAGS, Payload, example, poison_metadata


def save_step(root, step=1, **extra):
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(4, 4), "b": torch.zeros(4)}, "step": step}
    return checkpoint.save_stage({**state, **extra}, root, step=step)


def empty_state():
    return {"model": {"w": torch.empty(4, 4), "b": torch.empty(4)}, "step": 0}


def test_plain_dcp_runs_code_from_metadata(tmp_path):
    folder, marker = save_step(tmp_path / "ckpt"), tmp_path / "pwned"
    poison_metadata(folder, marker)
    dcp.load(empty_state(), checkpoint_id=folder)
    assert marker.exists()


def test_plain_dcp_runs_code_from_a_non_tensor_item(tmp_path):
    marker = tmp_path / "pwned"
    folder = save_step(tmp_path / "ckpt", lr_scheduler={"x": Payload(marker)})
    assert not marker.exists()
    dcp.load({**empty_state(), "lr_scheduler": {"x": None}}, checkpoint_id=folder)
    assert marker.exists()


def read_with_dcp_load(folder):
    """dcp.load through pippy's reader and planner, as the example resumes."""
    checkpoint.load_stage(empty_state(), folder)


READ_PATHS = {
    "dcp.load": read_with_dcp_load,
    "read_metadata": read_metadata,
    "read_checkpoint": offline.read_checkpoint,
    "read_checkpoint(model.)": lambda f: offline.read_checkpoint(f, prefix="model."),
    "load_model": lambda f: offline.load_model(f, torch.nn.Linear(4, 4)),
}


@pytest.mark.parametrize("read", READ_PATHS.values(), ids=READ_PATHS.keys())
def test_pippy_refuses_poisoned_metadata(tmp_path, read):
    folder, marker = save_step(tmp_path / "ckpt"), tmp_path / "pwned"
    poison_metadata(folder, marker)
    with pytest.raises(checkpoint.UnsafeCheckpointError) as error:
        read(folder)
    assert not marker.exists()
    message = str(error.value)
    assert str(folder / ".metadata") in message and "io.open" in message
    assert "PIPPY_TRUST_CHECKPOINT=1" in message


def test_pippy_refuses_a_poisoned_non_tensor_item(tmp_path):
    marker = tmp_path / "pwned"
    folder = save_step(tmp_path / "ckpt", extra={"x": Payload(marker)})
    with pytest.raises(checkpoint.UnsafeCheckpointError) as error:
        offline.read_checkpoint(folder)
    assert not marker.exists()
    assert "'extra.x' of __0_0.distcp" in str(error.value)
    assert "io.open" in str(error.value)


def test_a_damaged_item_is_reported_as_damage_not_as_an_attack(tmp_path):
    folder = save_step(tmp_path / "ckpt", extra={"note": "a plain string"})
    metadata = read_metadata(folder)
    [info] = [i for k, i in metadata.storage_data.items() if k.fqn == "extra.note"]
    data = folder / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset : info.offset + info.length] = b"\xff" * info.length
    data.write_bytes(bytes(raw))
    with pytest.raises(
        checkpoint.CheckpointError, match="'extra.note' of __0_0.distcp is damaged"
    ) as error:
        offline.read_checkpoint(folder)
    assert not isinstance(error.value, checkpoint.UnsafeCheckpointError)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_trusted_checkpoints_load_with_plain_pickle(tmp_path, monkeypatch, how):
    folder, marker = save_step(tmp_path / "ckpt"), tmp_path / "pwned"
    poison_metadata(folder, marker)
    if how == "argument":
        state = offline.read_checkpoint(folder, trusted=True)
    else:
        monkeypatch.setenv("PIPPY_TRUST_CHECKPOINT", "1")
        state = offline.read_checkpoint(folder)
    assert marker.exists()  # the opt-out is exactly plain DCP's behaviour
    assert state["step"] == 1 and state["model.b"].shape == (4,)


def test_what_pippy_writes_loads_under_the_restricted_rules(tmp_path):
    folder = save_step(tmp_path / "ckpt", lr_scheduler={"betas": (0.9, 0.95), "n": 3})
    state = offline.read_checkpoint(folder)
    assert state["lr_scheduler.betas"] == (0.9, 0.95)
    assert state["lr_scheduler.n"] == 3 and state["step"] == 1


def test_example_refuses_to_resume_from_a_poisoned_checkpoint(tmp_path, tiny_run):
    # The example's own step-6 (a tiny run shared with other modules, copied).
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    shutil.copytree(tiny_run[0], ckpt)
    flags = ["--checkpoint-dir", ckpt, *TINY_FLAGS]
    poison_metadata(ckpt / "step-6", marker)
    run = example(2, *flags, "--steps", "7", expect_ok=False)
    assert run.returncode != 0
    assert not marker.exists()
    for rank in range(2):
        assert (
            f"[rank {rank}] error: refused to load {ckpt / 'step-6' / '.metadata'}"
            in run.stdout
        )
    assert not (ckpt / "step-7").exists()
