"""Writing a checkpoint for other tools: a Hugging Face folder, torchtitan's layout.

``from_pretrained`` opens a folder holding ``config.json`` and
``model.safetensors``, or, above the shard size, ``model-0000i-of-0000n``
shards and ``model.safetensors.index.json`` mapping each key to its shard.
The weights are read with :func:`~pippy.checkpoint.read_checkpoint` (any
layout it reads) and written with ``safetensors`` directly: DCP's own
Hugging Face consolidation mishandles integer and bool tensors in torch 2.13
(pytorch/pytorch#192485). :func:`convert_layout` rewrites a checkpoint in
pippy's or torchtitan's layout as the other.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from pippy.checkpoint.errors import explain_failures
from pippy.checkpoint.layouts import PIPPY, TORCHTITAN, to_torchtitan
from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.storage import Location, Storage, check_publishable, storage_for
from pippy.checkpoint.taking import take_state
from pippy.checkpoint.unsplit import read_checkpoint

__all__ = ["convert_layout", "export_hf", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30})
#: torchtitan's count of tokens trained on, which pippy does not keep.
_NTOKENS = "train_state.ntokens_seen"


def parse_size(text: str) -> int:
    """Parses a size such as ``5GB``, ``500MiB`` or ``1000`` (bytes).

    Args:
        text: A number, optionally followed by B, KB, MB, GB, KiB, MiB or GiB.

    Returns:
        The size in bytes.

    Raises:
        ValueError: ``text`` is not such a size, or it is not positive.
    """
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size such as 5GB, 500MB or 1000")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def _shards(weights: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Groups keys, in order, into shards of at most ``limit`` bytes (or one key)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _write(
    storage: Storage, folder: Location, weights: dict[str, torch.Tensor], limit: int
) -> list[str]:
    """Writes the safetensors file(s), and the index when there are several."""
    from safetensors.torch import save

    shards = _shards(weights, limit)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        n = len(shards)
        names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        index = {
            "metadata": {
                "total_size": sum(
                    t.numel() * t.element_size() for t in weights.values()
                )
            },
            "weight_map": {
                k: name for name, keys in zip(names, shards, strict=True) for k in keys
            },
        }
        storage.write_atomic(
            storage.join(folder, "model.safetensors.index.json"),
            json.dumps(index, indent=2).encode(),
        )
    for name, keys in zip(names, shards, strict=True):
        data = save({k: weights[k] for k in keys}, metadata={"format": "pt"})
        storage.write_atomic(storage.join(folder, name), data)
    return names


def export_hf(
    path: Location,
    out: Location,
    *,
    config: Mapping[str, Any] | str | os.PathLike,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    force: bool = False,
    trusted: bool | None = None,
    verify: bool = True,
) -> list[Any]:
    """Writes a step's model weights as a folder ``from_pretrained`` opens.

    The folder is written under a temporary name beside ``out`` and renamed
    when complete, so a failed export leaves nothing at ``out``.

    Args:
        path: A ``step-<N>`` folder, in pippy's or torchtitan's layout.
        out: The folder to write; it must not exist unless ``force``.
        config: The model's Hugging Face config, as a dict or the path of a
            ``config.json``; written as ``config.json``.
        max_shard_size: Above this many bytes of weights, write several
            shards and an index.
        dtype: If given, floating-point tensors are converted to it
            (integer and bool tensors never are).
        force: Replace an existing ``out``.
        trusted: See :class:`~pippy.checkpoint.SafeFileSystemReader`.
        verify: See :func:`~pippy.checkpoint.load_stage`.

    Returns:
        The files written, inside ``out``.

    Raises:
        FileExistsError: ``out`` exists and ``force`` is False.
        ValueError: ``config`` is not a JSON object, or a model entry of the
            checkpoint is not a tensor.
        CheckpointError: As :func:`~pippy.checkpoint.read_checkpoint`.
        CheckpointDirError: ``out`` is on storage without atomic renames.
    """
    storage = check_publishable(out)
    if storage.exists(out) and not force:
        raise FileExistsError(f"{os.fspath(out)!r} exists; pass force to replace it")
    if not isinstance(config, Mapping):
        config = json.loads(storage_for(config).read_bytes(config))
    if not isinstance(config, Mapping):
        raise ValueError("the Hugging Face config must be a JSON object")
    weights = {}
    state = read_checkpoint(path, prefix="model.", trusted=trusted, verify=verify)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model.{key} in {str(path)!r} is not a tensor")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        weights[key] = value.contiguous()
    tmp = _sibling(storage, out)  # same file system
    storage.makedirs(tmp)
    try:
        text = json.dumps(dict(config), indent=2) + "\n"
        storage.write_atomic(storage.join(tmp, "config.json"), text.encode())
        names = ["config.json", *_write(storage, tmp, weights, max_shard_size)]
        if storage.exists(out):
            storage.remove(out)
        storage.publish(tmp, out)
    finally:
        storage.remove(tmp)
    return [storage.join(out, name) for name in names]


def _sibling(storage: Storage, out: Location) -> Any:
    """A new hidden name beside ``out``, to write into before publishing."""
    token = uuid.uuid4().hex[:12]
    return storage.join(storage.parent(out), f".{storage.name(out)}.partial-{token}")


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

    Reads every key (in one process) and saves it again with ``dcp.save``
    under the other layout's names (see :mod:`~pippy.checkpoint.layouts`),
    into a temporary folder renamed to ``out`` when complete. Written for
    torchtitan, ``train_state.ntokens_seen``, which its trainer requires and
    pippy does not keep, is 0; written for pippy, a count of 0 is left out
    (so that pippy -> torchtitan -> pippy gives the same keys and values),
    and another count is kept as ``train_state.ntokens_seen``. Extra state
    (a data sampler's) is torchtitan's ``dataloader.<extra name>.<name>``,
    and the param group indices are kept (see
    :mod:`~pippy.checkpoint.layouts`).

    Args:
        path: A ``step-<N>`` folder in either layout.
        out: The step folder to write (for torchtitan's ``CheckpointManager``
            to find it, ``<its folder>/step-<N>``); it must not exist.
        to: ``"pippy"`` or ``"torchtitan"``.
        trusted: See :class:`~pippy.checkpoint.SafeFileSystemReader`.
        verify: See :func:`~pippy.checkpoint.load_stage` (a torchtitan
            checkpoint has no manifest: pass False).

    Returns:
        The number of items written.

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: ``to`` is not a layout, or a key has no place in
            torchtitan's (see :func:`~pippy.checkpoint.layouts.to_torchtitan`).
        CheckpointError: As :func:`~pippy.checkpoint.read_checkpoint`.
    """
    if to not in (PIPPY, TORCHTITAN):
        raise ValueError(f"no layout {to!r}: {PIPPY!r} or {TORCHTITAN!r}")
    storage = storage_for(out)
    if storage.exists(out):
        raise FileExistsError(f"{os.fspath(out)!r} exists; converting never overwrites")
    flat = read_checkpoint(path, trusted=trusted, verify=verify)  # pippy's names
    if to == TORCHTITAN:
        flat = to_torchtitan(flat, param_groups=True)
        if "train_state.step" in flat:
            flat.setdefault(_NTOKENS, 0)
    elif _NTOKENS in flat and _is_zero(flat[_NTOKENS]):
        del flat[_NTOKENS]  # no count: what the line above writes for pippy's step
    # The save sequence, in one process: take and check the state, write it
    # through DCP into a staging folder, publish it as out (or discard it).
    step = int(flat.get("step", flat.get("train_state.step", 0)))
    flat, step, planner = take_state(flat, step=step)
    # On an object store, written in place and committed by its manifest.
    staging = _sibling(storage, out) if storage.atomic_rename else out
    storage.makedirs(staging)
    try:
        with warnings.catch_warnings(), explain_failures(f"writing {out}"):
            # One process, writing alone, by design.
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            writer = ManifestWriter(staging, step=step)  # loads verify it
            dcp.save(flat, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException:
        storage.remove(staging)
        raise
    if staging != out:
        storage.publish(staging, out)
    return len(flat)
