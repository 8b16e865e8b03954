"""How a stage's optimizer state is keyed, packed and parsed in a checkpoint.

Optimizer state is keyed by parameter FQN (``state.layers.3.w.exp_avg``), not
by index into ``param_groups``: indices restart at 0 on every stage, so
indexed keys would collide across ranks and DCP would keep one stage's state.
DCP's ``flatten_optimizer_state_dict`` gives that, with one entry per
parameter and option; :func:`pack_scalars` puts each parameter's options and
0-dim state into one item, ``scalars.<fqn>``, so that a save writes a few
items per parameter instead of about fifteen. The layout on disk, under a
stage's ``optim.`` section:

* ``state.<fqn>.<name>``: a tensor with elements (AdamW's ``exp_avg``);
* ``scalars.<fqn>``: ``[[name, value], ...]`` with ``name`` either
  ``param_groups.<option>`` or ``state.<name>``; a 0-dim tensor is stored as
  ``[name, number, dtype name]``; and ``["group", index]``, the position of
  the parameter's group in its optimizer (an LR scheduler's per-group lists
  are positional).

A parameter whose gradient stayed None (an unused head, an expert no token
reached) has ``scalars.<fqn>`` but no ``state.<fqn>.*``: it had no state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# The FQNs DCP's state_dict helpers name a module's parameter by (without the
# wrappers' prefixes of torch.compile, DDP, activation checkpointing).
from torch.distributed.checkpoint.state_dict import StateDictOptions, _get_fqns

#: Optimizer state keyed by parameter FQN, as DCP's state_dict helpers give it.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

_OPTIM_STATE = re.compile(r"(?:^|\.)optim\.state\.")


def pack_scalars(
    optim_sd: dict[str, Any], groups: dict[str, int] | None = None
) -> dict[str, Any]:
    """Puts all of a parameter's optimizer entries but its tensors in one item.

    ``flatten_optimizer_state_dict`` gives one entry per parameter and name:
    AdamW's 11 options (``param_groups.<fqn>.lr``, ``...betas``, ...) and its
    0-dim ``state.<fqn>.step`` beside the moments. DCP writes each entry as an
    item of its own, at a fixed CPU cost per item (a ``torch.save``, a plan
    entry, a metadata entry). Packed: three items per parameter for AdamW
    (two moments and this list) instead of fourteen, still keyed by FQN, so
    any split of the model loads it. ``bench/README.md`` measures the gain.

    Args:
        optim_sd: A flattened optimizer state_dict (``get_state_dict`` with
            ``flatten_optimizer_state_dict=True``).
        groups: The index of each parameter's param group, by FQN.

    Returns:
        Tensors with elements under their keys; for each parameter,
        ``scalars.<fqn>``: a list of ``[name, value]`` pairs as the module
        docstring describes. DCP keeps such a list, with no tensor inside, as
        one item.
    """
    packed: dict[str, Any] = {}
    scalars: dict[str, list[list[Any]]] = {}
    for key, value in optim_sd.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            packed[key] = value
            continue
        section, rest = key.split(".", 1)
        fqn, name = rest.rsplit(".", 1)
        entry = [f"{section}.{name}", value]
        if isinstance(value, torch.Tensor):
            entry = [entry[0], value.item(), str(value.dtype).removeprefix("torch.")]
        scalars.setdefault(fqn, []).append(entry)
    for fqn, index in (groups or {}).items():
        if fqn in scalars:
            scalars[fqn].append(["group", index])
    packed.update((f"scalars.{fqn}", entries) for fqn, entries in scalars.items())
    return packed


def unpack_scalars(packed: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`pack_scalars`: the flattened optimizer state_dict.

    A 0-dim tensor comes back on the CPU with its saved dtype and value
    (``.item()`` of a real dtype is exact); ``optimizer.load_state_dict``
    moves ``step`` to the parameter's device where the optimizer wants it
    there (``capturable``, ``fused``).

    Args:
        packed: An optimizer state_dict as :func:`pack_scalars` returns it.

    Returns:
        The flattened optimizer state_dict DCP's ``set_state_dict`` takes.
    """
    flat: dict[str, Any] = {}
    for key, value in packed.items():
        if not key.startswith("scalars."):
            flat[key] = value
            continue
        fqn = key.removeprefix("scalars.")
        for name, item, *dtype in value:
            if name == "group":
                continue
            section, name = name.split(".", 1)
            if dtype:
                item = torch.tensor(item, dtype=getattr(torch, dtype[0]))
            flat[f"{section}.{fqn}.{name}"] = item
    return flat


def saved_groups(packed: dict[str, Any]) -> dict[str, int]:
    """The index each parameter's param group had when saved, by FQN.

    Args:
        packed: An optimizer state_dict as :func:`pack_scalars` returns it.

    Returns:
        ``{fqn: group index}``; empty for checkpoints saved before pippy
        recorded it.
    """
    return {
        key.removeprefix("scalars."): entry[1]
        for key, value in packed.items()
        if key.startswith("scalars.")
        for entry in value
        if entry[0] == "group"
    }


def param_fqns(module: nn.Module) -> dict[nn.Parameter, str]:
    """Maps each parameter of ``module`` to the FQN DCP's state_dicts give it.

    Args:
        module: A stage's module, possibly wrapped (DDP, FSDP2, compile).

    Returns:
        ``{parameter: fqn}``, without the wrappers' prefixes.
    """
    return {
        param: next(iter(_get_fqns(module, name)))
        for name, param in module.named_parameters()
    }


def split_state_key(key: str) -> tuple[str, str] | None:
    """Parses a key of optimizer state into the root and the parameter's FQN.

    Args:
        key: A dotted checkpoint key, e.g. ``app.optim.state.layers.0.w.exp_avg``.

    Returns:
        ``("app.", "layers.0.w")`` for that key: the root is what stands
        before ``optim.`` (empty when ``StageState``'s state_dict is the whole
        state_dict); None for a key that is not optimizer state.
    """
    match = _OPTIM_STATE.search(key)
    if match is None:
        return None
    root = key[: match.start() + (1 if match.start() else 0)]
    return root, key[match.end() :].rsplit(".", 1)[0]


def _state_params(keys: Iterable[str]) -> set[tuple[str, str]]:
    """The ``(root, fqn)`` of every key of optimizer state among ``keys``."""
    return {pair for pair in map(split_state_key, keys) if pair is not None}


def state_fqns(optim_keys: Iterable[str]) -> set[str]:
    """The FQNs that have state among an optimizer state_dict's keys.

    Args:
        optim_keys: Keys of a flattened optimizer state_dict
            (``state.<fqn>.<name>``, ``param_groups.<fqn>.<option>``).

    Returns:
        The ``<fqn>`` of every ``state.`` key.
    """
    return {fqn for _, fqn in _state_params(f"optim.{k}" for k in optim_keys)}


def stateless_keys(wanted: Iterable[str], saved: Iterable[str]) -> set[str]:
    """Keys of optimizer state to skip: their parameter had none when saved.

    A parameter that requires grad but whose gradient stayed None gets no
    state from ``optimizer.step()``, so its checkpoint has its
    ``optim.scalars.<fqn>`` but no ``optim.state.<fqn>.*``. A fresh optimizer
    to load into has state for every such parameter (DCP's ``get_state_dict``
    creates it), so those keys are wanted but cannot be read.

    Args:
        wanted: The dotted keys of the state_dict to load into.
        saved: The checkpoint's keys.

    Returns:
        The keys of ``wanted`` whose parameter had no state in the checkpoint.
    """
    saved = set(saved)
    wanted = list(wanted)
    stateless = {
        (root, fqn)
        for root, fqn in _state_params(wanted) - _state_params(saved)
        if f"{root}optim.scalars.{fqn}" in saved
    }
    return {key for key in wanted if split_state_key(key) in stateless}


@contextmanager
def without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hides param groups without parameters from DCP's ``set_state_dict``.

    The flattened optimizer state is keyed by parameter FQN, so a group with
    no parameters has no entries (nothing to lose), and torch 2.13's
    ``_unflatten_optim_state_dict`` fails on it with an ``IndexError``
    (it reads the group's first parameter). A stage can own no parameters
    of some group, e.g. a no-decay group for biases on a stage with none.

    Args:
        optimizer: The optimizer to load into; its groups are restored, in
            order, on exit.
    """
    groups = optimizer.param_groups
    kept = [i for i, group in enumerate(groups) if group["params"]]
    if len(kept) == len(groups):
        yield
        return
    optimizer.param_groups = [groups[i] for i in kept]
    try:
        yield
    finally:  # loading replaced the kept groups' dicts: put those back in place
        merged = list(groups)
        for i, group in zip(kept, optimizer.param_groups, strict=True):
            merged[i] = group
        optimizer.param_groups = merged
