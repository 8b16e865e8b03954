"""Checkpoints for other tools: torchtitan's layout both ways, Hugging Face
export with integer and bool tensors, and models whose hooks rename keys."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.checks import named_leaves
from pippy.checkpoint.keys import from_torchtitan, pippy_name, to_torchtitan
from pippy.checkpoint.state import OPTIONS
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
        offline.read_checkpoint(step, prefix="model.")
    model_sd = offline.read_checkpoint(step, prefix="model.", verify=False)
    assert offline.diff_state_dicts(model_sd, state.module.state_dict()) == []
    fresh = fresh_state()
    assert offline.load_model(step, fresh.module, fresh.optimizer, verify=False) == 1
    expected = {k: v for k, v in state.state_dict().items() if k in ("model", "optim")}
    got = {k: v for k, v in fresh.state_dict().items() if k in ("model", "optim")}
    assert offline.diff_state_dicts(got, expected) == []
    assert main(["inspect", str(step)]) == 0
    assert "(torchtitan layout)" in capsys.readouterr().out
    out = str(tmp_path / "m.safetensors")
    assert main(["export", str(step), "--out", out]) == 2  # names the opt-out
    assert "pass --allow-no-manifest" in capsys.readouterr().err
    assert main(["export", str(step), "--allow-no-manifest", "--out", out]) == 0
    exported = load_file(tmp_path / "m.safetensors")
    assert offline.diff_state_dicts(exported, state.module.state_dict()) == []
    # torchtitan -> pippy: a resume with load_stage, every entry bitwise.
    assert (
        main(
            [
                "convert",
                str(step),
                "--allow-no-manifest",
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
    assert offline.diff_state_dicts(fresh.state_dict(), state.state_dict()) == []


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
    # torchtitan's train_state, and the param groups' positions it has no place for.
    assert sorted(sd) == [
        "train_state.ntokens_seen",
        "train_state.pippy_param_groups",
        "train_state.step",
    ]
    assert (sd["train_state.step"], sd["train_state.ntokens_seen"]) == (1, 0)
    with pytest.raises(FileExistsError):
        offline.convert_layout(tmp_path / "run" / "step-1", out, to="torchtitan")


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


class Sampler:
    """A data sampler's state: its generator's, as the example's."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def state_dict(self):
        return {"rng_state": self.generator.get_state()}

    def load_state_dict(self, state_dict):
        self.generator.set_state(state_dict["rng_state"])


def sampled_state(extra=True):
    """trained_state() with a data sampler under "data" (or none)."""
    state = trained_state()
    state.extra = {"data": Sampler()} if extra else {}
    return state


def refusal(state, step, **kwargs):
    """The CheckpointError text load_stage raises, without its rank prefix."""
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_stage(state, step, **kwargs)
    return str(e.value).split("rank 0: CheckpointError: ", 1)[1]


def test_extra_state_goes_into_torchtitans_dataloader_section_and_back(tmp_path):
    flat = dict(named_leaves(sampled_state().state_dict()))
    titan = to_torchtitan(flat, param_groups=True)
    assert "dataloader.data.rng_state" in titan and "data.rng_state" not in titan
    assert titan["train_state.pippy_param_groups"][0] == ["tok_embeddings.weight", 0]
    back = from_torchtitan(titan)
    assert sorted(back) == sorted(flat)
    assert back["optim.scalars.norm.weight"] == flat["optim.scalars.norm.weight"]
    # torchtitan's own data loader state is flat: it reads as itself.
    assert pippy_name("dataloader.dp_rank_0") == "dataloader.dp_rank_0"
    assert to_torchtitan({"dataloader.world_size": 2}) == {"dataloader.world_size": 2}
    with pytest.raises(ValueError, match=r"^'seed' has no place in torchtitan's"):
        to_torchtitan({"seed": 3})
    # A stage loads its sampler's state from the converted step, too.
    saved = sampled_state()
    checkpoint.save_stage(saved, tmp_path / "run")
    titan = tmp_path / "titan" / "step-1"
    offline.convert_layout(tmp_path / "run" / "step-1", titan, to="torchtitan")
    fresh = fresh_state()
    fresh.extra = {"data": Sampler()}
    fresh.extra["data"].generator.manual_seed(7)
    must_read = ("model.", "optim.", "lr_scheduler.", "step", "data.")
    checkpoint.load_stage(fresh, titan, must_read=must_read)
    assert offline.diff_state_dicts(fresh.state_dict(), saved.state_dict()) == []


def test_state_that_is_not_the_models_is_named_when_it_does_not_load(tmp_path):
    # The data sampler's state under model., as convert --to pippy wrote it
    # from torchtitan's layout before it had a section there.
    old = sampled_state().state_dict()
    old["model"]["data.rng_state"] = old.pop("data")["rng_state"]
    checkpoint.save_stage(old, tmp_path / "old", step=1)
    assert refusal(sampled_state(), tmp_path / "old" / "step-1") == (
        "this run's state has a 'data' section that the checkpoint lacks (it "
        "holds 'model.data.rng_state' instead): load a step saved with the same "
        "state, or build this run's state without it (1 problem(s): "
        "'data.rng_state' is not in the checkpoint)"
    )
    assert refusal(sampled_state(extra=False), tmp_path / "old" / "step-1") == (
        "1 key(s) of the checkpoint are read by no rank and would be dropped "
        "('model.data.rng_state'): this model has no module 'data' (its modules: "
        "layers, norm, output, tok_embeddings), so those keys are another model's "
        "or other state saved under 'model.': load into the model that saved "
        "them, or remap those keys before loading"
    )
    checkpoint.save_stage(sampled_state(), tmp_path / "new")
    assert refusal(sampled_state(extra=False), tmp_path / "new" / "step-1") == (
        "1 key(s) of the checkpoint are read by no rank and would be dropped "
        "('data.rng_state'): this run's state lacks a 'data' section: to restore "
        "it, add a Stateful of that name to the StageState's extra; to leave it "
        "unread, load with must_read=('model.', 'optim.', 'lr_scheduler.', 'step')"
    )
    # torchtitan's own sections, which a pippy run's state has no place for.
    save_torchtitan(trained_state(), tmp_path / "titan" / "step-1")
    assert refusal(fresh_state(), tmp_path / "titan" / "step-1", verify=False) == (
        "2 key(s) of the checkpoint are read by no rank and would be dropped "
        "('dataloader.world_size', 'train_state.ntokens_seen'): this run's state "
        "lacks 'dataloader' and 'train_state' sections: to restore them, add a "
        "Stateful of each name to the StageState's extra; to leave them unread, "
        "load with must_read=('model.', 'optim.', 'lr_scheduler.', 'step')"
    )


def test_load_model_reads_torchtitans_optimizer_state_without_a_scheduler(tmp_path):
    state = trained_state()  # its optimizer has an LR scheduler: initial_lr
    save_torchtitan(state, tmp_path / "step-1")
    model = tiny_gpt(n_layers=2, dim=16, max_seq_len=8, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no scheduler
    step = offline.load_model(tmp_path / "step-1", model, optimizer, verify=False)
    assert step == 1
    assert offline.diff_state_dicts(model.state_dict(), state.module.state_dict()) == []
    ours = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
    theirs = get_optimizer_state_dict(state.module, state.optimizer, options=OPTIONS)
    assert (
        offline.diff_state_dicts(
            {k: v for k, v in ours.items() if k.startswith("state.")},
            {k: v for k, v in theirs.items() if k.startswith("state.")},
        )
        == []
    )
    assert all("initial_lr" not in group for group in optimizer.param_groups)
