"""A pipeline checkpoint in one process: a flat dict, or the un-split model.

The stages' keys are the un-split model's FQNs, so their union is the whole
model: no process group and no pipeline are needed to read it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pippy.checkpoint.api import load_stage, open_step, read_into
from pippy.checkpoint.checks import tied_groups
from pippy.checkpoint.errors import CheckpointError
from pippy.checkpoint.layouts import PIPPY, detect_layout, from_torchtitan, pippy_name
from pippy.checkpoint.state import StageState
from pippy.checkpoint.storage import Location

__all__ = ["load_model", "read_checkpoint"]


def read_checkpoint(
    path: Location,
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
    reader, planner = open_step(path, trusted=trusted, verify=verify, no_dist=True)
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
    planner.must_read = tuple(state_dict)
    read_into(state_dict, reader, planner, no_dist=True)
    if name is pippy_name:
        state_dict = from_torchtitan(state_dict)
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


def _check_ties(
    path: Location, model: nn.Module, trusted: bool | None, verify: bool
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
    path: Location,
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
