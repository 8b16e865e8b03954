"""A checkpoint in one process: read whole, loaded into the un-split model, exported.

The stages' keys are the un-split model's FQNs, so their union is the whole
model, read with no process group or pipeline; :func:`verify_step` checks a
step's every item against its manifest. :func:`export_hf` writes
``safetensors`` directly (DCP's Hugging Face consolidation mishandles integer
and bool tensors in torch 2.13, pytorch/pytorch#192485).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from pippy.checkpoint.checks import (
    diff_state_dicts,
    fingerprint,
    named_leaves,
    tied_groups,
)
from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointError,
    explain_failures,
)
from pippy.checkpoint.hf import experts_one_by_one
from pippy.checkpoint.keys import (
    PIPPY,
    TORCHTITAN,
    detect_layout,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.load import load_stage, open_step, read_into
from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.reader import verify_step
from pippy.checkpoint.save import take_state
from pippy.checkpoint.state import StageState
from pippy.checkpoint.steps import is_step_name, list_steps, step_holding
from pippy.checkpoint.storage import Location, Storage, check_publishable, storage_for

__all__ = [
    "convert_layout",
    "diff_state_dicts",
    "fingerprints",
    "export_hf",
    "load_model",
    "read_checkpoint",
    "verify_step",
]

logger = logging.getLogger(__name__)


def read_checkpoint(
    path: Location,
    *,
    prefix: str = "",
    keys: Collection[str] | None = None,
    trusted: bool | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Reads a whole checkpoint, or the keys under a prefix, in this process.

    Keys come back flat, in pippy's names (a torchtitan checkpoint's too), with
    ``prefix`` removed: ``prefix="model."`` gives the un-split model's
    ``state_dict``; floating-point tensors outside the model's and the
    optimizer's sections are then left out with a warning naming them (a plain
    DCP step keyed as a Hugging Face model keeps ``lm_head.weight`` there).
    This rank alone reads, with no collective, through the safe reader and
    planner.

    Args:
        path: A ``step-<N>`` folder, in pippy's or torchtitan's layout.
        prefix: Only keys starting with this are read.
        keys: If given, only these keys (without ``prefix``) are read; those
            not in the checkpoint are left out of the result.
        trusted: See :class:`~pippy.checkpoint.reader.SafeFileSystemReader`.
        verify: As :func:`~pippy.checkpoint.load_stage`.

    Returns:
        ``{key: tensor or value}``; tensors on the CPU, in their saved dtype.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As
            :func:`~pippy.checkpoint.reader.read_metadata`.
        KeyError: No key starts with ``prefix``.
        CheckpointError: A data file is missing or damaged.
    """
    reader, planner = open_step(path, trusted=trusted, verify=verify, no_dist=True)
    saved = reader.read_metadata().state_dict_metadata
    name = (lambda k: k) if detect_layout(saved) == PIPPY else pippy_name
    state_dict: dict[str, Any] = {}
    left = []  # reading the model: weights a foreign layout keeps outside it
    for key, item in saved.items():
        fqn = name(key)
        if fqn.startswith(prefix) and (keys is None or fqn[len(prefix) :] in keys):
            if isinstance(item, TensorStorageMetadata):
                state_dict[key] = torch.empty(item.size, dtype=item.properties.dtype)
            else:
                state_dict[key] = None  # replaced by the loaded value
        elif (
            prefix == "model."
            and isinstance(item, TensorStorageMetadata)
            and item.properties.dtype.is_floating_point
            and not fqn.startswith(("model.", "optim."))
        ):
            left.append(key)
    if left:
        logger.warning(
            "%s: only its model section is read; %d floating-point tensor(s) "
            "outside it and the optimizer's are left out: %s",
            path,
            len(left),
            ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""),
        )
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
        first, *others = [fqn for fqn in group if fqn in saved] or [""]
        differ = [f for f in others if not torch.equal(saved[f], saved[first])]
        if differ:
            raise CheckpointError(
                f"{', '.join(map(repr, [first, *differ]))} are one tied parameter in "
                f"this model but hold different values in {str(path)!r}: loading "
                "would keep one and silently lose the other. Load into a model "
                "with them untied (for Hugging Face, tie_word_embeddings=False)"
            )


def fingerprints(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """A short text per leaf of a (nested) state_dict that differs when it does.

    Compare two with ``==`` to tell whether two states are equal bit for bit
    without holding both, e.g. a model's before it is freed and another's
    after its checkpoint was loaded into it.

    Args:
        state_dict: As from ``StageState.state_dict()``.

    Returns:
        ``{dotted key (as DCP names it): text}``; a tensor's text is its
        dtype, shape and the CRC-32C of its bytes (a DTensor's, this rank's
        shard; a GPU tensor is copied to the host one at a time), another
        value's its ``repr``.
    """
    return {key: fingerprint(value) for key, value in named_leaves(state_dict)}


def load_model(
    path: Location,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trusted: bool | None = None,
    verify: bool = True,
) -> int:
    """Loads a pipeline checkpoint into the un-split model, in one process.

    A model of plain tensors loads in this process alone, also on one rank
    of a group. A model sharded with FSDP2 (DTensors) loads on every rank of
    its group at once.

    Args:
        path: A ``step-<N>`` folder.
        model: The un-split model; its keys and the checkpoint's model keys
            must be the same (strict).
        optimizer: If given, its state is loaded too; build it over
            ``model.parameters()`` first.
        trusted: As :func:`read_checkpoint`.
        verify: As :func:`~pippy.checkpoint.load_stage`.

    Returns:
        The step the checkpoint was saved at.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As :func:`read_checkpoint`.
        CheckpointError: Keys missing on either side, or shapes that differ; or
            parameters tied in ``model`` hold different values in the checkpoint
            (checked before loading, where the last one read would win).
    """
    _check_ties(path, model, trusted, verify)
    state = StageState(model, optimizer)
    must_read = ("model.", "optim.") if optimizer is not None else ("model.",)
    sharded = any(isinstance(t, DTensor) for t in model.state_dict().values())
    load_stage(
        state,
        path,
        must_read=must_read,
        trusted=trusted,
        verify=verify,
        no_dist=not sharded,
    )
    return state.step


#: torchtitan's count of tokens trained on, which pippy does not keep.
_NTOKENS = "train_state.ntokens_seen"


def _write(
    storage: Storage, folder: Location, weights: dict[str, torch.Tensor], limit: int
) -> list[str]:
    """Writes shards of at most ``limit`` bytes (or one key); the index if several.

    Returns the names of the files written (the index first, if any).
    """
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    if n == 1:
        names = ["model.safetensors"]
    else:
        total = sum(t.numel() * t.element_size() for t in weights.values())
        where = {
            k: name for name, keys in zip(names, shards, strict=True) for k in keys
        }
        index = {"metadata": {"total_size": total}, "weight_map": where}
        data = json.dumps(index, indent=2).encode()
        storage.write_atomic(storage.join(folder, "model.safetensors.index.json"), data)
    for name, keys in zip(names, shards, strict=True):
        data = save({k: weights[k] for k in keys}, metadata={"format": "pt"})
        storage.write_atomic(storage.join(folder, name), data)
    return names if n == 1 else ["model.safetensors.index.json", *names]


def export_hf(
    path: Location,
    out: Location,
    *,
    config: Mapping[str, Any] | str | os.PathLike | Any,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    force: bool = False,
    trusted: bool | None = None,
    verify: bool = True,
) -> list[Any]:
    """Writes a step's model weights as a folder ``from_pretrained`` opens.

    ``config.json`` and ``model.safetensors``, or above ``max_shard_size``
    ``model-0000i-of-0000n.safetensors`` shards and their index; the experts
    of a mixture of experts one by one, named as ``save_pretrained`` names
    them (:func:`~pippy.checkpoint.hf.experts_one_by_one`). Written beside
    ``out`` and renamed when complete: a failed export leaves nothing at ``out``.

    Args:
        path: A ``step-<N>`` folder, in pippy's or torchtitan's layout.
        out: The folder to write; it must not exist unless ``force``.
        config: The model's Hugging Face config: a dict, a ``config.json``
            path, or a ``transformers`` config (its ``to_dict()``).
        max_shard_size: Above this many bytes, write shards and an index.
        dtype: If given, floating-point tensors are converted to it.
        force: Replace an existing ``out``: a file, or the folder of an
            earlier export (nothing else in it).
        trusted: As :func:`read_checkpoint`.
        verify: As :func:`~pippy.checkpoint.load_stage`.

    Returns:
        The files written, inside ``out``.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is False.
        ValueError: ``out`` is or lies in a step folder, or holds steps (even
            with ``force``: see :func:`refuse_out`); with ``force``, ``out`` is
            a folder holding anything an export does not write, or holds the
            current folder; ``config`` is not a JSON object, or a model entry
            of the checkpoint is not a tensor.
        CheckpointError: As :func:`read_checkpoint`.
        CheckpointDirError: ``out`` is on storage without atomic renames.
    """
    storage = check_publishable(out)
    if storage.exists(out) and not force:
        raise FileExistsError(
            f"{os.fspath(out)!r} exists; pass force=True (--force) to replace it"
        )
    refuse_out(storage, out)
    _refuse_replacing(storage, out)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        config = config.to_dict()
    if not isinstance(config, Mapping):
        try:
            config = json.loads(storage_for(config).read_bytes(config))
        except ValueError as e:
            raise ValueError(f"{str(config)!r} is not JSON: {e}") from None
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no Hugging Face config at {str(config)!r} (config, --hf-config)"
            ) from None
    if not isinstance(config, Mapping):
        raise ValueError("the Hugging Face config must be a JSON object")
    weights = model_weights(path, dtype=dtype, trusted=trusted, verify=verify)
    weights = experts_one_by_one(weights, config.get("model_type"))
    with _written_whole(storage, out, replace=True) as tmp:
        text = json.dumps(dict(config), indent=2) + "\n"
        storage.write_atomic(storage.join(tmp, "config.json"), text.encode())
        names = ["config.json", *_write(storage, tmp, weights, max_shard_size)]
    return [storage.join(out, name) for name in names]


def model_weights(
    path: Location,
    *,
    dtype: torch.dtype | None = None,
    trusted: bool | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """A step's model weights, ``{fqn: contiguous CPU tensor}`` (``model.`` removed).

    Args and errors as :func:`export_hf`; what is left out, as
    :func:`read_checkpoint`.
    """
    weights = {}
    state = read_checkpoint(path, prefix="model.", trusted=trusted, verify=verify)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model.{key} in {str(path)!r} is not a tensor")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        weights[key] = value.contiguous()
    return weights


def refuse_out(storage: Storage, out: Location) -> None:
    """Refuses to write ``out`` where it would damage or replace a checkpoint.

    Args:
        storage: ``out``'s storage.
        out: A file or folder an offline tool is about to write (or replace).

    Raises:
        ValueError: ``out`` is or lies in a complete step folder, or is a
            folder holding ``step-<N>`` folders (a run's checkpoint folder).
    """
    holder = step_holding(storage, out)
    if holder is not None:
        inside = storage.same_place(holder) != storage.same_place(out)
        where = f"lies in the step folder {str(holder)!r}" if inside else "is a step"
        raise ValueError(
            f"refused to write {os.fspath(out)!r}: it {where}, a checkpoint that "
            "writing there would damage. Write it outside every step folder"
        )
    if storage.is_dir(out) and (steps := list_steps(storage, out)):
        raise ValueError(
            f"refused to write {os.fspath(out)!r}: it is a checkpoint folder holding "
            f"{', '.join(f'step-{n}' for n in steps)}, which replacing it would "
            "delete. Write it to a folder of its own"
        )


# The names export_hf writes: what force may replace.
_HF_NAMES = re.compile(
    r"config\.json|model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors"
)


def _refuse_replacing(storage: Storage, out: Location) -> None:
    """ValueError unless ``out`` is no folder, or a folder of an HF export alone."""
    if not storage.is_dir(out):
        return
    here = Path.cwd()
    if storage.atomic_rename and Path(out).resolve() in (here, *here.parents):
        raise ValueError(
            f"refused to replace {os.fspath(out)!r}: it is or holds the current "
            "folder. Write the export to a folder of its own"
        )
    others = [  # a folder named model.safetensors is no export's
        n
        for n in storage.listdir(out)
        if not _HF_NAMES.fullmatch(n) or storage.size(storage.join(out, n)) is None
    ]
    if others:
        shown = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
        raise ValueError(
            f"refused to replace {os.fspath(out)!r}: it holds {shown}, which no "
            "Hugging Face export writes, and force replaces an earlier export "
            "only. Write the export to a folder of its own"
        )


@contextmanager
def _written_whole(storage: Storage, out: Location, *, replace: bool) -> Iterator[Any]:
    """A folder to write, published as ``out`` after the block; removed if it fails."""
    token = uuid.uuid4().hex[:12]
    tmp = storage.join(storage.parent(out), f".{storage.name(out)}.partial-{token}")
    if not storage.atomic_rename:  # written in place, committed by its manifest
        tmp = out
    try:
        storage.makedirs(tmp, staged=tmp != out)
    except OSError as e:  # a file where a folder above it should be, say
        where = storage.parent(out)
        why = e.strerror or e
        raise CheckpointDirError(
            f"cannot write {str(out)!r} in {str(where)!r}: {why}"
        ) from e
    try:
        yield tmp
        if tmp != out:
            if replace:
                storage.remove(out)  # fine if there is none
            storage.publish(tmp, out)
    except BaseException:
        storage.remove(tmp)
        raise


def _is_zero(value: Any) -> bool:
    """Whether a stored count is 0 (an int, or a one-element tensor)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.item() == 0
    return isinstance(value, int) and value == 0


def convert_layout(
    path: Location,
    out: Location,
    *,
    to: str,
    trusted: bool | None = None,
    verify: bool = True,
) -> int:
    """Writes a checkpoint in the other layout: pippy's or torchtitan's.

    Reads every key in one process and saves it with ``dcp.save`` under the other
    layout's names (see :mod:`~pippy.checkpoint.state`), published as ``out`` when
    complete. torchtitan's ``train_state.ntokens_seen``, which pippy does not
    keep, is written as 0 and a 0 dropped converting back, so a round trip gives
    the same keys and values.

    Args:
        path: A ``step-<N>`` folder in either layout.
        out: The step folder to write (``<folder>/step-<N>`` for torchtitan's
            ``CheckpointManager``); it must not exist.
        to: ``"pippy"`` or ``"torchtitan"``.
        trusted: As :func:`read_checkpoint`.
        verify: As :func:`~pippy.checkpoint.load_stage` (a torchtitan checkpoint
            has no manifest: pass False).

    Returns:
        The number of items written.

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: ``out`` is or lies in a step folder (see
            :func:`refuse_out`), or is named ``step-<M>`` (``step-06`` too) for
            another step than the one it holds; ``to`` is not a layout, or a
            key has no place in torchtitan's (see
            :func:`~pippy.checkpoint.keys.to_torchtitan`).
        CheckpointError: As :func:`read_checkpoint`.
    """
    if to not in (PIPPY, TORCHTITAN):
        raise ValueError(f"no layout {to!r}: {PIPPY!r} or {TORCHTITAN!r}")
    storage = storage_for(out)
    if storage.exists(out):
        raise FileExistsError(f"{os.fspath(out)!r} exists; converting never overwrites")
    refuse_out(storage, out)
    flat = read_checkpoint(path, trusted=trusted, verify=verify)  # pippy's names
    if to == TORCHTITAN:
        flat = to_torchtitan(flat, param_groups=True)
        if "train_state.step" in flat:
            flat.setdefault(_NTOKENS, 0)
    elif _NTOKENS in flat and _is_zero(flat[_NTOKENS]):
        del flat[_NTOKENS]  # no count: what the line above writes for pippy's step
    step = int(flat.get("step", flat.get("train_state.step", 0)))
    name = storage.name(out)  # find_latest_step would skip or refuse another
    if is_step_name(name) and name != f"step-{step}":
        raise ValueError(
            f"{os.fspath(out)!r} would hold step {step}: name it step-{step}"
        )
    flat, step, planner = take_state(flat, step=step)
    with _written_whole(storage, out, replace=False) as staging:
        writer = ManifestWriter(storage, staging, step=step)  # loads verify it
        with warnings.catch_warnings(), explain_failures(f"writing {out}"):
            # One process, writing alone, by design.
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(flat, storage_writer=writer, planner=planner, no_dist=True)
    return len(flat)
