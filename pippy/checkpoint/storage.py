"""The storage seam: every path and file operation of a checkpoint, in one place.

A checkpoint's location is a local folder (a ``str`` or ``os.PathLike``; it
stays a :class:`~pathlib.Path`) or an fsspec URL (``s3://``, ``gs://``,
``memory://``, ``file://``; it stays a ``str``: ``Path("memory://run")`` would
fold it into the local folder ``memory:/run``). :func:`storage_for` picks the
:class:`Storage` of a location; nothing outside this module opens, renames,
links or deletes a checkpoint's files.

:class:`LocalStorage` writes durably, in the order that survives a power loss:
write, flush, ``fsync`` the file, rename, ``fsync`` the folder that holds the
new name; :class:`DurableFileSystem` gives DCP's own writer the same order
(torch 2.13's ``FileSystemWriter`` fsyncs ``.metadata`` before its buffer is
flushed and never fsyncs a folder). :class:`FsspecStorage` reads any fsspec
URL; object stores have no atomic rename (S3 copies, then deletes), so
:mod:`~pippy.checkpoint.steps` writes a step there in place and commits it
with its manifest, written last in one PUT, and :func:`check_publishable`
refuses them for what only a rename publishes whole (a Hugging Face folder).
"""

from __future__ import annotations

import errno
import fnmatch
import io
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Any, Protocol, cast

import google_crc32c
import numpy
import torch
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem as FsspecFileSystem,
)
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.serialization import get_crc32_options, set_crc32_options
from torch.torch_version import TorchVersion

from pippy.checkpoint.errors import CheckpointDirError, UnsafeCheckpointError

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


def glob(storage: Storage, folder: Location, pattern: str) -> list[Any]:
    """The entries of ``folder`` whose names match the shell ``pattern``."""
    return [
        storage.join(folder, name)
        for name in storage.listdir(folder)
        if fnmatch.fnmatchcase(name, pattern)
    ]


# Checksums as written: a CRC-32C per item, in place of torch.save's CRC-32.

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
    """A stream being written, recording the CRC-32C of the bytes between two tells."""

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

    DCP's writer calls ``tell()`` before and after each item, so each span
    between two calls is one item: its ``(file, offset, length)`` goes into
    ``fs.crcs`` with the CRC-32C of its bytes as they were written, which
    :class:`~pippy.checkpoint.steps.ManifestWriter` takes for its manifest
    instead of reading the items back. The ~40 small records ``torch.save``
    writes per item are gathered, then checksummed and passed on in one write.
    Meanwhile this thread's ``torch.save`` skips its own CRC-32
    (:func:`no_crc32`). Use it inside the block that closes ``raw``: at its
    end, what it holds back is written to ``raw`` (DCP closes a data file's
    stream itself, but not ``.metadata``'s).
    """
    record = fs.__dict__.setdefault("crcs", {})
    stream = _Crc32cStream(raw, os.path.basename(os.fspath(path)), record)
    with no_crc32():
        yield stream
    if not stream.closed:
        stream.tell()


# POSIX folders: durable writes, atomic renames, exclusive creation by hard link.


def _fsync_dir(folder: Path) -> None:
    """Makes the names in ``folder`` durable (its entries, not their data)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DurableWriter(io.BufferedWriter):
    """A buffered file whose ``close`` flushes, then fsyncs, then closes."""

    def close(self) -> None:
        """Flushes the buffer and fsyncs the file before closing it."""
        if not self.closed:
            try:
                self.flush()
                os.fsync(self.fileno())
            finally:
                super().close()
        else:
            super().close()


class DurableFileSystem(FileSystem):
    """DCP's local ``FileSystem``, durable, each item checksummed as written.

    A file written is fsynced after its last byte, at close; a rename fsyncs
    the folder that holds the new name (``.metadata``); writes go through
    :func:`checksummed`, without ``torch.save``'s CRC-32.

    Attributes:
        crcs: ``(file, offset, length)`` of each item written, to its
            CRC-32C, taken as it was written.
    """

    crcs: dict[tuple[str, int, int], int]

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        """DCP's stream; in write mode durable at close, without CRC-32."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _DurableWriter(io.FileIO(os.fspath(path), "wb")) as raw:
            with checksummed(self, path, raw) as stream:
                yield stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """Renames, then fsyncs the folder holding the new name."""
        os.rename(path, new_path)
        _fsync_dir(Path(new_path).parent)


class LocalStorage:
    """A POSIX folder: atomic renames, ``fsync`` for durability, hard links."""

    atomic_rename = True

    def join(self, base: Location, *names: str) -> Path:
        """``base/name/...`` as a ``Path``."""
        return Path(base).joinpath(*names)

    def name(self, location: Location) -> str:
        """The last component of ``location``."""
        return Path(location).name

    def parent(self, location: Location) -> Path:
        """The folder holding ``location``."""
        return Path(location).parent

    def exists(self, location: Location) -> bool:
        """Whether anything is at ``location`` (a dangling link is nothing)."""
        return Path(location).exists()

    def is_dir(self, location: Location) -> bool:
        """Whether ``location`` is a folder."""
        return Path(location).is_dir()

    def size(self, location: Location) -> int | None:
        """The size of the file at ``location``; None if no file is there."""
        path = Path(location)
        return path.stat().st_size if path.is_file() else None

    def listdir(self, location: Location) -> list[str]:
        """The names in folder ``location``, sorted; empty if it does not exist."""
        try:
            return sorted(os.listdir(location))
        except (FileNotFoundError, NotADirectoryError):  # as Path.exists: nothing
            return []

    def makedirs(self, location: Location) -> None:
        """Creates the folder and missing parents, fsyncing each new name's holder."""
        path = Path(location)
        missing = []
        while not path.exists():
            missing.append(path)
            path = path.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                continue  # another process made it meanwhile
            _fsync_dir(folder.parent)
        if not Path(location).is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(location))

    def open_read(self, location: Location) -> IO[bytes]:
        """Opens the file at ``location`` to read bytes."""
        return open(location, "rb")

    def read_bytes(self, location: Location) -> bytes:
        """The whole file at ``location``."""
        return Path(location).read_bytes()

    @contextmanager
    def open_atomic(self, location: Location) -> Iterator[IO[bytes]]:
        """Writes a temporary file, fsyncs it, renames it, fsyncs the folder.

        If the block raises, the temporary file is removed and ``location``
        is untouched.
        """
        path = Path(location)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with _DurableWriter(io.FileIO(tmp, "xb")) as f:
                yield cast(IO[bytes], f)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)

    def write_atomic(self, location: Location, data: bytes) -> None:
        """Writes the bytes whole or not at all, durably (:meth:`open_atomic`)."""
        with self.open_atomic(location) as f:
            f.write(data)

    def create_exclusive(self, location: Location, data: bytes) -> bool:
        """Writes a draft, then hard-links it to ``location`` (atomic, also on NFS)."""
        path = Path(location)
        draft = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.draft")
        try:
            with _DurableWriter(io.FileIO(draft, "xb")) as f:
                f.write(data)
            try:
                os.link(draft, path)
            except FileExistsError:
                return False
        finally:
            draft.unlink(missing_ok=True)
        _fsync_dir(path.parent)
        return True

    def publish(self, source: Location, target: Location) -> None:
        """Renames ``source`` to ``target`` and fsyncs what makes it durable.

        A folder's own entries are fsynced before the rename, and the folder
        holding ``target`` after it.
        """
        source, target = Path(source), Path(target)
        if source.is_dir():
            _fsync_dir(source)
        os.rename(source, target)
        _fsync_dir(target.parent)

    def remove(self, location: Location) -> None:
        """Deletes the file or folder tree; fsyncs the folder that held it."""
        path = Path(location)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        if path.parent.is_dir():
            _fsync_dir(path.parent)

    def same_place(self, location: Location) -> Path:
        """``location`` with links resolved."""
        return Path(location).resolve()

    def dcp_filesystem(self, location: Location) -> FileSystemBase:
        """A :class:`DurableFileSystem`."""
        return DurableFileSystem()


# fsspec URLs, as strings.

# The optional extra that brings each protocol's fsspec client.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# The protocols whose PUT takes If-Match on a version tag (s3fs passes it on).
_CONDITIONAL = {"s3", "s3a"}


class _FsspecFileSystem(FsspecFileSystem):
    """DCP's fsspec ``FileSystem``, each item checksummed as written, without CRC-32."""

    crcs: dict[tuple[str, int, int], int]

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        """DCP's stream; writing, it goes through :func:`checksummed`."""
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            with checksummed(self, path, raw) as stream:
                yield stream


class FsspecStorage:
    """Any fsspec URL; its client comes from the protocol's optional extra.

    Args:
        url: A location on the storage, e.g. ``s3://bucket/run``.

    Raises:
        CheckpointDirError: The protocol is unknown to fsspec, or its client
            is not installed (the message names the extra to install).
    """

    atomic_rename = False

    def __init__(self, url: str) -> None:
        self.protocol = url.split("://", 1)[0]
        try:
            self.fs, _ = url_to_fs(url)
        except ImportError as e:
            extra = _EXTRAS.get(self.protocol)
            fix = f"pip install 'pippy[{extra}]'" if extra else f"install it ({e})"
            raise CheckpointDirError(
                f"{url!r} needs the fsspec client of {self.protocol}://: {fix}"
            ) from None
        except ValueError as e:
            raise CheckpointDirError(f"{url!r} is not a storage URL: {e}") from None

    def _path(self, location: Location) -> str:
        """The path fsspec's file system takes (the URL without its protocol).

        Listings fsspec cached are dropped first: other processes (the other
        ranks, another job) write the same folder.
        """
        path = cast(str, self.fs._strip_protocol(os.fspath(location)))
        self.fs.invalidate_cache(path)
        return path

    def join(self, base: Location, *names: str) -> str:
        """``base/name/...`` as a URL."""
        return "/".join([os.fspath(base).rstrip("/"), *names])

    def name(self, location: Location) -> str:
        """The last component of the URL."""
        return os.fspath(location).rstrip("/").rsplit("/", 1)[-1]

    def parent(self, location: Location) -> str:
        """The URL of the folder holding ``location``."""
        return os.fspath(location).rstrip("/").rsplit("/", 1)[0]

    def exists(self, location: Location) -> bool:
        """Whether anything is at ``location``."""
        return bool(self.fs.exists(self._path(location)))

    def is_dir(self, location: Location) -> bool:
        """Whether ``location`` is a folder (a prefix holding objects)."""
        return bool(self.fs.isdir(self._path(location)))

    def size(self, location: Location) -> int | None:
        """The size of the object at ``location``; None if there is none."""
        path = self._path(location)
        return int(self.fs.size(path)) if self.fs.isfile(path) else None

    def listdir(self, location: Location) -> list[str]:
        """The names under ``location``, sorted; empty if there are none."""
        path = self._path(location)
        if not self.fs.isdir(path):
            return []
        entries = self.fs.ls(path, detail=False, refresh=True)
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def makedirs(self, location: Location) -> None:
        """Creates the folder (a no-op on stores without folders)."""
        self.fs.makedirs(self._path(location), exist_ok=True)

    def open_read(self, location: Location) -> IO[bytes]:
        """Opens the object at ``location`` to read bytes."""
        return cast(IO[bytes], self.fs.open(self._path(location), "rb"))

    def read_bytes(self, location: Location) -> bytes:
        """The whole object at ``location``."""
        return cast(bytes, self.fs.cat_file(self._path(location)))

    def write_atomic(self, location: Location, data: bytes) -> None:
        """Writes the object in one PUT, which object stores make atomic."""
        self.fs.pipe_file(self._path(location), data)

    @contextmanager
    def open_atomic(self, location: Location) -> Iterator[IO[bytes]]:
        """Collects the bytes, then writes them in one PUT if the block succeeds."""
        buffer = io.BytesIO()
        yield buffer
        self.write_atomic(location, buffer.getvalue())

    def create_exclusive(self, location: Location, data: bytes) -> bool:
        """Creates the object unless it exists, atomically.

        fsspec's ``"xb"`` mode: on S3 a conditional PUT (``If-None-Match: *``),
        which a store that honours it refuses when the object exists (s3fs
        raises an ``OSError``, "pre-conditions ... did not hold").
        """
        path = self._path(location)
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except OSError:  # FileExistsError, or S3's precondition failure
            self.fs.invalidate_cache(path)
            if self.fs.exists(path):
                return False
            raise
        return True

    def version(self, location: Location) -> str | None:
        """The version tag of the object at ``location`` (S3: its ETag), or None.

        None too where the store gives none, or nothing is there.
        """
        try:
            info = self.fs.info(self._path(location))
        except FileNotFoundError:
            return None
        tag = info.get("ETag") if self.protocol in _CONDITIONAL else None
        return str(tag) if tag else None

    def replace_if_unchanged(
        self, location: Location, data: bytes, version: str | None
    ) -> str | None:
        """Overwrites the object in one PUT if it is still at ``version``.

        On S3 a conditional PUT (``If-Match``, honoured by AWS S3 since 2024
        and by SeaweedFS), so that a writer that stalled cannot overwrite what
        another wrote meanwhile. Elsewhere (no ``version``) the PUT is plain.

        Returns:
            The new version tag ("" where the store gives none), or None if
            the object changed or is gone: nothing was written.
        """
        path = self._path(location)
        if version is None or self.protocol not in _CONDITIONAL:
            self.fs.pipe_file(path, data)
            return ""
        try:
            out = self.fs.pipe_file(path, data, IfMatch=version)
        except FileNotFoundError:
            return None
        except OSError as e:  # s3fs: "pre-conditions you specified did not hold"
            if "pre-condition" in str(e) or "412" in str(e):
                return None
            raise
        return str(out["ETag"])

    def publish(self, source: Location, target: Location) -> None:
        """Moves ``source`` to ``target``: a copy, then a delete (not atomic)."""
        self.fs.mv(self._path(source), self._path(target), recursive=True)

    def remove(self, location: Location) -> None:
        """Deletes the object or the tree under ``location``."""
        path = self._path(location)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def same_place(self, location: Location) -> str:
        """The URL (object stores have no links)."""
        return os.fspath(location).rstrip("/")

    def dcp_filesystem(self, location: Location) -> FileSystemBase:
        """DCP's fsspec ``FileSystem``, set up for ``location``, without CRC-32."""
        fs = _FsspecFileSystem()
        fs.init_path(os.fspath(location))
        return fs
