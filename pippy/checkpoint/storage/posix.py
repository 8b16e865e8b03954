"""POSIX folders: durable writes, atomic renames, exclusive creation by hard link."""

from __future__ import annotations

import errno
import io
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from pippy.checkpoint.storage import Location, checksummed, no_crc32

__all__ = ["DurableFileSystem", "LocalStorage"]


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
    """DCP's local ``FileSystem``, durable and without ``torch.save``'s CRC-32.

    * A file opened to write is fsynced after its last byte, at close (torch
      2.13's writer fsyncs before its buffer is flushed).
    * A rename fsyncs the folder that holds the new name (``.metadata``).
    * While a file is written, this thread's ``torch.save`` skips its CRC-32,
      which ``torch.load`` never checks (pytorch/pytorch#126952); pippy's
      manifest holds a CRC-32C of every item instead, taken from the bytes as
      they are written (``crcs``: nothing is read back). torch 2.13 keeps the
      setting per thread (a ContextVar), so a ``torch.save`` elsewhere in the
      process, meanwhile, is unaffected.

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
        with no_crc32(), _DurableWriter(io.FileIO(os.fspath(path), "wb")) as stream:
            with checksummed(self, path, stream) as checked:
                yield checked

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

    def _write_durable(self, path: Path, data: bytes, mode: str = "wb") -> None:
        """Writes ``data`` to a new file and fsyncs it before closing."""
        with _DurableWriter(io.FileIO(path, mode)) as f:
            f.write(data)

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
            self._write_durable(draft, data, "xb")
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
