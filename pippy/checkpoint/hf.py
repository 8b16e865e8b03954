"""Start from a Hugging Face folder: every rank reads only its own stage's tensors.

A stage built with :func:`pippy.build_stage_module` keeps the un-split model's
FQNs, the names ``save_pretrained`` gives its tensors, so each rank loads its
stage's weights from the ``*.safetensors`` shards with ``dcp.load`` and
:class:`StageReader`: DCP's ``HuggingFaceStorageReader``, reading each shard's
header and then only the stage's own bytes (an FSDP2 shard: its rows) with
``pread``. DCP's own reader maps each shard whole, and the kernel's readahead
(8 MB per fault on some machines) then reads far beyond the stage. The experts
of MoE models (Mixtral, Qwen3-MoE), which ``save_pretrained`` stores one by one
and the model holds fused, are read straight into the fused tensors' rows.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import _getdtype
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from pippy.checkpoint.checks import tied_groups
from pippy.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    explain_failures,
)
from pippy.checkpoint.safe_load import SafeLoadPlanner
from pippy.checkpoint.state import StageState
from pippy.checkpoint.storage import LocalStorage, RangeFile, is_url

__all__ = ["StageReader", "load_hf_stage"]

#: The index ``save_pretrained`` writes beside sharded weights.
INDEX_FILE = "model.safetensors.index.json"


def _shards(folder: str | os.PathLike) -> list[str]:
    """The shards to read, sorted: those the index names, else every one.

    Raises as :class:`StageReader`.
    """
    storage = LocalStorage()
    if is_url(folder) or not storage.is_dir(folder):
        raise CheckpointNotFoundError(
            f"no Hugging Face folder at {os.fspath(folder)!r}: pass the local "
            "folder that save_pretrained wrote (config.json, *.safetensors)"
        )
    shards = [n for n in storage.listdir(folder) if n.endswith(".safetensors")]
    if not shards:
        raise CheckpointNotFoundError(
            f"{os.fspath(folder)!r} holds no *.safetensors file: pass the folder "
            "that save_pretrained wrote"
        )
    index = storage.join(folder, INDEX_FILE)
    if storage.exists(index):  # its shards alone, as from_pretrained reads them
        shards = json.loads(storage.read_bytes(index)).get("weight_map", {}).values()
    shards = sorted(set(shards))
    root = storage.same_place(folder)
    for name in shards:
        path = storage.same_place(storage.join(folder, name))
        if not path.is_relative_to(root) or path == root:
            raise UnsafeCheckpointError(
                f"{name!r} in {os.fspath(folder)!r} resolves to {str(path)!r}, "
                "outside the folder: refused; copy the shards into it"
            )
        if storage.size(path) is None:
            raise CheckpointError(
                f"{os.fspath(folder)!r} lacks {name!r}, which its {INDEX_FILE} "
                "names: copy the whole folder save_pretrained wrote"
            )
    return shards


@dataclass(frozen=True)
class _Place:
    """Where a tensor's bytes lie: its shard, their first byte, shape and dtype."""

    path: str
    start: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class StageReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader, reading each tensor's own bytes and no more.

    The metadata comes from each shard's header; a tensor (or the rows of it
    that an FSDP2 shard holds) is read with ``pread`` straight into the stage's
    tensor, with no readahead (:class:`~pippy.checkpoint.storage.RangeFile`). A
    header whose tensors overlap it or lie past the file's end is refused.

    Args:
        path: The folder ``save_pretrained`` wrote.
        model_type: The stage's ``config.model_type`` (a transformers
            model's); in DCP's planning, a folder whose ``config.json`` names
            another is refused (``CheckpointError``, on every rank).

    Raises:
        CheckpointNotFoundError: ``path`` is not a local folder, or holds no
            ``*.safetensors`` file.
        UnsafeCheckpointError: A shard in it, or one its index names,
            resolves outside it (a link).
        CheckpointError: A shard its index names is missing.
    """

    def __init__(self, path: str | os.PathLike, model_type: str | None = None) -> None:
        self.shards = _shards(path)  # at once: inside dcp.load, another error
        self.model_type = model_type
        super().__init__(os.fspath(path))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """DCP's; refuses a folder of another model type than the stage's."""
        storage, config = LocalStorage(), os.path.join(self.path, "config.json")
        if self.model_type and storage.size(config) is not None:
            saved = json.loads(storage.read_bytes(config)).get("model_type")
            if saved and saved != self.model_type:
                folder, ours = os.fspath(self.path), self.model_type
                raise CheckpointError(
                    f"{folder!r} holds a {saved} model (its config.json), and this "
                    f"stage is {ours}: pass the folder of a {ours} model"
                )
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_metadata(self) -> Metadata:
        """Every shard's tensors, from its header alone (read once per reader)."""
        tensors: dict[str, Any] = {}
        self.storage_data = {}
        for key, place in self._places.items():
            shape, zeros = torch.Size(place.shape), torch.Size([0] * len(place.shape))
            chunks = [ChunkStorageMetadata(zeros, shape)]
            properties = TensorProperties(dtype=place.dtype)
            tensors[key] = TensorStorageMetadata(properties, shape, chunks)
            self.storage_data[MetadataIndex(key, zeros)] = place
        metadata = Metadata(state_dict_metadata=tensors, storage_data=self.storage_data)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    @functools.cached_property
    def _places(self) -> dict[str, _Place]:
        """Where each tensor lies, from the shards' headers (a length, then JSON)."""
        places: dict[str, _Place] = {}
        for name in self.shards:
            path = os.path.join(self.path, name)
            with RangeFile(path) as file:
                head = file.read(0, 8)
                (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
                if not 0 < length <= file.size - 8:
                    raise CheckpointError(
                        f"{name} is not a safetensors file (its header)"
                    )
                try:
                    header = json.loads(file.read(8, length))
                except ValueError as e:
                    raise CheckpointError(
                        f"{name}'s safetensors header is damaged: {e}"
                    ) from None
            size = file.size
            header.pop("__metadata__", None)
            for key, entry in header.items():
                if key in places:  # a stale shard: which is right is unknown
                    raise CheckpointError(
                        f"{key!r} is in both {os.path.basename(places[key].path)} "
                        f"and {name}: keep only the shards save_pretrained wrote "
                        "(its index names them)"
                    )
                try:
                    dtype, shape = _getdtype(entry["dtype"]), tuple(entry["shape"])
                    begin, end = entry["data_offsets"]
                except (KeyError, TypeError, ValueError):
                    raise CheckpointError(
                        f"{name}'s header entry for {key!r} is damaged"
                    ) from None
                nbytes = math.prod(shape) * dtype.itemsize
                data = 8 + length  # where the tensors' bytes begin
                if not (0 <= begin and end - begin == nbytes and data + end <= size):
                    raise CheckpointError(
                        f"{key!r} in {name} does not fit the file: its "
                        "header is damaged, or the file was cut short"
                    )
                places[key] = _Place(path, data + begin, shape, dtype)
        return places

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each requested tensor's bytes (or its rows) into its target."""
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            place = self.storage_data[item.storage_index]
            by_file.setdefault(place.path, []).append((item, place))
        for path, items in by_file.items():
            with RangeFile(path) as file:
                for item, place in items:
                    self._read(file, item, place, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(
        self, file: RangeFile, item: Any, place: _Place, planner: LoadPlanner
    ) -> None:
        """One read item: the rows it wants, into its target if it can take them."""
        shape, offsets, lengths = place.shape, item.storage_offsets, item.lengths
        first, rows = (offsets[0], lengths[0]) if shape else (0, 1)
        row_bytes = math.prod(shape[1:]) * place.dtype.itemsize
        target = planner.resolve_tensor(item).detach()
        direct = (  # its block is one byte range, and the target can take it
            tuple(lengths[1:]) == shape[1:]
            and target.device.type == "cpu"
            and target.dtype == place.dtype
            and target.is_contiguous()
        )
        rows_shape = (rows, *shape[1:]) if shape else ()
        block = target if direct else torch.empty(rows_shape, dtype=place.dtype)
        view = block.reshape(-1).view(torch.uint8).numpy().data  # writable, no copy
        if file.read_into(view, place.start + first * row_bytes) < len(view):
            raise CheckpointError(f"{file.name} ends inside a tensor (truncated)")
        if not direct:
            cut = zip(offsets[1:], lengths[1:], strict=True)
            inner = (slice(None), *(slice(o, o + n) for o, n in cut))
            target.copy_(block[inner] if shape else block)
        planner.commit_tensor(item, target)


#: The parts that ``save_pretrained`` stores for each expert ``e`` of a fused
#: expert weight (``<moe>.experts.gate_up_proj``, experts along dim 0), in the
#: fused tensor's order along dim 1, by naming: Qwen2-MoE's
#: (``<moe>.experts.<e>.gate_proj.weight``) or Mixtral's (``w1``, its ``<moe>``
#: named ``block_sparse_moe``, not ``mlp``).
_PARTS = {
    "qwen": {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
    "mixtral": {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
}
#: The naming of each model type whose experts ``save_pretrained`` stores one
#: by one (transformers' conversion mapping).
_NAMING = {
    **dict.fromkeys(["mixtral", "minimax", "minimax_m2"], "mixtral"),
    **dict.fromkeys(["qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"], "qwen"),
}


def _renamed(key: str, naming: str) -> str:
    """``key`` as a folder in ``naming`` names it (Mixtral's MoE block)."""
    return key.replace(".mlp.", ".block_sparse_moe.", 1) if naming == "mixtral" else key


def _expert_names(key: str, naming: str, experts: range) -> list[str]:
    """The stored names of experts' parts of a fused expert weight (else none)."""
    block, _, fused = _renamed(key, naming).rpartition(".experts.")
    parts = _PARTS[naming].get(fused, ())
    return [f"{block}.experts.{e}.{part}.weight" for part in parts for e in experts]


def _one_by_one(names: list[str], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of each expert's parts of fused expert rows, under ``names``."""
    parts = rows.chunk(len(names) // len(rows), dim=1)
    views = (expert for part in parts for expert in part)
    return dict(zip(names, views, strict=True))


def _experts_as_stored(
    state_dict: dict[str, Any], stored: Collection[str]
) -> dict[str, Any]:
    """The stage's weights as the folder names them: fused experts as views.

    A key the folder lacks is looked for under Mixtral's name; a fused expert
    weight the folder stores per expert (found by any expert, so that a missing
    one is named) is replaced by views of this rank's experts' rows, for DCP to
    read each expert straight into. Any other key stays, for the planner to judge.
    """
    found: dict[str, Any] = {}
    for key, value in state_dict.items():
        naming = _stored_naming(key, value, stored)
        mixtral = _renamed(key, "mixtral")
        if key in stored or (naming is None and mixtral not in stored):
            found[key] = value
        elif naming is None:
            found[mixtral] = value
        else:
            rows, first = _local_experts(key, value)
            names = _expert_names(key, naming, range(first, first + len(rows)))
            found.update(_one_by_one(names, rows))
    return found


def _stored_naming(key: str, value: Any, stored: Collection[str]) -> str | None:
    """The naming in which the folder stores a fused expert weight per expert."""
    for naming in _PARTS:
        experts = range(len(value)) if value.dim() else range(0)
        if any(name in stored for name in _expert_names(key, naming, experts)):
            return naming
    return None


def _local_experts(key: str, value: Any) -> tuple[torch.Tensor, int]:
    """A fused expert weight's rows on this rank, and its first expert's index."""
    if not isinstance(value, DTensor):
        return value.detach(), 0
    if any(isinstance(p, Shard) and p.dim != 0 for p in value.placements):
        raise CheckpointError(
            f"{key!r} is split along another dim than its experts "
            f"({value.placements}), and the folder stores each expert whole: "
            "shard the experts along dim 0 only (FSDP2's default)"
        )
    _, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return value.to_local().detach(), offset[0]


def experts_one_by_one(
    weights: Mapping[str, torch.Tensor], model_type: str | None
) -> dict[str, torch.Tensor]:
    """The weights named as ``save_pretrained`` stores them: experts one by one.

    For a model type whose experts ``save_pretrained`` is known to store one
    by one (Mixtral's family, Qwen2-MoE's), each fused expert weight
    (``<moe>.experts.gate_up_proj``, experts along dim 0) becomes one tensor
    per expert and part, copied. Any other model type keeps its fused tensors,
    which ``from_pretrained`` reads as they are.

    Args:
        weights: ``{fqn: tensor}`` of the whole model.
        model_type: The model's ``config.json`` ``model_type``, if any.

    Returns:
        The weights under the names a Hugging Face folder holds.
    """
    naming = _NAMING.get(model_type or "")
    if naming is None:
        return dict(weights)
    found: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        names = (
            _expert_names(key, naming, range(len(value))) if value.dim() == 3 else []
        )
        if names:  # each expert its own storage, as safetensors wants
            found.update((n, v.clone()) for n, v in _one_by_one(names, value).items())
        else:
            found[_renamed(key, naming)] = value
    return found


def load_hf_stage(
    stages: StageState | nn.Module | Iterable[nn.Module],
    folder: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> int:
    """Loads this rank's stage(s) from a Hugging Face folder, in place, on every rank.

    Each rank reads only the tensors of its own stage(s) from the
    ``*.safetensors`` shards ``save_pretrained`` wrote (their headers, then
    its tensors; FSDP2 shards only their slices). Weights only: an
    optimizer, LR schedule and step start afresh. Call it on every rank of
    ``process_group`` at once.

    Args:
        stages: The stage's :class:`~pippy.checkpoint.StageState` (its modules
            are loaded), a stage module, or a rank's stage modules. Their
            FQNs must be the un-split model's (``pippy.build_stage_module``).
        folder: The folder ``save_pretrained`` wrote.
        process_group: The ranks that load; the default group if None.

    Returns:
        The number of tensors this rank loaded.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As :class:`StageReader`.
        CheckpointError: As :class:`StageReader`; or a tensor of the stage is
            missing from the folder, or has another shape or dtype there (named,
            on every rank); a tensor is in two of its files; its ``config.json``
            names another ``model_type`` than the stage's; a fused expert weight
            the folder stores per expert is split over ranks along another dim
            than the experts'.
    """
    if isinstance(stages, StageState):
        modules = [stages.module]
    elif isinstance(stages, nn.Module):
        modules = [stages]
    else:
        modules = list(stages)
    weights: dict[str, Any] = {}  # DCP's: DDP's prefix left out, FSDP2's DTensors
    types = set()
    for module in modules:
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        types.add(getattr(getattr(inner, "config", None), "model_type", None))
        weights.update(get_model_state_dict(module))
        for group in tied_groups(inner):  # once, as save_pretrained stores it
            for alias in group[1:]:
                weights.pop(alias, None)
    reader = StageReader(folder, types.pop() if len(types) == 1 else None)
    with explain_failures(f"loading {os.fspath(folder)}"):
        stored = reader.read_metadata().state_dict_metadata
        dcp.load(
            _experts_as_stored(weights, stored),
            storage_reader=reader,
            planner=SafeLoadPlanner(must_read=()),
            process_group=process_group,
        )
    return len(weights)
