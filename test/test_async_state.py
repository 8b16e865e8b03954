"""An async save is the state at the call, or it is not published.

The copy of a save runs while training goes on. What changes a saved tensor
in place before its copy must not reach the step: BatchNorm's running
statistics (updated by its kernel without moving their version counters), a
sampler's tensor or an EMA in extra state (copied at the call), a parameter
clamped or an optimizer moment scaled (their version counters move: the save
fails on every rank, naming the key, and nothing is published). The copy is
held back by a stager that waits for the test (a slow device), so each change
lands before it.
"""

import threading

import pytest
import torch
from torch import nn

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.async_saver import KeptBufferStager

from helpers import plain_read


class HeldStager(KeptBufferStager):
    """The default stager, copying only once ``go`` is set."""

    def __init__(self):
        super().__init__(in_background=True)
        self.go = threading.Event()

    def _fill(self, *args, **kwargs):
        assert self.go.wait(60)
        return super()._fill(*args, **kwargs)


class Sampler:
    """A sampler's state: how often each of 4 shards was seen, a tensor it
    advances in place, and an EMA of the model's first weight."""

    def __init__(self, model):
        self.seen = torch.zeros(4, dtype=torch.int64)
        self.ema = model[0].weight.detach().clone()

    def state_dict(self):
        return {"seen": self.seen, "ema": self.ema}

    def load_state_dict(self, state_dict):
        self.seen.copy_(state_dict["seen"])
        self.ema.copy_(state_dict["ema"])


def bn_state(stepped):
    """A Linear and a BatchNorm1d under AdamW, at step 1 (after an optimizer
    step if `stepped`: the saver then takes the tensors in the background)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    if stepped:
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return checkpoint.StageState(
        model, optimizer, step=1, extra={"data": Sampler(model)}
    )


def train_on(state):
    """What the next step does before its optimizer step: a forward in train
    mode (BatchNorm's statistics), the sampler's and the EMA's updates."""
    model, data = state.module, state.extra["data"]
    model.train()
    model(torch.randn(8, 4) * 3 + 1).sum().backward()
    data.seen.add_(1)
    data.ema.lerp_(model[0].weight.detach(), 0.1)


@pytest.mark.parametrize("stepped", [True, False], ids=["deferred", "at-once"])
def test_buffers_and_extra_state_are_saved_as_at_the_call(tmp_path, stepped):
    state = bn_state(stepped)
    stager = HeldStager()
    saver = checkpoint.AsyncSaver(tmp_path, async_stager=stager)
    bn, data = state.module[1], state.extra["data"]
    at_call = {
        "model.1.running_mean": bn.running_mean.clone(),
        "model.1.running_var": bn.running_var.clone(),
        "model.1.num_batches_tracked": bn.num_batches_tracked.clone(),
        "data.seen": data.seen.clone(),
        "data.ema": data.ema.clone(),
    }
    running_var_version = bn.running_var._version
    saver.save(state)
    train_on(state)  # before the copy
    assert not torch.equal(bn.running_var, at_call["model.1.running_var"])
    assert bn.running_var._version == running_var_version  # no version moved
    stager.go.set()
    assert saver.wait() == tmp_path / "step-1"
    saver.close()
    saved = plain_read(tmp_path / "step-1")  # plain DCP
    for key, value in at_call.items():
        assert torch.equal(saved[key], value), key
    ours = offline.read_checkpoint(tmp_path / "step-1")
    assert torch.equal(ours["data.seen"], at_call["data.seen"])


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda s: s.module[0].weight.clamp_(-0.01, 0.01), "model.0.weight"),
        (
            lambda s: s.optimizer.state[s.module[0].bias]["exp_avg"].mul_(0.5),
            "optim.state.0.bias.exp_avg",
        ),
    ],
    ids=["clamp", "moment"],
)
def test_a_tensor_changed_in_place_before_its_copy_fails_the_save(
    tmp_path, change, key
):
    state = bn_state(stepped=True)
    checkpoint.save_stage(state, tmp_path)  # step-1, whole
    before = {p.name: p.read_bytes() for p in (tmp_path / "step-1").iterdir()}
    stager = HeldStager()
    saver = checkpoint.AsyncSaver(tmp_path, async_stager=stager)
    state.step = 2
    saver.save(state)
    with torch.no_grad():
        change(state)
    stager.go.set()
    with pytest.raises(checkpoint.CheckpointError) as raised:
        saver.wait()
    assert f"{key} was changed in place after save() returned" in str(raised.value)
    assert "wait_for_staging()" in str(raised.value)
    saver.close()
    assert checkpoint.find_latest_step(tmp_path) == tmp_path / "step-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "step-1").iterdir()} == before


def test_a_saver_used_as_a_context_lands_its_last_save_and_closes(tmp_path, caplog):
    state = bn_state(stepped=True)
    with checkpoint.AsyncSaver(tmp_path) as saver:
        saver.save(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    with pytest.raises(RuntimeError, match="this AsyncSaver is closed"):
        saver.save(state)
    # The block fails with a failing save in flight: the block's error is
    # raised, the save's failure logged, nothing published.
    stager = HeldStager()
    with pytest.raises(KeyError, match="the block's"):
        with checkpoint.AsyncSaver(tmp_path, async_stager=stager) as saver:
            state.step = 2
            saver.save(state)
            with torch.no_grad():
                state.module[0].weight.clamp_(-0.01, 0.01)
            stager.go.set()
            raise KeyError("the block's")
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(logged) == 1 and logged[0].startswith("the save in flight failed too")
    assert "model.0.weight was changed in place" in logged[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_change_after_wait_for_staging_is_not_in_the_step(tmp_path):
    state = bn_state(stepped=True)
    saver = checkpoint.AsyncSaver(tmp_path)
    weight = state.module[0].weight.detach().clone()
    saver.save(state)
    saver.wait_for_staging()
    with torch.no_grad():
        state.module[0].weight.clamp_(-0.01, 0.01)
    saver.close()
    assert torch.equal(plain_read(tmp_path / "step-1")["model.0.weight"], weight)
