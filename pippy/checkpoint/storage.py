"""The storage seam: every path and file operation of a checkpoint, in one place.

A location is a local folder (kept a :class:`~pathlib.Path`) or an fsspec URL
(kept a ``str``: ``Path("memory://run")`` would become ``memory:/run``);
nothing outside this module opens, renames, links or deletes a checkpoint's
files.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Any, Protocol, cast

from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import (
    FileSystem as FsspecFileSystem,
)
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from pippy.checkpoint.errors import (
    CheckpointDirError,
    UnsafeCheckpointError,
    dir_error,
)

#: A checkpoint location: a local path, or an fsspec URL as a ``str``.
Location = str | os.PathLike


def is_url(location: Location) -> bool:
    """Tells whether ``location`` is an fsspec URL (``<protocol>://...``)."""
    return not isinstance(location, Path) and "://" in os.fspath(location)


def join(base: Location, *names: str) -> Any:
    """``base/name/...``: a ``Path`` for a local folder, a ``str`` for a URL."""
    if is_url(base):
        return "/".join([os.fspath(base).rstrip("/"), *names])
    return Path(base).joinpath(*names)


class Storage(Protocol):
    """What pippy does with a checkpoint's files, on one kind of storage.

    Locations are of the storage's own kind (``Path`` or URL ``str``). Writes are
    durable when they return; ``atomic_rename`` tells whether :meth:`publish` is
    atomic, as publishing a step requires. ``staged``: the location is, or lies
    in, a folder to :meth:`publish`, which makes the names in it durable then
    (a file's bytes are durable at once either way).
    """

    atomic_rename: bool

    def join(self, base: Location, *names: str) -> Any:
        """``base/name/...``, of ``base``'s kind (as :func:`join`)."""
        return join(base, *names)

    def name(self, location: Location) -> str:
        """The last component of ``location``."""
        return os.fspath(location).rstrip("/").rsplit("/", 1)[-1]

    def parent(self, location: Location) -> Any:
        """The folder holding ``location``, of its kind."""
        if is_url(location):
            return os.fspath(location).rstrip("/").rsplit("/", 1)[0]
        return Path(location).parent

    def exists(self, location: Location) -> bool:
        """Whether anything is at ``location``."""

    def is_dir(self, location: Location) -> bool:
        """Whether ``location`` is a folder."""

    def size(self, location: Location) -> int | None:
        """The size of the file at ``location`` in bytes; None if no file is there."""

    def listdir(self, location: Location) -> list[str]:
        """The names in folder ``location``, sorted; empty if it does not exist."""

    def makedirs(self, location: Location, *, staged: bool = False) -> None:
        """Creates folder ``location`` and its parents, durably; fine if it exists."""

    def read_bytes(self, location: Location) -> bytes:
        """The whole file at ``location``."""

    def write_atomic(
        self, location: Location, data: bytes, *, staged: bool = False
    ) -> None:
        """Writes ``data`` at ``location`` whole or not at all, durably."""
        with self.open_atomic(location, staged=staged) as f:
            f.write(data)

    def open_atomic(
        self, location: Location, *, staged: bool = False
    ) -> AbstractContextManager[IO[bytes]]:
        """A stream whose bytes appear at ``location`` whole, once the block ends."""

    def create_exclusive(self, location: Location, data: bytes) -> bool:
        """Creates the file ``location`` holding ``data``; False if it exists."""

    def publish(self, source: Location, target: Location) -> None:
        """Renames ``source`` to ``target`` (a file or folder), durably."""

    def remove(self, location: Location) -> None:
        """Deletes the file or folder tree at ``location``; fine if it is gone."""

    def same_place(self, location: Location) -> Any:
        """``location`` with links resolved, to compare two locations."""

    def dcp_filesystem(self, location: Location) -> FileSystemBase:
        """DCP's ``FileSystemBase`` for files under ``location``."""


def storage_for(location: Location) -> Storage:
    """The storage of ``location`` (fsspec for a URL); refuses a URL it cannot open."""
    if is_url(location):
        return FsspecStorage(os.fspath(location))
    return LocalStorage()


def same_location(a: Location, b: Location) -> bool:
    """Whether two locations name one place (links resolved, URLs as written)."""
    return storage_for(a).same_place(a) == storage_for(b).same_place(b)


def check_publishable(location: Location) -> Storage:
    """The storage of ``location``; refused if it lacks an atomic rename."""
    storage = storage_for(location)
    if not storage.atomic_rename:
        raise CheckpointDirError(
            f"cannot write a folder to {os.fspath(location)!r}: publishing it "
            "whole needs an atomic rename, which this storage lacks (a reader "
            "could see half of it). Write it to a local or mounted folder"
        )
    return storage


def step_file(storage: Storage, folder: Location, name: str) -> Any:
    """``folder/name``; refused if it is a link out of the step folder.

    Every file pippy reads from a step goes through it (object stores have no links).
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
        """Flushes and fsyncs the file, then closes it."""
        try:
            if not self.closed:
                self.flush()
                os.fsync(self.fileno())
        finally:
            super().close()


class DurableFileSystem(FileSystem):
    """DCP's local ``FileSystem``, each file it writes fsynced at close.

    torch 2.13's own fsyncs ``.metadata`` before flushing it, and never a folder:
    :meth:`LocalStorage.publish` fsyncs the staging folder before its rename.
    """

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike, mode: str
    ) -> Generator[io.IOBase, None, None]:
        """DCP's stream; a written file is fsynced at close."""
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _DurableWriter(io.FileIO(os.fspath(path), "wb")) as stream:
            yield stream


class RangeFile:
    """A local file read by byte ranges (``pread``), readahead off; a context manager.

    For a few ranges of large files (a stage's tensors in a model's shards):
    ``POSIX_FADV_RANDOM`` makes the disk read only what is asked for. ``name``
    (for messages) and ``size`` are the file's.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.name = os.path.basename(os.fspath(path))
        self.fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = os.fstat(self.fd).st_size

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the file)."""
        return os.pread(self.fd, length, offset)

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Fills ``buffer`` from ``offset``; the bytes read (fewer at the end)."""
        done = 0
        while done < len(buffer):
            got = os.preadv(self.fd, [buffer[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done


class LocalStorage(Storage):
    """A POSIX folder: write, flush, fsync, rename, fsync the folder; hard links."""

    atomic_rename = True

    def exists(self, location: Location) -> bool:
        """Whether anything is at ``location`` (a dangling link is nothing)."""
        return Path(location).exists()

    def is_dir(self, location: Location) -> bool:
        """Whether ``location`` is a folder."""
        return Path(location).is_dir()

    def size(self, location: Location) -> int | None:
        """The file's size; None if no file is there."""
        path = Path(location)
        return path.stat().st_size if path.is_file() else None

    def listdir(self, location: Location) -> list[str]:
        """The names in the folder, sorted; empty if it does not exist."""
        try:
            return sorted(os.listdir(location))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, location: Location, *, staged: bool = False) -> None:
        """Creates the folder and missing parents, fsyncing each new name's holder."""
        path = Path(location)
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                continue  # another process made it meanwhile
            if not (staged and folder == path):
                _fsync_dir(folder.parent)
        if not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(location))

    def read_bytes(self, location: Location) -> bytes:
        """The whole file."""
        return Path(location).read_bytes()

    @contextmanager
    def _draft(
        self, location: Location, commit: Callable, staged: bool = False
    ) -> Iterator[IO[bytes]]:
        """A hidden file fsynced, then ``commit(draft, path)``; on error, nothing."""
        path = Path(location)
        draft = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            raw = io.FileIO(draft, "xb")
        except OSError as e:  # named by the file asked for, not its draft
            raise type(e)(e.errno, e.strerror, os.fspath(path)) from None
        try:
            with _DurableWriter(raw) as f:
                yield cast(IO[bytes], f)
            commit(draft, path)
        finally:
            draft.unlink(missing_ok=True)
        if not staged:
            _fsync_dir(path.parent)

    def open_atomic(
        self, location: Location, *, staged: bool = False
    ) -> AbstractContextManager[IO[bytes]]:
        """Writes a temp file, fsyncs, renames, fsyncs the folder; on error, nothing."""
        return self._draft(location, os.replace, staged)

    def create_exclusive(self, location: Location, data: bytes) -> bool:
        """Writes a draft, then hard-links it to ``location`` (atomic, also on NFS)."""
        try:
            with self._draft(location, os.link) as f:
                f.write(data)
        except FileExistsError:  # from the link: another's is there
            return False
        return True

    def publish(self, source: Location, target: Location) -> None:
        """Renames, fsyncing a folder's entries before and the target's holder after."""
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


class FsspecStorage(Storage):
    """Any fsspec URL; refuses an unknown protocol or a missing client."""

    atomic_rename = False

    def __init__(self, url: str) -> None:
        self.protocol, _, path = url.partition("://")
        if magic := sorted({c for c in path if c in "*?["}):
            raise CheckpointDirError(
                f"{url!r} holds {' '.join(magic)}, which fsspec reads as a wildcard: "
                "it would move or delete other objects than this folder's. Name "
                "the folder without * ? ["
            )
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
        """The URL without its protocol, fsspec's cached listing of it dropped."""
        path = cast(str, self.fs._strip_protocol(os.fspath(location)))
        self.fs.invalidate_cache(path)
        return path

    def exists(self, location: Location) -> bool:
        """Whether anything is at ``location``."""
        return bool(self.fs.exists(self._path(location)))

    def is_dir(self, location: Location) -> bool:
        """Whether ``location`` is a folder (a prefix holding objects)."""
        return bool(self.fs.isdir(self._path(location)))

    def size(self, location: Location) -> int | None:
        """The object's size; None if there is none."""
        path = self._path(location)
        return int(self.fs.size(path)) if self.fs.isfile(path) else None

    def listdir(self, location: Location) -> list[str]:
        """The names under ``location``, sorted; empty if there are none."""
        path = self._path(location)
        if not self.fs.isdir(path):
            return []
        entries = self.fs.ls(path, detail=False, refresh=True)
        return sorted(self.name(e) for e in entries)

    def makedirs(self, location: Location, *, staged: bool = False) -> None:
        """Creates the folder (a no-op on stores without folders); never a bucket."""
        path = self._path(location)
        bucket = path.split("/", 1)[0]
        if self.protocol in _EXTRAS and not self.fs.exists(bucket):
            raise CheckpointDirError(
                f"no bucket {bucket!r} for {os.fspath(location)!r}: create it "
                "first (a job never creates a bucket), or correct the URL"
            )
        self.fs.makedirs(path, exist_ok=True)

    def read_bytes(self, location: Location) -> bytes:
        """The whole object."""
        return cast(bytes, self.fs.cat_file(self._path(location)))

    @contextmanager
    def open_atomic(
        self, location: Location, *, staged: bool = False
    ) -> Iterator[IO[bytes]]:
        """Collects the bytes, then writes them in one PUT (atomic on object stores)."""
        buffer = io.BytesIO()
        yield buffer
        self.fs.pipe_file(self._path(location), buffer.getvalue())

    def create_exclusive(self, location: Location, data: bytes) -> bool:
        """Creates the object unless it exists, atomically (S3: ``If-None-Match``)."""
        path = self._path(location)
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except OSError:  # FileExistsError, or S3's precondition failure
            if self.exists(location):
                return False
            raise
        return True

    @property
    def conditional(self) -> bool:
        """Whether :meth:`replace_if_unchanged` can write (S3's ``If-Match``)."""
        return self.protocol in _CONDITIONAL

    def version(self, location: Location) -> str | None:
        """The object's version tag (S3: its ETag); None if none or nothing there."""
        try:
            info = self.fs.info(self._path(location))
        except FileNotFoundError:
            return None
        tag = info.get("ETag") if self.protocol in _CONDITIONAL else None
        return str(tag) if tag else None

    def replace_if_unchanged(
        self, location: Location, data: bytes, version: str | None
    ) -> str | None:
        """Overwrites the object if still at ``version`` (S3 ``If-Match``); new tag.

        So a writer that stalled cannot overwrite another's (only where
        :attr:`conditional`); None if the object changed or is gone. Without a
        ``version`` (the store gave none), a plain PUT (tag "").
        """
        path = self._path(location)
        if version is None:
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
        """Copies ``source`` to ``target`` object by object, then deletes it.

        Not atomic. Each object is named: a store without folders has no object
        for the prefix.
        """
        source, target = self._path(source), self._path(target)
        objects = self.fs.find(source) if self.fs.isdir(source) else [source]
        for name in objects:
            self.fs.copy(name, target + name[len(source) :])
        self.remove(source)  # no wildcard: refused in the URL

    def remove(self, location: Location) -> None:
        """Deletes the object or tree (a second pass: the folder SeaweedFS keeps)."""
        for _ in range(2):
            path = self._path(location)  # listings as they are now
            if not self.fs.exists(path):
                return
            self.fs.rm(path, recursive=True)

    def same_place(self, location: Location) -> str:
        """The URL (object stores have no links)."""
        return os.fspath(location).rstrip("/")

    def dcp_filesystem(self, location: Location) -> FileSystemBase:
        """DCP's fsspec ``FileSystem``, set up for ``location``."""
        fs = FsspecFileSystem()
        fs.init_path(os.fspath(location))
        return fs


@contextmanager
def written_whole(storage: Storage, out: Location, *, replace: bool) -> Iterator[Any]:
    """A folder to write, published as ``out`` after the block; removed if it fails."""
    token = uuid.uuid4().hex[:12]
    tmp = storage.join(storage.parent(out), f".{storage.name(out)}.partial-{token}")
    if not storage.atomic_rename:  # written in place, committed by its manifest
        tmp = out
    try:
        storage.makedirs(tmp, staged=tmp != out)
    except OSError as e:  # a file where a folder above it should be, say
        action = f"cannot write {str(out)!r} in {str(storage.parent(out))!r}"
        raise dir_error(action, e) from e
    try:
        yield tmp
        if tmp != out:
            if replace:
                storage.remove(out)  # fine if there is none
            storage.publish(tmp, out)
    except BaseException:
        storage.remove(tmp)
        raise
