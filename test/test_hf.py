"""Models nobody here wrote: tiny Hugging Face Llama and GPT-2, split with
pippy.build_stage_module, trained on real ranks, resumed, reshaped, exported."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pippy
from pippy import checkpoint
from pippy.checkpoint import offline

from helpers import (
    ROOT,
    hf_config,
    hf_model_class,
    hf_stage,
)

transformers = pytest.importorskip("transformers")
MODELS = ("llama", "gpt2")


@pytest.fixture(scope="module")
def hf_run(two_rank_checks):
    """Both models trained on 2 ranks: step-3 and step-6 of each, and results
    (the hf check, in a launch shared with other modules' checks: conftest.py)."""
    out = two_rank_checks["dist_checks"]
    ranks = [json.loads((out / f"hf-rank{r}.json").read_text()) for r in range(2)]
    return out, ranks


def plain_dcp_model(step):
    """The checkpoint's model keys, read with plain DCP (no pippy)."""
    metadata = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.")
    }
    dcp.load(sd, checkpoint_id=step, no_dist=True)
    return {k.removeprefix("model."): v for k, v in sd.items()}


@pytest.mark.parametrize("name", MODELS)
def test_hf_stages_keep_keys_and_resume_bitwise(hf_run, name):
    _, ranks = hf_run
    keys = [set(r[name]["keys"]) for r in ranks]
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == set(hf_model_class(name)(hf_config(name)).state_dict())
    for r in ranks:
        r = r[name]
        assert any(k.startswith("model.") for k in r["differ_before_load"])
        assert r["differ_after_load"] == [] and r["differ_final"] == []
        assert r["losses_a"] == r["losses_b"]
    assert all(x is not None for x in ranks[1][name]["losses_a"])


@pytest.mark.launches
@pytest.mark.parametrize("name", MODELS)
def test_hf_two_stages_into_one_and_into_from_pretrained(hf_run, tmp_path, name):
    out, _ = hf_run
    step = out / name / "step-6"
    # 2 -> 1 stage: model and AdamW state, every key read.
    one = hf_stage(name, 0, 1, seed=1)
    state = checkpoint.StageState(one, torch.optim.AdamW(one.parameters()))
    checkpoint.load_stage(state, step)
    assert state.step == 6
    expected = plain_dcp_model(step)
    assert offline.diff_state_dicts(one.state_dict(), expected) == []
    # Into the plain HF model, and through an export into from_pretrained.
    plain = hf_model_class(name)(hf_config(name))
    assert offline.load_model(step, plain) == 6
    config = tmp_path / "config.json"
    hf_config(name).to_json_file(config)
    export = tmp_path / "export"
    cmd = [
        sys.executable,
        "-m",
        "pippy",
        "export",
        str(step),
        "--hf-config",
        str(config),
        "--out",
        str(export),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in export.iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    loaded = hf_model_class(name).from_pretrained(export, local_files_only=True)
    tokens = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = [
            one.eval()(tokens),
            plain.eval()(tokens).logits,
            loaded.eval()(tokens).logits,
        ]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], logits[2])


def test_meta_build_keeps_non_persistent_buffers():
    # Built under meta_init and allocated: inv_freq as the CPU-built model has it.
    stage = hf_stage("llama", 1, 2)
    cpu = hf_model_class("llama")(hf_config("llama"))
    for fqn in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        assert torch.equal(stage.get_buffer(fqn), cpu.get_buffer(fqn)), fqn
    assert "model.rotary_emb.inv_freq" not in stage.state_dict()  # no checkpoint has it
    # Built on meta by hand: to_empty would leave it garbage, so it is refused.
    with torch.device("meta"):
        model = hf_model_class("llama")(hf_config("llama"))
    with pytest.raises(pippy.StageBuildError, match="'model.rotary_emb.inv_freq'"):
        pippy.materialize(model, "cpu")


def test_split_model_keeps_module_list_indices_and_refuses_bad_containers():
    model = pippy.split_model(
        hf_model_class("llama")(hf_config("llama")),
        1,
        3,
        **{
            "layers": "model.layers",
            "first": ["model.embed_tokens"],
            "last": ["lm_head"],
        },
    )
    assert [type(m).__name__ for m in model.model.layers] == [
        "PassThrough",
        "PassThrough",
        "LlamaDecoderLayer",
        "PassThrough",
    ]
    assert {
        k.split(".")[2] for k in model.state_dict() if k.startswith("model.layers.")
    } == {"2"}
    assert "lm_head.weight" not in model.state_dict()
    with pytest.raises(pippy.StageBuildError, match="not an nn.ModuleList"):
        pippy.split_model(model, 0, 2, layers="model.norm")
    with pytest.raises(pippy.StageBuildError, match="cannot split 4 layers into 5"):
        pippy.layer_range(0, 5, 4)


def test_load_model_refuses_tied_keys_that_differ(tmp_path):
    config = hf_config("llama")
    untied = hf_model_class("llama")(config)
    config.tie_word_embeddings = True
    checkpoint.save_stage({"model": untied.state_dict(), "step": 1}, tmp_path, step=1)
    tied = hf_model_class("llama")(config)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"'model.embed_tokens.weight', 'lm_head.weight' are one tied parameter.*tie_word_embeddings=False",
    ):
        offline.load_model(tmp_path / "step-1", tied)
    # Equal values load, silently.
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.model.embed_tokens.weight)
    checkpoint.save_stage({"model": untied.state_dict(), "step": 2}, tmp_path, step=2)
    assert offline.load_model(tmp_path / "step-2", tied) == 2
    assert torch.equal(tied.lm_head.weight, untied.lm_head.weight)
