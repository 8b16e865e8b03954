"""Stages started from a Hugging Face folder that `save_pretrained` wrote in
several shards: every rank loads only its stage's tensors, bitwise those of
`from_pretrained`; a folder that does not fit is refused in one line."""

import os

import pytest
import torch
from ranks import run_ranks

import pippy
from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.hf import StageReader, load_hf_stage

from helpers import HF_SPLIT, TINY_DECODER, hf_config, hf_model_class, hf_stage

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved in shards of at most 20 KB, with their index, and
    its weights as `from_pretrained` reads them."""
    folder = tmp_path_factory.mktemp("llama-hf")
    torch.manual_seed(0)
    model = hf_model_class("llama")(hf_config("llama"))
    model.save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 4 and (folder / "model.safetensors.index.json").is_file()
    loaded = hf_model_class("llama").from_pretrained(folder)
    return folder, {k: v.clone() for k, v in loaded.state_dict().items()}


def stage_of(config, cls, stage=0, stages=1):
    """Stage `stage` of `stages` of a tiny transformers model, allocated."""
    return pippy.build_stage_module(
        lambda: cls(config), stage, stages, device="cpu", **HF_SPLIT["llama"]
    )


def stages_on_rank(rank, world_size, folder, stages_per_rank):
    """This rank's stages (r, r + world_size, ...), loaded from the folder."""
    num_stages = world_size * stages_per_rank
    modules = [
        hf_stage("llama", s, num_stages, seed=1)
        for s in range(rank, num_stages, world_size)
    ]
    count = load_hf_stage(modules, folder)
    return count, {k: v for m in modules for k, v in m.state_dict().items()}


@pytest.mark.parametrize("ranks, stages_per_rank", [(2, 1), (2, 2), (4, 1)])
def test_stages_load_their_own_tensors_bitwise(pretrained, ranks, stages_per_rank):
    folder, whole = pretrained
    results = run_ranks(ranks, stages_on_rank, folder, stages_per_rank)
    seen = set()
    for count, weights in results:
        assert count == len(weights) and weights
        for key, value in weights.items():
            assert torch.equal(value, whole[key]), key
        assert seen.isdisjoint(weights)  # each stage's own keys
        seen |= set(weights)
    assert seen == set(whole)  # together, the whole model


def qwen3():
    """A tiny Qwen3 (QK-norm, explicit head_dim): its config and class."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**TINY_DECODER, head_dim=8)
    return config, Qwen3ForCausalLM


def qwen3_stage_on_rank(rank, world_size, folder):

    config, cls = qwen3()
    module = stage_of(config, cls, rank, world_size)
    load_hf_stage(module, folder)
    return module.state_dict()


def test_qwen3_stages_load_bitwise(tmp_path):
    config, cls = qwen3()
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path, max_shard_size="20KB")
    whole = cls.from_pretrained(tmp_path).state_dict()
    seen = set()
    for weights in run_ranks(2, qwen3_stage_on_rank, tmp_path):
        for key, value in weights.items():
            assert torch.equal(value, whole[key]), key
        seen |= set(weights)
    assert seen == set(whole)


def test_a_stage_state_loads_its_modules_weights(pretrained):
    folder, whole = pretrained
    module = hf_stage("llama", 0, 1, seed=1)
    optimizer = torch.optim.AdamW(module.parameters())
    state = checkpoint.StageState(module, optimizer)
    assert load_hf_stage(state, folder) == len(whole)
    for key, value in module.state_dict().items():
        assert torch.equal(value, whole[key]), key
    assert state.step == 0 and not optimizer.state  # weights only


def copied(folder, to):
    """A copy of the folder, and its shards' names in order."""
    to.mkdir()
    for p in folder.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to, sorted(p.name for p in to.glob("*.safetensors"))


def test_a_missing_shard_is_named(pretrained, tmp_path):
    folder, shards = copied(pretrained[0], tmp_path / "hf")
    (folder / shards[1]).unlink()
    module = hf_stage("llama", 0, 1)
    with pytest.raises(checkpoint.CheckpointError, match=f"lacks '{shards[1]}'"):
        load_hf_stage(module, folder)


def test_a_tensor_missing_from_every_shard_is_named(pretrained, tmp_path):
    folder, shards = copied(pretrained[0], tmp_path / "hf")
    (folder / "model.safetensors.index.json").unlink()
    (folder / shards[1]).unlink()
    module = hf_stage("llama", 0, 1)
    with pytest.raises(checkpoint.CheckpointError, match="is not in the checkpoint"):
        load_hf_stage(module, folder)


def test_another_dtype_is_refused(pretrained, tmp_path):
    model = hf_model_class("llama").from_pretrained(pretrained[0])
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    module = hf_stage("llama", 0, 1)
    with pytest.raises(
        checkpoint.CheckpointError, match="in the checkpoint.s dtype .torch.bfloat16"
    ):
        load_hf_stage(module, tmp_path / "bf16")


def test_another_shape_is_refused(pretrained, tmp_path):
    config = hf_config("llama")
    config.intermediate_size = 48
    hf_model_class("llama")(config).save_pretrained(tmp_path / "other")
    module = hf_stage("llama", 0, 1)
    with pytest.raises(checkpoint.CheckpointError, match="has shape"):
        load_hf_stage(module, tmp_path / "other")


def test_a_shard_linked_from_outside_the_folder_is_refused(pretrained, tmp_path):
    folder, shards = copied(pretrained[0], tmp_path / "hf")
    shard = folder / shards[2]
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    os.symlink(outside, shard)
    module = hf_stage("llama", 0, 1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="outside the folder"):
        load_hf_stage(module, folder)
    for key, value in module.state_dict().items():  # nothing read
        assert torch.equal(value, before[key])


def test_a_path_that_is_no_folder_is_refused(tmp_path):
    module = hf_stage("llama", 0, 1)
    with pytest.raises(checkpoint.CheckpointNotFoundError, match="no Hugging Face"):
        load_hf_stage(module, tmp_path / "nowhere")


def fsdp_stage_on_rank(rank, world_size, folder, fsdp=True):
    """A (dp 2, pp 2) mesh: this rank's stage, FSDP2-sharded over dp (or a
    whole replica), loaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    module = hf_stage("llama", mesh.get_local_rank("pp"), 2, seed=1)
    if not fsdp:  # a replica reads its whole stage
        load_hf_stage(module, folder)
        weights = {k: v.clone() for k, v in module.state_dict().items()}
        return weights, weights, weights
    fully_shard(module, mesh=mesh["dp"])
    shards = {k: v.to_local().clone() for k, v in module.state_dict().items()}
    load_hf_stage(module, folder)
    loaded = module.state_dict()
    local = {k: v.to_local() for k, v in loaded.items()}
    return {k: v.full_tensor() for k, v in loaded.items()}, shards, local


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicas"])
def test_stages_over_dp_load_bitwise(pretrained, fsdp):
    """2 stages x 2 data-parallel ranks: FSDP2 shards read their rows,
    replicas their whole stage."""
    folder, whole = pretrained
    seen = set()
    for weights, before, local in run_ranks(4, fsdp_stage_on_rank, folder, fsdp):
        for key, value in weights.items():
            assert torch.equal(value, whole[key]), key
            assert local[key].shape == before[key].shape  # still its shard
        seen |= set(weights)
    assert seen == set(whole)


def columns_on_rank(rank, world_size, folder):
    """Tensor-parallel columns (Shard(1)) of one weight: rows read, then cut."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    key = "model.layers.1.mlp.up_proj.weight"
    empty = torch.zeros(hf_config("llama").intermediate_size, 32)
    loaded = {key: distribute_tensor(empty, mesh, [Shard(1)])}
    dcp.load(
        loaded,
        storage_reader=StageReader(str(folder)),
        planner=checkpoint.SafeLoadPlanner(must_read=()),
    )
    return key, loaded[key].to_local().clone(), loaded[key].full_tensor()


def test_column_shards_read_their_columns(pretrained):
    folder, whole = pretrained
    for rank, (key, local, full) in enumerate(run_ranks(2, columns_on_rank, folder)):
        assert torch.equal(full, whole[key])
        assert torch.equal(local, whole[key][:, rank * 16 : (rank + 1) * 16])


def read_bytes():
    """Bytes this process has had read from the disk (page-cache misses)."""
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def test_each_stage_reads_its_own_bytes_from_the_disk(tmp_path):
    """4 stages of an 8-layer Llama (34 MB, in 4 shards or more), each loaded
    with the shards out of the page cache: the disk reads are the stage's
    tensors, within 10%, not the model (the kernel reads 8 MB ahead here)."""

    config = hf_config("llama")
    config.update(dict(vocab_size=1024, hidden_size=256, intermediate_size=1024))
    config.num_hidden_layers = 8
    cls = hf_model_class("llama")
    torch.manual_seed(0)
    model = cls(config)
    total = sum(t.nbytes for t in model.state_dict().values())
    model.save_pretrained(tmp_path, max_shard_size=total // 4 + 1)
    shards = list(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 4
    for stage in range(4):
        module = stage_of(config, cls, stage, 4)
        own = sum(t.nbytes for t in module.state_dict().values())
        for shard in shards:  # out of the page cache: each read is the disk's
            fd = os.open(shard, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        before = read_bytes()
        load_hf_stage(module, tmp_path)
        read = read_bytes() - before
        assert own <= read <= 1.1 * own, (stage, own, read, total)
        for key, value in module.state_dict().items():
            assert torch.equal(value, model.state_dict()[key]), key


def moe(name):
    """A tiny Mixtral or Qwen3-MoE of 4 experts: its config and class."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if name == "mixtral":
        return MixtralConfig(**TINY_DECODER, num_local_experts=4), MixtralForCausalLM
    config = Qwen3MoeConfig(
        **TINY_DECODER,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        head_dim=8,
    )
    return config, Qwen3MoeForCausalLM


def moe_stage_on_rank(rank, world_size, name, folder, fsdp):
    """This rank's stage of a MoE model, loaded; with `fsdp`, on a (dp 2, pp 2)
    mesh, each stage's experts sharded over dp (FSDP2, dim 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    config, cls = moe(name)
    stage, stages, mesh = rank, world_size, None
    if fsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        stage, stages = mesh.get_local_rank("pp"), 2
    module = stage_of(config, cls, stage, stages)
    if fsdp:
        fully_shard(module, mesh=mesh["dp"])
    load_hf_stage(module, folder)
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v
        for k, v in module.state_dict().items()
    }


@pytest.mark.parametrize(
    "ranks, fsdp", [(2, False), (4, False), (4, True)], ids=["pp2", "pp4", "dp2xpp2"]
)
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_experts_stored_one_by_one_load_into_the_fused_tensors_bitwise(
    tmp_path, name, ranks, fsdp
):
    """transformers stores a MoE model's experts one by one (Mixtral names its
    MoE block block_sparse_moe, its experts w1, w3, w2) and fuses them when it
    loads; each stage reads them straight into its fused tensors (an FSDP2
    shard: its own experts), bitwise from_pretrained's."""
    from safetensors import safe_open

    config, cls = moe(name)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path, max_shard_size="20KB")
    stored = set()
    for shard in tmp_path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            stored |= set(f.keys())
    assert (tmp_path / "model.safetensors.index.json").is_file()  # several shards
    assert any(".experts.3." in k for k in stored)
    assert not any(k.endswith("gate_up_proj") for k in stored)
    whole = cls.from_pretrained(tmp_path).state_dict()
    assert any(k.endswith(".experts.gate_up_proj") for k in whole)
    seen = set()
    for weights in run_ranks(ranks, moe_stage_on_rank, name, tmp_path, fsdp):
        for key, value in weights.items():
            assert torch.equal(value, whole[key]), key
        seen |= set(weights)
    assert seen == set(whole)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_trained_moe_stage_exports_as_save_pretrained_stores_it(tmp_path, name):
    """A MoE stage, trained one step, saved and exported: the export names its
    tensors as save_pretrained does (the experts one by one), and
    from_pretrained of it, and a stage loaded from it, hold its weights
    bitwise."""
    from safetensors import safe_open

    config, cls = moe(name)
    torch.manual_seed(0)
    module = stage_of(config, cls)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.02)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.arange(8).view(1, 8)).logits.sum().backward()
    optimizer.step()
    state = checkpoint.StageState(module, optimizer)
    state.step = 1
    checkpoint.save_stage(state, tmp_path / "run")
    hf = tmp_path / "hf"
    files = offline.export_hf(
        tmp_path / "run" / "step-1", hf, config=config, max_shard_size=20_000
    )
    assert sorted(p.name for p in files) == sorted(p.name for p in hf.iterdir())
    assert (hf / "model.safetensors.index.json").is_file()
    module.save_pretrained(tmp_path / "theirs")
    names = {}
    for folder in (hf, tmp_path / "theirs"):
        names[folder] = set()
        for shard in folder.glob("*.safetensors"):
            with safe_open(shard, "pt") as f:
                names[folder] |= set(f.keys())
    assert names[hf] == names[tmp_path / "theirs"]
    trained = module.state_dict()
    exported = cls.from_pretrained(hf).state_dict()
    fresh = stage_of(config, cls)
    load_hf_stage(fresh, hf)
    for key, value in trained.items():
        assert torch.equal(exported[key], value), key
        assert torch.equal(fresh.state_dict()[key], value), key


def test_experts_are_split_only_for_model_types_whose_names_are_known():
    """save_pretrained's names for a model type's experts are known for
    Mixtral's and Qwen2-MoE's families; any other keeps its fused tensors
    (from_pretrained reads them as they are), never names it would not read."""
    from pippy.checkpoint.hf import experts_one_by_one

    fused = torch.arange(2 * 4 * 3.0).view(2, 4, 3)  # 2 experts, 2 x 2 rows each
    weights = {
        "model.layers.0.mlp.experts.gate_up_proj": fused,
        "model.layers.0.mlp.gate.weight": torch.ones(2, 3),
    }
    for unknown in ("gpt_oss", "phimoe", None):
        assert experts_one_by_one(weights, unknown) == weights
    minimax = experts_one_by_one(weights, "minimax")
    assert sorted(minimax) == [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w3.weight",
        "model.layers.0.block_sparse_moe.experts.1.w1.weight",
        "model.layers.0.block_sparse_moe.experts.1.w3.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
    ]
    up = minimax["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    assert torch.equal(up, fused[1, 2:])
    olmoe = experts_one_by_one(weights, "olmoe")
    assert torch.equal(
        olmoe["model.layers.0.mlp.experts.0.gate_proj.weight"], fused[0, :2]
    )


def experts_split_by_rows_on_rank(rank, world_size, folder):
    """The experts' weights split along dim 1 (rows of each expert), loaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    config, cls = moe("qwen3_moe")
    module = stage_of(config, cls)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in module.model.layers:
        experts = layer.mlp.experts
        for name, param in list(experts.named_parameters()):
            split = distribute_tensor(param.detach(), mesh, [Shard(1)])
            setattr(experts, name, torch.nn.Parameter(split))
    try:
        load_hf_stage(module, folder)
    except checkpoint.CheckpointError as e:
        return str(e)


def test_experts_split_along_another_dim_are_refused(tmp_path):
    config, cls = moe("qwen3_moe")
    cls(config).save_pretrained(tmp_path)
    for error in run_ranks(2, experts_split_by_rows_on_rank, tmp_path):
        assert error.startswith(
            "'model.layers.0.mlp.experts.gate_up_proj' is split along another "
            "dim than its experts ((Shard(dim=1),)), and the folder stores each "
            "expert whole: shard the experts along dim 0 only (FSDP2's default)"
        ), error


@pytest.mark.parametrize("expert", [0, 3])
def test_a_missing_expert_is_named(tmp_path, expert):
    from safetensors.torch import load_file, save_file

    config, cls = moe("qwen3_moe")
    cls(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"
    del tensors[key]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    module = stage_of(config, cls)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        load_hf_stage(module, tmp_path)
    assert f"{key!r} is not in the checkpoint" in str(raised.value)
    assert "gate_up_proj" not in str(raised.value)


def test_a_folder_of_another_model_type_is_refused(tmp_path):
    config, cls = moe("qwen3_moe")
    cls(config).save_pretrained(tmp_path)
    config, cls = moe("mixtral")
    module = stage_of(config, cls)
    with pytest.raises(checkpoint.CheckpointError) as raised:
        load_hf_stage(module, tmp_path)
    assert (
        f"{str(tmp_path)!r} holds a qwen3_moe model (its config.json), and this "
        "stage is mixtral: pass the folder of a mixtral model"
    ) in str(raised.value)


def mixtral_stage_from_on_rank(rank, world_size, folder):
    """A Mixtral stage loaded from `folder`: the error, one line."""
    config, cls = moe("mixtral")
    module = stage_of(config, cls, rank, world_size)
    try:
        load_hf_stage(module, folder)
    except checkpoint.CheckpointError as e:
        return str(e)


def test_a_failure_alike_on_every_rank_is_one_line(tmp_path):
    config, cls = moe("qwen3_moe")
    cls(config).save_pretrained(tmp_path)
    for error in run_ranks(2, mixtral_stage_from_on_rank, tmp_path):
        assert error == (
            f"loading {tmp_path} failed on ranks 0, 1: CheckpointError: "
            f"{str(tmp_path)!r} holds a qwen3_moe model (its config.json), and "
            "this stage is mixtral: pass the folder of a mixtral model"
        )


def test_shards_the_index_does_not_name_are_ignored_and_a_key_in_two_is_refused(
    pretrained, tmp_path
):
    """A shard left from an older save (an rsync without --delete) is not
    read where an index names the shards, as from_pretrained does; without an
    index, a key in two files is refused naming both."""
    from safetensors.torch import save_file

    folder, whole = pretrained
    stale = {k: v + 1 for k, v in whole.items() if k.startswith("model.layers.0.")}
    leftover, _ = copied(folder, tmp_path / "leftover")
    save_file(stale, leftover / "model-00001-of-00099.safetensors")
    module = hf_stage("llama", 0, 1)
    load_hf_stage(module, leftover)
    for key, value in module.state_dict().items():
        assert torch.equal(value, whole[key]), key
    single = tmp_path / "single"
    single.mkdir()
    save_file(whole, single / "model.safetensors")
    save_file(stale, single / "old.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="is in both") as raised:
        load_hf_stage(hf_stage("llama", 0, 1), single)
    assert "and old.safetensors: keep only the shards save_pretrained wrote" in str(
        raised.value
    )


PEAK_SCRIPT = """
import os, resource, sys
import pippy
from transformers import LlamaConfig, LlamaForCausalLM
from pippy.checkpoint import load_hf_stage

folder = sys.argv[1]
config = LlamaConfig.from_pretrained(folder)
module = pippy.build_stage_module(  # allocated, not yet touched
    lambda: LlamaForCausalLM(config), 0, 2, device="cpu", layers="model.layers",
    first=["model.embed_tokens"], last=["model.norm", "lm_head"],
)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
load_hf_stage(module, folder)
sizes = [t.nbytes for t in module.state_dict().values()]
print(peak() - before, sum(sizes), max(sizes))
"""


@pytest.mark.launches
def test_a_load_takes_the_stage_and_at_most_one_tensor_more(tmp_path):
    """In a process of its own, the peak RSS while stage 0 of 2 of an 80 MB
    Llama loads from 3 shards grows by the stage (its tensors, allocated but
    untouched, are written) and at most one tensor more. DCP's own reader
    maps the shards: 55 MB for a 40 MB stage whose largest tensor is 8 MB."""
    import subprocess
    import sys

    from helpers import ROOT

    config = hf_config("llama")
    config.update(dict(vocab_size=4096, hidden_size=512, intermediate_size=2048))
    config.update(dict(num_attention_heads=8, num_key_value_heads=4))
    hf_model_class("llama")(config).save_pretrained(tmp_path, max_shard_size="30MB")
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    grown, stage, largest = map(int, run.stdout.split())
    assert stage > 30e6 and grown <= stage + largest, (grown, stage, largest)
