"""Checks of a stage's state_dict and model: before a split, and after a load.

DCP takes equal keys on different ranks for replicas and writes one of them
without an error, so a stage's keys must be exactly the un-split model's FQNs
of what it owns (:func:`~pippy.checkpoint.collisions.check_keys` proves that
across ranks). :func:`check_untied` and :func:`restore_non_persistent_buffers`
remove two known causes of collisions; :func:`diff_state_dicts` compares bit
for bit; :func:`named_leaves` and :func:`fingerprint` name and summarise the
leaves of a nested state_dict.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pippy.checkpoint.errors import TiedParametersError

__all__ = [
    "fingerprint",
    "local",
    "check_untied",
    "diff_state_dicts",
    "named_leaves",
    "renaming_hooks",
    "restore_non_persistent_buffers",
    "state_dict_size",
    "tied_groups",
]

logger = logging.getLogger(__name__)


def named_leaves(
    state_dict: Mapping[str, Any], prefix: str = ""
) -> Iterator[tuple[str, Any]]:
    """Yields the leaves of a nested state_dict under the keys DCP gives them.

    DCP flattens nested dicts by joining keys with dots:
    ``{"optim": {"state.w.exp_avg": t}}`` is saved as ``optim.state.w.exp_avg``.

    Args:
        state_dict: A nested dict, e.g. from ``StageState.state_dict()``.
        prefix: Put before every key (``"model."``).

    Yields:
        ``(dotted key, leaf)`` pairs; a leaf is anything but a mapping.
    """
    for key, value in state_dict.items():
        if isinstance(value, Mapping):
            yield from named_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def local(value: Any) -> Any:
    """A DTensor's shard on this rank (FSDP2); any other value as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def state_dict_size(state_dict: Mapping[str, Any]) -> tuple[int, int]:
    """Counts the tensors of a (nested) state_dict and the bytes this rank holds.

    Args:
        state_dict: A dict as returned by ``StageState.state_dict()``.

    Returns:
        ``(number of tensors, their total size in bytes)``; a DTensor (FSDP2)
        counts with its local shard.
    """
    tensors = [
        local(v) for _, v in named_leaves(state_dict) if isinstance(v, torch.Tensor)
    ]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def fingerprint(value: Any) -> str:
    """A short text that differs when a state_dict leaf differs.

    Args:
        value: A tensor (dtype, shape and a SHA-1 of its bytes) or any value
            with a faithful ``repr`` (numbers, strings, lists of them).

    Returns:
        A string to compare across ranks (a few dozen characters for a tensor).
    """
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().view(-1).view(torch.uint8)
        return (
            f"{value.dtype}{tuple(value.shape)}"
            + hashlib.sha1(data.numpy().tobytes()).hexdigest()
        )
    return repr(value)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The FQNs of each parameter reachable under more than one name.

    Args:
        model: Any module.

    Returns:
        One list of FQNs per tied parameter, in ``named_parameters`` order.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def renaming_hooks(module: nn.Module) -> list[str]:
    """Names the submodules whose state_dict hooks rename their keys.

    DCP's state_dict helpers map every key back to the parameter of that
    name, so a key a hook invents (torchtitan's fused QKV split into ``wq``,
    ``wk``, ``wv``) fails there with a bare ``AttributeError``.

    Args:
        module: A stage's module.

    Returns:
        One line per such submodule: its FQN, class, hook and a renamed key.
    """
    found = []
    for name, sub in module.named_modules():
        hooks = [*sub._state_dict_hooks.values(), *sub._state_dict_pre_hooks.values()]
        if not hooks:
            continue
        own = {n for n, _ in sub.named_parameters()} | {
            n for n, _ in sub.named_buffers()
        }
        renamed = sorted(set(sub.state_dict(keep_vars=True)) - own)
        if renamed:
            hook = ", ".join(getattr(h, "__qualname__", repr(h)) for h in hooks)
            found.append(
                f"module {name or '(root)'!r} ({type(sub).__name__}) has the "
                f"state_dict hook {hook}, which gives it the key {renamed[0]!r}"
            )
    return found


def check_untied(model: nn.Module) -> None:
    """Refuses a model with tied weights before it is split into stages.

    A parameter reachable under two FQNs (an output head tied to the
    embedding) ends up on two stages after a split: each stage trains its own
    copy, the copies drift apart, and both go into the checkpoint, where one
    silently overwrites the other in the un-split model (a manual split) or
    their keys collide (tracing copies the tie as ``output.weight`` onto both
    stages). pippy does not keep tied weights in sync across stages, so it
    says so instead. Call it on the un-split (for example meta) model.

    Args:
        model: The un-split model.

    Raises:
        TiedParametersError: Naming each pair of FQNs that share a parameter.
    """
    ties = [f"{n!r} is {g[0]!r}" for g in tied_groups(model) for n in g[1:]]
    if ties:
        raise TiedParametersError(
            f"tied weights: {', '.join(ties)}. Split into pipeline stages, each "
            "stage would train its own copy and the checkpoint would keep one. "
            "pippy does not synchronise tied weights across stages: untie them "
            "(give each module its own nn.Parameter) before splitting."
        )


def restore_non_persistent_buffers(
    stage_module: nn.Module, model: nn.Module
) -> list[str]:
    """Makes the model's non-persistent buffers non-persistent in a traced stage.

    ``torch.distributed.pipelining.pipeline`` registers every buffer of the
    traced model as a persistent buffer of each stage that uses it, so a
    buffer the model keeps out of its ``state_dict`` (a RoPE table, a causal
    mask) appears as the same key on every stage. This re-registers those
    buffers as non-persistent, in place, so the stage's keys are again a
    subset of ``model.state_dict()``'s.

    Args:
        stage_module: The stage's module (``pipe.build_stage(...).submod``).
        model: The un-split model that was traced.

    Returns:
        The FQNs of the buffers that were re-registered.
    """
    stage_buffers = dict(stage_module.named_buffers())
    restored = []
    for owner_name, owner in model.named_modules():
        for name in owner._non_persistent_buffers_set:
            fqn = f"{owner_name}.{name}" if owner_name else name
            if fqn in stage_buffers:
                stage_owner = stage_module.get_submodule(fqn.rpartition(".")[0])
                stage_owner.register_buffer(name, stage_buffers[fqn], persistent=False)
                restored.append(fqn)
    logger.debug("re-registered non-persistent buffers %s", restored)
    return restored


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that equal NaNs compare equal and -0.0 != 0.0."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def diff_state_dicts(
    actual: Mapping[str, Any], expected: Mapping[str, Any]
) -> list[str]:
    """Lists the keys whose values differ between two (nested) state_dicts.

    Tensors must match in dtype, shape and every bit (a NaN equals the same
    NaN; ``0.0`` and ``-0.0`` differ); DTensors (FSDP2) compare this rank's
    shards, with no collective; other values compare with ``==``.

    Args:
        actual: A state_dict, as from ``StageState.state_dict()``.
        expected: The state_dict to compare with.

    Returns:
        Sorted dotted keys (as DCP names them) that differ or are in only one
        of the two; empty if they are equal.
    """
    a, b = dict(named_leaves(actual)), dict(named_leaves(expected))
    differ = set(a.keys() ^ b.keys())
    for key in a.keys() & b.keys():
        x, y = local(a[key]), local(b[key])
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = (
                x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(_raw_bytes(x), _raw_bytes(y))
            )
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = False
        else:
            same = x == y
        if not same:
            differ.add(key)
    return sorted(differ)
