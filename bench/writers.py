"""The storage writers the sync saves are timed with, and the variants tried.

Every writer notes when ``write_data`` starts and ends (:class:`Marks`), which
splits ``dcp.save``'s time into planning, writing and finishing. The variants
are the options that were measured against pippy's ``ManifestWriter``
(bench/README.md gives the figures and what was kept):

* :class:`Crc32Writer`: ``torch.save``'s CRC-32 left on (pippy before);
* :class:`PlainTimedWriter`: DCP's own writer, no manifest (CRC-32 off too, so
  that it differs from pippy's in the checksums alone).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

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
