"""Checkpoints for other tools: torchtitan's layout both ways, Hugging Face
export with integer and bool tensors, and models whose hooks rename keys."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from pippy import checkpoint
from pippy.checkpoint.optim_layout import OPTIONS
from pippy.cli import main

from helpers import plain_read, tiny_gpt


def trained_state(seed=0):
    """A tiny GPT with AdamW and an LR scheduler, stepped once."""
    model = tiny_gpt(n_layers=2, dim=16, max_seq_len=8, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    model(torch.randint(256, (2, 8))).sum().backward()
    optimizer.step()
    scheduler.step()
    return checkpoint.StageState(model, optimizer, scheduler, step=1)


def fresh_state():
    model = tiny_gpt(n_layers=2, dim=16, max_seq_len=8, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    return checkpoint.StageState(model, optimizer, scheduler)


def save_torchtitan(state, step):
    """What torchtitan's CheckpointManager writes, with plain DCP: model keys at
    the root, optimizer flattened by FQN, lr_scheduler, train_state, dataloader."""
    sd = dict(state.module.state_dict())
    optim = get_optimizer_state_dict(state.module, state.optimizer, options=OPTIONS)
    sd.update((f"optimizer.{k}", v) for k, v in optim.items())
    sd["lr_scheduler"] = state.lr_scheduler.state_dict()
    sd["train_state"] = {"step": state.step, "ntokens_seen": 32}
    sd["dataloader"] = {"world_size": 1}
    dcp.save(sd, checkpoint_id=step, no_dist=True)


def test_torchtitan_layout_read_loaded_inspected_exported(tmp_path, capsys):
    state = trained_state()
    save_torchtitan(state, tmp_path / "step-1")
    step = tmp_path / "step-1"
    # torchtitan writes no manifest.json: reading it is an explicit opt-out.
    with pytest.raises(checkpoint.CheckpointError, match="has no manifest.json"):
        checkpoint.read_checkpoint(step, prefix="model.")
    model_sd = checkpoint.read_checkpoint(step, prefix="model.", verify=False)
    assert checkpoint.diff_state_dicts(model_sd, state.module.state_dict()) == []
    fresh = fresh_state()
    assert checkpoint.load_model(step, fresh.module, fresh.optimizer, verify=False) == 1
    expected = {k: v for k, v in state.state_dict().items() if k in ("model", "optim")}
    got = {k: v for k, v in fresh.state_dict().items() if k in ("model", "optim")}
    assert checkpoint.diff_state_dicts(got, expected) == []
    assert main(["inspect", str(step)]) == 0
    assert "(torchtitan layout)" in capsys.readouterr().out
    out = str(tmp_path / "m.safetensors")
    assert main(["export", str(step), "--no-verify", "--out", out]) == 0
    exported = load_file(tmp_path / "m.safetensors")
    assert checkpoint.diff_state_dicts(exported, state.module.state_dict()) == []
    # torchtitan -> pippy: a resume with load_stage, every entry bitwise.
    assert (
        main(
            [
                "convert",
                str(step),
                "--no-verify",
                "--to",
                "pippy",
                "--out",
                str(tmp_path / "p" / "step-1"),
            ]
        )
        == 0
    )
    fresh = fresh_state()
    # Its train_state.ntokens_seen and dataloader have no place in this state.
    must_read = ("model.", "optim.", "lr_scheduler.", "step")
    checkpoint.load_stage(fresh, tmp_path / "p" / "step-1", must_read=must_read)
    assert checkpoint.diff_state_dicts(fresh.state_dict(), state.state_dict()) == []


def test_pippy_to_torchtitan_read_with_plain_dcp(tmp_path):
    state = trained_state()
    checkpoint.save_stage(state, tmp_path / "run")
    out = tmp_path / "tt" / "step-1"
    assert (
        main(
            ["convert", str(tmp_path / "run"), "--to", "torchtitan", "--out", str(out)]
        )
        == 0
    )
    sd = plain_read(out)
    for fqn, value in state.module.state_dict().items():
        assert torch.equal(sd.pop(fqn), value), fqn
    optim = get_optimizer_state_dict(state.module, state.optimizer, options=OPTIONS)
    for key, value in optim.items():
        saved = sd.pop(f"optimizer.{key}")
        if isinstance(value, torch.Tensor):
            assert saved.dtype == value.dtype and torch.equal(saved, value), key
        else:
            assert saved == value, key
    lr = {
        k.removeprefix("lr_scheduler."): sd.pop(k)
        for k in list(sd)
        if k.startswith("lr_scheduler.")
    }
    assert lr["last_epoch"] == 1 and lr["base_lrs"] == [1e-3]
    assert (
        sorted(sd) == ["data.rng_state"]
        or sorted(sd) == ["train_state.step", "train_state.ntokens_seen"][:0]
        or not [k for k in sd if not k.startswith("train_state.")]
    )
    with pytest.raises(FileExistsError):
        checkpoint.convert_layout(tmp_path / "run" / "step-1", out, to="torchtitan")


def test_a_state_dict_hook_that_renames_keys_is_named():
    class FusedQKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wqkv = torch.nn.Linear(4, 12, bias=False)
            self._register_state_dict_hook(FusedQKV.split)

        @staticmethod
        def split(module, state_dict, prefix, local_metadata):
            fused = state_dict.pop(f"{prefix}wqkv.weight")
            for name, part in zip("qkv", fused.chunk(3), strict=True):
                state_dict[f"{prefix}w{name}.weight"] = part

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), FusedQKV())
    state = checkpoint.StageState(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"module '1' \(FusedQKV\) has the state_dict hook .*FusedQKV.split, which gives it the key 'wk.weight'",
    ):
        state.state_dict()


def test_hf_export_of_integer_and_bool_tensors_in_shards(tmp_path):
    model = tiny_gpt(n_layers=1, dim=16, max_seq_len=8)
    model.register_buffer("counts", torch.arange(-3, 5, dtype=torch.int64) * 2**40)
    model.register_buffer("mask", torch.tensor([True, False, True]))
    model.register_buffer("small", torch.tensor([7, -8], dtype=torch.int8))
    checkpoint.save_stage(
        {"model": model.state_dict(), "step": 1}, tmp_path / "run", step=1
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt", "n_layers": 1}))
    out = tmp_path / "hf"
    argv = [
        "export",
        str(tmp_path / "run"),
        "--hf-config",
        str(config),
        "--out",
        str(out),
    ]
    assert main([*argv, "--max-shard-size", "20KB", "--dtype", "bfloat16"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert (
        len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    )
    loaded = {}
    for shard in shards:
        loaded.update(load_file(out / shard))
    assert sorted(loaded) == sorted(index["weight_map"]) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            value = value.to(torch.bfloat16)  # --dtype converts floats only
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert json.loads((out / "config.json").read_text()) == {
        "model_type": "gpt",
        "n_layers": 1,
    }
    assert main(argv) == 2  # exists: never replaced without --force
