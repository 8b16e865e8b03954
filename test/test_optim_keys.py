"""The grammar of optimizer-state keys: parsed by FQN, nested state, what DCP
cannot store, param-group options of the user's own classes, layout version."""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from pippy import checkpoint
from pippy.checkpoint.errors import explain_failures
from pippy.checkpoint.keys import (
    LAYOUT_VERSION,
    OptimKeys,
    check_layout_version,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.reader import SafeFileSystemReader, read_metadata
from pippy.checkpoint.safe_load import SafeLoadPlanner
from pippy.checkpoint.steps import step_dir


class Heads(nn.Module):
    """A body and two heads; a head left out of ``use`` gets no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.head = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})

    def forward(self, x, use):
        h = self.body(x)
        return sum(self.head[name](h).sum() for name in use)


class Nested(torch.optim.Optimizer):
    """A Shampoo-like optimizer: each parameter's state nests dicts two deep."""

    def __init__(self, params, lr=0.1, **options):
        super().__init__(params, {"lr": lr, **options})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # all of it nested: no entry at the top
                    state["precond"] = {
                        "L": torch.zeros_like(p),
                        "R": torch.zeros(p.shape[0]),
                        "stats": {"count": 0, "scale": torch.tensor(1.0)},
                    }
                precond = state["precond"]
                precond["L"].add_(p.grad.square())
                precond["R"].add_(p.grad.abs().reshape(p.shape[0], -1).sum(1))
                precond["stats"]["count"] += 1
                precond["stats"]["scale"].mul_(0.5)
                p.sub_(group["lr"] * p.grad / (precond["L"].sqrt() + 1e-3))


def nested_state(**options):
    model = Heads()
    return checkpoint.StageState(model, Nested(model.parameters(), **options))


def train_step(state, use=("a", "b")):
    torch.manual_seed(state.step)
    state.module(torch.randn(2, 4), use).backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def assert_bitwise(loaded, saved, where="state"):
    """Equal nested values: tensors by torch.equal and dtype, others by ==."""
    assert type(loaded) is type(saved), where
    if isinstance(saved, dict):
        assert loaded.keys() == saved.keys(), where
        for key in saved:
            assert_bitwise(loaded[key], saved[key], f"{where}.{key}")
    elif isinstance(saved, torch.Tensor):
        assert loaded.dtype == saved.dtype and torch.equal(loaded, saved), where
    else:
        assert loaded == saved, where


def assert_same_optimizer(loaded, saved):
    assert_bitwise(loaded.optimizer.state_dict(), saved.optimizer.state_dict())


def load_nested(state, folder):
    """Loads as DCP's tutorial does: the Stateful under a key, ``{"app": state}``."""
    reader = SafeFileSystemReader(folder)
    with explain_failures(f"loading {folder}"):
        dcp.load({"app": state}, storage_reader=reader, planner=SafeLoadPlanner())


# The grammar


def test_keys_parse_against_the_known_fqns_not_at_a_dot():
    keys = OptimKeys(["head.a.weight", "body.bias"])
    assert keys.parse("state.head.a.weight.precond.stats.count") == (
        "state",
        "head.a.weight",
        "precond.stats.count",
    )
    assert keys.parse("param_groups.body.bias.lr") == (
        "param_groups",
        "body.bias",
        "lr",
    )
    assert keys.parse("scalars.head.a.weight") == ("scalars", "head.a.weight", "")
    assert keys.parse("state.head.c.weight.exp_avg") is None  # no such parameter
    assert keys.parse("state.head.a.weight") is None  # a parameter, no name
    assert keys.parse("model.head.a.weight") is None
    assert keys.split("app.optim.state.head.a.weight.precond.L") == (
        "app.",
        "state",
        "head.a.weight",
        "precond.L",
    )
    assert keys.split("optim.scalars.body.bias") == ("", "scalars", "body.bias", "")
    assert keys.split("model.head.a.weight") is None


def test_the_longest_known_fqn_wins():
    keys = OptimKeys(["w", "w.precond"])
    assert keys.parse("state.w.precond.L") == ("state", "w.precond", "L")
    assert keys.parse("state.w.other.L") == ("state", "w", "other.L")


def test_fqns_are_known_from_a_checkpoints_scalars_items():
    keys = OptimKeys.of_keys(
        ["step", "model.head.a.weight", "app.optim.scalars.head.a.weight"]
    )
    assert keys.fqns == {"head.a.weight"}
    assert keys.state_fqns(["state.head.a.weight.precond.L", "scalars.x"]) == {
        "head.a.weight"
    }


def test_a_torchtitan_checkpoints_nested_state_packs_under_its_parameter():
    flat = {
        "optimizer.state.head.a.weight.precond.L": torch.ones(2, 4),
        "optimizer.state.head.a.weight.precond.stats.count": 3,
        "optimizer.state.head.a.weight.step": torch.tensor(3.0),
        "optimizer.param_groups.head.a.weight.lr": 0.1,
    }
    packed = from_torchtitan(flat)
    assert sorted(packed) == [
        "optim.scalars.head.a.weight",
        "optim.state.head.a.weight.precond.L",
    ]
    assert ["state.precond.stats.count", 3] in packed["optim.scalars.head.a.weight"]
    assert_bitwise(to_torchtitan(packed), flat)
    known = OptimKeys(["head.a.weight"])
    assert pippy_name("optimizer.state.head.a.weight.step", known) == (
        "optim.scalars.head.a.weight"
    )
    assert pippy_name("optimizer.state.head.a.weight.precond.step", known) == (
        "optim.state.head.a.weight.precond.step"
    )


# Nested optimizer state, through save_stage and load_stage


def test_nested_optimizer_state_round_trips_bitwise(tmp_path):
    saved = nested_state()
    for _ in range(2):
        train_step(saved)
    folder = checkpoint.save_stage(saved, tmp_path)
    keys = set(read_metadata(folder).state_dict_metadata)
    assert "optim.state.head.a.weight.precond.L" in keys
    # Its int and 0-dim entries sit in the parameter's own item, nowhere else.
    assert {k for k in keys if k.startswith("optim.scalars.")} == {
        f"optim.scalars.{fqn}" for fqn, _ in saved.module.named_parameters()
    }
    loaded = nested_state()
    checkpoint.load_stage(loaded, folder)
    assert_same_optimizer(loaded, saved)
    for state in (saved, loaded):
        train_step(state)
    assert_same_optimizer(loaded, saved)


@pytest.mark.parametrize("nested", [False, True])
def test_nested_state_loads_with_a_parameter_that_got_no_gradient(tmp_path, nested):
    saved = nested_state()
    train_step(saved, use=("a",))
    assert saved.module.head.b.weight not in saved.optimizer.state
    loaded = nested_state()
    if nested:
        checkpoint.save_stage({"app": saved}, tmp_path, step=1)
        load_nested(loaded, step_dir(tmp_path, 1))
    else:
        checkpoint.load_stage(loaded, checkpoint.save_stage(saved, tmp_path))
    assert loaded.module.head.b.weight not in loaded.optimizer.state
    assert_same_optimizer(loaded, saved)
    for state in (saved, loaded):  # now b trains too, from fresh state in both
        train_step(state)
    assert_same_optimizer(loaded, saved)


# What DCP cannot store


@pytest.mark.parametrize(
    "where, name",
    [(lambda s: s, "kind"), (lambda s: s["precond"], "precond.kind")],
    ids=["top", "nested"],
)
def test_state_dcp_cannot_store_is_refused_by_name_before_writing(
    tmp_path, where, name
):
    state = nested_state()
    train_step(state)
    where(state.optimizer.state[state.module.head.b.bias])["kind"] = "diagonal"
    message = (
        f"optimizer state {name!r} of parameter 'head.b.bias' is a str; DCP "
        "stores only tensors, ints, floats and dicts of them"
    )
    with pytest.raises(checkpoint.CheckpointError, match=message):
        state.state_dict()
    with pytest.raises(checkpoint.CheckpointError, match=message):
        checkpoint.save_stage(state, tmp_path)
    assert list(tmp_path.iterdir()) == []


# A param-group option of the user's own class


@dataclass
class Cfg:
    beta: float


def test_a_dataclass_option_is_refused_naming_add_safe_globals_then_loads(tmp_path):
    saved = nested_state(cfg=Cfg(0.5))
    train_step(saved)
    folder = checkpoint.save_stage(saved, tmp_path)
    with pytest.raises(checkpoint.UnsafeCheckpointError) as error:
        checkpoint.load_stage(nested_state(cfg=Cfg(0.25)), folder)
    assert f"it would import {__name__}.Cfg" in str(error.value)
    assert (
        "allow that class alone, before loading: "
        f"torch.serialization.add_safe_globals([Cfg]) (Cfg of {__name__})"
    ) in str(error.value)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([Cfg])
    try:
        loaded = nested_state(cfg=Cfg(0.25))
        checkpoint.load_stage(loaded, folder)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert loaded.optimizer.param_groups[0]["cfg"] == Cfg(0.5)
    assert_same_optimizer(loaded, saved)


# The layout version


def test_layout_versions_older_checkpoints_and_the_current_one_are_read():
    assert LAYOUT_VERSION == 1
    check_layout_version(None, "step-3")  # written before the field existed
    check_layout_version(LAYOUT_VERSION, "step-3")


@pytest.mark.parametrize(
    "version, fix",
    [(7, "upgrade pippy"), (0, "no pippy writes it"), ("1", "no pippy writes it")],
)
def test_an_unknown_layout_version_is_refused_saying_which_exist(version, fix):
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"^step-3 was written with optimizer layout {version!r}; this pippy "
        rf"reads layout 1; {fix}",
    ):
        check_layout_version(version, "step-3")
    with pytest.raises(checkpoint.CheckpointError):
        check_layout_version(True, "step-3")  # a bool is not layout 1


def test_the_manifest_records_the_layout_and_loads_refuse_another(tmp_path):
    import json

    from helpers import linear_state

    state = linear_state()
    checkpoint.save_stage(state, tmp_path)
    manifest_file = tmp_path / "step-0" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest["optim_layout"] == 1
    del manifest["optim_layout"]  # as written before pippy recorded it: layout 1
    manifest_file.write_text(json.dumps(manifest))
    checkpoint.load_stage(linear_state(), tmp_path / "step-0")
    manifest["optim_layout"] = 7
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_stage(linear_state(), tmp_path / "step-0")
    assert str(e.value) == (
        f"{str(tmp_path / 'step-0')!r} was written with optimizer layout 7; this "
        "pippy reads layout 1; upgrade pippy"
    )
