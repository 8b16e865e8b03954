"""Any fsspec URL (``s3://``, ``gs://``, ``memory://``, ``file://``), as a string."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, cast

from torch.distributed.checkpoint.filesystem import FileSystemBase

from pippy.checkpoint.errors import CheckpointDirError
from pippy.checkpoint.storage import Location, checksummed, no_crc32

__all__ = ["FsspecStorage"]

# The optional extra that brings each protocol's fsspec client.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# The protocols whose PUT takes If-Match on a version tag (s3fs passes it on).
_CONDITIONAL = {"s3", "s3a"}


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
            from fsspec.core import url_to_fs

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
        fs = _no_crc32_filesystem()
        fs.init_path(os.fspath(location))
        return fs


def _no_crc32_filesystem() -> FileSystemBase:
    """DCP's fsspec file system: no ``torch.save`` CRC-32, a CRC-32C per item."""
    from torch.distributed.checkpoint._fsspec_filesystem import (
        FileSystem as FsspecFileSystem,
    )

    class NoCrc32FsspecFileSystem(FsspecFileSystem):
        """As :class:`~pippy.checkpoint.storage.DurableFileSystem`, on fsspec.

        Attributes:
            crcs: ``(file, offset, length)`` of each item written, to its
                CRC-32C, taken as it was written.
        """

        crcs: dict[tuple[str, int, int], int]

        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            """DCP's stream; writing, this thread's ``torch.save`` skips CRC-32."""
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with no_crc32(), super().create_stream(path, mode) as stream:
                with checksummed(self, path, stream) as checked:
                    yield checked

    return NoCrc32FsspecFileSystem()
