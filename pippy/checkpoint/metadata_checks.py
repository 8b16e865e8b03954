"""Checking a step's ``.metadata`` against its folder before anything is read.

A ``.metadata`` names, for every item, a data file, an offset and a length:
:func:`check_structure` refuses one whose files are not plain names inside
the step folder, or whose items do not fit their places, and
:func:`find_damage` lists the data files that are missing or short, before
any read or allocation.
"""

from __future__ import annotations

import math
import os
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from pippy.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from pippy.checkpoint.steps import METADATA_FILE
from pippy.checkpoint.storage import Location, Storage, step_file, storage_for

__all__ = ["check_structure", "data_file", "find_damage", "storage_ranges"]


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


def data_file(storage: Storage, folder: Location, name: Any) -> Any:
    """The data file ``name`` inside ``folder``; refused if it could be elsewhere.

    Raises:
        UnsafeCheckpointError: ``name`` is not a plain file name (a path), or
            is a link leading out of the step folder
            (:func:`~pippy.checkpoint.storage.step_file`).
    """
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
        UnsafeCheckpointError: As :func:`data_file`.
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
            data_file(files, folder, name)
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
    """``(file, offset, length)`` of the items at ``indices`` (default all), to keys.

    Args:
        metadata: A step's metadata.
        indices: ``MetadataIndex`` es of its storage table; all if None.

    Returns:
        ``{(file, offset, length): key}``.
    """
    storage = metadata.storage_data
    indices = storage.keys() if indices is None else indices
    return {
        (storage[i].relative_path, storage[i].offset, storage[i].length): i.fqn
        for i in indices
    }
