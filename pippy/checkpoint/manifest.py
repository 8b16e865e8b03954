"""Checksums: each item's CRC-32C taken as written, in manifest.json, checked as read.

DCP stores no checksums and ``torch.load`` never checks the zip CRC-32
(pytorch/pytorch#126952). :class:`ManifestWriter`'s file system
(:class:`Checksumming`) takes each item's CRC-32C from the bytes as they are
written, with ``torch.save``'s CRC-32 off (:func:`no_crc32`); the coordinator
writes them in ``manifest.json`` after ``.metadata``, with ``.metadata``'s own.
A load checks the manifest against the folder and ``.metadata``
(:func:`check_manifest`) and each item as it is read (:class:`ItemReader`,
:func:`verify_item`). ``optim_layout`` is
:data:`~pippy.checkpoint.keys.LAYOUT_VERSION`:

.. code-block:: json

    {"format": "pippy-manifest/1", "step": 20, "checksum": "crc32c",
     "optim_layout": 1, "written_by": {"torch": "2.13.0+cpu", "pippy": "0.3.0"},
     "metadata_crc32c": 1137295361,
     "files": {"__0_0.distcp": 5123456, "...": 0},
     "items": [{"key": "model.layers.0.qkv.weight", "file": "__0_0.distcp",
                "offset": 0, "length": 49920, "crc32c": 2596996162}]}
"""

from __future__ import annotations

import functools
import importlib.metadata
import io
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.serialization import get_crc32_options, set_crc32_options
from torch.torch_version import TorchVersion

from pippy.checkpoint.errors import (
    MOVE_ASIDE,
    CheckpointError,
    CheckpointNotFoundError,
    check_number,
)
from pippy.checkpoint.keys import LAYOUT_VERSION, check_layout_version
from pippy.checkpoint.storage import Location, Storage, is_url, join, step_file

MANIFEST_FILE = "manifest.json"
#: DCP's index of a step's items, written last: a step folder without it is partial.
METADATA_FILE = ".metadata"
_FORMAT = "pippy-manifest/1"

#: Bytes one CRC-32C call takes: google_crc32c holds the GIL in a call, and
#: other threads (the one launching kernels) run between calls.
CRC_CHUNK = 4 << 20


def crc32c(data: Any, crc: int = 0) -> int:
    """The CRC-32C of contiguous bytes-like ``data``, extending ``crc`` (0: none)."""
    array = numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)
    for start in range(0, len(array), CRC_CHUNK):
        crc = google_crc32c.extend(crc, array[start : start + CRC_CHUNK])
    return crc


#: Whether ``torch.save``'s CRC-32 setting is per thread (a ContextVar from 2.12).
CRC32_PER_THREAD = TorchVersion(torch.__version__) >= "2.12"


@contextmanager
def no_crc32() -> Iterator[None]:
    """This thread's ``torch.save`` writes zero CRC-32s (the manifest has CRC-32C).

    A no-op on torch 2.10 and 2.11, whose setting is the process's (other threads'
    saves would lose it).
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
        """Writes ``data``, extending the checksum."""
        size = len(data)  # torch.save and DCP write bytes (format "B")
        if size <= _SMALL_WRITE:
            self.small += data
            return size
        self._pass_small()
        self.crc = crc32c(data, self.crc)
        return self.raw.write(data)

    def _pass_small(self) -> None:
        """Checksums the gathered small writes and passes them on."""
        if self.small:
            data = bytes(self.small)
            self.crc = crc32c(data, self.crc)
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


class Checksumming:
    """DCP's file system ``inner``, recording each written item's CRC-32C in ``crcs``.

    DCP's writer calls ``tell()`` around each item: ``crcs`` maps each span between
    two calls, ``(file, offset, length)``, to its CRC-32C. ``torch.save``'s CRC-32
    is off meanwhile, and its ~40 small records per item make one write.
    """

    def __init__(self, inner: FileSystemBase) -> None:
        self.inner = inner
        self.crcs: dict[tuple[str, int, int], int] = {}

    def __getattr__(self, name: str) -> Any:
        """``inner``'s attribute."""
        if name == "inner":  # not set yet (an object being copied)
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        """``inner``'s stream; written, through a :class:`_Crc32cStream`."""
        with self.inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _Crc32cStream(raw, os.path.basename(os.fspath(path)), self.crcs)
            with no_crc32():
                yield stream
            if not stream.closed:  # .metadata's (DCP leaves it open): write the rest
                stream.tell()


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: ``items`` maps ``(file, offset, length)`` to ``(key, crc)``.

    ``files`` gives sizes in bytes; ``optim_layout`` None means layout 1.
    """

    step: int
    files: dict[str, int]
    items: dict[tuple[str, int, int], tuple[str, int]]
    optim_layout: object
    written_by: dict[str, str]
    metadata_crc: int | None = None  # absent from manifests before it was recorded


def read_crcs(
    storage: Storage, folder: Location, ranges: Iterable[tuple[str, int, int]]
) -> Iterator[tuple[tuple[str, int, int], int]]:
    """Each ``(file, offset, length)`` range and the CRC-32C of its stored bytes."""
    fs = storage.dcp_filesystem(folder)  # reads as DCP's reader does
    for name, spans in itertools.groupby(sorted(ranges), key=lambda r: r[0]):
        with fs.create_stream(storage.join(folder, name), "rb") as f:
            for _, offset, length in spans:
                f.seek(offset)
                data = f.read(length)
                if len(data) != length:
                    raise CheckpointError(f"{name} ended at byte {offset + len(data)}")
                yield (name, offset, length), crc32c(data)


class ManifestWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, also writing ``manifest.json`` with checksums.

    Each rank passes every item's CRC-32C, taken as written (read back if the file
    system recorded none), to the coordinator in DCP's write results; it writes
    ``manifest.json`` after ``.metadata``. ``written``: ``(tensors, bytes)`` this
    rank wrote; ``**kwargs`` go to ``FileSystemWriter``.
    """

    def __init__(
        self, storage: Storage, path: str | os.PathLike, *, step: int, **kwargs: Any
    ) -> None:
        super().__init__(path, **kwargs)
        self.storage = storage
        fs = Checksumming(storage.dcp_filesystem(path))
        self.fs = fs  # type: ignore[assignment]
        # A local stream fsyncs at close; fsspec's have no fileno (DCP would
        # os.sync()): DCP's own fsync of each file would be a second one.
        self.sync_files = False
        if is_url(path):
            self.path = self.fs.init_path(path)
        self.step = step
        self.written = (0, 0)

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """DCP's ``write_data``, with the CRC-32C of each item written."""
        results = super().write_data(plan, planner).wait()
        tensors = {i.index for i in plan.items if i.type != WriteItemType.BYTE_IO}
        lengths = [r.storage_data.length for r in results if r.index in tensors]
        self.written = (len(lengths), sum(lengths))
        infos = (r.storage_data for r in results)
        ranges = [(i.relative_path, i.offset, i.length) for i in infos]
        crcs = getattr(self.fs, "crcs", {})
        if not all(r in crcs for r in ranges):  # a file system that records none
            crcs = dict(read_crcs(self.storage, self.path, ranges))
        checked = [  # storage_data (info, crc), for the coordinator
            WriteResult(r.index, r.size_in_bytes, (r.storage_data, crcs[k]))
            for r, k in zip(results, ranges, strict=True)
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(checked)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Writes ``.metadata`` as DCP does, then ``manifest.json``."""
        plain = [  # DCP's own storage_data, without the CRC-32C
            [WriteResult(r.index, r.size_in_bytes, r.storage_data[0]) for r in rank]
            for rank in results
        ]
        super().finish(metadata, plain)
        stored = self.storage.read_bytes(join(self.path, METADATA_FILE))
        written = [(r.index.fqn, *r.storage_data) for r in itertools.chain(*results)]
        manifest = {
            "format": _FORMAT,
            "step": self.step,
            "checksum": "crc32c",
            "optim_layout": LAYOUT_VERSION,
            "written_by": {"torch": str(torch.__version__), "pippy": _pippy_version()},
            "metadata_crc32c": crc32c(stored),
            "files": dict(sorted(file_ends(i for _, i, _ in written).items())),
            "items": [
                {
                    "key": key,
                    "file": info.relative_path,
                    "offset": info.offset,
                    "length": info.length,
                    "crc32c": crc,
                }
                for key, info, crc in written
            ],
        }
        # dumps: json.dump streams through the pure-Python encoder, ~10x slower.
        data = json.dumps(manifest, separators=(",", ":")).encode()
        self.before_commit()
        # In a staging folder, whose publishing makes the names in it durable.
        self.storage.write_atomic(join(self.path, MANIFEST_FILE), data, staged=True)

    def before_commit(self) -> None:
        """Runs just before the manifest is written (on a store, the commit)."""


@functools.cache
def _pippy_version() -> str:
    """Pippy's installed version, once per process (a lookup takes milliseconds)."""
    try:
        return importlib.metadata.version("pippy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def read_manifest(storage: Storage, folder: Location) -> Manifest | None:
    """A step folder's ``manifest.json``, or None; refuses a link out or damage."""
    path = step_file(storage, folder, MANIFEST_FILE)
    if storage.size(path) is None:
        return None
    try:
        raw = json.loads(storage.read_bytes(path))
        if raw.get("format") != _FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, not {_FORMAT!r}")
        files = {str(k): _count(v) for k, v in raw["files"].items()}
        items = {}
        for i in raw["items"]:
            place = (str(i["file"]), _count(i["offset"]), _count(i["length"]))
            items[place] = (str(i["key"]), _count(i["crc32c"]))
        versions = {str(k): str(v) for k, v in raw.get("written_by", {}).items()}
        step = _count(raw["step"])
        crc = raw.get("metadata_crc32c")
        crc = None if crc is None else _count(crc)
        return Manifest(step, files, items, raw.get("optim_layout"), versions, crc)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{path} is damaged ({type(e).__name__}: {e}): restore it, or load "
            "the step unverified (verify=False, --allow-no-manifest)"
        ) from None


def _count(value: Any) -> int:
    """``value`` if it is a non-negative int; else a ``ValueError``."""
    return check_number(
        value, "{!r} is not a non-negative integer", whole=True, at_least=0
    )


def check_manifest(
    storage: Storage,
    folder: Location,
    ranges: Mapping[tuple[str, int, int], str],
    sizes: Mapping[str, int | None],
    named: int | None,
    metadata: bytes,
) -> Manifest:
    """Reads a step's manifest; refuses one absent or at odds with the folder.

    ``sizes``: data files' sizes already found (by ``steps.find_damage``);
    ``named``: the step the folder's name says, if any; ``metadata``: the
    bytes of its ``.metadata``.
    """
    manifest = read_manifest(storage, folder)
    if manifest is None and not storage.atomic_rename:  # its commit record
        raise CheckpointNotFoundError(
            f"{str(folder)!r} has no {MANIFEST_FILE}, a step's commit record on an "
            "object store: a save that did not finish (use an earlier step), or a "
            "step plain DCP wrote, to load with verify=False if you know it is intact"
        )
    if manifest is None:
        raise CheckpointError(
            f"{str(folder)!r} has no {MANIFEST_FILE}, so its content cannot be "
            "verified (written by plain DCP or an older pippy, or the file was "
            "lost). If you know it is intact, load it with verify=False"
        )
    if named not in (None, manifest.step):
        raise CheckpointError(
            f"{str(folder)!r} holds step {manifest.step} by its {MANIFEST_FILE}: a "
            "folder renamed or copied under another step's name. Give it its own "
            f"name (step-{manifest.step}) or move it out of the checkpoint folder"
        )
    check_layout_version(manifest.optim_layout, repr(str(folder)))
    for name, size in manifest.files.items():
        path = storage.join(folder, name)
        actual = sizes[name] if name in sizes else storage.size(path)
        if actual != size:
            raise CheckpointError(
                f"{str(folder)!r} is damaged: {name} has "
                f"{'no file' if actual is None else f'{actual} bytes'}, "
                f"{MANIFEST_FILE} says {size}. Restore it, or {MOVE_ASIDE}"
            )
    recorded = {place: key for place, (key, _) in manifest.items.items()}
    if dict(ranges) != recorded:
        differ = sorted({key for _, key in ranges.items() ^ recorded.items()})
        raise CheckpointError(
            f"{str(folder)!r} is damaged: its .metadata and {MANIFEST_FILE} "
            f"disagree on where {', '.join(map(repr, differ[:4]))} "
            f"{'is' if len(differ) == 1 else 'are'} stored. "
            f"Restore the step, or {MOVE_ASIDE}"
        )
    if manifest.metadata_crc not in (None, crc32c(metadata)):
        raise CheckpointError(
            f"{str(folder)!r} is damaged: its .metadata does not match its checksum "
            f"in {MANIFEST_FILE} (edited, or a flipped bit), so it may describe its "
            f"items wrongly. Restore the step, or {MOVE_ASIDE}"
        )
    return manifest


def verify_item(
    manifest: Manifest, place: tuple[str, int, int], key: str, crc: int
) -> None:
    """Raises unless the manifest lists the item at ``place`` with CRC-32C ``crc``."""
    name, offset, length = place
    if place not in manifest.items:
        raise CheckpointError(
            f"item {key!r} of {name} (bytes {offset}-{offset + length}) is not "
            f"in {MANIFEST_FILE}: .metadata and the manifest disagree, so the "
            "step is damaged or was edited; load an earlier step"
        )
    if crc != manifest.items[place][1]:
        raise CheckpointError(
            f"item {key!r} of {name} is damaged: its bytes do not match their "
            f"checksum in {MANIFEST_FILE} (a flipped bit, or a file replaced "
            f"by another). Restore the file, or {MOVE_ASIDE}"
        )


def file_ends(infos: Iterable[Any]) -> dict[str, int]:
    """``{file: where its last item ends}``: the size its items need."""
    ends: dict[str, int] = {}
    for info in infos:
        end = info.offset + info.length
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    return ends


# Tensor items of this many bytes or more are read straight into their tensor
# (:class:`ItemReader`); smaller ones whole, then loaded: fewer Python calls.
STREAMED = 1 << 20


class ItemReader(io.RawIOBase):
    """One stored item of an open file, as ``torch.load`` reads it, CRC-32C on the way.

    ``torch.load`` reads a zip's parts out of order (its directory at the end
    first) and a tensor's bytes with ``readinto`` straight into its storage.
    Small reads are kept until the checksum reaches them; a large one is
    checked in place once every byte before it is (read again from the file if
    ``torch.load`` skipped it, as it does a record's padding).
    """

    def __init__(self, file: Any, offset: int, length: int, *, crc: bool) -> None:
        self.file, self.offset, self.length = file, offset, length
        self.pos = 0  # torch.load's position in the item
        self.crc: int | None = 0 if crc else None
        self.checked = 0  # the checksum covers the item's bytes before this one
        self.kept: dict[int, bytes] = {}  # small reads past the checksum, by start

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        """Moves within the item, as a file does."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}
        self.pos = base[whence] + pos
        return self.pos

    def readinto(self, buffer: Any) -> int:
        """Reads up to the item's end into ``buffer``; its bytes go to the checksum."""
        view = memoryview(buffer).cast("B")[: max(0, self.length - self.pos)]
        self.file.seek(self.offset + self.pos)
        n = self.file.readinto(view) or 0
        start, self.pos = self.pos, self.pos + n
        if self.crc is None or self.pos <= self.checked:
            return n
        if n < STREAMED:
            self.kept[start] = bytes(view[:n])
            self._extend()
            return n
        self._extend(start)  # with the bytes before it that torch.load skips
        self.crc = crc32c(view[self.checked - start : n], self.crc)
        self.checked = self.pos
        return n

    def _extend(self, until: int = 0) -> None:
        """Extends the checksum over the kept reads, and the file up to ``until``."""
        while self.crc is not None:
            at = self.checked
            if found := [s for s, d in self.kept.items() if s <= at < s + len(d)]:
                data = self.kept.pop(found[0])
                self.crc = crc32c(data[at - found[0] :], self.crc)
                self.checked = found[0] + len(data)
                continue
            if at >= until:
                return
            end = min((s for s in self.kept if at < s < until), default=until)
            self.file.seek(self.offset + at)
            data = self.file.read(end - at)
            if not data:  # the file ends inside the item
                return
            self.crc = crc32c(data, self.crc)
            self.checked += len(data)

    def finish(self) -> tuple[int, int | None]:
        """``(bytes of the item in its file, CRC-32C)``, reading what is unchecked."""
        if self.crc is None:
            end = self.file.seek(0, io.SEEK_END)
            return min(self.length, max(0, end - self.offset)), None
        self._extend(self.length)
        return self.checked, self.crc
