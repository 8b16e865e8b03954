"""A JSON manifest of what each save wrote, with a CRC-32C of every item.

DCP stores no checksums, and ``torch.load`` never checks the zip CRC-32 that
``torch.save`` computes (its zip reader is built with CRC checks disabled:
pytorch/pytorch#126952), so a flipped bit, a truncated item or a rank file
swapped for another of equal size loads without a word. :class:`ManifestWriter`
is DCP's ``FileSystemWriter`` that checksums each item (CRC-32C,
``google-crc32c``) from its bytes as they are written, and the coordinator
writes ``manifest.json`` beside ``.metadata``:

.. code-block:: json

    {"format": "pippy-manifest/1", "step": 20, "checksum": "crc32c",
     "optim_layout": 1, "written_by": {"torch": "2.13.0+cpu", "pippy": "0.3.0"},
     "files": {"__0_0.distcp": 5123456, "...": 0},
     "items": [{"key": "model.layers.0.qkv.weight", "file": "__0_0.distcp",
                "offset": 0, "length": 49920, "crc32c": 2596996162}]}

``optim_layout`` is :data:`~pippy.checkpoint.state.LAYOUT_VERSION` (absent:
layout 1); ``written_by`` the torch and pippy that wrote the step; ``files``
each data file's size in bytes. Reading the JSON runs no code;
``SafeFileSystemReader`` checks it against ``.metadata`` and the files before
loading, and each item's checksum as it is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pippy.checkpoint import stall
from pippy.checkpoint.errors import CheckpointError
from pippy.checkpoint.metadata import written_by
from pippy.checkpoint.state import LAYOUT_VERSION, check_layout_version
from pippy.checkpoint.storage import (
    DurableFileSystem,
    Location,
    is_url,
    step_file,
    storage_for,
)

__all__ = [
    "MANIFEST_FILE",
    "Manifest",
    "ManifestWriter",
    "read_manifest",
]

#: The manifest's file name inside a step folder.
MANIFEST_FILE = "manifest.json"
_FORMAT = "pippy-manifest/1"


@dataclass(frozen=True)
class _Checksummed:
    """DCP's storage info of one item, with its CRC-32C, for the coordinator."""

    info: Any
    crc32c: int


@dataclass(frozen=True)
class Manifest:
    """What one save wrote, as recorded in ``manifest.json``.

    Attributes:
        step: The step the save holds.
        files: Size in bytes of each data file, by file name.
        items: ``(file, offset, length)`` of each item, to its key and CRC-32C.
        optim_layout: The optimizer layout version recorded (None: layout 1).
        written_by: The ``torch`` and ``pippy`` versions that wrote the step
            (may be empty).
    """

    step: int
    files: dict[str, int]
    items: dict[tuple[str, int, int], tuple[str, int]]
    optim_layout: object = None
    written_by: dict[str, str] = field(default_factory=dict)


def _crc32c_of(folder: Location, ranges: Iterable[tuple[str, int, int]]) -> dict:
    """CRC-32C of each ``(file, offset, length)`` byte range, read from storage."""
    storage = storage_for(folder)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in ranges:
        by_file.setdefault(name, []).append((offset, length))
    crcs = {}
    for name, spans in by_file.items():
        with storage.open_read(storage.join(folder, name)) as f:
            for offset, length in sorted(spans):
                f.seek(offset)
                data = f.read(length)
                if len(data) != length:
                    raise CheckpointError(f"{name} ended at byte {offset + len(data)}")
                crcs[name, offset, length] = google_crc32c.value(data)
    return crcs


class ManifestWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, also writing ``manifest.json`` with checksums.

    Each rank takes every item's CRC-32C as it is written (from the file
    system's streams; read back only if a given file system records none);
    the checksums reach the coordinator with DCP's write results, and it
    writes ``manifest.json`` after ``.metadata``. Plain ``dcp.load`` ignores
    the file. Items are written without ``torch.save``'s own CRC-32 (see the
    note), in the writing thread only. Files and renames are fsynced
    (:class:`~pippy.checkpoint.storage.DurableFileSystem`).

    Args:
        path: The folder to write (the ``checkpoint_id``).
        step: The step being saved, recorded in the manifest.
        **kwargs: Passed to ``FileSystemWriter`` (``thread_count``, ...).

    Attributes:
        written: After the save, ``(tensors, bytes)`` this rank wrote, bytes
            as in its file (with ``torch.save`` framing).

    Note:
        The items' zip records carry no CRC-32 (zero fields), which
        ``torch.load`` never checks (see the module docstring) but a zip tool
        reports. On torch 2.10 and 2.11, whose setting is per process, they
        keep it (:func:`~pippy.checkpoint.storage.no_crc32`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        step: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        if is_url(path):  # an object store: fsspec's streams, durable at close
            self.fs = storage_for(path).dcp_filesystem(path)  # type: ignore[assignment]
            self.path = self.fs.init_path(path)
            self.sync_files = False  # else DCP runs os.sync() per stream
        else:
            self.fs = DurableFileSystem()
        self.step = step
        self.written = (0, 0)

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """Writes this rank's items as DCP does, then checksums them as written.

        Under :mod:`~pippy.checkpoint.stall`, progress is recorded and the
        rank then waits for the others.

        Raises:
            CheckpointTimeout: Some rank did not finish writing in time.
        """
        waits = stall.active()
        if waits is None:
            return self._write_checksummed(plan, planner)
        sizes = {item.index: item.tensor_storage_size() or 0 for item in plan.items}
        with waits.inside_dcp():
            return self._write_checksummed(plan, waits.counting(planner, sizes))

    def _write_checksummed(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """DCP's ``write_data``, its results carrying each item's CRC-32C."""
        results = super().write_data(plan, planner).wait()
        tensors = {i.index for i in plan.items if i.type != WriteItemType.BYTE_IO}
        lengths = [r.storage_data.length for r in results if r.index in tensors]
        self.written = (len(lengths), sum(lengths))
        ranges = [
            (r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length)
            for r in results
        ]
        written = getattr(self.fs, "crcs", {})
        if all(r in written for r in ranges):
            crcs = {r: written[r] for r in ranges}
        else:
            crcs = _crc32c_of(self.path, ranges)
        checked = [
            WriteResult(r.index, r.size_in_bytes, _Checksummed(r.storage_data, crc))
            for r, crc in zip(results, (crcs[k] for k in ranges), strict=True)
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(checked)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Writes ``.metadata`` as DCP does, then ``manifest.json``."""
        storage = storage_for(self.path)
        items: list[dict[str, Any]] = []
        files: dict[str, int] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                info, crc = r.storage_data.info, r.storage_data.crc32c
                plain[-1].append(WriteResult(r.index, r.size_in_bytes, info))
                name, end = info.relative_path, info.offset + info.length
                files[name] = max(files.get(name, 0), end)
                items.append(
                    {
                        "key": r.index.fqn,
                        "file": name,
                        "offset": info.offset,
                        "length": info.length,
                        "crc32c": crc,
                    }
                )
        super().finish(metadata, plain)
        manifest = {
            "format": _FORMAT,
            "step": self.step,
            "checksum": "crc32c",
            "optim_layout": LAYOUT_VERSION,
            "written_by": written_by(),
            "files": dict(sorted(files.items())),
            "items": items,
        }
        # dumps, not dump: json.dump streams through the pure-Python encoder,
        # about 10x slower than the C one dumps uses.
        data = json.dumps(manifest, separators=(",", ":")).encode()
        storage.write_atomic(storage.join(self.path, MANIFEST_FILE), data)


def read_manifest(folder: Location) -> Manifest | None:
    """Reads a step folder's ``manifest.json``.

    Returns:
        The manifest, or None if the step folder has none.

    Raises:
        UnsafeCheckpointError: ``manifest.json`` is a link leading out of the
            step folder.
        CheckpointError: The manifest is not valid JSON of this format.
    """
    storage = storage_for(folder)
    path = step_file(storage, folder, MANIFEST_FILE)
    if storage.size(path) is None:
        return None
    try:
        raw = json.loads(storage.read_bytes(path))
        if raw.get("format") != _FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, not {_FORMAT!r}")
        files = {str(k): _count(v) for k, v in raw["files"].items()}
        items = {
            (str(i["file"]), _count(i["offset"]), _count(i["length"])): (
                str(i["key"]),
                _count(i["crc32c"]),
            )
            for i in raw["items"]
        }
        versions = raw.get("written_by", {})
        if not isinstance(versions, dict):
            raise ValueError(f"written_by is {versions!r}, not an object")
        versions = {str(k): str(v) for k, v in versions.items()}
        step = _count(raw["step"])
        return Manifest(step, files, items, raw.get("optim_layout"), versions)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is damaged: {e}") from None


def check_manifest(
    folder: Location, step: int | None, ranges: Mapping[tuple[str, int, int], str]
) -> Manifest:
    """Reads a step's manifest and checks it against the folder.

    Args:
        folder: The step folder.
        step: The step its name says (None for another name).
        ranges: ``{(file, offset, length): key}`` of ``.metadata``'s items.

    Raises:
        UnsafeCheckpointError: As :func:`read_manifest`.
        CheckpointError: There is no manifest; it names another step or an
            unknown optimizer layout; or it disagrees with the files' sizes
            or ``.metadata``'s items.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        raise CheckpointError(
            f"{str(folder)!r} has no {MANIFEST_FILE}, so its content cannot be "
            "verified (written by plain DCP or an older pippy, or the file was "
            "lost). If you know it is intact, load it with verify=False"
        )
    if step is not None and step != manifest.step:
        raise CheckpointError(
            f"{str(folder)!r} holds step {manifest.step} by its {MANIFEST_FILE}: a "
            "folder renamed or copied under another step's name. Give it its own "
            f"name (step-{manifest.step}) or move it out of the checkpoint folder"
        )
    check_layout_version(manifest.optim_layout, repr(str(folder)))
    storage = storage_for(folder)
    for name, size in manifest.files.items():
        actual = storage.size(storage.join(folder, name))
        if actual != size:
            raise CheckpointError(
                f"{str(folder)!r} is damaged: {name} has "
                f"{'no file' if actual is None else f'{actual} bytes'}, "
                f"{MANIFEST_FILE} says {size}. Restore it, or move the folder out "
                "of the checkpoint folder to resume from an earlier step"
            )
    recorded = {place: key for place, (key, _) in manifest.items.items()}
    if dict(ranges) != recorded:
        differ = sorted(
            {ranges.get(p) or recorded[p] for p in ranges.keys() ^ recorded.keys()}
            | {k for p, k in ranges.items() if recorded.get(p, k) != k}
        )
        raise CheckpointError(
            f"{str(folder)!r} is damaged: its .metadata and {MANIFEST_FILE} "
            f"disagree on where {', '.join(map(repr, differ[:4]))} are stored. "
            "Restore the step, or move it out of the checkpoint folder to resume "
            "from an earlier step"
        )
    return manifest


def _count(value: Any) -> int:
    """``value`` if it is a non-negative int; else a ``ValueError``."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def verify_ranges(
    folder: Location, manifest: Manifest, ranges: Mapping[tuple[str, int, int], str]
) -> None:
    """Checks byte ranges of a step's files against their manifest checksums.

    Raises:
        CheckpointError: A range the manifest lacks, or whose bytes do not
            match their checksum, naming the key and file.
    """
    for place, key in ranges.items():
        _check_listed(manifest, place, key)
    crcs = _crc32c_of(folder, ranges)
    for place, key in ranges.items():
        if crcs[place] != manifest.items[place][1]:
            raise _mismatch(key, place[0])


def verify_item(
    manifest: Manifest, place: tuple[str, int, int], key: str, data: bytes
) -> None:
    """Checks one item's bytes, as read, against its manifest checksum.

    Raises:
        CheckpointError: As :func:`verify_ranges`.
    """
    _check_listed(manifest, place, key)
    if google_crc32c.value(data) != manifest.items[place][1]:
        raise _mismatch(key, place[0])


def _check_listed(manifest: Manifest, place: tuple[str, int, int], key: str) -> None:
    """Raises if the manifest has no item at ``place``."""
    if place not in manifest.items:
        name, offset, length = place
        raise CheckpointError(
            f"item {key!r} of {name} (bytes {offset}-{offset + length}) is not "
            f"in {MANIFEST_FILE}: .metadata and the manifest disagree, so the "
            "step is damaged or was edited; load an earlier step"
        )


def _mismatch(key: str, name: str) -> CheckpointError:
    """The error for an item whose bytes do not match their checksum."""
    return CheckpointError(
        f"item {key!r} of {name} is damaged: its bytes do not match their "
        f"checksum in {MANIFEST_FILE} (a flipped bit, or a file replaced "
        "by another). Restore the file, or move the folder out of the "
        "checkpoint folder to resume from an earlier step"
    )
