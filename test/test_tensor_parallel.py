"""Tensor-parallel and other sharded DTensors, judged by their own placements.

DCP writes every shard of a DTensor (the chunk each rank holds) and reshards
on load; equal chunks on several ranks are replicas, written once. pippy's
key check decides from the same facts: different chunks of one key are
shards, never a collision; ranks that its placements replicate it over are
compared, and a replica that differs is refused. 2 ranks as threads over
real gloo (test/ranks.py), each read back with plain DCP.
"""

import torch
import torch.distributed as dist
from layout_checks import error_of
from ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pippy import checkpoint
from pippy.checkpoint.checks import diff_state_dicts

from helpers import plain_read


def tp_mlp(seed):
    """A two-layer MLP, column- then row-parallel over every rank."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(model, mesh, plan), mesh


def tp_round_trip(rank, world_size, folder):
    model, _ = tp_mlp(seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    state = checkpoint.StageState(model, optimizer, step=1)
    checkpoint.save_stage(state, folder)  # no mesh: the placements say it all
    fresh_model, _ = tp_mlp(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters())
    fresh_model(torch.ones(2, 8)).sum().backward()
    fresh_optimizer.step()
    fresh = checkpoint.StageState(fresh_model, fresh_optimizer, step=0)
    checkpoint.load_stage(fresh, folder / "step-1")
    differ = diff_state_dicts(state.state_dict(), fresh.state_dict())
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"differ": differ, "full": full, "step": fresh.step}


def test_tensor_parallel_layers_save_and_load_bitwise_without_a_mesh(tmp_path):
    ranks = run_ranks(2, tp_round_trip, tmp_path)
    for result in ranks:
        assert result["differ"] == [] and result["step"] == 1
    plain = plain_read(tmp_path / "step-1")  # the whole tensors, by plain DCP
    for key, tensor in ranks[0]["full"].items():
        assert torch.equal(plain[f"model.{key}"], tensor), key


def sharded_and_replicated(rank, world_size, folder):
    mesh = init_device_mesh("cpu", (world_size,))
    whole = torch.arange(16.0).reshape(4, 4)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    # Another section's DTensor, sharded: each rank writes its own rows.
    shard_error = error_of(
        lambda: checkpoint.save_stage({"dtensor": sharded}, folder / "a", step=1)
    )
    # Replicated by its placements, but one rank's copy differs: DCP would
    # write one of them.
    replicated = distribute_tensor(whole, mesh, [Replicate()])
    if rank == 1:
        replicated.to_local().add_(1)
    replica_error = error_of(
        lambda: checkpoint.save_stage({"dtensor": replicated}, folder / "b", step=1)
    )
    # Under the model section: a replica that differs is refused too.
    model = nn.Linear(4, 4, bias=False)
    model.weight = nn.Parameter(distribute_tensor(whole, mesh, [Replicate()]))
    if rank == 1:
        with torch.no_grad():
            model.weight.to_local().add_(1)
    model_error = error_of(
        lambda: checkpoint.save_stage(
            checkpoint.StageState(model, step=1), folder / "c"
        )
    )
    return {"shard": shard_error, "replica": replica_error, "model": model_error}


def test_shards_of_one_key_are_saved_and_diverged_replicas_refused(tmp_path):
    ranks = run_ranks(2, sharded_and_replicated, tmp_path)
    assert [r["shard"] for r in ranks] == [None, None]
    plain = plain_read(tmp_path / "a" / "step-1")
    assert torch.equal(plain["dtensor"], torch.arange(16.0).reshape(4, 4))
    for r in ranks:
        assert r["replica"].startswith("KeyCollisionError: 1 shared checkpoint entr")
        assert "'dtensor'" in r["replica"]
        assert r["model"].startswith("DivergedReplicasError: the data-parallel")
        assert "'model.weight'" in r["model"]
    assert not (tmp_path / "b" / "step-1").exists()
    assert not (tmp_path / "c" / "step-1").exists()


def sharded_tensor(rank, world_size, folder):
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(
        dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)]
    )
    st = empty(spec, 4, 4)
    st.local_shards()[0].tensor.copy_(torch.arange(8.0).reshape(2, 4) + 8 * rank)
    return error_of(lambda: checkpoint.save_stage({"st": st}, folder, step=1))


def test_a_sharded_tensors_local_shards_are_saved(tmp_path):
    """DCP's older sharded type: each rank's local shards are its chunks."""
    assert run_ranks(2, sharded_tensor, tmp_path) == [None, None]
    plain = plain_read(tmp_path / "step-1")
    assert torch.equal(plain["st"], torch.arange(16.0).reshape(4, 4))


def dcp_recipe(rank, world_size, folder):
    """{"model", "optimizer"} from get_state_dict, as DCP's recipe saves it:
    DDP replicas (one model, declared by the mesh), then two pipeline stages
    (each its own layer: their param_groups differ under one key)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def recipe(model):
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def linear():  # the same values on every rank (threads share torch's RNG)
        layer = nn.Linear(4, 4)
        with torch.no_grad():
            layer.weight.copy_(torch.arange(16.0).reshape(4, 4) / 16)
            layer.bias.fill_(0.5)
        return layer

    replicas = recipe(linear())
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "pp"))
    saved = error_of(
        lambda: checkpoint.save_stage(replicas, folder / "ddp", step=1, mesh=mesh)
    )
    stage = nn.Sequential()
    stage.add_module(f"layer{rank}", linear())
    refused = error_of(
        lambda: checkpoint.save_stage(recipe(stage), folder / "pp", step=1)
    )
    return {"saved": saved, "refused": refused, "weight": replicas["model"]["weight"]}


def test_the_dcp_recipes_model_and_optimizer_sections(tmp_path):
    ranks = run_ranks(2, dcp_recipe, tmp_path)
    assert [r["saved"] for r in ranks] == [None, None]
    plain = plain_read(tmp_path / "ddp" / "step-1")
    assert torch.equal(plain["model.weight"], ranks[0]["weight"])
    assert "optimizer.state.weight.exp_avg" in plain
    # Two stages' param_groups under one key: DCP would keep one rank's.
    for r in ranks:
        assert r["refused"].startswith("KeyCollisionError: ")
        assert "'optimizer.param_groups" in r["refused"]
    assert not (tmp_path / "pp" / "step-1").exists()


def dcp_recipe_round_trip(rank, world_size, folder):
    """{"model", "optimizer"} from get_state_dict, nested and with flattened
    optimizer keys (as torchtitan's), saved by DDP replicas and loaded by name
    into another run's: each key where DCP would put it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
    )

    def recipe(seed, flatten):  # threads share torch's RNG: values set
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.copy_(torch.arange(16.0).reshape(4, 4) / 16 + seed)
            model.bias.fill_(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        return {"model": model_sd, "optimizer": optim_sd}

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "pp"))
    differ = {}
    for flatten in (False, True):
        saved = recipe(0, flatten)  # alike on each rank: replicas
        step = checkpoint.save_stage(saved, folder / str(flatten), step=1, mesh=mesh)
        loaded = recipe(1, flatten)
        checkpoint.load_stage(loaded, step)
        differ[flatten] = diff_state_dicts(loaded, saved)
    return differ


def test_the_dcp_recipes_layouts_load_back_by_name(tmp_path):
    for differ in run_ranks(2, dcp_recipe_round_trip, tmp_path):
        assert differ == {False: [], True: []}


def two_d_and_submeshes(rank, world_size, folder):
    """4 ranks: a 2-D mesh (dp, tp) and its tp submeshes, no mesh= given."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    whole = torch.arange(32.0).reshape(8, 4)
    # Replicated over dp, sharded over tp: each chunk on two ranks, compared.
    hsdp = distribute_tensor(whole, mesh, [Replicate(), Shard(0)])
    saved = error_of(lambda: checkpoint.save_stage({"w": hsdp}, folder / "2d", step=1))
    # Loaded into another layout of the same mesh: DCP reshards, bitwise.
    other = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0), Shard(1)])
    loaded = {"w": other}
    checkpoint.load_stage(loaded, folder / "2d" / "step-1")
    full = loaded["w"].full_tensor()
    # A dp replica that differs is refused, by the placements alone.
    diverged = distribute_tensor(whole, mesh, [Replicate(), Shard(0)])
    if tuple(mesh.get_coordinate()) == (1, 0):
        diverged.to_local().add_(1)
    refused = error_of(
        lambda: checkpoint.save_stage({"w": diverged}, folder / "diverged", step=1)
    )
    # Pipeline x tensor parallel: each stage (a dp row, here pp) its own
    # layer, sharded over its tp submesh.
    stage = mesh.get_coordinate()[0]
    layer = distribute_tensor(whole + stage, mesh["tp"], [Shard(1)])
    pp_tp = error_of(
        lambda: checkpoint.save_stage({f"layer{stage}": layer}, folder / "pp", step=1)
    )
    return {"saved": saved, "full": full, "refused": refused, "pp_tp": pp_tp}


def test_a_2d_mesh_and_submeshes_save_reshard_and_refuse_by_placements(tmp_path):
    ranks = run_ranks(4, two_d_and_submeshes, tmp_path)
    whole = torch.arange(32.0).reshape(8, 4)
    assert [r["saved"] for r in ranks] == [None] * 4
    assert torch.equal(plain_read(tmp_path / "2d" / "step-1")["w"], whole)
    for r in ranks:
        assert torch.equal(r["full"], whole)
        assert r["refused"].startswith("KeyCollisionError: 1 shared checkpoint entr")
        assert r["pp_tp"] is None
    assert not (tmp_path / "diverged" / "step-1").exists()
    plain = plain_read(tmp_path / "pp" / "step-1")
    assert torch.equal(plain["layer0"], whole) and torch.equal(
        plain["layer1"], whole + 1
    )


class AppState:
    """DCP's tutorial's Stateful: the model's and optimizer's state under one
    top-level key (``{"app": AppState(model, optimizer)}``)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def nested_stateful(rank, world_size, folder):
    """DDP replicas save {"app": AppState}; another run's loads it back."""

    def build(value):  # alike on each rank: replicas
        model = nn.Linear(4, 4)
        with torch.no_grad():
            model.weight.fill_(value)
            model.bias.fill_(value)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        return model, optimizer

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "pp"))
    model, optimizer = build(1.0)
    step = checkpoint.save_stage(
        {"app": AppState(model, optimizer)}, folder, step=1, mesh=mesh
    )
    other, other_optimizer = build(2.0)
    checkpoint.load_stage({"app": AppState(other, other_optimizer)}, step)
    differ = diff_state_dicts(
        AppState(other, other_optimizer).state_dict(),
        AppState(model, optimizer).state_dict(),
    )
    return differ, model.weight.detach().clone()


def test_dcps_tutorial_stateful_nested_under_one_key_saves_and_loads(tmp_path):
    """A section every rank nests its state under is a namespace (refused only
    where it names a stage: test_parallel's "stage0")."""
    ranks = run_ranks(2, nested_stateful, tmp_path)
    assert [differ for differ, _ in ranks] == [[], []]
    plain = plain_read(tmp_path / "step-1")
    assert torch.equal(plain["app.model.weight"], ranks[0][1])
