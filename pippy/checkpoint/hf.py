"""Start from a Hugging Face folder: every rank reads only its own stage's tensors.

A stage built with :func:`pippy.build_stage_module` keeps the un-split
model's FQNs, the names ``save_pretrained`` gives its tensors, so each rank
loads its stage's weights straight from the ``*.safetensors`` shards through
DCP (``dcp.load`` with DCP's ``HuggingFaceStorageReader``, whose reads
:class:`StageReader` replaces): it reads each shard's header, then only its
own tensors' bytes (an FSDP2 shard: its rows), with ``pread`` into the
stage's tensors. DCP's own reader maps each shard whole, and the kernel's
readahead (8 MB per fault on some machines) then reads far beyond the stage.
The experts of transformers' MoE models (Mixtral, Qwen3-MoE), which
``save_pretrained`` stores one by one and the model holds fused, are read
straight into the fused tensors' rows. Safetensors holds no pickled code.
The folder's files must lie inside it,
and every tensor of the stage must be in it with its shape and dtype
(:class:`~pippy.checkpoint.SafeLoadPlanner`'s checks).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Collection, Iterable, Mapping, Sequence
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


def check_folder(folder: str | os.PathLike) -> list[str]:
    """Checks a Hugging Face folder before DCP's reader opens its shards.

    Returns:
        The names of its shards, sorted: those its index names, else its
        ``*.safetensors`` files.

    Raises:
        CheckpointNotFoundError: ``folder`` is not a local folder, or holds no
            ``*.safetensors`` file.
        UnsafeCheckpointError: A shard in it, or one its index names,
            resolves outside it (a link).
        CheckpointError: A shard its index names is missing.
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
        shards = sorted(
            set(json.loads(storage.read_bytes(index)).get("weight_map", {}).values())
        )
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


def _header(file: RangeFile) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header (8 bytes of length, then JSON) and its size."""
    head = file.read(0, 8)
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
    if not 0 < length <= file.size - 8:
        raise CheckpointError(f"{file.name} is not a safetensors file (its header)")
    try:
        return 8 + length, json.loads(file.read(8, length))
    except ValueError as e:
        raise CheckpointError(
            f"{file.name}'s safetensors header is damaged: {e}"
        ) from None


def _read_into(file: RangeFile, tensor: torch.Tensor, offset: int) -> None:
    """Fills a contiguous CPU tensor with the file's bytes from ``offset``."""
    view = tensor.reshape(-1).view(torch.uint8).numpy().data  # writable, no copy
    if file.read_into(view, offset) < len(view):
        raise CheckpointError(f"{file.name} ends inside a tensor (truncated)")


class StageReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader, reading each tensor's own bytes and no more.

    The metadata comes from each shard's header (two ``pread`` calls); a
    tensor (or the rows of it that an FSDP2 shard holds) is read with
    ``pread`` straight into the stage's tensor, the file opened with
    ``POSIX_FADV_RANDOM`` so that the kernel reads nothing ahead. A header
    whose tensors overlap it or lie past the file's end is refused. Made by
    :func:`load_hf_stage`.

    Args:
        path: The folder ``save_pretrained`` wrote.
        model_type: The stage's ``config.model_type`` (a transformers
            model's); in DCP's planning, a folder whose ``config.json`` names
            another is refused (``CheckpointError``, on every rank).

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :func:`check_folder`, at once (inside ``dcp.load`` DCP would
            report them as another error).
    """

    def __init__(self, path: str | os.PathLike, model_type: str | None = None) -> None:
        self.shards = check_folder(path)
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
        tensors, self.storage_data = self._headers
        metadata = Metadata(state_dict_metadata=tensors, storage_data=self.storage_data)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    @functools.cached_property
    def _headers(self) -> tuple[dict[str, Any], dict[MetadataIndex, _Place]]:
        """``(tensors' metadata, where each lies)`` from the shards' headers."""
        tensors: dict[str, Any] = {}
        shard_of: dict[str, str] = {}
        places: dict[MetadataIndex, _Place] = {}
        for name in self.shards:
            path = os.path.join(self.path, name)
            with RangeFile(path) as file:
                data, header = _header(file)
            size = file.size
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if key in tensors:  # a stale shard: which is right is unknown
                    raise CheckpointError(
                        f"{key!r} is in both {shard_of[key]} and {name}: keep "
                        "only the shards save_pretrained wrote (its index names "
                        "them)"
                    )
                shard_of[key] = name
                try:
                    dtype, shape = _getdtype(entry["dtype"]), tuple(entry["shape"])
                    begin, end = entry["data_offsets"]
                except (KeyError, TypeError, ValueError):
                    raise CheckpointError(
                        f"{name}'s header entry for {key!r} is damaged"
                    ) from None
                nbytes = math.prod(shape) * dtype.itemsize
                if not (0 <= begin and end - begin == nbytes and data + end <= size):
                    raise CheckpointError(
                        f"{key!r} in {name} does not fit the file: its "
                        "header is damaged, or the file was cut short"
                    )
                tensors[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(shape),
                    chunks=[
                        ChunkStorageMetadata(
                            torch.Size([0] * len(shape)), torch.Size(shape)
                        )
                    ],
                )
                index = MetadataIndex(fqn=key, offset=[0] * len(shape))
                places[index] = _Place(path, data + begin, shape, dtype)
        return tensors, places

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
        _read_into(file, block, place.start + first * row_bytes)
        if not direct:
            cut = zip(offsets[1:], lengths[1:], strict=True)
            inner = (slice(None), *(slice(o, o + n) for o, n in cut))
            target.copy_(block[inner] if shape else block)
        planner.commit_tensor(item, target)


def _weights(modules: Iterable[nn.Module]) -> dict[str, Any]:
    """The modules' weights by FQN, each tied parameter under its first name.

    DCP's ``get_model_state_dict`` (DDP's prefix left out, FSDP2's shards as
    DTensors); a tied parameter once, as ``save_pretrained`` stores it.
    """
    state_dict: dict[str, Any] = {}
    for module in modules:
        taken = get_model_state_dict(module)
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        for group in tied_groups(inner):
            for alias in group[1:]:
                taken.pop(alias, None)
        state_dict.update(taken)
    return state_dict


#: A fused expert weight of transformers' MoE models (``<moe>.experts.<name>``,
#: experts along dim 0) and the weights a folder stores for each expert ``e``
#: instead, in the fused tensor's order along dim 1: as ``save_pretrained``
#: writes Qwen3-MoE (``<moe>.experts.<e>.gate_proj.weight``) or Mixtral
#: (``<moe>.experts.<e>.w1.weight``, its ``<moe>`` ``block_sparse_moe``, not ``mlp``).
_EXPERT_PARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "gate_up_proj": {"qwen": ("gate_proj", "up_proj"), "mixtral": ("w1", "w3")},
    "down_proj": {"qwen": ("down_proj",), "mixtral": ("w2",)},
}


def _stored_as(key: str, naming: str) -> tuple[str, tuple[str, ...]] | None:
    """``(block, parts)`` of a fused expert weight in ``naming`` (qwen, mixtral).

    None for another key. A folder stores it as ``<block>.experts.<e>.<part>.weight``.
    """
    block, _, fused = key.rpartition(".experts.")
    if fused not in _EXPERT_PARTS:
        return None
    if naming == "mixtral":
        block = f"{block.removesuffix('.mlp')}.block_sparse_moe"
    return block, _EXPERT_PARTS[fused][naming]


def _expert_keys(block: str, parts: tuple[str, ...], experts: range) -> list[str]:
    """The stored names of experts' parts, part by part."""
    return [f"{block}.experts.{e}.{part}.weight" for part in parts for e in experts]


def _one_by_one(
    block: str, parts: tuple[str, ...], rows: torch.Tensor, first: int = 0
) -> dict[str, torch.Tensor]:
    """Views of each expert's parts of fused expert rows (experts ``first``, ...)."""
    keys = _expert_keys(block, parts, range(first, first + len(rows)))
    views = (expert for part in rows.chunk(len(parts), dim=1) for expert in part)
    return dict(zip(keys, views, strict=True))


def _experts_as_stored(
    state_dict: dict[str, Any], stored: Collection[str]
) -> dict[str, Any]:
    """The stage's weights as the folder names them: fused experts as views.

    A key the folder lacks is looked for under Mixtral's name of its MoE block
    (``block_sparse_moe`` for ``mlp``); a fused expert weight the folder stores
    per expert is replaced by views of it, one per stored tensor, named as the
    folder names it, so that DCP reads each expert's tensor straight into its
    rows of the fused tensor (an FSDP2 shard of experts: its own experts'
    rows). Any other key stays as it is, for the load planner to judge.
    """
    found: dict[str, Any] = {}
    for key, value in state_dict.items():
        mixtral = key.replace(".mlp.", ".block_sparse_moe.", 1)
        per_expert = _per_expert(key, value.shape, stored)
        if key in stored or (mixtral not in stored and per_expert is None):
            found[key] = value
        elif per_expert is None:
            found[mixtral] = value
        else:
            rows, first = _local_experts(key, value)
            found.update(_one_by_one(*per_expert, rows, first))
    return found


def _per_expert(
    key: str, shape: Sequence[int], stored: Collection[str]
) -> tuple[str, tuple[str, ...]] | None:
    """``(block, parts)`` if the folder stores a fused expert weight per expert.

    By any of its ``shape[0]`` experts' tensors: one missing is then named.
    """
    for naming in ("qwen", "mixtral"):
        named = _stored_as(key, naming) if shape else None
        if named and any(k in stored for k in _expert_keys(*named, range(shape[0]))):
            return named
    return None


def _local_experts(key: str, value: Any) -> tuple[torch.Tensor, int]:
    """A fused expert weight's experts on this rank, and the index of the first.

    Raises:
        CheckpointError: A DTensor split along another dim than the experts'.
    """
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


#: The model types whose experts ``save_pretrained`` stores one by one, by the
#: names it gives them (transformers' conversion mapping): Mixtral's, or
#: Qwen2-MoE's (``gate_proj``, ``up_proj``, ``down_proj``).
_MIXTRAL_NAMES = frozenset({"mixtral", "minimax", "minimax_m2"})
_QWEN_NAMES = frozenset({"qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"})


def experts_one_by_one(
    weights: Mapping[str, torch.Tensor], model_type: str | None
) -> dict[str, torch.Tensor]:
    """The weights named as ``save_pretrained`` stores them: experts one by one.

    For a model type whose experts ``save_pretrained`` is known to store one
    by one, each fused expert weight (``<moe>.experts.gate_up_proj``, experts
    along dim 0) becomes one tensor per expert and part, copied: Mixtral's
    names (``block_sparse_moe``, ``w1``, ``w3``, ``w2``) or Qwen2-MoE's
    (``gate_proj``, ``up_proj``, ``down_proj``). Any other model type keeps
    its fused tensors, which ``from_pretrained`` reads as they are.

    Args:
        weights: ``{fqn: tensor}`` of the whole model.
        model_type: The model's ``config.json`` ``model_type``, if any.

    Returns:
        The weights under the names a Hugging Face folder holds.
    """
    mixtral = model_type in _MIXTRAL_NAMES
    if not mixtral and model_type not in _QWEN_NAMES:
        return dict(weights)
    found: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        named = _stored_as(key, "mixtral" if mixtral else "qwen")
        if named is None or value.dim() != 3:
            name = key.replace(".mlp.", ".block_sparse_moe.", 1) if mixtral else key
            found[name] = value
            continue
        for name, expert in _one_by_one(*named, value).items():
            found[name] = expert.clone()  # its own storage: safetensors'
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
        CheckpointNotFoundError: ``folder`` is not a folder, or holds no
            ``*.safetensors`` file.
        UnsafeCheckpointError: A shard in the folder, or one its index names,
            resolves outside it (a link).
        CheckpointError: A tensor of the stage is missing from the folder, or
            has another shape or dtype there (the message names them, on
            every rank); a tensor is in two of its files; its ``config.json``
            names another ``model_type`` than the stage's (a ``transformers``
            model's ``config``); a fused expert weight the folder stores per
            expert is split over ranks along another dim than the experts'.
    """
    if isinstance(stages, StageState):
        modules = [stages.module]
    elif isinstance(stages, nn.Module):
        modules = [stages]
    else:
        modules = list(stages)
    inner = [m.module if isinstance(m, DistributedDataParallel) else m for m in modules]
    types = {getattr(getattr(m, "config", None), "model_type", None) for m in inner}
    # the folder checked before anything is read
    reader = StageReader(folder, types.pop() if len(types) == 1 else None)
    weights = _weights(modules)
    with explain_failures(f"loading {os.fspath(folder)}"):
        stored = reader.read_metadata().state_dict_metadata
        dcp.load(
            _experts_as_stored(weights, stored),
            storage_reader=reader,
            planner=SafeLoadPlanner(must_read=()),
            process_group=process_group,
        )
    return len(weights)
