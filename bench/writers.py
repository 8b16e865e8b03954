"""The storage writers the sync saves are timed with, and the variants tried.

Every writer notes when ``write_data`` starts and ends (:class:`Marks`), which
splits ``dcp.save``'s time into planning, writing and finishing. The variants
are the options that were measured against pippy's ``ManifestWriter``
(bench/README.md gives the figures and what was kept):

* :class:`Crc32Writer`: ``torch.save``'s CRC-32 left on (pippy before);
* :class:`CrcWhileWritingWriter`: the manifest's CRC-32C computed from the
  bytes as they are written (a stream wrapper) instead of read back after;
* :class:`PlainTimedWriter`: DCP's own writer, no manifest (CRC-32 off too, so
  that it differs from pippy's in the checksums alone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import google_crc32c
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.storage import DurableFileSystem


class Marks:
    """Notes when a storage writer's ``write_data`` starts and ends.

    ``dcp.save`` plans (every rank's plan to the coordinator and back), then
    calls ``write_data`` on every rank, then gathers the write results for the
    coordinator's ``.metadata``; these marks split its time into the three.
    """

    marks: dict[str, float]

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.marks = {"write": time.perf_counter()}
        future = super().write_data(plan, planner)  # type: ignore[misc]
        future.wait()  # written (and checksummed) before returning; to be sure
        self.marks["written"] = time.perf_counter()
        return future


class TimedWriter(Marks, ManifestWriter):
    """pippy's writer: DCP's, CRC-32 off, a CRC-32C of every item in manifest.json."""


class Crc32Writer(TimedWriter):
    """pippy's writer with ``torch.save``'s CRC-32 of every item left on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = FileSystem()


class PlainTimedWriter(Marks, FileSystemWriter):
    """DCP's own writer, CRC-32 off, fsynced as pippy's: no checksums, no manifest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = DurableFileSystem()


class Crc32cStream:
    """A file being written, with the CRC-32C of the bytes between two ``tell()``s.

    DCP calls ``tell()`` before and after each item it writes, so each span
    between two calls is one item: its ``(file, offset, length)`` is recorded
    with its CRC-32C. The C extension of google-crc32c takes ``bytes`` only,
    so every write (memoryviews from ``torch.save``) is copied once.
    """

    def __init__(self, raw: Any, name: str, record: dict) -> None:
        self.raw, self.name, self.record = raw, name, record
        self.start, self.crc = raw.tell(), 0

    def write(self, data: Any) -> int:
        self.crc = google_crc32c.extend(self.crc, bytes(data))
        return self.raw.write(data)

    def tell(self) -> int:
        pos = self.raw.tell()
        if pos != self.start:
            self.record[self.name, self.start, pos - self.start] = self.crc
            self.start, self.crc = pos, 0
        return pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.tell()
        self.raw.close()


class Crc32cFileSystem(DurableFileSystem):
    """CRC-32 off, and every file written through a :class:`Crc32cStream`."""

    def __init__(self) -> None:
        self.record: dict[tuple[str, int, int], int] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" in mode:
                stream = Crc32cStream(stream, os.path.basename(path), self.record)
            yield stream


class CrcWhileWritingWriter(TimedWriter):
    """pippy's writer, its CRC-32C taken while writing instead of read back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = Crc32cFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.marks = {"write": time.perf_counter()}
        self.fs.record.clear()
        results = FileSystemWriter.write_data(self, plan, planner).wait()
        checked = []
        for r in results:
            info = r.storage_data
            crc = self.fs.record[info.relative_path, info.offset, info.length]
            checked.append(
                WriteResult(r.index, r.size_in_bytes, Checksummed(info, crc))
            )
        future: Future[list[WriteResult]] = Future()
        future.set_result(checked)
        self.marks["written"] = time.perf_counter()
        return future


class Checksummed:
    """What ``ManifestWriter.finish`` reads from each write result: info, crc32c."""

    def __init__(self, info: Any, crc32c: int) -> None:
        self.info, self.crc32c = info, crc32c


class DcpSaveSpan(logging.Handler):
    """Keeps ``dcp.save``'s start and end from ``save_stage``'s DEBUG record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.span: tuple[float, float] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.span = (record.dcp_save_start, record.dcp_save_end)


@contextlib.contextmanager
def dcp_save_span() -> Iterator[DcpSaveSpan]:
    """Listens to ``pippy.checkpoint.api`` at DEBUG for the ``with`` block."""
    handler = DcpSaveSpan()
    api_log = logging.getLogger("pippy.checkpoint.api")
    level = api_log.level
    api_log.setLevel(logging.DEBUG)
    api_log.addHandler(handler)
    try:
        yield handler
    finally:
        api_log.removeHandler(handler)
        api_log.setLevel(level)
