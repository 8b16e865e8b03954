"""The storage writers the sync saves are timed with, and the variants tried.

Every writer notes when ``write_data`` starts and ends (:class:`Marks`), which
splits ``dcp.save``'s time into planning, writing and finishing. The variants
are the options that were measured against pippy's ``StepWriter``
(bench/README.md gives the figures and what was kept):

* :class:`Crc32Writer`: ``torch.save``'s CRC-32 left on (pippy before);
* :class:`PlainTimedWriter`: DCP's own writer, no manifest (CRC-32 off too, so
  that it differs from pippy's in the checksums alone).
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from pippy.checkpoint.manifest import Checksumming
from pippy.checkpoint.save import StepWriter
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


class TimedWriter(Marks, StepWriter):
    """pippy's step writer: DCP's, CRC-32 off, a CRC-32C of every item in
    manifest.json, staged and published in ``finish``."""


class Crc32Writer(TimedWriter):
    """pippy's writer with ``torch.save``'s CRC-32 of every item left on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = FileSystem()


class PlainTimedWriter(Marks, FileSystemWriter):
    """DCP's own writer, CRC-32 off, fsynced as pippy's: no checksums, no manifest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = Checksumming(DurableFileSystem())
