"""The storage seam: every path and file operation of a checkpoint, in one place.

A checkpoint's location is a local folder (a ``str`` or ``os.PathLike``; it
stays a :class:`~pathlib.Path`) or an fsspec URL (``s3://``, ``gs://``,
``memory://``, ``file://``; it stays a ``str``: ``Path("memory://run")`` would
fold it into the local folder ``memory:/run``). :func:`storage_for` picks the
implementation of :class:`Storage` for a location; nothing outside this
package opens, renames, links or deletes a checkpoint's files, so a new
storage, publish protocol or lock is added here alone.

:class:`LocalStorage` (:mod:`~pippy.checkpoint.storage.posix`) writes durably,
in the order that survives a power loss: write, flush, ``fsync`` the file,
rename, ``fsync`` the folder that holds the new name.
:class:`DurableFileSystem` gives DCP's own writer the same order: torch
2.13's ``FileSystemWriter`` fsyncs ``.metadata`` before its buffer is flushed
at close (torch 2.14 flushes first) and never fsyncs a folder.

:class:`FsspecStorage` (:mod:`~pippy.checkpoint.storage.url`) reads any fsspec
URL. Object stores have no atomic rename (S3 copies every object, then
deletes it): :mod:`~pippy.checkpoint.steps` writes a step there in place and
commits it with its manifest, written last in one PUT.
:func:`check_publishable` refuses such a location for what only a rename can
publish whole (a Hugging Face folder).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

import google_crc32c
import numpy
import torch
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.serialization import get_crc32_options, set_crc32_options
from torch.torch_version import TorchVersion

from pippy.checkpoint.errors import CheckpointDirError, UnsafeCheckpointError

__all__ = [
    "DurableFileSystem",
    "FsspecStorage",
    "LocalStorage",
    "Location",
    "Storage",
    "check_publishable",
    "checksummed",
    "is_url",
    "step_file",
    "storage_for",
]

#: A checkpoint location: a local path, or an fsspec URL as a ``str``.
Location = str | os.PathLike


def is_url(location: Location) -> bool:
    """Tells whether ``location`` is an fsspec URL (``<protocol>://...``)."""
    return not isinstance(location, Path) and "://" in os.fspath(location)


class Storage(Protocol):
    """What pippy does with a checkpoint's files, on one kind of storage.

    Locations passed in and returned are of the storage's own kind: ``Path``
    for :class:`LocalStorage`, URL strings for :class:`FsspecStorage`.
    Writes are durable when they return; ``atomic_rename`` tells whether
    :meth:`publish` is atomic, as a step's publication requires.
    """

    atomic_rename: bool

    def join(self, base: Location, *names: str) -> Any:
        """``base/name/...``, of this storage's kind."""
        ...

    def name(self, location: Location) -> str:
        """The last component of ``location``."""
        ...

    def parent(self, location: Location) -> Any:
        """The folder holding ``location``."""
        ...

    def exists(self, location: Location) -> bool:
        """Whether anything is at ``location``."""
        ...

    def is_dir(self, location: Location) -> bool:
        """Whether ``location`` is a folder."""
        ...

    def size(self, location: Location) -> int | None:
        """The size of the file at ``location`` in bytes; None if no file is there."""
        ...

    def listdir(self, location: Location) -> list[str]:
        """The names in folder ``location``, sorted; empty if it does not exist."""
        ...

    def makedirs(self, location: Location) -> None:
        """Creates folder ``location`` and its parents, durably; fine if it exists."""
        ...

    def open_read(self, location: Location) -> IO[bytes]:
        """Opens the file at ``location`` to read bytes."""
        ...

    def read_bytes(self, location: Location) -> bytes:
        """The whole file at ``location``."""
        ...

    def write_atomic(self, location: Location, data: bytes) -> None:
        """Writes ``data`` at ``location`` whole or not at all, durably."""
        ...

    def open_atomic(self, location: Location) -> AbstractContextManager[IO[bytes]]:
        """A stream whose bytes appear at ``location`` whole, once the block ends."""
        ...

    def create_exclusive(self, location: Location, data: bytes) -> bool:
        """Creates the file ``location`` holding ``data``; False if it exists."""
        ...

    def publish(self, source: Location, target: Location) -> None:
        """Renames ``source`` to ``target`` (a file or folder), durably."""
        ...

    def remove(self, location: Location) -> None:
        """Deletes the file or folder tree at ``location``; fine if it is gone."""
        ...

    def same_place(self, location: Location) -> Any:
        """``location`` with links resolved, to compare two locations."""
        ...

    def dcp_filesystem(self, location: Location) -> FileSystemBase:
        """DCP's ``FileSystemBase`` for files under ``location``."""
        ...


#: Whether torch keeps ``torch.save``'s CRC-32 setting per thread: from torch
#: 2.12 on (a ContextVar in its config module); torch 2.10 and 2.11 have one
#: setting for the whole process.
CRC32_PER_THREAD = TorchVersion(torch.__version__) >= "2.12"


@contextmanager
def no_crc32() -> Iterator[None]:
    """This thread's ``torch.save`` skips its CRC-32 for the block.

    ``torch.load`` never checks it (pytorch/pytorch#126952); pippy's manifest
    holds a CRC-32C of every item instead. torch keeps the setting per thread
    from 2.12 on, so a ``torch.save`` elsewhere in the process, meanwhile, is
    unaffected.

    Note:
        On torch 2.10 and 2.11 (:data:`CRC32_PER_THREAD` false) the block
        changes nothing: there the setting is the whole process's, so turning
        it off would drop the CRC-32 of every other thread's ``torch.save``
        meanwhile, and two writer threads restoring it in turn could leave it
        off for good.
    """
    if not CRC32_PER_THREAD:
        yield
        return
    previous = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(previous)


# Writes up to this many bytes are gathered before they are checksummed.
_SMALL_WRITE = 16 * 1024


class _Crc32cStream:
    """A stream being written, with the CRC-32C of the bytes between two tells.

    DCP's writer calls ``tell()`` before and after each item, so each span
    between two calls is one item: its ``(file, offset, length)`` gets the
    CRC-32C of the bytes as they were written, and nothing need be read back.
    ``torch.save`` writes about 40 small records per item: they are gathered,
    then checksummed and passed on in one write.
    """

    def __init__(self, raw: Any, name: str, record: dict) -> None:
        self.raw, self.name, self.record = raw, name, record
        self.start, self.crc = raw.tell(), 0
        self.small = bytearray()  # small writes not yet checksummed nor passed on
        self.closed = False

    def write(self, data: Any) -> int:
        """Writes ``data``, extending the checksum (of a view, not a copy)."""
        size = len(data)  # torch.save and DCP write bytes (format "B")
        if size <= _SMALL_WRITE:
            self.small += data
            return size
        self._pass_small()
        array = numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)
        self.crc = google_crc32c.extend(self.crc, array)
        return self.raw.write(data)

    def _pass_small(self) -> None:
        """Checksums the gathered small writes and passes them on."""
        if self.small:
            data = bytes(self.small)
            self.crc = google_crc32c.extend(self.crc, data)
            self.raw.write(data)
            self.small.clear()

    def tell(self) -> int:
        """The position; the span since the last call is recorded."""
        self._pass_small()
        position = int(self.raw.tell())
        if position != self.start:
            self.record[self.name, self.start, position - self.start] = self.crc
            self.start, self.crc = position, 0
        return position

    def fileno(self) -> int:
        """The file's descriptor, for DCP's fsync; AttributeError if it has none."""
        self.flush()
        return int(self.raw.fileno())

    def flush(self) -> None:
        """Flushes the stream."""
        self._pass_small()
        self.raw.flush()

    def close(self) -> None:
        """Records the last span, then closes."""
        if not self.closed:
            self.tell()
            self.raw.close()
            self.closed = True


@contextmanager
def checksummed(fs: FileSystemBase, path: str | os.PathLike, raw: Any) -> Iterator[Any]:
    """``raw``, a stream DCP writes ``path`` through, recording each item's CRC-32C.

    The checksums go into ``fs.crcs``, ``(file, offset, length)`` to CRC-32C,
    which :class:`~pippy.checkpoint.steps.ManifestWriter` takes for its
    manifest instead of reading the items back. Use it inside the block that
    closes ``raw``: at its end, what it holds back is written to ``raw``
    (DCP closes a data file's stream itself, but not ``.metadata``'s).
    """
    record = fs.__dict__.setdefault("crcs", {})
    stream = _Crc32cStream(raw, os.path.basename(os.fspath(path)), record)
    yield stream
    if not stream.closed:
        stream.tell()


def glob(storage: Storage, folder: Location, pattern: str) -> list[Any]:
    """The entries of ``folder`` whose names match the shell ``pattern``."""
    return [
        storage.join(folder, name)
        for name in storage.listdir(folder)
        if fnmatch.fnmatchcase(name, pattern)
    ]


def storage_for(location: Location) -> Storage:
    """The storage that holds ``location``: fsspec for a URL, else the local one.

    Args:
        location: A local path, or an fsspec URL.

    Returns:
        A :class:`LocalStorage` or an :class:`FsspecStorage`.

    Raises:
        CheckpointDirError: A URL whose client is missing or unknown.
    """
    if is_url(location):
        return FsspecStorage(os.fspath(location))
    return LocalStorage()


def check_publishable(location: Location) -> Storage:
    """The storage of ``location``, if steps can be published there safely.

    Args:
        location: A run's checkpoint folder, or a folder to export into.

    Returns:
        Its storage.

    Raises:
        CheckpointDirError: The storage has no atomic rename (an object
            store), so a reader could see half a folder: refused, in one line.
    """
    storage = storage_for(location)
    if not storage.atomic_rename:
        raise CheckpointDirError(
            f"cannot write a folder to {os.fspath(location)!r}: publishing it "
            "whole needs an atomic rename, which this storage lacks (a reader "
            "could see half of it). Write it to a local or mounted folder"
        )
    return storage


def step_file(storage: Storage, folder: Location, name: str) -> Any:
    """The file ``name`` of the step ``folder``; refused if it links out of it.

    Every file of a step that pippy reads (``.metadata``, ``manifest.json``,
    the data files) is taken through it. A link inside the step folder to a
    file elsewhere would otherwise be read wherever it points; no checkpoint
    written by DCP or pippy holds one. Object stores have no links; an
    fsspec URL (``file://`` too) is taken as it is.

    Args:
        storage: The storage of ``folder``.
        folder: A step folder.
        name: A plain file name in it.

    Returns:
        ``folder/name``, of the storage's kind (the link's name, not its target).

    Raises:
        UnsafeCheckpointError: ``folder/name`` is a link leading out of
            ``folder``; the message names the file and where it points.
    """
    path = storage.join(folder, name)
    target = storage.same_place(path)
    if storage.parent(target) != storage.same_place(folder):
        raise UnsafeCheckpointError(
            f"refused to read {os.fspath(path)!r}: it is a link to "
            f"{os.fspath(target)!r}, outside its step folder, which no checkpoint "
            "written by DCP or pippy holds. Put the file itself in the step "
            "folder in place of the link"
        )
    return path


# After the protocol: the implementations import it.
from pippy.checkpoint.storage.posix import DurableFileSystem, LocalStorage  # noqa: E402
from pippy.checkpoint.storage.url import FsspecStorage  # noqa: E402
