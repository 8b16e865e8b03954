"""A step's ``.metadata``: checked against its folder, read from another torch.

:func:`check_structure` refuses a ``.metadata`` whose data files are not
plain names inside the step folder or whose items do not fit their places;
:func:`find_damage` lists data files missing or short, before any read.

``.metadata`` pickles torch's own classes, whose fields change between
releases: torch 2.15 adds ``strides`` to ``TensorProperties`` (6 fields),
which torch 2.10 to 2.14's ``__setstate__`` cannot unpack (5).
:class:`CompatTensorProperties` drops the fields the running torch lacks (a
tensor's bytes are a ``torch.save`` record of their own, strides included).
A ``.metadata`` that still cannot be read, where the manifest
(:func:`written_by`) says a newer torch wrote it, is refused by
:func:`newer_torch_refusal` with the versions named.

Private torch names pippy relies on, each tested in
test/test_torch_internals.py on torch 2.10 to 2.15
(test/golden/version_matrix.py):

* ``torch.distributed.checkpoint.state_dict._get_fqns`` (optimizer keys);
* ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
  (a shard's place, for the replica check);
* ``torch.distributed.checkpoint._fsspec_filesystem.FileSystem`` (URLs);
* the ``.metadata`` globals :mod:`~pippy.checkpoint.safe_load` allows, and
  ``_StorageInfo``'s ``relative_path``, ``offset`` and ``length``;
* ``FileSystemWriter``/``FileSystemReader``'s ``fs``, ``path`` and
  ``sync_files``, which pippy's writer and reader replace;
* the ``GLOBAL module.name`` text of ``torch.load(weights_only=True)``'s
  refusal, which the load planner parses;
* ``torch.serialization.set_crc32_options`` being per thread from torch 2.12
  (``storage.CRC32_PER_THREAD``; per process before, so kept on there);
* ``torch.distributed.distributed_c10d._get_default_store`` and a group's
  ``_device_types``, ``_get_backend`` and ``options._timeout``
  (:mod:`~pippy.checkpoint.stall`; no public getters);
* ``DefaultLoadPlanner.original_state_dict`` (undocumented), the dict
  ``dcp.load`` fills, filled when ``read_data`` returns;
* ``DefaultSavePlanner._enable_plan_caching`` (refused by the save planner);
* an LR scheduler's ``_last_lr`` list in its state;
* ``nn.Module``'s ``_parameters``, ``_buffers``, ``_modules``,
  ``_non_persistent_buffers_set``, ``_state_dict_hooks`` and
  ``_state_dict_pre_hooks``.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.torch_version import TorchVersion

from pippy.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from pippy.checkpoint.storage import Location, Storage, step_file, storage_for

__all__ = [
    "CompatTensorProperties",
    "check_structure",
    "find_damage",
    "newer_torch_refusal",
    "storage_ranges",
    "written_by",
]

#: DCP's index of a step's items, written last: a step folder without it is partial.
METADATA_FILE = ".metadata"


def find_damage(path: str | os.PathLike, metadata: Metadata) -> list[str]:
    """Lists the data files that ``.metadata`` names but are missing or short.

    A step is published whole, so this finds damage done afterwards (a file
    deleted, a copy cut short), which DCP would meet mid-load on some ranks.

    Args:
        path: A step folder.
        metadata: Its metadata, from :func:`read_metadata`.

    Returns:
        One line per damaged file (``"__1_0.distcp is missing"``); empty if
        every file is there and at least as long as its items.
    """
    storage = storage_for(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            end = info.offset + info.length
            needed[name] = max(needed.get(name, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        actual = storage.size(storage.join(path, name))
        if actual is None:
            problems.append(f"{name} is missing")
        elif actual < size:
            problems.append(f"{name} has {actual} bytes, its items need {size}")
    return problems


def _data_file(storage: Storage, folder: Location, name: Any) -> Any:
    """The data file ``name`` inside ``folder``; refused if it could be elsewhere."""
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )
    if not plain:
        raise UnsafeCheckpointError(
            f"refused to load {str(folder)!r}: its {METADATA_FILE} names the data "
            f"file {name!r}, which is not a plain file name inside the step folder "
            "(a path). DCP would open it wherever it points; no checkpoint written "
            "by DCP or pippy does that"
        )
    return step_file(storage, folder, name)


def check_structure(folder: Location, metadata: Metadata) -> None:
    """Refuses metadata whose items are not where, or not as large as, it says.

    Raises:
        CheckpointError: A table is malformed, an item has no valid place,
            a tensor's chunks do not fill its shape, or an item is larger
            than its place in the file.
        UnsafeCheckpointError: A data file is not a plain name inside ``folder``.
    """
    damaged = (
        f"{os.fspath(storage_for(folder).join(folder, METADATA_FILE))!r} is damaged"
    )
    try:
        _check_tables(folder, metadata, damaged)
    except (AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
        raise CheckpointError(f"{damaged}: {type(e).__name__}: {e}") from None


def _check_tables(folder: Location, metadata: Metadata, damaged: str) -> None:
    """:func:`_check_structure`'s checks; a malformed entry raises anything."""
    files = storage_for(folder)
    storage = metadata.storage_data
    items = metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(items, dict):
        raise CheckpointError(f"{damaged}: it has no table of items and files")
    contained: set[str] = set()  # each file once: resolving a path stats it
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and name in contained):
            _data_file(files, folder, name)
            contained.add(str(name))  # a plain name: data_file refuses others
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(type(n) is int and n >= 0 for n in (offset, length)):
            raise CheckpointError(f"{damaged}: item {index.fqn!r} has no valid place")
    for key, item in items.items():
        if isinstance(item, BytesStorageMetadata):
            chunks: list[tuple[MetadataIndex, int]] = [(MetadataIndex(key), 0)]
        elif isinstance(item, TensorStorageMetadata):
            size = item.properties.dtype.itemsize
            chunks = [
                (MetadataIndex(key, chunk.offsets), math.prod(chunk.sizes) * size)
                for chunk in item.chunks
            ]
            inside = all(
                len(c.offsets) == len(c.sizes) == len(item.size)
                and all(
                    0 <= o and o + n <= d
                    for o, n, d in zip(c.offsets, c.sizes, item.size, strict=True)
                )
                for c in item.chunks
            )
            volume = sum(math.prod(c.sizes) for c in item.chunks)
            if not inside or volume != math.prod(item.size):
                raise CheckpointError(
                    f"{damaged}: {key!r} declares shape {list(item.size)}, which "
                    "its stored chunks do not fill"
                )
        else:
            raise CheckpointError(f"{damaged}: {key!r} is neither tensor nor object")
        for index, nbytes in chunks:
            info = storage.get(index)
            if info is None:
                raise CheckpointError(f"{damaged}: no file holds {key!r}")
            if nbytes > info.length:  # torch.save adds headers, never removes bytes
                raise CheckpointError(
                    f"{damaged}: {key!r} declares {nbytes} bytes, but its file "
                    f"holds {info.length} for it"
                )


def storage_ranges(metadata: Metadata, indices: Any = None) -> dict:
    """``{(file, offset, length): key}`` of the items at ``indices`` (default all)."""
    storage = metadata.storage_data
    indices = storage.keys() if indices is None else indices
    return {
        (storage[i].relative_path, storage[i].offset, storage[i].length): i.fqn
        for i in indices
    }


# How many fields this torch's TensorProperties pickles.
_FIELDS = len(TensorProperties().__getstate__())


class CompatTensorProperties(TensorProperties):
    """DCP's ``TensorProperties``, also read from a newer torch's longer state."""

    def __setstate__(self, state: Any) -> None:
        """Takes the fields this torch knows; drops those a newer torch added."""
        if isinstance(state, tuple) and len(state) > _FIELDS:
            state = state[:_FIELDS]
        super().__setstate__(state)


def written_by() -> dict[str, str]:
    """The versions that write a step now: ``{"torch": ..., "pippy": ...}``."""
    try:
        pippy = importlib.metadata.version("pippy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        pippy = "unknown"
    return {"torch": str(torch.__version__), "pippy": pippy}


def newer_torch_refusal(
    metadata_file: str, writer: object, error: Exception
) -> CheckpointError | None:
    """The error for a ``.metadata`` a newer torch wrote and this one cannot read.

    Args:
        metadata_file: The file, for the message.
        writer: The torch version the step's manifest records (None if none).
        error: What unpickling raised.

    Returns:
        The error, or None unless ``writer`` is newer than this torch.
    """
    if not isinstance(writer, str):
        return None
    try:
        newer = TorchVersion(writer) > TorchVersion(str(torch.__version__))
    except Exception:  # not a version: the manifest is no help here
        return None
    if not newer:
        return None
    return CheckpointError(
        f"{metadata_file} was written by torch {writer}, this is torch "
        f"{torch.__version__}, which cannot read it ({type(error).__name__}: "
        f"{error}). Read it with torch {writer} or newer"
    )
