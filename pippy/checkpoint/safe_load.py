"""Reading a checkpoint's index without running code, and finding damage first.

torch 2.13's ``FileSystemReader`` unpickles ``.metadata`` with
``pickle.load``, and ``DefaultLoadPlanner`` reads non-tensor items with
``torch.load(weights_only=False)``: whoever can write a checkpoint folder
could run code on every rank that loads it. :class:`SafeFileSystemReader`
accepts only DCP's own metadata classes and finds damaged data files before
anything is read; :class:`~pippy.checkpoint.load_planner.SafeLoadPlanner`
guards the items. :func:`resolve_trusted` is the one place that reads
``PIPPY_TRUST_CHECKPOINT``.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from pippy.checkpoint import stall
from pippy.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from pippy.checkpoint.steps import (
    MANIFEST_FILE,
    METADATA_FILE,
    CompatTensorProperties,
    Manifest,
    check_manifest,
    check_structure,
    find_damage,
    is_complete,
    list_steps,
    newer_torch_refusal,
    parse_step,
    read_manifest,
    storage_ranges,
    verify_item,
    verify_ranges,
)
from pippy.checkpoint.storage import Location, is_url, step_file, storage_for

__all__ = [
    "TRUST_ENV",
    "SafeFileSystemReader",
    "after_reads",
    "find_damage",
    "read_metadata",
    "resolve_trusted",
    "verify_step",
]

#: Environment variable that, set to 1, lets the safe reader and planner load
#: any pickle, as plain DCP does. Only for checkpoints from a trusted source.
TRUST_ENV = "PIPPY_TRUST_CHECKPOINT"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
}


#: A function of the state_dict ``dcp.load`` fills, run by this thread's
#: next read once its reads are done (:func:`after_reads`).
Apply = Callable[[dict[str, Any]], None]
_after_reads = threading.local()


@contextmanager
def after_reads(apply: Apply) -> Iterator[Apply | None]:
    """Runs ``apply`` inside the block's first read of a :class:`SafeFileSystemReader`.

    ``apply`` gets the state_dict ``dcp.load`` fills (top-level values too)
    once this rank's reads succeeded, before DCP gathers every rank's outcome,
    so an exception it raises reaches every rank. A planner that is no
    ``DefaultLoadPlanner`` gets none.

    Yields:
        The function it replaces in this thread (None if none).
    """
    before = getattr(_after_reads, "apply", None)
    _after_reads.apply = apply
    try:
        yield before
    finally:
        _after_reads.apply = before


def _run_after_reads(filled: dict[str, Any] | None) -> None:
    """Runs the block's :func:`after_reads` function on ``filled``, once."""
    apply = getattr(_after_reads, "apply", None)
    if apply is not None and filled is not None:
        _after_reads.apply = None
        apply(filled)


def resolve_trusted(trusted: bool | None) -> bool:
    """``trusted`` if given; for None, whether ``PIPPY_TRUST_CHECKPOINT`` is 1."""
    return os.environ.get(TRUST_ENV) == "1" if trusted is None else trusted


def refusal(what: str, refused: str) -> UnsafeCheckpointError:
    """The error for loading ``what``, whose pickle would import ``refused``."""
    return UnsafeCheckpointError(
        f"refused to load {what}: it would import {refused}, which no checkpoint "
        "written by DCP or pippy holds, and unpickling it could run code. If you "
        f"trust where the checkpoint comes from, set {TRUST_ENV}=1 (or pass "
        "trusted=True, or --trust-checkpoint to python -m pippy) to load it "
        "with plain pickle."
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing (unless trusted) all but DCP's globals."""

    def __init__(self, file: Any, name: str, trusted: bool = False) -> None:
        super().__init__(file)
        self.name = name
        self.trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        """Returns an allow-listed global; raises for any other."""
        if (module, name) == (_DCP_METADATA, "TensorProperties"):
            return CompatTensorProperties
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not (allowed or self.trusted):
            raise refusal(self.name, f"{module}.{name}")
        return super().find_class(module, name)


def _read_metadata_file(folder: Location, trusted: bool) -> Metadata:
    """A step's ``.metadata``, unpickled (allow-listed unless trusted)."""
    storage = storage_for(folder)
    path = step_file(storage, folder, METADATA_FILE)
    try:
        with storage.open_read(path) as metadata_file:
            metadata = _MetadataUnpickler(metadata_file, str(path), trusted).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # whatever a crafted pickle makes the unpickler raise
        manifest = _manifest_or_none(folder)
        writer = manifest.written_by.get("torch") if manifest else None
        newer = newer_torch_refusal(str(path), writer, e)
        if newer is not None:
            raise newer from None
        raise CheckpointError(f"{path} is damaged: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} does not hold DCP metadata")
    return metadata


def _manifest_or_none(folder: Location) -> Manifest | None:
    """The step's manifest, or None if it has none or it cannot be read."""
    try:
        return read_manifest(folder)
    except CheckpointError:
        return None


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles ``.metadata`` with an allow-list.

    Only DCP's metadata classes, ``torch.Size``, torch dtypes and layouts,
    paths and plain builtins are accepted; any other global is refused before
    it is imported. Data files must lie inside the step folder and hold their
    items; with ``verify``, ``manifest.json`` must agree with the folder and
    each item read must match its CRC-32C. All this is checked when the
    reader is made: inside ``dcp.load``, DCP would log a traceback on every
    rank and raise an unrelated ``AssertionError`` ("metadata is None").

    Args:
        path: The step folder (the ``checkpoint_id``).
        trusted: True loads any pickle, as ``FileSystemReader`` does; None
            decides by :func:`resolve_trusted`.
        check_files: Also check the data files (:func:`find_damage`); False
            reads the metadata alone.
        verify: Check the manifest, and each item's checksum as it is read
            (with ``check_files``). False loads one without a manifest.

    Raises:
        CheckpointNotFoundError: ``path`` is not a folder, or has no
            ``.metadata`` (its save did not finish).
        UnsafeCheckpointError: ``.metadata`` holds a refused global, or a
            file of the step lies or leads out of the step folder.
        CheckpointError: ``.metadata`` is damaged or not DCP's, or an item
            does not fit its file; with ``verify``, the manifest is missing,
            names another step or disagrees with the files.
    """

    manifest: Manifest | None

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trusted: bool | None = None,
        check_files: bool = True,
        verify: bool = True,
    ) -> None:
        self._open(path, trusted)
        storage, folder = storage_for(path), self.folder
        if not storage.is_dir(folder):
            raise CheckpointNotFoundError(f"no checkpoint folder at {str(folder)!r}")
        if storage.size(storage.join(folder, METADATA_FILE)) is None:
            steps = [p for p in list_steps(folder).values() if is_complete(p)]
            if steps:
                raise CheckpointNotFoundError(
                    f"{str(folder)!r} is a run's checkpoint folder; pass one of its "
                    f"steps, e.g. {str(steps[-1])!r}"
                )
            raise CheckpointNotFoundError(
                f"{str(folder)!r} is not a complete checkpoint (no {METADATA_FILE}: "
                "its save did not finish); use an earlier step"
            )
        self.metadata = _read_metadata_file(folder, self.trusted)
        check_structure(folder, self.metadata)
        if not check_files:
            return
        problems = find_damage(folder, self.metadata)
        if problems:
            raise CheckpointError(
                f"{str(folder)!r} is damaged: {'; '.join(problems[:4])}"
                f"{' ...' if len(problems) > 4 else ''}. Restore those files, or "
                "move the folder out of the checkpoint folder to resume from an "
                "earlier step"
            )
        if verify:
            ranges = storage_ranges(self.metadata)
            self.manifest = check_manifest(folder, parse_step(folder), ranges)

    def _open(self, path: str | os.PathLike, trusted: bool | None) -> None:
        """DCP's reader of ``path``, set up without touching a file."""
        super().__init__(path)
        storage = storage_for(path)
        if is_url(path):  # DCP's FileSystemReader would read a local folder
            self.fs = storage.dcp_filesystem(path)  # type: ignore[assignment]
            self.path = self.fs.init_path(path)
        self.trusted = resolve_trusted(trusted)
        self.folder = storage.join(path)
        self.manifest = None

    @classmethod
    def checked(
        cls,
        path: str | os.PathLike,
        *,
        trusted: bool,
        metadata: Metadata,
        manifest: Manifest | None,
    ) -> SafeFileSystemReader:
        """A reader of a step another rank read and checked; reads nothing."""
        reader = cls.__new__(cls)
        reader._open(path, trusted)
        reader.metadata, reader.manifest = metadata, manifest
        return reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Returns the metadata read and checked when the reader was made."""
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each planned item once, checks it, then hands it to ``planner``.

        As DCP's ``FileSystemReader.read_data``, but each stored item is read
        once, however many requests share it, and checked (whole, and with
        ``verify`` against its CRC-32C) before it is unpickled. Under
        :mod:`~pippy.checkpoint.stall` the rank then waits for the others;
        then the :func:`after_reads` function runs.

        Raises:
            CheckpointError: A data file ends inside an item, an item does
                not match its checksum, or the ``step`` read is not the
                manifest's.
            CheckpointTimeout: Some rank did not finish reading in time.
            Exception: What the :func:`after_reads` function raised.

        Note:
            DCP loads in place: after an error, the items before the damaged
            one already hold the step's values; load another step, or build
            the stage anew, before using it.
        """
        waits = stall.active()
        if waits is None:
            read = self._read_once(plan, planner)
        else:
            sizes = {
                i.storage_index: self.storage_data[i.storage_index].length
                for i in plan.items
            }
            with waits.inside_dcp():
                read = self._read_once(plan, waits.counting(planner, sizes))
        _run_after_reads(getattr(planner, "original_state_dict", None))
        return read

    def _read_once(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``read_data``, reading each item once and checking it first."""
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for req in plan.items:
            name = self.storage_data[req.storage_index].relative_path
            per_file.setdefault(name, {}).setdefault(req.storage_index, []).append(req)
        for name, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                for index, reqs in items.items():
                    info = self.storage_data[index]
                    data = self._slice_file(f, info).read(-1)
                    self._check_item(index.fqn, info, data)
                    for req in reqs:
                        self._hand_over(req, info, data, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _check_item(self, key: str, info: Any, data: bytes) -> None:
        """Raises unless ``data`` is all of the item and what the manifest holds."""
        name, offset, length = info.relative_path, info.offset, info.length
        if len(data) != length:
            raise CheckpointError(
                f"{str(self.folder)!r} is damaged: {name} ends at byte "
                f"{offset + len(data)}, inside item {key!r}. Restore the file, or "
                "move the folder out of the checkpoint folder to resume from an "
                "earlier step"
            )
        if self.manifest is None:
            return
        verify_item(self.manifest, (name, offset, length), key, data)
        if key == "step":  # the stored step, the name and the manifest agree
            step = torch.load(io.BytesIO(data), weights_only=True)
            if step != self.manifest.step:
                raise CheckpointError(
                    f"{str(self.folder)!r} holds step {step!r}, its "
                    f"{MANIFEST_FILE} says {self.manifest.step}: the manifest "
                    "was edited or belongs to another step. Move the folder "
                    "out of the checkpoint folder"
                )

    def _hand_over(
        self, req: ReadItem, info: Any, data: bytes, planner: LoadPlanner
    ) -> None:
        """Gives ``planner`` the item one request reads, as DCP's reader does."""
        descriptors = getattr(info, "transform_descriptors", None) or ()
        stream = self.transforms.transform_load_stream(
            req, descriptors, io.BytesIO(data)
        )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        if not stream.seekable():  # torch.load seeks
            stream = io.BytesIO(stream.read(-1))
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        for dim, (offset, size) in enumerate(
            zip(req.storage_offsets, req.lengths, strict=True)
        ):
            if size < tensor.size(dim):
                tensor = tensor.narrow(dim, offset, size)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"{str(self.folder)!r} is damaged: item {req.storage_index.fqn!r} "
                f"of {info.relative_path} holds {list(tensor.size())} where "
                f"{list(target.size())} is read. Load an earlier step"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def read_metadata(path: str | os.PathLike, *, trusted: bool | None = None) -> Metadata:
    """Reads a step folder's ``.metadata`` with :class:`SafeFileSystemReader`.

    In this process alone (no collective).

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`.
    """
    reader = SafeFileSystemReader(path, trusted=trusted, check_files=False)
    return reader.read_metadata()


def verify_step(path: str | os.PathLike, *, trusted: bool | None = None) -> int:
    """Checks a whole step against its manifest: every item of every file.

    In this process alone (no collective).

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`.

    Returns:
        The number of items verified.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader` with ``verify``.
    """
    reader = SafeFileSystemReader(path, trusted=trusted)
    assert reader.manifest is not None
    ranges = storage_ranges(reader.metadata)
    verify_ranges(reader.folder, reader.manifest, ranges)
    return len(ranges)
