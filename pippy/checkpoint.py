"""Stage-aware distributed checkpointing for pipeline parallelism.

Every rank of a pipeline holds one stage. To checkpoint, every rank calls
``torch.distributed.checkpoint.save`` on the same ``checkpoint_id`` at the same
time: each writes its own data file and the coordinator writes ``.metadata``.
That works only if each stage's ``state_dict`` keys are the un-split model's
FQNs for exactly the parameters the stage owns, so that the union over ranks is
the whole model and no key is offered by two ranks. This module holds what
makes that hold and what finds the checkpoints again:

* :class:`StageState`: model, optimizer (keyed by FQN), LR scheduler, step and
  any extra ``Stateful`` of one stage, as one ``state_dict``.
* :func:`check_keys`: a cross-rank check, before a save, that no key is offered
  by two ranks and shared entries agree (DCP would silently keep one copy).
* :func:`restore_non_persistent_buffers`: undoes the tracing front end turning
  non-persistent buffers into persistent keys on every stage.
* :func:`step_dir`, :func:`publish_step`, :func:`find_latest_step`: one folder
  per step (``<checkpoint_dir>/step-<N>``), published only once complete.
* :class:`SafeFileSystemReader`, :class:`SafeLoadPlanner`: load without
  running code that a checkpoint's pickles could carry.
* :func:`read_checkpoint`, :func:`load_model`: a checkpoint in one process,
  as a flat dict or into the un-split model (plain or FSDP2-sharded).
* :func:`explain_failures`: turns DCP's ``CheckpointException`` into one error
  per rank that says what went wrong; :func:`fail_together` does the same for
  a step each rank runs alone (applying a loaded state_dict).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    FileSystemReader,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

# The FQNs DCP's state_dict helpers name a module's parameter by (without the
# wrappers' prefixes of torch.compile, DDP, activation checkpointing).
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = [
    "AsyncSaver",
    "CheckpointDirError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "KeyCollisionError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "StageState",
    "TiedParametersError",
    "UnsafeCheckpointError",
    "check_keys",
    "check_untied",
    "check_writable",
    "diff_state_dicts",
    "explain_failures",
    "fail_together",
    "find_damage",
    "find_latest_step",
    "is_complete",
    "list_steps",
    "load_model",
    "parse_step",
    "publish_step",
    "read_checkpoint",
    "read_metadata",
    "remove_old_steps",
    "restore_non_persistent_buffers",
    "state_dict_size",
    "step_dir",
]

logger = logging.getLogger(__name__)

#: The file DCP's coordinator writes last; a step folder without it is partial.
METADATA_FILE = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")

# Optimizer state keyed by parameter FQN ("state.layers.3.w.exp_avg") instead of
# by index into param_groups: indices restart at 0 on every stage, so indexed
# keys would collide across ranks and DCP would keep only one stage's state.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(Exception):
    """Base of pippy's checkpoint errors; the message says what to do."""


class KeyCollisionError(CheckpointError, ValueError):
    """Two or more ranks offer the same checkpoint key.

    DCP treats equal keys on different ranks as replicas and writes only one
    of them, so saving would silently lose the others' values.
    """


@contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hides param groups without parameters from DCP's ``set_state_dict``.

    The flattened optimizer state is keyed by parameter FQN, so a group with
    no parameters has no entries (nothing to lose), and torch 2.13's
    ``_unflatten_optim_state_dict`` fails on it with an ``IndexError``
    (it reads the group's first parameter). A stage can own no parameters
    of some group, e.g. a no-decay group for biases on a stage with none.
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


def _pack_scalars(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """Puts all of a parameter's optimizer entries but its tensors in one item.

    ``flatten_optimizer_state_dict`` gives one entry per parameter and name:
    AdamW's 11 options (``param_groups.<fqn>.lr``, ``...betas``, ...) and its
    0-dim ``state.<fqn>.step`` beside the moments. DCP writes each entry as an
    item of its own, at a fixed CPU cost per item (a ``torch.save``, a plan
    entry, a metadata entry). Packed: three items per parameter for AdamW
    (two moments and this list) instead of fourteen (fifteen with an LR
    scheduler's ``initial_lr``), still keyed by FQN, so
    any split of the model loads it. On the benchmark's model that makes a
    save 1.3x-1.5x faster, 2.1x-2.5x with four times the layers
    (``bench/README.md``).

    Args:
        optim_sd: A flattened optimizer state_dict (``get_state_dict`` with
            ``flatten_optimizer_state_dict=True``).

    Returns:
        Tensors with elements under their keys; for each parameter,
        ``scalars.<fqn>``: a list of ``[name, value]`` pairs (``name`` is
        ``param_groups.<option>`` or ``state.<name>``); a 0-dim tensor is
        stored as ``[name, number, dtype name]``. DCP keeps such a list, with
        no tensor inside, as one item.
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
    packed.update((f"scalars.{fqn}", entries) for fqn, entries in scalars.items())
    return packed


def _unpack_scalars(packed: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`_pack_scalars`: the flattened optimizer state_dict.

    A 0-dim tensor comes back on the CPU with its saved dtype and value
    (``.item()`` of a real dtype is exact); ``optimizer.load_state_dict``
    moves ``step`` to the parameter's device where the optimizer wants it
    there (``capturable``, ``fused``).
    """
    flat: dict[str, Any] = {}
    for key, value in packed.items():
        if not key.startswith("scalars."):
            flat[key] = value
            continue
        fqn = key.removeprefix("scalars.")
        for name, item, *dtype in value:
            section, name = name.split(".", 1)
            if dtype:
                item = torch.tensor(item, dtype=getattr(torch, dtype[0]))
            flat[f"{section}.{fqn}.{name}"] = item
    return flat


def _param_fqns(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter of ``module`` and the FQN that DCP's state_dicts give it."""
    return {
        param: next(iter(_get_fqns(module, name)))
        for name, param in module.named_parameters()
    }


_OPTIM_STATE = re.compile(r"(?:^|\.)optim\.state\.")


def _split_state_key(key: str) -> tuple[str, str] | None:
    """``("app.", "layers.0.w")`` for the key ``app.optim.state.layers.0.w.exp_avg``.

    The root is what stands before ``optim.``: empty when ``StageState``'s
    state_dict is the whole state_dict, ``app.`` under ``{"app": state}``.
    """
    match = _OPTIM_STATE.search(key)
    if match is None:
        return None
    root = key[: match.start() + (1 if match.start() else 0)]
    return root, key[match.end() :].rsplit(".", 1)[0]


def _state_params(keys: Iterable[str]) -> set[tuple[str, str]]:
    """The ``(root, fqn)`` of every key of optimizer state among ``keys``."""
    return {pair for pair in map(_split_state_key, keys) if pair is not None}


def _state_fqns(optim_keys: Iterable[str]) -> set[str]:
    """FQNs with state among an optimizer state_dict's ``state.<fqn>.<name>``."""
    return {fqn for _, fqn in _state_params(f"optim.{k}" for k in optim_keys)}


def _stateless_params(
    wanted: Iterable[str], saved: Iterable[str]
) -> set[tuple[str, str]]:
    """Parameters that had no optimizer state when saved, as ``(root, fqn)``.

    A parameter that requires grad but whose gradient stayed None (an unused
    head, an expert no token was routed to yet) gets no state from
    ``optimizer.step()``, so its checkpoint has its ``optim.scalars.<fqn>``
    but no ``optim.state.<fqn>.*``. A fresh optimizer to load into has state
    for every such parameter (DCP's ``get_state_dict`` creates it), so those
    keys are wanted but not saved.

    Args:
        wanted: The keys to load (DCP's flattened names).
        saved: The checkpoint's keys.
    """
    saved = set(saved)
    return {
        (root, fqn)
        for root, fqn in _state_params(wanted) - _state_params(saved)
        if f"{root}optim.scalars.{fqn}" in saved
    }


class StageState(Stateful):
    """The checkpointable state of one pipeline stage.

    ``state_dict()`` returns a nested dict whose leaves DCP writes as
    ``model.<fqn>``, ``optim.state.<fqn>.<name>`` (the optimizer's tensors
    with elements, e.g. AdamW's ``exp_avg``), ``optim.scalars.<fqn>`` (all
    else of that parameter's optimizer entry in one item: its param group's
    options and 0-dim state such as AdamW's ``step``), ``lr_scheduler.<name>``,
    ``step`` and ``<extra name>.<name>``. Model and optimizer keys are the
    un-split model's FQNs of the parameters this stage owns, so the stages'
    keys are disjoint and together form the whole model; the scheduler, step
    and extra state are the same on every rank and DCP stores them once.

    Args:
        module: The stage's module, keeping the un-split model's FQNs (for
            example ``layers.5.mlp.w1.weight``, never renumbered).
        optimizer: The optimizer over ``module``'s parameters.
        lr_scheduler: Optional LR scheduler of ``optimizer``.
        step: Number of optimizer steps taken so far.
        extra: Further ``Stateful`` objects saved under their names (for
            example a data sampler). Their state must be the same on every
            rank: DCP keeps one copy of equal keys.

    Note:
        DCP loads in place. Build the stage and its optimizer first, take
        ``sd = state.state_dict()`` (this creates the empty optimizer state to
        load into), ``dcp.load(sd, ...)``, then ``state.load_state_dict(sd)``.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        step: int = 0,
        extra: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.step = step
        self.extra = dict(extra or {})
        reserved = {"model", "optim", "lr_scheduler", "step"} & self.extra.keys()
        if reserved:
            raise ValueError(f"extra state may not use the reserved names {reserved}")

    def state_dict(self) -> dict[str, Any]:
        """Returns the stage's state as a nested dict for ``dcp.save``/``load``.

        Returns:
            ``{"model": ..., "optim": ..., "step": int}``, plus
            ``"lr_scheduler"`` when there is one and one entry per ``extra``.
            Tensors are the live ones (no copies).
        """
        model_sd, optim_sd = get_state_dict(
            self.module, self.optimizer, options=_OPTIONS
        )
        optim_sd = _pack_scalars(optim_sd)
        sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": self.step}
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = self.lr_scheduler.state_dict()
        for name, obj in self.extra.items():
            sd[name] = obj.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Applies a state_dict from :meth:`state_dict` (after ``dcp.load``).

        Args:
            state_dict: The dict that ``dcp.load`` filled in place.

        A parameter whose ``state.`` entries are all absent from the
        checkpoint (it had no optimizer state when saved; see
        :class:`SafeLoadPlanner`) ends with no optimizer state, as saved, so
        that its next step starts its state afresh, as the saved run would.

        Its checks all run before anything is applied (``dcp.load`` has
        filled the tensors in place already).

        Raises:
            RuntimeError: A model key is missing or unexpected
                (``set_state_dict`` is strict).
            KeyError: A section (``model``, ``optim``, ...) is missing.
            CheckpointError: An ``optim.scalars.<fqn>`` item lacks an entry
                this optimizer has, or has one it lacks (saved by another
                optimizer class, or without the LR scheduler that adds
                ``initial_lr``; an ``initial_lr`` this optimizer lacks is
                allowed). DCP cannot see inside the item, and
                ``set_state_dict`` would load an empty dict for a missing
                state entry such as ``step`` and ignore extra ones. Also:
                some of a parameter's state is missing while the rest is
                there (a damaged or edited checkpoint).
            CheckpointError: A param group here joins parameters saved with
                different options (``set_state_dict`` would give them all the
                first one's), or the LR scheduler was saved for another number
                of param groups.
        """
        optim_sd = _unpack_scalars(state_dict["optim"])
        wanted = get_optimizer_state_dict(self.module, self.optimizer, options=_OPTIONS)
        # Parameters without state in the checkpoint (SafeLoadPlanner read none
        # of it): set_state_dict takes the fresh state, dropped after it.
        stateless = _state_fqns(wanted) - _state_fqns(optim_sd)
        for key in wanted.keys() - optim_sd.keys():
            if _state_fqns([key]) & stateless:
                optim_sd[key] = wanted[key]
        self._check_entries(wanted, optim_sd)
        fqn_of = _param_fqns(self.module)
        self._check_groups(optim_sd, fqn_of)
        if self.lr_scheduler is not None:
            self._check_scheduler(state_dict["lr_scheduler"])
        with _without_empty_groups(self.optimizer):
            set_state_dict(
                self.module,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=optim_sd,
                options=_OPTIONS,
            )
        # No state, as saved; an empty entry (set_state_dict makes one for each
        # parameter of an optimizer without state, e.g. SGD) is none either.
        for param, fqn in fqn_of.items():
            if fqn in stateless or not self.optimizer.state.get(param, True):
                self.optimizer.state.pop(param, None)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.step = int(state_dict["step"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state_dict[name])

    @staticmethod
    def _check_entries(wanted: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
        """Checks that the loaded optimizer entries are exactly the wanted ones.

        Raises:
            CheckpointError: Naming the missing or extra entries.
        """
        missing = sorted(wanted.keys() - loaded.keys())
        # An LR scheduler's initial_lr may stay behind when loading into an
        # optimizer without one; any other entry is another optimizer's.
        extra = sorted(
            k for k in loaded.keys() - wanted.keys() if not k.endswith(".initial_lr")
        )

        def shown(keys: list[str]) -> str:
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            return ", ".join(repr(k) for k in keys[:5]) + more

        lost = [k for k in missing if k.startswith("state.")]
        if lost:  # a parameter with none of its state is taken as stateless
            raise CheckpointError(
                f"the checkpoint's optimizer state has no {shown(lost)}, though it "
                "has other state of the same parameters: the checkpoint is "
                "damaged or was edited; load an earlier step"
            )
        for what, keys in (("has no", missing), ("has entries this one lacks:", extra)):
            if keys:
                raise CheckpointError(
                    f"the checkpoint's optimizer state {what} {shown(keys)}: it was "
                    "saved by another optimizer class or with other param-group "
                    "options (an LR scheduler adds 'initial_lr'); build the "
                    "optimizer (and scheduler) as the run that saved it did"
                )

    def _check_groups(
        self, optim_sd: Mapping[str, Any], fqn_of: Mapping[nn.Parameter, str]
    ) -> None:
        """Checks that the params of each group here had the same options saved.

        ``set_state_dict`` gives a param group the saved options of its first
        parameter, so a group that joins parameters saved with different
        options (one group here for a decay and a no-decay group there) would
        silently give them all the first one's learning rate or weight decay.

        Raises:
            CheckpointError: Naming the group, the options that differ, and
                for the first of them (``lr`` if it is one) two parameters with
                their saved values.
        """
        # How a step is computed, not what it computes: no need to agree.
        implementation = {"params", "foreach", "fused", "capturable", "differentiable"}

        def key(value: Any) -> str:  # betas: (0.9, 0.999) and [0.9, 0.999] agree
            return _digest(list(value) if isinstance(value, tuple) else value)

        for index, group in enumerate(self.optimizer.param_groups):
            fqns = [fqn_of[p] for p in group["params"] if p in fqn_of]
            differ: dict[str, tuple[str, Any, Any]] = {}
            for option in sorted(
                group.keys() - implementation, key=lambda o: o != "lr"
            ):
                values = [optim_sd.get(f"param_groups.{f}.{option}") for f in fqns]
                for fqn, value in zip(fqns[1:], values[1:], strict=True):
                    if key(value) != key(values[0]):
                        differ[option] = (fqn, values[0], value)
                        break
            if differ:
                option, (fqn, first, other) = next(iter(differ.items()))
                raise CheckpointError(
                    f"param group {index} here holds parameters saved with different "
                    f"{', '.join(map(repr, differ))}: {option} {first!r} for "
                    f"{fqns[0]!r}, {other!r} for {fqn!r}; one group would silently "
                    "get the first one's. Build the param groups as the run that "
                    "saved it did"
                )

    def _check_scheduler(self, saved: Mapping[str, Any]) -> None:
        """Checks that the LR scheduler was saved for as many param groups.

        A scheduler keeps per-group lists (``base_lrs``, ``_last_lr``,
        ReduceLROnPlateau's ``min_lrs``, LambdaLR's ``lr_lambdas``); loaded for
        another number of groups, LambdaLR, CosineAnnealingLR and SequentialLR
        fail at their first step, others run on misaligned. The lists are
        compared with this scheduler's own (a group added to the optimizer
        after the scheduler was built is in neither).

        Raises:
            CheckpointError: Naming the list and both lengths.
        """
        live = self.lr_scheduler.state_dict() if self.lr_scheduler else {}
        for key in ("base_lrs", "min_lrs", "_last_lr"):
            ours, theirs = live.get(key), saved.get(key)
            if isinstance(ours, list) and isinstance(theirs, list):
                if len(ours) != len(theirs):
                    raise CheckpointError(
                        f"the LR scheduler was saved for {len(theirs)} param "
                        f"group(s) (its {key!r}), this one has {len(ours)}: its "
                        "per-group schedule would not line up. Build the param "
                        "groups as the run that saved it did"
                    )


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields ``(dotted key, leaf)`` pairs of nested dicts, as DCP names them."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], obj


def state_dict_size(state_dict: Mapping[str, Any]) -> tuple[int, int]:
    """Counts the tensors of a (nested) state_dict and their size.

    Args:
        state_dict: A dict as returned by :meth:`StageState.state_dict`.

    Returns:
        ``(number of tensors, their total size in bytes)``.
    """
    tensors = [v for _, v in _leaves(state_dict) if isinstance(v, torch.Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def _digest(value: Any) -> str:
    """A fingerprint of a state_dict leaf, to compare replicas across ranks."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().view(-1).view(torch.uint8)
        return (
            f"{value.dtype}{tuple(value.shape)}"
            + hashlib.sha1(data.numpy().tobytes()).hexdigest()
        )
    return repr(value)


def _shown(items: dict[str, list[int]]) -> str:
    text = ", ".join(f"{k!r} (ranks {r})" for k, r in sorted(items.items())[:10])
    return text + (" ..." if len(items) > 10 else "")


def check_keys(
    state_dict: Mapping[str, Any],
    *,
    owned: tuple[str, ...] = ("model", "optim"),
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Checks across ranks, before ``dcp.save``, that DCP will lose nothing.

    DCP takes equal keys on different ranks for replicas and writes one of
    them, without an error. So every key under ``owned`` (model and optimizer
    state) must be offered by one rank only, and every other entry (step,
    scheduler, data state) must hold the same value on every rank. Each rank
    sends its key names and a SHA-1 of each shared entry (a few KB); call it
    on every rank of ``process_group``.

    Args:
        state_dict: This rank's state_dict, as from :meth:`StageState.state_dict`.
        owned: Top-level entries that each stage owns exclusively.
        process_group: Group of the pipeline ranks; the default group if None.

    Raises:
        KeyCollisionError: On every rank, naming the keys and their ranks, if
            an owned key appears on more than one rank or a shared entry
            differs between ranks.

    Note:
        Known causes of collisions: layers renumbered per stage (``layers.0``
        on every stage), a tied weight copied into two stages, and
        non-persistent buffers that tracing made persistent (see
        :func:`restore_non_persistent_buffers`). Per-rank state such as a
        stage's RNG belongs under a key naming the stage (``rng.stage_3``).
    """
    if not dist.is_initialized():
        return
    mine = {
        "owned": [
            k
            for s in owned
            if s in state_dict
            for k, _ in _leaves(state_dict[s], f"{s}.")
        ],
        "shared": {
            k: _digest(v)
            for s in state_dict
            if s not in owned
            for k, v in _leaves({s: state_dict[s]})
        },
    }
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, mine, group=process_group)
    owners: dict[str, list[int]] = {}
    for rank, theirs in enumerate(gathered):
        for key in theirs["owned"]:
            owners.setdefault(key, []).append(rank)
    collisions = {key: ranks for key, ranks in owners.items() if len(ranks) > 1}
    if collisions:
        raise KeyCollisionError(
            f"{len(collisions)} checkpoint key(s) are offered by more than one rank: "
            f"{_shown(collisions)}. DCP would keep one copy and drop the others. "
            "Give every stage the un-split model's FQNs (keep layers in a "
            "ModuleDict keyed by the global layer index), and call "
            "restore_non_persistent_buffers() on traced stages."
        )
    digests: dict[str, dict[str, list[int]]] = {}
    for rank, theirs in enumerate(gathered):
        for key, digest in theirs["shared"].items():
            digests.setdefault(key, {}).setdefault(digest, []).append(rank)
    differing = {
        key: min(by_digest.values(), key=len)  # the odd rank(s) out
        for key, by_digest in digests.items()
        if len(by_digest) > 1
    }
    if differing:
        raise KeyCollisionError(
            f"{len(differing)} shared checkpoint entr(ies) differ between ranks: "
            f"{_shown(differing)}. DCP would keep one rank's value. Keep per-rank "
            "state under a key that names the stage, or make it equal on all ranks."
        )


class TiedParametersError(CheckpointError, ValueError):
    """The model shares a parameter under several FQNs (tied weights)."""


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
    first_name: dict[int, str] = {}
    ties = []
    for name, param in model.named_parameters(remove_duplicate=False):
        first = first_name.setdefault(id(param), name)
        if first != name:
            ties.append(f"{name!r} is {first!r}")
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


def step_dir(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    """Returns the folder of one step's checkpoint: ``<checkpoint_dir>/step-<step>``.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        step: Number of optimizer steps taken when the checkpoint was saved.
    """
    return Path(checkpoint_dir) / f"step-{step}"


def is_complete(path: str | os.PathLike) -> bool:
    """Tells whether a step folder holds a complete checkpoint.

    DCP's coordinator writes ``.metadata`` only after every rank has written
    its data, so a folder without it was interrupted mid-save.
    """
    return (Path(path) / METADATA_FILE).is_file()


def parse_step(path: str | os.PathLike) -> int | None:
    """The step of a ``step-<N>`` folder name, or None for any other name."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_steps(checkpoint_dir: str | os.PathLike) -> dict[int, Path]:
    """Lists the step folders of a checkpoint folder, complete or not.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        ``{step: folder}`` sorted by step; empty if the folder does not exist.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder.
    """
    root = Path(checkpoint_dir)
    if not root.exists():
        return {}
    if not root.is_dir():
        raise CheckpointDirError(
            f"checkpoint dir {str(root)!r} is a file; pass a folder "
            "(it is created if missing)"
        )
    steps = {}
    for path in root.iterdir():
        step = parse_step(path)
        if step is not None and path.is_dir():
            steps[step] = path
    return dict(sorted(steps.items()))


def find_latest_step(checkpoint_dir: str | os.PathLike) -> Path | None:
    """Finds the newest complete step folder, to resume from.

    Incomplete folders (no ``.metadata``: a crash mid-save) are never chosen;
    a warning names those newer than the one returned.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        The newest complete ``step-<N>`` folder, or None if there is none.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder.
    """
    skipped: list[str] = []
    latest = None
    for path in reversed(list_steps(checkpoint_dir).values()):
        if is_complete(path):
            latest = path
            break
        skipped.append(str(path))
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("skipping incomplete checkpoints (no .metadata) %s", skipped)
    return latest


def _on_coordinator(
    action: str, fn: Any, process_group: dist.ProcessGroup | None
) -> None:
    """Runs ``fn`` on rank 0 only; if it fails, every rank raises the error.

    A failure on rank 0 alone would leave the other ranks waiting in the next
    collective; broadcasting it lets all of them stop with the same message.
    """
    rank0 = not dist.is_initialized() or dist.get_rank(process_group) == 0
    error: list[str | None] = [None]
    if rank0:
        try:
            fn()
        except OSError as e:
            error[0] = f"{action}: {e.strerror or e} ({e.filename or ''})"
    if dist.is_initialized():
        src = dist.get_global_rank(process_group, 0) if process_group else 0
        dist.broadcast_object_list(error, src=src, group=process_group)
    if error[0] is not None:
        raise CheckpointDirError(f"{error[0]}; pass a writable --checkpoint-dir")


def _staging_dir(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    final = step_dir(checkpoint_dir, step)
    return final.with_name(f".{final.name}.partial")


def _prepare_step(
    checkpoint_dir: str | os.PathLike,
    step: int,
    process_group: dist.ProcessGroup | None,
) -> Path:
    """Checks that step-<step> is new and makes its (empty) staging folder."""
    final, staging = step_dir(checkpoint_dir, step), _staging_dir(checkpoint_dir, step)
    list_steps(checkpoint_dir)  # a file where the folder should be: say so
    if is_complete(final):
        raise CheckpointDirError(
            f"{str(final)!r} already exists; checkpoints are never overwritten. "
            "Resume from it, or use a new --checkpoint-dir."
        )

    def make_staging() -> None:
        if final.exists():  # incomplete, not written by publish_step: keep it aside
            aside = final.with_name(f".{final.name}.incomplete-{int(time.time())}")
            final.rename(aside)
            logger.warning("moved incomplete %s aside to %s", final, aside.name)
        if staging.exists():  # left by a crash during an earlier save of this step
            shutil.rmtree(staging)
        staging.mkdir(parents=True)

    _on_coordinator(f"cannot create {staging}", make_staging, process_group)
    return staging


def _publish(
    checkpoint_dir: str | os.PathLike,
    step: int,
    keep_last: int | None,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Renames the staging folder to step-<step>; then prunes old steps."""

    def rename_and_prune() -> None:
        _staging_dir(checkpoint_dir, step).rename(step_dir(checkpoint_dir, step))
        if keep_last is not None:
            remove_old_steps(checkpoint_dir, keep_last)

    _on_coordinator(f"cannot publish step-{step}", rename_and_prune, process_group)


def check_writable(
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Checks, before training, that checkpoints can be written there.

    Rank 0 creates the folder if needed and writes and deletes a probe file,
    so that a wrong path fails in the first second, not at the first save.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        process_group: The ranks that will save; the default group if None.

    Raises:
        CheckpointDirError: On every rank, if the folder is a file, cannot be
            created, or cannot be written.
    """
    list_steps(checkpoint_dir)
    root = Path(checkpoint_dir)

    def probe() -> None:
        root.mkdir(parents=True, exist_ok=True)
        probe_file = root / f".write-test-{os.getpid()}"
        probe_file.write_bytes(b"")
        probe_file.unlink()

    _on_coordinator(f"cannot write to {root}", probe, process_group)


def remove_old_steps(checkpoint_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Deletes all but the newest ``keep_last`` complete step folders.

    Incomplete folders are left alone (they may be a save in progress).

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: How many complete steps to keep; at least 1.

    Returns:
        The folders deleted.

    Raises:
        ValueError: ``keep_last`` is less than 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    complete = [p for p in list_steps(checkpoint_dir).values() if is_complete(p)]
    old = complete[:-keep_last]
    for path in old:
        shutil.rmtree(path)
    if old:
        logger.info("removed old checkpoints %s", [p.name for p in old])
    return old


@contextmanager
def publish_step(
    checkpoint_dir: str | os.PathLike,
    step: int,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Iterator[Path]:
    """Gives every rank a staging folder and publishes it as ``step-<step>``.

    Use it around ``dcp.save``, on every rank::

        with publish_step(checkpoint_dir, step) as checkpoint_id:
            dcp.save(state_dict, checkpoint_id=checkpoint_id)

    The save goes into ``.step-<step>.partial``; once it returned on every
    rank (so the coordinator has written ``.metadata``), rank 0 renames the
    folder to ``step-<step>``, which is atomic on a POSIX file system, and
    only then removes steps beyond ``keep_last``. A crash before that leaves
    only the hidden staging folder, which :func:`find_latest_step` never picks
    and the next save of that step replaces. An existing step folder is never
    written into. If the body raises, nothing is published.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing. On
            several nodes it must be storage that every node sees.
        step: The step being saved.
        keep_last: If set, keep only this many newest complete steps.
        process_group: Group of the ranks that save; the default group if None.

    Yields:
        The staging folder, to pass to ``dcp.save`` as ``checkpoint_id``.

    Raises:
        CheckpointDirError: On every rank: ``step-<step>`` exists, or
            ``checkpoint_dir`` is a file or cannot be written.
    """
    staging = _prepare_step(checkpoint_dir, step, process_group)
    yield staging
    _publish(checkpoint_dir, step, keep_last, process_group)


class AsyncSaver:
    """Saves in the background with ``dcp.async_save``, one save at a time.

    ``save`` returns once DCP has copied the state (staging), so training can
    change the live tensors at once: the checkpoint holds the values of the
    moment of the call. The files are written by a background thread over a
    dedicated gloo group (async saves must not share a group with training
    collectives, and CPU-capable collectives need gloo). The step is
    published, as by :func:`publish_step`, when the save is waited for: by
    the next ``save``, by :meth:`wait`, which a load or the end of training
    must call first, or by ``close``. Two saves in flight on one gloo group
    crash (torch 2.13: "Connection reset by peer"), hence one at a time.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: If set, keep only this many newest complete steps.

    Note:
        Staging copies the state into CPU buffers that are allocated at the
        first save and kept for the next ones (DCP's ``DefaultStager``), so a
        rank holds a second copy of its state for as long as the saver lives:
        budget the state's size again per rank. Keeping them brings the
        training loop's wait below a bare copy of the tensors but for many
        small ones (``bench/README.md``). DCP's plan caching
        (``enable_plan_caching``) is not used: torch 2.13 compares plans
        without dtypes, so after a dtype change it writes the old dtype into
        ``.metadata`` and loads convert silently.
    """

    def __init__(
        self, checkpoint_dir: str | os.PathLike, *, keep_last: int | None = None
    ):
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        self.process_group = (
            dist.new_group(backend="gloo") if dist.is_initialized() else None
        )
        self._pending: tuple[Any, int] | None = None
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,  # staged before save() returns
                use_non_blocking_copy=False,
            )
        )

    def save(self, state_dict: dict[str, Any], step: int) -> Path:
        """Waits for the previous save, then starts saving ``state_dict``.

        Returns:
            The staging folder being written.

        Raises:
            CheckpointError: The previous save failed (see :meth:`wait`).
            CheckpointDirError: As :func:`publish_step`.
        """
        self.wait()
        staging = _prepare_step(self.checkpoint_dir, step, self.process_group)
        with explain_failures(f"saving step-{step}"):
            future = dcp.async_save(
                state_dict,
                checkpoint_id=staging,
                process_group=self.process_group,
                async_stager=self._stager,
            )
        self._pending = (future, step)
        return staging

    def wait(self) -> Path | None:
        """Waits for the save in flight and publishes it.

        Returns:
            The published step folder, or None if no save was in flight.

        Raises:
            CheckpointError: The background save failed, on some rank; the
                step is not published and earlier steps are untouched.
        """
        if self._pending is None:
            return None
        future, step = self._pending
        self._pending = None
        with explain_failures(f"saving step-{step} in the background"):
            future.result()
        _publish(self.checkpoint_dir, step, self.keep_last, self.process_group)
        return step_dir(self.checkpoint_dir, step)

    def close(self) -> None:
        """Waits for the save in flight (publishing it), frees buffers and group."""
        try:
            self.wait()
        finally:
            self._stager.close()
            if self.process_group is not None:
                dist.destroy_process_group(self.process_group)
                self.process_group = None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that equal NaNs compare equal and -0.0 != 0.0."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def diff_state_dicts(
    actual: Mapping[str, Any], expected: Mapping[str, Any]
) -> list[str]:
    """Lists the keys whose values differ between two (nested) state_dicts.

    Tensors must match in dtype, shape and every bit (a NaN equals the same
    NaN; ``0.0`` and ``-0.0`` differ); other values compare with ``==``.

    Args:
        actual: A state_dict, as from :meth:`StageState.state_dict`.
        expected: The state_dict to compare with.

    Returns:
        Sorted dotted keys (as DCP names them) that differ or are in only one
        of the two; empty if they are equal.
    """
    a, b = dict(_leaves(actual)), dict(_leaves(expected))
    differ = set(a.keys() ^ b.keys())
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = (
                x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(_bits(x), _bits(y))
            )
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = False
        else:
            same = x == y
        if not same:
            differ.add(key)
    return sorted(differ)


# Loading without running code ------------------------------------------------
#
# A DCP checkpoint is partly pickle: torch 2.13's FileSystemReader.read_metadata
# unpickles .metadata with pickle.load, and DefaultLoadPlanner reads non-tensor
# items with torch.load(weights_only=False). Whoever can write a checkpoint
# folder could run code on every rank that loads it. The two classes below
# accept only what a checkpoint legitimately holds.

#: Environment variable that, set to 1, lets the safe reader and planner load
#: any pickle, as plain DCP does. Only for checkpoints from a trusted source.
TRUST_ENV = "PIPPY_TRUST_CHECKPOINT"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
}


class CheckpointDirError(CheckpointError, NotADirectoryError):
    """The checkpoint folder is not a folder, or cannot be written."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was asked for."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint holds a pickled object that could run code when loaded."""


def _trusted(trusted: bool | None) -> bool:
    return os.environ.get(TRUST_ENV) == "1" if trusted is None else trusted


def _refusal(what: str, refused: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"refused to load {what}: it would import {refused}, which no checkpoint "
        "written by DCP or pippy holds, and unpickling it could run code. If you "
        f"trust where the checkpoint comes from, set {TRUST_ENV}=1 (or pass "
        "trusted=True, or --trust-checkpoint to python -m pippy) to load it "
        "with plain pickle."
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global but DCP's own classes."""

    def __init__(self, file: Any, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise _refusal(self.name, f"{module}.{name}")
        return super().find_class(module, name)


def find_damage(path: str | os.PathLike, metadata: Metadata) -> list[str]:
    """Lists the data files that ``.metadata`` names but are missing or short.

    A step is published whole, so this finds damage done afterwards: a rank's
    file deleted, or a copy or sync of the folder cut short. DCP would fail
    mid-load with a ``FileNotFoundError`` (or a short read) on the ranks that
    read that file, and ``find_latest_step`` would pick the same step again
    on every restart.

    Args:
        path: A step folder.
        metadata: Its metadata, from :func:`read_metadata`.

    Returns:
        One line per damaged file (``"__1_0.distcp is missing"``); empty if
        every file is there and at least as long as its items.
    """
    folder = Path(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            end = info.offset + info.length
            needed[name] = max(needed.get(name, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size < size:
            problems.append(
                f"{name} has {path.stat().st_size} bytes, its items need {size}"
            )
    return problems


def _check_data_files(folder: Path, metadata: Metadata) -> None:
    """Raises a :class:`CheckpointError` naming the files of :func:`find_damage`."""
    problems = find_damage(folder, metadata)
    if problems:
        raise CheckpointError(
            f"{str(folder)!r} is damaged: {'; '.join(problems[:4])}"
            f"{' ...' if len(problems) > 4 else ''}. Restore those files, or move "
            "the folder out of the checkpoint folder to resume from an earlier step"
        )


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles ``.metadata`` with an allow-list.

    Only DCP's metadata classes, ``torch.Size``, torch dtypes and layouts,
    paths and plain builtins are accepted; any other global (``os.system``,
    ``builtins.eval``, a class of some package) is refused before it is
    imported or called.

    The metadata is read and checked when the reader is made, before
    ``dcp.load`` runs: inside it, DCP would catch the error, log its
    traceback on every rank and raise an unrelated ``AssertionError``
    ("metadata is None").

    Args:
        path: The step folder (the ``checkpoint_id``).
        trusted: True loads any pickle, as ``FileSystemReader`` does. None
            (the default) reads ``PIPPY_TRUST_CHECKPOINT=1`` from the
            environment.
        check_files: Also check the data files (:func:`find_damage`), as a
            load needs; False reads the metadata alone.

    Raises:
        CheckpointNotFoundError: ``path`` is not a folder, or has no
            ``.metadata`` (its save did not finish).
        UnsafeCheckpointError: ``.metadata`` holds a refused global; the
            message names the file and the global.
        CheckpointError: ``.metadata`` is truncated or not DCP's, or a data
            file it names is missing or shorter than the items it should hold.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trusted: bool | None = None,
        check_files: bool = True,
    ) -> None:
        super().__init__(path)
        self.trusted = _trusted(trusted)
        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint folder at {str(folder)!r}")
        steps = [p for p in list_steps(folder).values() if is_complete(p)]
        if not is_complete(folder) and steps:
            raise CheckpointNotFoundError(
                f"{str(folder)!r} is a run's checkpoint folder; pass one of its "
                f"steps, e.g. {str(steps[-1])!r}"
            )
        if not is_complete(folder):
            raise CheckpointNotFoundError(
                f"{str(folder)!r} is not a complete checkpoint (no {METADATA_FILE}: "
                "its save did not finish); use an earlier step"
            )
        metadata_path = folder / METADATA_FILE
        try:
            with open(metadata_path, "rb") as metadata_file:
                if self.trusted:
                    metadata = pickle.load(metadata_file)
                else:
                    unpickler = _MetadataUnpickler(metadata_file, str(metadata_path))
                    metadata = unpickler.load()
        except UnsafeCheckpointError:
            raise
        except (EOFError, pickle.UnpicklingError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{metadata_path} is damaged: {e}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{metadata_path} does not hold DCP metadata")
        if check_files:
            _check_data_files(folder, metadata)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Returns the metadata read and checked when the reader was made."""
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that runs no pickled code and drops no key.

    Non-tensor items (step, LR scheduler state, optimizer options) are read
    with ``torch.load(weights_only=True)``, which accepts containers,
    numbers, strings and tensors and refuses other globals.

    It also checks, on the coordinator, that every checkpoint key under
    ``must_read`` is read by some rank. DCP ignores keys that no rank asks
    for, so without this a checkpoint with more layers than the model, or
    per-stage state saved under a stage index that no longer exists after a
    change of pipeline degree, would load "successfully" and lose them.

    A parameter that had no optimizer state when saved (it requires grad but
    its gradient stayed None: an unused head, an expert no token was routed
    to) has ``optim.scalars.<fqn>`` in the checkpoint and no
    ``optim.state.<fqn>.*``, while the fresh optimizer loaded into has state
    for every parameter. Its
    ``optim.state.<fqn>.*`` keys are then not read and are removed from the
    state_dict being loaded, so that :meth:`StageState.load_state_dict` gives
    it no state, as saved; DCP alone stops at the first such key.

    Args:
        trusted: True reads any pickle, as ``DefaultLoadPlanner`` does. None
            (the default) reads ``PIPPY_TRUST_CHECKPOINT=1`` from the
            environment.
        must_read: Prefixes of the checkpoint keys that some rank must read;
            ``("",)`` (the default) is every key, ``()`` none. Loading only
            the weights (a fine-tuning start) passes ``("model.",)``.
        **kwargs: Passed to ``DefaultLoadPlanner``.

    Raises:
        UnsafeCheckpointError: From :meth:`load_bytes`, naming the key, its
            file and the refused global.
        CheckpointError: From :meth:`create_global_plan`, naming the keys
            that no rank reads.
    """

    def __init__(
        self,
        *,
        trusted: bool | None = None,
        must_read: tuple[str, ...] = ("",),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trusted = _trusted(trusted)
        self.must_read = must_read

    def create_local_plan(self) -> LoadPlan:
        """Checks every requested key (present, shape, dtype), then plans.

        DCP itself stops at the first missing key or shape, and copies a
        tensor of another dtype without a word (float32 into bfloat16).
        """
        saved = self.metadata.state_dict_metadata if self.metadata else {}
        self._stateless = _stateless_params(self.state_dict.keys(), saved.keys())
        problems: dict[str, str] = {}  # key: what is wrong with it
        for key, value in list(self.state_dict.items()):
            item = saved.get(key)
            problem = None
            if item is None:
                if _split_state_key(key) in self._stateless:
                    self._drop(key)  # nothing to read: it had no state
                elif not self.allow_partial_load:
                    problem = f"{key!r} is not in the checkpoint"
            elif isinstance(value, torch.Tensor):
                if not isinstance(item, TensorStorageMetadata):
                    problem = f"{key!r} is not a tensor in the checkpoint"
                elif tuple(item.size) != tuple(value.shape):
                    problem = (
                        f"{key!r} has shape {list(item.size)} in the checkpoint, "
                        f"{list(value.shape)} here"
                    )
                elif item.properties.dtype != value.dtype:
                    problem = (
                        f"{key!r} is {item.properties.dtype} in the checkpoint, "
                        f"{value.dtype} here"
                    )
            if problem is not None:
                problems[key] = problem
        if problems:
            shown = "; ".join(list(problems.values())[:6])
            fix = "Build the model with the configuration it was saved with."
            if all(_split_state_key(k) for k in problems):
                fix = (
                    "Only the optimizer's state differs: build the optimizer as the "
                    "run that saved it did (its class, and options that add state, "
                    "such as amsgrad or momentum)."
                )
            elif all(re.search(r"(^|\.)lr_scheduler\.", k) for k in problems):
                fix = "Build the LR scheduler (or none) as the run that saved it did."
            wants_packed = any(k.startswith("optim.scalars.") for k in self.state_dict)
            if wants_packed and any(k.startswith("optim.param_groups.") for k in saved):
                fix = (
                    "It was written by pippy before optimizer options were packed "
                    "into optim.scalars.<fqn> (it has optim.param_groups.* keys): "
                    "load its weights alone (--init-from, or load_model without "
                    "an optimizer)."
                )
            raise CheckpointError(
                f"the checkpoint does not match this model ({len(problems)} "
                f"problem(s)): {shown}{' ...' if len(problems) > 6 else ''}. {fix}"
            )
        return super().create_local_plan()

    def _drop(self, key: str) -> None:
        """Removes ``key`` from what DCP reads and from the caller's state_dict."""
        del self.state_dict[key]
        path = self.mappings.pop(key, None) if self.flatten_state_dict else None
        if path is not None:
            parent: Any = self.original_state_dict
            for part in path[:-1]:
                parent = parent[part]
            del parent[path[-1]]

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's global plan, after checking that no required key is left unread."""
        global_plan = super().create_global_plan(global_plan)
        read = {item.storage_index.fqn for plan in global_plan for item in plan.items}
        unread = sorted(
            key
            for key in (self.metadata.state_dict_metadata if self.metadata else {})
            if key.startswith(self.must_read) and key not in read
        )
        if unread:
            shown = ", ".join(repr(k) for k in unread[:8])
            why = (
                "The model or its split does not match the checkpoint (fewer "
                "layers? per-stage state keyed by a stage index that no longer "
                "exists?). Fix the model, or remap those keys before loading."
            )
            if all(_split_state_key(k) for k in unread):
                why = (
                    "They are optimizer state that the optimizer loaded into has no "
                    "place for: it is another class (SGD without momentum has no "
                    "state), it has stepped only some parameters (a fresh one gets "
                    "state for every parameter that requires grad), or they do not "
                    "require grad here. Build the optimizer as the run that saved "
                    "it did, freshly, and unfreeze them."
                )
            raise CheckpointError(
                f"{len(unread)} key(s) of the checkpoint are read by no rank and "
                f"would be dropped: {shown}{' ...' if len(unread) > 8 else ''}. {why}"
            )
        return global_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Checks one non-tensor item under ``weights_only`` rules, then loads it.

        An item that passes holds only allow-listed globals, so DCP's own
        loading of the same bytes runs no code either.
        """
        if not self.trusted:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                storage = self.metadata.storage_data if self.metadata else {}
                info = storage.get(read_item.storage_index)
                where = getattr(info, "relative_path", "its data file")
                what = f"item {read_item.dest_index.fqn!r} of {where}"
                match = re.search(r"GLOBAL ([\w.]+)", str(e))
                if match is None:  # not a refused global: the bytes are damaged
                    raise CheckpointError(f"{what} is damaged: {e}") from None
                raise _refusal(what, match.group(1)) from None
            value.seek(0)
        super().load_bytes(read_item, value)


def _said(error: BaseException) -> str:
    """An exception's message; an ``EOFError`` without one is a short file."""
    if isinstance(error, EOFError):
        return str(error) or "the file ended early"
    return str(error)


def _failed_on(action: str, failures: Mapping[int, str]) -> CheckpointError:
    """One error for failures on several ranks: a line per rank, by rank."""
    lines = "\n".join(f"  rank {rank}: {failures[rank]}" for rank in sorted(failures))
    return CheckpointError(f"{action} failed on {len(failures)} rank(s):\n{lines}")


@contextmanager
def explain_failures(action: str) -> Iterator[None]:
    """Turns DCP's ``CheckpointException`` into one error that names each rank.

    DCP gathers the ranks' exceptions into a ``CheckpointException``, which
    is a ``BaseException`` (so ``except Exception`` misses it) and prints as
    a traceback per rank. Use this around ``dcp.save`` and ``dcp.load``.

    Args:
        action: What was attempted, for the message (``"loading step-20"``).

    Raises:
        UnsafeCheckpointError: Some rank refused a pickle (the first message).
        CheckpointError: Any other failure: one line per failed rank with the
            exception's type and message.
    """
    try:
        yield
    except CheckpointException as e:
        failures = {rank: exc for rank, (exc, _trace) in sorted(e.failures.items())}
        for exc in failures.values():
            if isinstance(exc, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(exc)) from None
        raise _failed_on(
            action,
            {rank: f"{type(x).__name__}: {_said(x)}" for rank, x in failures.items()},
        ) from None


@contextmanager
def fail_together(
    action: str, process_group: dist.ProcessGroup | None = None
) -> Iterator[None]:
    """Makes a step that each rank runs alone fail on every rank, or on none.

    Applying a loaded state_dict (:meth:`StageState.load_state_dict`) runs on
    each rank without collectives. If its checks refuse on one rank only (a
    param group that only one stage has), the other ranks would go on to
    train and die in their next collective with a gloo or NCCL error that
    hides the cause. Around such a step, every rank learns every rank's
    outcome (one ``all_gather_object``) and all raise the same error. Every
    rank of ``process_group`` must enter it.

    Args:
        action: What was attempted, for the message (``"loading step-20"``).
        process_group: The ranks that agree; the default group if None.

    Raises:
        CheckpointError: On every rank, if the body raised an ``Exception``
            on some rank: one line per failed rank (its global rank) with the
            exception's type and message. Without a process group, the
            body's own exception.
        ValueError: This rank is not in ``process_group``.
    """
    if dist.is_initialized() and dist.get_rank(process_group) < 0:
        raise ValueError(
            f"fail_together: rank {dist.get_rank()} is not in the process group"
        )
    error: str | None = None
    try:
        yield
    except Exception as e:
        if not dist.is_initialized():
            raise
        error = f"{type(e).__name__}: {_said(e)}".replace("\n", "\n    ")
    if not dist.is_initialized():
        return
    errors: list[str | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(errors, error, group=process_group)
    failed = {
        dist.get_global_rank(process_group, r) if process_group else r: e
        for r, e in enumerate(errors)
        if e is not None
    }
    if failed:
        raise _failed_on(action, failed)


def read_metadata(path: str | os.PathLike, *, trusted: bool | None = None) -> Metadata:
    """Reads a step folder's ``.metadata`` with :class:`SafeFileSystemReader`.

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`.

    Returns:
        DCP's ``Metadata``: ``state_dict_metadata`` maps every key to its
        shape and dtype, ``storage_data`` every chunk to its file.

    Raises:
        CheckpointNotFoundError: ``path`` is not a complete checkpoint.
        UnsafeCheckpointError: ``.metadata`` holds a refused global.
    """
    reader = SafeFileSystemReader(path, trusted=trusted, check_files=False)
    return reader.read_metadata()


def read_checkpoint(
    path: str | os.PathLike, *, prefix: str = "", trusted: bool | None = None
) -> dict[str, Any]:
    """Reads a whole checkpoint, or the keys under a prefix, in this process.

    The keys come back flat, as DCP names them, with ``prefix`` removed: with
    ``prefix="model."`` the result is the un-split model's ``state_dict``,
    ready for ``model.load_state_dict(..., strict=True)``. Works without a
    process group (reads every rank's file here) and inside one (this rank
    alone reads, with no collective). Reads through the safe reader and
    planner.

    Args:
        path: A ``step-<N>`` folder.
        prefix: Only keys starting with this are read.
        trusted: See :class:`SafeFileSystemReader`.

    Returns:
        ``{key: tensor or value}``; tensors on the CPU, in their saved dtype.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As
            :func:`read_metadata`.
        KeyError: No key starts with ``prefix``.
        CheckpointError: A data file is missing or damaged.
    """
    reader = SafeFileSystemReader(path, trusted=trusted)
    state_dict: dict[str, Any] = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix):
            if isinstance(item, TensorStorageMetadata):
                state_dict[key] = torch.empty(item.size, dtype=item.properties.dtype)
            else:
                state_dict[key] = None  # replaced by the loaded value
    if not state_dict:
        raise KeyError(f"no key in {str(path)!r} starts with {prefix!r}")
    with explain_failures(f"reading {path}"), warnings.catch_warnings():
        # One process reading alone is the point here, not a mistake to warn of.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=SafeLoadPlanner(trusted=trusted, must_read=(prefix,)),
            no_dist=True,
        )
    return {key[len(prefix) :]: value for key, value in state_dict.items()}


def load_model(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trusted: bool | None = None,
) -> int:
    """Loads a pipeline checkpoint into the un-split model, in one process.

    The stages' keys are the un-split model's FQNs, so their union is the
    whole model: no process group and no pipeline are needed. For example::

        model = GPT(ModelArgs())
        step = pippy.checkpoint.load_model("checkpoints/step-20", model)
        logits = model(tokens)  # equal to the pipeline's

    The same call loads into a model sharded with FSDP2 (``fully_shard``),
    on every rank of its group: DCP reads each rank's shards.

    Args:
        path: A ``step-<N>`` folder.
        model: The un-split model; every parameter and persistent buffer must
            be in the checkpoint (strict), and every model key of the
            checkpoint must be in the model.
        optimizer: If given, its state (AdamW moments, step, options) is loaded
            too; build it over ``model.parameters()`` first. Option entries
            it lacks (an LR scheduler's ``initial_lr``) are not required.
        trusted: See :class:`SafeFileSystemReader`.

    Returns:
        The step the checkpoint was saved at.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As :func:`read_metadata`.
        CheckpointError: Keys missing on either side, or shapes that differ.
    """
    reader = SafeFileSystemReader(path, trusted=trusted)
    state = None if optimizer is None else StageState(model, optimizer)
    if state is None:
        state_dict: dict[str, Any] = {"model": get_model_state_dict(model), "step": 0}
    else:
        state_dict = state.state_dict()
    # Every weight and every optimizer moment must land somewhere; per-group
    # options the new optimizer lacks (a scheduler's initial_lr) may not.
    must_read = ("model.", "optim.") if optimizer is not None else ("model.",)
    with explain_failures(f"loading {path}"), warnings.catch_warnings():
        # Without a process group, one process reading alone is the intent.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=SafeLoadPlanner(trusted=trusted, must_read=must_read),
        )
    with fail_together(f"loading {path}"):
        if state is None:
            set_model_state_dict(model, state_dict["model"])
        else:
            state.load_state_dict(state_dict)
    return int(state_dict["step"])
