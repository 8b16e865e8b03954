"""A checkpoint in one process: inspected, read, loaded into the whole model, exported.

The stages' keys are the un-split model's FQNs, so their union is the whole
model, read with no process group or pipeline. :func:`inspect_step` reports
what a step holds with no tensor read (with ``verify``, each item checked
against its manifest, as :func:`verify_step`). :func:`export_hf` writes
``safetensors`` directly (DCP's Hugging Face consolidation mishandles integer
and bool tensors in torch 2.13, pytorch/pytorch#192485).
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from pippy.checkpoint.checks import diff_state_dicts, fingerprints, tied_groups
from pippy.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    explain_failures,
)
from pippy.checkpoint.hf import INDEX_FILE, experts_one_by_one
from pippy.checkpoint.keys import (
    PIPPY,
    TORCHTITAN,
    detect_layout,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.load import load_stage, open_step, read_into
from pippy.checkpoint.manifest import ManifestWriter, read_manifest
from pippy.checkpoint.owner import refuse_out
from pippy.checkpoint.reader import read_metadata, verify_step
from pippy.checkpoint.save import take_state
from pippy.checkpoint.state import StageState
from pippy.checkpoint.steps import (
    find_damage,
    is_complete,
    is_step_name,
    list_steps,
    newest_complete_step,
    parse_step,
)
from pippy.checkpoint.storage import (
    Location,
    Storage,
    check_publishable,
    storage_for,
    written_whole,
)

__all__ = [
    "StepReport",
    "convert_layout",
    "diff_state_dicts",
    "fingerprints",
    "export_hf",
    "export_weights",
    "inspect_step",
    "inspect_steps",
    "load_model",
    "read_checkpoint",
    "verify_step",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepReport:
    """What a step folder holds, found with no tensor read (:func:`inspect_step`).

    Attributes:
        folder: The step folder.
        complete: Whether its save finished: it has ``.metadata`` (and, on an
            object store, ``manifest.json``).
        files: ``{name: bytes}`` of everything in the folder (None: a folder).
        metadata: Its ``.metadata``; None where it could not be read.
        error: Why ``.metadata`` could not be read (missing, refused, damaged),
            to raise; None where it was read.
        layout: ``"pippy"`` or ``"torchtitan"``, by its keys; None unread.
        damage: One line per data file missing or shorter than its items
            need, or the item that failed verification (with its fix); empty
            if none.
        verified: The number of items found to match ``manifest.json``; None
            where none were checked (not asked, damage found, or no manifest).
    """

    folder: Any
    complete: bool
    files: dict[str, int | None]
    metadata: Metadata | None
    error: CheckpointError | None
    layout: str | None
    damage: tuple[str, ...]
    verified: int | None

    @property
    def size(self) -> int:
        """Bytes of the files in the folder."""
        return sum(size for size in self.files.values() if size is not None)


def _report(
    storage: Storage, folder: Any, trusted: bool | None, verify: bool = False
) -> StepReport:
    """The report of one step folder; with ``verify``, its items checked."""
    names = storage.listdir(folder)
    files = {name: storage.size(storage.join(folder, name)) for name in names}
    complete = is_complete(storage, folder)
    try:
        metadata = read_metadata(folder, trusted=trusted)
    except CheckpointError as e:
        return StepReport(folder, complete, files, None, e, None, (), None)
    damage = find_damage(storage, folder, metadata)
    verified = None
    # A manifest refused (linked out) or damaged raises: there is nothing to verify.
    if verify and not damage and read_manifest(storage, folder) is not None:
        try:
            verified = verify_step(folder, trusted=trusted, storage=storage)
        except UnsafeCheckpointError:
            raise  # not damage: refused
        except CheckpointError as e:  # its problem and fix, the step not named again
            damage = [str(e).removeprefix(f"{str(folder)!r} is damaged: ")]
    layout = detect_layout(metadata.state_dict_metadata)
    return StepReport(
        folder, complete, files, metadata, None, layout, tuple(damage), verified
    )


def _open_folder(path: Location) -> tuple[Storage, bool]:
    """``path``'s storage, and whether it is one step rather than a run's folder.

    FileNotFoundError or NotADirectoryError unless ``path`` is a folder.
    """
    storage = storage_for(path)
    if not storage.exists(path):
        raise FileNotFoundError(f"no such folder: {str(path)!r}")
    if not storage.is_dir(path):
        raise NotADirectoryError(f"{str(path)!r} is a file, not a checkpoint folder")
    return storage, is_complete(storage, path) or parse_step(path) is not None


def inspect_step(
    path: Location,
    *,
    step: int | None = None,
    verify: bool = False,
    trusted: bool | None = None,
) -> StepReport:
    """Reports what one step holds: its files, ``.metadata`` and damage.

    Reads ``.metadata`` and the folder's listing, no tensor (with ``verify``,
    every item's bytes too); a step that cannot be read is reported, not
    raised (:attr:`StepReport.error`).

    Args:
        path: A step folder, or a run's checkpoint folder (``step-<N>`` in it).
        step: The step of a run's folder; None: the newest complete one, which
            a resume would take.
        verify: Also check every item against ``manifest.json``, if any.
        trusted: As :func:`read_checkpoint`.

    Returns:
        The step's report.

    Raises:
        FileNotFoundError, NotADirectoryError, CheckpointDirError: As
            :func:`inspect_steps`.
        ValueError: ``step`` is not the step folder's, or not in the run's.
        CheckpointNotFoundError: The run's folder holds no complete step.
        UnsafeCheckpointError: A ``manifest.json`` leads out of its folder
            (the newest step's, or with ``verify`` the step's), or with
            ``verify`` an item is refused.
        CheckpointError: With ``verify``, ``manifest.json`` is damaged.
    """
    storage, one_step = _open_folder(path)
    if one_step:
        if step is not None and parse_step(path) != step:
            raise ValueError(
                f"step (--step) needs a run folder; {str(path)!r} is one step"
            )
        return _report(storage, path, trusted, verify)
    steps = list_steps(storage, path)
    if step is not None:
        if step not in steps:
            raise ValueError(f"no step {step} in {str(path)!r} (steps: {list(steps)})")
        return _report(storage, steps[step], trusted, verify)
    latest, _ = newest_complete_step(storage, path)
    if latest is None:
        found = f"only incomplete steps {list(steps)}" if steps else "no step-<N>"
        raise CheckpointNotFoundError(f"{str(path)!r} holds {found}")
    return _report(storage, latest, trusted, verify)


def inspect_steps(
    path: Location, *, trusted: bool | None = None
) -> dict[int, StepReport]:
    """Reports each step of a run's checkpoint folder, as :func:`inspect_step`.

    Args:
        path: A run's checkpoint folder.
        trusted: As :func:`read_checkpoint`.

    Returns:
        ``{step: its report}``, in step order, complete or not; empty where
        ``path`` is a step folder itself, or holds no ``step-<N>`` folder.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NotADirectoryError: ``path`` is a file.
        CheckpointDirError: ``path`` holds a folder named as a step but not
            as pippy names one (``step-08``).
    """
    storage, one_step = _open_folder(path)
    if one_step:
        return {}
    steps = list_steps(storage, path).items()
    return {step: _report(storage, folder, trusted) for step, folder in steps}


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
    ``state_dict``, and a warning names the floating-point tensors outside the
    model's and the optimizer's sections (a plain DCP step keyed as a Hugging
    Face model keeps ``lm_head.weight`` there). This rank alone reads, with no
    collective, through the safe reader and planner.

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
        held = [fqn for fqn in group if fqn in saved]
        differ = [f for f in held[1:] if not torch.equal(saved[f], saved[held[0]])]
        if differ:
            raise CheckpointError(
                f"{', '.join(map(repr, [held[0], *differ]))} are one tied parameter in "
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


def _write(
    storage: Storage, folder: Location, weights: dict[str, torch.Tensor], limit: int
) -> list[str]:
    """Writes shards of at most ``limit`` bytes (or one tensor), an index if several.

    Returns the names of the files written (the index first, if any).
    """
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in weights.items():
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += tensor.nbytes
    n = len(shards)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    if n == 1:
        names = ["model.safetensors"]
    for name, shard in zip(names, shards, strict=True):
        data = save(shard, metadata={"format": "pt"})
        storage.write_atomic(storage.join(folder, name), data)
    if n == 1:
        return names
    where = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
    total = sum(tensor.nbytes for tensor in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": where}
    data = json.dumps(index, indent=2).encode()
    storage.write_atomic(storage.join(folder, INDEX_FILE), data)
    return [INDEX_FILE, *names]


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

    ``config.json`` and ``model.safetensors`` (or shards and their index), the
    experts of a mixture of experts one by one as ``save_pretrained`` stores
    them (:func:`~pippy.checkpoint.hf.experts_one_by_one`); written beside
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
        FileNotFoundError: ``config`` names no file.
        ValueError: As :func:`export_weights`, even with ``force``; with it,
            ``out`` holds anything an export does not write, or the current
            folder; ``config`` is not a JSON object.
        CheckpointError: As :func:`read_checkpoint`.
        CheckpointDirError: ``out`` is on storage without atomic renames.
    """
    storage = check_publishable(out)
    if storage.exists(out) and not force:
        raise FileExistsError(
            f"{os.fspath(out)!r} exists; pass force=True (--force) to replace it"
        )
    refuse_out(storage, out)
    if storage.is_dir(out):
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
    weights = _model_weights(path, dtype, trusted, verify)
    weights = experts_one_by_one(weights, config.get("model_type"))
    with written_whole(storage, out, replace=True) as tmp:
        text = json.dumps(dict(config), indent=2) + "\n"
        storage.write_atomic(storage.join(tmp, "config.json"), text.encode())
        names = ["config.json", *_write(storage, tmp, weights, max_shard_size)]
    return [storage.join(out, name) for name in names]


#: The names export_hf writes: what force may replace.
_HF_NAMES = re.compile(
    r"config\.json|model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors"
)


def _refuse_replacing(storage: Storage, out: Location) -> None:
    """ValueError unless the folder ``out`` holds an earlier export alone."""
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


def _model_weights(
    path: Location, dtype: torch.dtype | None, trusted: bool | None, verify: bool
) -> dict[str, torch.Tensor]:
    """A step's model weights, ``{fqn: contiguous CPU tensor}``, for an export."""
    weights = {}
    state = read_checkpoint(path, prefix="model.", trusted=trusted, verify=verify)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model.{key} in {str(path)!r} is not a tensor")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        weights[key] = value.contiguous()
    return weights


def export_weights(
    path: Location,
    out: Location,
    *,
    format: str | None = None,
    dtype: torch.dtype | None = None,
    force: bool = False,
    trusted: bool | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Writes a step's model weights to one file, whole or not at all.

    The un-split model's ``state_dict`` (keys under ``model.``, the prefix
    removed; no optimizer state), written beside ``out`` and renamed (on an
    object store, one upload): a failed export leaves no partial file.

    Args:
        path: A ``step-<N>`` folder, in pippy's or torchtitan's layout.
        out: The file to write.
        format: ``"pt"`` (``torch.save``) or ``"safetensors"``; None:
            safetensors for a name ending in ``.safetensors``, else pt.
        dtype: If given, floating-point tensors are converted to it.
        force: Replace an existing file ``out``.
        trusted: As :func:`read_checkpoint`.
        verify: As :func:`~pippy.checkpoint.load_stage`.

    Returns:
        The weights written, ``{fqn: CPU tensor}``.

    Raises:
        ValueError: ``format`` is neither; ``out`` is or lies in a step
            folder, or holds steps (:func:`~pippy.checkpoint.owner.refuse_out`);
            a model entry is not a tensor.
        IsADirectoryError: ``out`` is a folder.
        FileExistsError: ``out`` exists and ``force`` is False.
        FileNotFoundError: There is no folder to write ``out`` in.
        CheckpointError: As :func:`read_checkpoint`.
    """
    if format is None:
        format = "safetensors" if os.fspath(out).endswith(".safetensors") else "pt"
    if format not in ("pt", "safetensors"):
        raise ValueError(f"no format {format!r}: 'pt' or 'safetensors'")
    storage = storage_for(out)  # a file: whole, by rename or by one PUT
    refuse_out(storage, out)
    if storage.is_dir(out):
        raise IsADirectoryError(
            f"{str(out)!r} is a folder: out (--out) names the file to write (a "
            "Hugging Face folder is export_hf's, --hf-config)"
        )
    if storage.exists(out) and not force:
        raise FileExistsError(
            f"{str(out)!r} exists; pass force=True (--force) to overwrite it"
        )
    parent = storage.parent(out)
    if storage.atomic_rename and not storage.is_dir(parent):  # a store has no folders
        name = storage.name(out)
        raise FileNotFoundError(f"no folder {str(parent)!r} to write {name} in")
    weights = _model_weights(path, dtype, trusted, verify)
    with storage.open_atomic(out) as f:
        if format == "safetensors":
            f.write(save(weights, metadata={"format": "pt"}))
        else:
            torch.save(weights, f)
    return weights


#: torchtitan's count of tokens trained on, which pippy does not keep.
_NTOKENS = "train_state.ntokens_seen"


def convert_layout(
    path: Location,
    out: Location,
    *,
    to: str,
    trusted: bool | None = None,
    verify: bool = True,
) -> int:
    """Writes a checkpoint in the other layout: pippy's or torchtitan's.

    Every key, read in one process and saved with ``dcp.save`` under the other
    layout's names, published as ``out`` when complete. torchtitan's
    ``train_state.ntokens_seen``, which pippy does not keep, is written as 0 and
    a 0 dropped converting back: a round trip gives the same keys and values.

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
        ValueError: ``out`` is or lies in a step folder, or is named
            ``step-<M>`` (``step-06`` too) for another step than the one it
            holds; ``to`` is not a layout, or a key has no place in
            torchtitan's (:func:`~pippy.checkpoint.keys.to_torchtitan`).
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
    elif _is_zero(flat.get(_NTOKENS)):
        del flat[_NTOKENS]  # no count: what the line above writes for pippy's step
    step = int(flat.get("step", flat.get("train_state.step", 0)))
    name = storage.name(out)  # find_latest_step would skip or refuse another
    if is_step_name(name) and name != f"step-{step}":
        raise ValueError(
            f"{os.fspath(out)!r} would hold step {step}: name it step-{step}"
        )
    flat, step, planner = take_state(flat, step=step)
    with written_whole(storage, out, replace=False) as staging:
        writer = ManifestWriter(storage, staging, step=step)  # loads verify it
        with warnings.catch_warnings(), explain_failures(f"writing {out}"):
            # One process, writing alone, by design.
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(flat, storage_writer=writer, planner=planner, no_dist=True)
    return len(flat)


def _is_zero(value: Any) -> bool:
    """Whether a stored count is 0 (an int, or a one-element tensor)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.item() == 0
    return isinstance(value, int) and value == 0
