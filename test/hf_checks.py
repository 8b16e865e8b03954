"""Hugging Face stages on real ranks: train, save, resume; run by dist_checks.py."""

import copy

import torch
import torch.nn.functional as F

import pippy
from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.steps import step_dir

from helpers import hf_config, hf_stage

MICROBATCHES = 2


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step, vocab):
    """Step `step`'s tokens and targets: the same on every rank and every run."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(vocab, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def build(name, rank, world_size, seed):
    module = hf_stage(name, rank, world_size, seed)
    stage = pippy.PipelineStage(module, rank, world_size, torch.device("cpu"))
    schedule = pippy.ScheduleGPipe(stage, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return stage, schedule, checkpoint.StageState(module, optimizer)


def train(name, stage, schedule, state, n):
    losses = []
    for _ in range(n):
        inputs, targets = batch(state.step, hf_config(name).vocab_size)
        out: list = []
        kwargs = {"target": targets, "losses": out} if stage.is_last else {}
        schedule.step(*([inputs] if stage.is_first else []), **kwargs)
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
        losses.append(torch.stack(out).mean().item() if out else None)
    return losses


def check_hf(out, rank, world_size):
    """Per model: keys, train 3 and save, train 3 more and save; a fresh stage
    (other seed) loads step-3 and trains 3: the same losses and tensors."""
    result = {}
    for name in ("llama", "gpt2"):
        stage, schedule, state = build(name, rank, world_size, seed=0)
        train(name, stage, schedule, state, 3)
        saved = copy.deepcopy(state.state_dict())
        checkpoint.save_stage(state, out / name)
        losses_a = train(name, stage, schedule, state, 3)
        checkpoint.save_stage(state, out / name)

        stage_b, schedule_b, state_b = build(name, rank, world_size, seed=1)
        before = offline.diff_state_dicts(state_b.state_dict(), saved)
        checkpoint.load_stage(state_b, step_dir(out / name, 3))
        after_load = offline.diff_state_dicts(state_b.state_dict(), saved)
        losses_b = train(name, stage_b, schedule_b, state_b, 3)
        result[name] = {
            "keys": sorted(state.module.state_dict()),
            "differ_before_load": before,
            "differ_after_load": after_load,
            "losses_a": losses_a,
            "losses_b": losses_b,
            "differ_final": offline.diff_state_dicts(
                state_b.state_dict(), state.state_dict()
            ),
        }
    return result
