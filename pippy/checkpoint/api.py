"""The one save path and the one load path, and reading a checkpoint in one process.

:func:`save_stage` and :func:`load_stage` are what every rank calls; the
reference example spells the same steps out with ``dcp.save`` and
``dcp.load`` to teach them. :func:`read_checkpoint` and :func:`load_model`
read a pipeline checkpoint without a pipeline.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import SavePlanner, StorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh

from pippy.checkpoint.checks import named_leaves, tied_groups
from pippy.checkpoint.collisions import check_keys
from pippy.checkpoint.errors import CheckpointError, explain_failures, fail_together
from pippy.checkpoint.layouts import (
    PIPPY,
    detect_layout,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.load_planner import SafeLoadPlanner
from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.safe_load import SafeFileSystemReader
from pippy.checkpoint.stage_state import StageState
from pippy.checkpoint.steps import publish_step, step_dir

__all__ = ["load_model", "load_stage", "read_checkpoint", "save_stage"]

logger = logging.getLogger(__name__)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, if it was on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@_gc_paused()
def save_stage(
    state: StageState | Mapping[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
) -> Path:
    """Saves this rank's stage into ``<checkpoint_dir>/step-<step>``, on every rank.

    The sequence the reference example spells out: take the state_dict,
    check across ranks that DCP will lose no key (:func:`check_keys`), then
    ``dcp.save`` into the step's staging folder, published once complete
    (:func:`publish_step`). Call it on every rank of ``process_group`` at
    once. Python's cyclic garbage collector is paused meanwhile: a save
    allocates many short-lived objects, which would otherwise set off a full
    collection of the whole process in some saves.

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict.
        checkpoint_dir: The run's checkpoint folder; created if missing.
        step: The step saved; defaults to ``state.step`` for a
            :class:`StageState` and is required otherwise.
        keep_last: If set, keep only this many newest complete steps.
        process_group: The ranks that save; the default group if None.
        mesh: The ranks' ``DeviceMesh`` with a ``"pp"`` dim and data-parallel
            dims, for :func:`check_keys`: stages replicated over data-parallel
            ranks are compared, not taken for collisions. DCP writes each
            replicated item once, spread over the replicas.
        storage_writer: DCP's storage writer; None writes files and a
            manifest of their checksums with :class:`ManifestWriter` (which
            loads verify by default). Its path is set to the staging folder.
        planner: DCP's save planner; None uses ``DefaultSavePlanner``.

    Returns:
        The published step folder.

    Raises:
        ValueError: No ``step`` for a plain state_dict, or the state's own
            ``step`` entry is another; or as :func:`check_keys`.
        CheckpointError: Taking the state failed on another rank (this one
            raises its own error).
        KeyCollisionError: As :func:`check_keys` (also its subclass
            ``DivergedReplicasError``, and ``NestedStateError``); nothing is
            written.
        CheckpointDirError: As :func:`publish_step`.
        CheckpointError: ``dcp.save`` failed on some rank (one line per rank);
            nothing is published.
    """
    if step is None and not isinstance(state, StageState):
        raise ValueError("save_stage needs step= for a plain state_dict")
    # Taking the state runs on each rank alone: a refusal on one rank (its
    # parts' LR schedulers differ) stops all, not only the one.
    with fail_together("saving", process_group, keep_own_error=True):
        if isinstance(state, StageState):
            state_dict = state.state_dict()
            step = state.step if step is None else step
        else:
            state_dict = dict(state)
        stored = state_dict.get("step")
        if isinstance(stored, int) and stored != step:
            raise ValueError(f"the state holds step {stored}; it cannot be step-{step}")
    assert step is not None
    check_keys(state_dict, process_group=process_group, mesh=mesh)
    with publish_step(
        checkpoint_dir, step, keep_last=keep_last, process_group=process_group
    ) as checkpoint_id:
        start = time.perf_counter()
        with explain_failures(f"saving step-{step}"):
            dcp.save(
                state_dict,
                checkpoint_id=checkpoint_id,
                storage_writer=storage_writer
                or ManifestWriter(checkpoint_id, step=step),
                planner=planner,
                process_group=process_group,
            )
        end = time.perf_counter()
        logger.debug(
            "dcp.save of step-%d took %.3f s",
            step,
            end - start,
            extra={"dcp_save_start": start, "dcp_save_end": end},
        )
    return step_dir(checkpoint_dir, step)


def _load(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    reader: SafeFileSystemReader,
    *,
    must_read: tuple[str, ...],
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` in place through the safe reader and planner, errors explained."""
    planner = SafeLoadPlanner(trusted=reader.trusted, must_read=must_read)
    with explain_failures(f"loading {path}"), warnings.catch_warnings():
        # Without a process group, one process reading alone is the intent.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )


def _set_leaf(state_dict: dict[str, Any], key: str, value: Any) -> None:
    """Sets the leaf of a nested state_dict that DCP names ``key``."""
    for name, child in state_dict.items():
        if key == name:
            state_dict[name] = value
            return
        if isinstance(child, dict) and key.startswith(f"{name}."):
            return _set_leaf(child, key[len(name) + 1 :], value)
    raise KeyError(key)


def _load_any_layout(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    reader: SafeFileSystemReader,
    *,
    must_read: tuple[str, ...],
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """:func:`_load` of a state_dict in pippy's names, from either layout."""
    saved = reader.read_metadata().state_dict_metadata
    if detect_layout(saved) == PIPPY:
        return _load(
            state_dict, path, reader, must_read=must_read, process_group=process_group
        )
    wanted = dict(named_leaves(state_dict))
    flat = to_torchtitan(wanted)
    must = tuple(k for k in saved if pippy_name(k).startswith(must_read))
    _load(flat, path, reader, must_read=must, process_group=process_group)
    for key, value in from_torchtitan(flat).items():
        if key in wanted:
            _set_leaf(state_dict, key, value)


def load_stage(
    state: StageState | dict[str, Any],
    path: str | os.PathLike,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Loads a step into this rank's stage, on every rank.

    The sequence the reference example spells out: build the stage and its
    optimizer first (DCP loads in place), take the state_dict (this creates
    the empty optimizer state to fill), ``dcp.load`` it through
    :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`, then apply it
    with :meth:`StageState.load_state_dict` on every rank or on none
    (:func:`fail_together`). Each rank reads only the keys its stage owns.

    Args:
        state: The stage's :class:`StageState` (``StageState(module)``
            without an optimizer loads the weights alone), or a nested
            state_dict that is filled in place and not applied.
        path: A ``step-<N>`` folder.
        must_read: Prefixes of the checkpoint's keys that some rank must read
            (see :class:`SafeLoadPlanner`); ``("model.",)`` for weights alone.
        trusted: See :class:`SafeFileSystemReader`.
        verify: Check every item read against the step's ``manifest.json``;
            False loads a checkpoint without one (plain DCP's), unverified.
        process_group: The ranks that load; the default group if None.

    Returns:
        The state_dict as loaded (tensors are the stage's own).

    Raises:
        CheckpointNotFoundError: ``path`` is not a complete checkpoint.
        UnsafeCheckpointError: It holds a pickle that could run code.
        CheckpointError: It is damaged or does not match the stage (keys,
            shapes, dtypes, optimizer or param groups): on every rank, one
            line per rank that refused.
    """
    reader = SafeFileSystemReader(path, trusted=trusted, verify=verify)
    state_dict = state.state_dict() if isinstance(state, StageState) else state
    _load_any_layout(
        state_dict, path, reader, must_read=must_read, process_group=process_group
    )
    if isinstance(state, StageState):
        with fail_together(f"loading {path}", process_group):
            state.load_state_dict(state_dict)
    return state_dict


def read_checkpoint(
    path: str | os.PathLike,
    *,
    prefix: str = "",
    keys: Collection[str] | None = None,
    trusted: bool | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Reads a whole checkpoint, or the keys under a prefix, in this process.

    The keys come back flat, as DCP names them, with ``prefix`` removed: with
    ``prefix="model."`` the result is the un-split model's ``state_dict``,
    ready for ``model.load_state_dict(..., strict=True)``. Works without a
    process group (reads every rank's file here) and inside one (this rank
    alone reads, with no collective). Reads through the safe reader and
    planner. A checkpoint in torchtitan's layout reads under pippy's names
    (see :mod:`~pippy.checkpoint.layouts`): its root model keys as
    ``model.<fqn>``.

    Args:
        path: A ``step-<N>`` folder, in pippy's or torchtitan's layout.
        prefix: Only keys starting with this are read.
        keys: If given, only these keys (without ``prefix``) are read; those
            not in the checkpoint are left out of the result.
        trusted: See :class:`SafeFileSystemReader`.
        verify: As :func:`load_stage`.

    Returns:
        ``{key: tensor or value}``; tensors on the CPU, in their saved dtype.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As :func:`read_metadata`.
        KeyError: No key starts with ``prefix``.
        CheckpointError: A data file is missing or damaged.
    """
    reader = SafeFileSystemReader(path, trusted=trusted, verify=verify)
    saved = reader.read_metadata().state_dict_metadata
    name = (lambda k: k) if detect_layout(saved) == PIPPY else pippy_name
    state_dict: dict[str, Any] = {}
    for key, item in saved.items():
        if name(key).startswith(prefix) and (
            keys is None or name(key)[len(prefix) :] in keys
        ):
            if isinstance(item, TensorStorageMetadata):
                state_dict[key] = torch.empty(item.size, dtype=item.properties.dtype)
            else:
                state_dict[key] = None  # replaced by the loaded value
    if not state_dict:
        raise KeyError(f"no key in {str(path)!r} starts with {prefix!r}")
    _load(state_dict, path, reader, must_read=tuple(state_dict), no_dist=True)
    if name is pippy_name:
        state_dict = from_torchtitan(state_dict)
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def _check_ties(
    path: str | os.PathLike, model: nn.Module, trusted: bool | None, verify: bool
) -> None:
    """Refuses a checkpoint whose keys tied in ``model`` hold different values."""
    groups = tied_groups(model)
    if not groups:
        return
    wanted = {fqn for group in groups for fqn in group}
    try:
        saved = read_checkpoint(
            path, prefix="model.", keys=wanted, trusted=trusted, verify=verify
        )
    except KeyError:  # none of them is in the checkpoint: the load names them
        return
    for group in groups:
        present = [fqn for fqn in group if fqn in saved]
        first = present[0] if present else ""
        differ = [f for f in present[1:] if not torch.equal(saved[f], saved[first])]
        if differ:
            raise CheckpointError(
                f"{', '.join(map(repr, [first, *differ]))} are one tied parameter in "
                f"this model but hold different values in {str(path)!r}: loading "
                "would keep one and silently lose the other. Load into a model "
                "with them untied (for Hugging Face, tie_word_embeddings=False)"
            )


def load_model(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trusted: bool | None = None,
    verify: bool = True,
) -> int:
    """Loads a pipeline checkpoint into the un-split model, in one process.

    The stages' keys are the un-split model's FQNs, so their union is the
    whole model: no process group and no pipeline are needed. For example::

        model = GPT(ModelArgs())
        step = pippy.checkpoint.load_model("checkpoints/step-20", model)

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
        verify: As :func:`load_stage`.

    Returns:
        The step the checkpoint was saved at.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As :func:`read_metadata`.
        CheckpointError: Keys missing on either side, or shapes that differ;
            or parameters tied in ``model`` (an output head sharing the
            embedding's weight) hold different values in the checkpoint.

    Note:
        Into a model with tied parameters, loading each tied key writes the
        same tensor, and the last one read would win. The tied keys are
        therefore compared first, and the load refused unless they agree.
    """
    _check_ties(path, model, trusted, verify)
    state = StageState(model, optimizer)
    # Every weight and every optimizer moment must land somewhere; per-group
    # options the new optimizer lacks (a scheduler's initial_lr) may not.
    must_read = ("model.", "optim.") if optimizer is not None else ("model.",)
    load_stage(state, path, must_read=must_read, trusted=trusted, verify=verify)
    return state.step
