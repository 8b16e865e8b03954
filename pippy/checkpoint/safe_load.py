"""The load side: what a load may read, and the step found and opened on rank 0.

torch 2.13's ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load``
and ``DefaultLoadPlanner`` reads non-tensor items with
``torch.load(weights_only=False)``: whoever can write a checkpoint folder could
run code on every rank that loads it. The planner also stops at the first
missing key, converts dtypes silently and ignores keys that no rank asks for.
:class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` refuse all of this,
naming the keys and the fix; :func:`resolve_trusted` is the one place that
reads ``PIPPY_TRUST_CHECKPOINT``.

Rank 0 of the process group alone answers every question about the checkpoint
folder, and broadcasts its answer or its error
(:func:`~pippy.checkpoint.errors.on_coordinator`): NFS attribute caching can
make ranks disagree on what a folder holds (and resume from different steps),
and hundreds of ranks listing a bucket at once get throttled into "no
checkpoint". The other ranks open only the data files whose items they load
and the staging folder they write (``test/test_one_rank_decides.py`` counts
it); without a process group the process answers alone. Here, rank 0 finds
the step to resume from (:func:`find_latest_step`) and opens it
(:func:`open_reader`); elsewhere it takes the folder
(:class:`~pippy.checkpoint.job.FolderOwner`) and publishes a step
(:class:`~pippy.checkpoint.api.StepWriter`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import re
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from types import SimpleNamespace
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future
from torch.torch_version import TorchVersion

from pippy.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    on_coordinator,
    own_error,
    pippy_group,
    portable,
)
from pippy.checkpoint.stall import Waits
from pippy.checkpoint.state import (
    TORCHTITAN,
    OptimKeys,
    detect_layout,
    pippy_name,
    stateless_keys,
)
from pippy.checkpoint.steps import (
    MANIFEST_FILE,
    METADATA_FILE,
    MOVE_ASIDE,
    Manifest,
    check_manifest,
    check_structure,
    find_damage,
    holds_its_step,
    is_complete,
    list_steps,
    newest_complete_step,
    parse_step,
    read_crcs,
    read_manifest,
    storage_ranges,
    verify_item,
)
from pippy.checkpoint.storage import (
    Location,
    Storage,
    crc32c,
    is_url,
    join,
    same_location,
    step_file,
    storage_for,
)

logger = logging.getLogger(__name__)

#: Environment variable that, set to 1, lets the safe reader and planner load
#: any pickle, as plain DCP does. Only for checkpoints from a trusted source.
TRUST_ENV = "PIPPY_TRUST_CHECKPOINT"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (module, name)
    for module, names in (
        (_DCP_METADATA, "Metadata MetadataIndex StorageMeta TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata _MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
        ("torch", "Size"),
        ("pathlib", "PosixPath PurePosixPath WindowsPath PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set frozenset slice complex"),
    )
    for name in names.split()
}
# Tensor items of this many bytes or more are read straight into their tensor
# (:class:`_ItemReader`); smaller ones whole, then loaded: fewer Python calls.
_STREAMED = 1 << 20
_BYTES = LoadItemType.BYTE_IO


#: A function of the state_dict ``dcp.load`` fills, run once the reads are done.
Apply = Callable[[dict[str, Any]], None]


def resolve_trusted(trusted: bool | None) -> bool:
    """``trusted`` if given; for None, whether ``PIPPY_TRUST_CHECKPOINT`` is 1."""
    return os.environ.get(TRUST_ENV) == "1" if trusted is None else trusted


def _refuse_none(path: Location | None) -> None:
    """CheckpointNotFoundError for a step ``None``: find_latest_step found none."""
    if path is None:
        raise CheckpointNotFoundError(
            "no step to load: the path is None (find_latest_step returns None "
            "where the folder holds no complete step); check for it first"
        )


def _refusal(what: str, refused: str) -> UnsafeCheckpointError:
    """The error for loading ``what``, whose pickle would import ``refused``."""
    return UnsafeCheckpointError(
        f"refused to load {what}: it would import {refused}, which no checkpoint "
        "written by DCP or pippy holds, and unpickling it could run code. If you "
        f"trust where the checkpoint comes from, set {TRUST_ENV}=1 (or pass "
        "trusted=True, or --trust-checkpoint to python -m pippy) to load it "
        "with plain pickle."
    )


# How many fields this torch's TensorProperties pickles.
_FIELDS = len(TensorProperties().__getstate__())


class _CompatTensorProperties(TensorProperties):
    """DCP's ``TensorProperties``, also from a newer torch's longer state (2.15: 6)."""

    def __setstate__(self, state: Any) -> None:
        """Takes the fields this torch knows; drops those a newer torch added."""
        if isinstance(state, tuple) and len(state) > _FIELDS:
            state = state[:_FIELDS]
        super().__setstate__(state)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing (unless trusted) all but DCP's globals."""

    def __init__(self, data: bytes, name: str, trusted: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.name, self.trusted = name, trusted

    def find_class(self, module: str, name: str) -> Any:
        """Returns an allow-listed global; raises for any other."""
        if (module, name) == (_DCP_METADATA, "TensorProperties"):
            return _CompatTensorProperties
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not (allowed or self.trusted):
            raise _refusal(self.name, f"{module}.{name}")
        return super().find_class(module, name)


def _read_metadata_file(
    storage: Storage, folder: Location, trusted: bool
) -> tuple[Metadata, bytes]:
    """A step's ``.metadata`` unpickled (allow-listed unless trusted), its bytes."""
    if not storage.is_dir(folder):  # first, whether it is a step that finished
        raise CheckpointNotFoundError(f"no checkpoint folder at {str(folder)!r}")
    path = step_file(storage, folder, METADATA_FILE)  # a link out is refused
    if (size := storage.size(path)) is None and storage.exists(path):  # a FIFO
        raise CheckpointError(f"{path} is damaged: it is not a file")
    if size is None:
        listed = list_steps(storage, folder).values()
        steps = [p for p in listed if is_complete(storage, p)]
        if steps:
            raise CheckpointNotFoundError(
                f"{str(folder)!r} is a run's checkpoint folder; pass one of its "
                f"steps, e.g. {str(steps[-1])!r}"
            )
        if parse_step(folder) is None:
            raise CheckpointNotFoundError(
                f"{str(folder)!r} is not a checkpoint (no {METADATA_FILE}); pass a "
                "step folder, <checkpoint folder>/step-<N>"
            )
        raise CheckpointNotFoundError(
            f"{str(folder)!r} is not a complete checkpoint (no {METADATA_FILE}: "
            "its save did not finish); use an earlier step"
        )
    try:
        data = storage.read_bytes(path)
        metadata = _MetadataUnpickler(data, str(path), trusted).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # whatever a crafted pickle makes the unpickler raise
        newer = False
        with suppress(Exception):  # no manifest, or no version in it: no help here
            manifest = cast(Manifest, read_manifest(storage, folder))
            writer = manifest.written_by["torch"]
            newer = TorchVersion(writer) > torch.__version__
        if newer:
            raise CheckpointError(
                f"{path} was written by torch {writer}, this is torch "
                f"{torch.__version__}, which cannot read it ({type(e).__name__}: "
                f"{e}). Read it with torch {writer} or newer"
            ) from None
        raise CheckpointError(f"{path} is damaged: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} does not hold DCP metadata")
    return metadata, data


class _ItemReader(io.RawIOBase):
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
        if n < _STREAMED:
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


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles ``.metadata`` with an allow-list.

    Only DCP's metadata classes, ``torch.Size``, torch dtypes and layouts,
    paths and plain builtins are accepted; any other global is refused before
    it is imported. Data files must lie inside the step folder and hold their
    items; with ``verify``, ``manifest.json`` must agree with the folder and
    each item read must match its CRC-32C. All is checked when the reader is
    made (inside ``dcp.load`` DCP would raise an unrelated ``AssertionError``).

    Args:
        path: The step folder (the ``checkpoint_id``).
        trusted: True loads any pickle, as ``FileSystemReader`` does; None
            decides by :func:`resolve_trusted`.
        check_files: Also check the data files (:func:`find_damage`); False
            reads the metadata alone.
        verify: Check the manifest, and each item's checksum as it is read
            (with ``check_files``). False loads one without a manifest.
        storage: ``path``'s storage, if the caller has it; else found from
            ``path``.
        extension_registry: DCP's registry of the stream extensions the step
            was written with (``FileSystemWriter``'s ``_extensions``); None:
            DCP's default one (ZStandard).

    Raises:
        CheckpointNotFoundError: ``path`` is None, is not a folder, or has
            no ``.metadata`` (its save did not finish).
        UnsafeCheckpointError: ``.metadata`` holds a refused global, or a
            file of the step lies or leads out of the step folder.
        CheckpointError: ``.metadata`` is damaged or not DCP's, or an item
            does not fit its file; with ``verify``, the manifest is missing,
            names another step or disagrees with the files. Reading an item
            written with a stream extension ``extension_registry`` lacks
            raises it too (:meth:`check_extensions`).
    """

    manifest: Manifest | None
    metadata_bytes: bytes  # .metadata as read, which rank 0 broadcasts
    # Given by load_into for one dcp.load: its watch, what to apply after the
    # reads, and this rank's failure to take its state (raised in DCP's planning).
    waits: Waits | None = None
    after_reads: Apply | None = None
    failure: Exception | None = None
    #: In :func:`~pippy.checkpoint.load_into`'s block, the group to pass
    #: ``dcp.load``: pippy's own gloo group over the loading ranks, whose
    #: collectives its ``timeout`` bounds; None where no other rank loads.
    process_group: dist.ProcessGroup | None = None

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trusted: bool | None = None,
        check_files: bool = True,
        verify: bool = True,
        storage: Storage | None = None,
        extension_registry: ExtensionRegistry | None = None,
    ) -> None:
        self._open(path, trusted, storage, extension_registry)
        folder, storage = self.folder, self.storage
        read = _read_metadata_file(storage, folder, self.trusted)
        self.metadata, self.metadata_bytes = read
        check_structure(storage, folder, self.metadata)
        if not check_files:
            return
        sizes: dict[str, int | None] = {}  # each file's, asked once
        problems = find_damage(storage, folder, self.metadata, sizes)
        if problems:
            shown = "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")
            raise self._damaged(shown, f"Restore those files, or {MOVE_ASIDE}")
        if verify:
            ranges = storage_ranges(self.metadata)
            self.manifest = check_manifest(storage, folder, ranges, sizes)

    def _open(
        self,
        path: str | os.PathLike,
        trusted: bool | None,
        storage: Storage | None,
        extension_registry: ExtensionRegistry | None,
    ) -> None:
        """DCP's reader of ``path``, set up without touching a file."""
        _refuse_none(path)
        super().__init__(path, _extension_registry=extension_registry)
        self.extension_registry = extension_registry or ExtensionRegistry()
        self.storage = storage = storage or storage_for(path)
        if is_url(path):  # DCP's FileSystemReader would read a local folder
            self.fs = storage.dcp_filesystem(path)  # type: ignore[assignment]
            self.path = self.fs.init_path(path)
        self.trusted = resolve_trusted(trusted)
        self.folder = join(path)
        self.manifest = None

    def check_extensions(self) -> None:
        """Refuses a step whose items need a stream extension not registered.

        Raises:
            CheckpointError: An item was written with a stream extension
                that the reader's ``extension_registry`` cannot make.
        """
        named = {
            tuple(d)
            for info in self.metadata.storage_data.values()
            if (d := getattr(info, "transform_descriptors", None))
        }
        for descriptors in named:
            try:
                self.extension_registry.from_descriptor_list(descriptors)
            except Exception as e:  # noqa: BLE001 (unknown, or its module missing)
                raise CheckpointError(
                    f"{self.folder} was written with DCP's stream extension(s) "
                    f"{list(descriptors)}, which this reader cannot undo ({e}): "
                    "pass open_step an extension_registry holding them, with "
                    "their modules installed"
                ) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Returns the metadata read and checked when the reader was made."""
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """As DCP's; ValueError for a ``checkpoint_id`` other than the step opened."""
        if checkpoint_id is not None and not same_location(checkpoint_id, self.folder):
            raise ValueError(
                f"this reader was opened for {self.folder}, not {checkpoint_id}: "
                "open_step that step, or leave dcp.load's checkpoint_id out"
            )
        super().reset()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """As DCP's, after raising this rank's :attr:`failure`, if any."""
        if self.failure is not None:
            raise own_error(self.failure) from self.failure
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each planned item once, checks it, then hands it to ``planner``.

        Each stored byte is read once and checked (whole, and with
        ``verify`` against its CRC-32C): a non-tensor item, and a tensor item
        under 1 MiB, before it is unpickled; a larger tensor item, which
        ``torch.load`` (``weights_only``) reads straight into a new tensor as
        DCP's reader does, before it is copied into the state_dict. Then,
        under :attr:`waits`, the rank waits for the others, and
        :attr:`after_reads` runs.

        Raises:
            UnsafeCheckpointError: Unless trusted, ``planner`` is not a
                :class:`SafeLoadPlanner` and the plan holds non-tensor items.
            CheckpointError: An item is damaged (cut short, or not its CRC-32C).

        Note:
            DCP loads in place: after a damaged item, the items before it
            already hold the step's values; load another step, or build the
            stage anew, before using it.
        """
        unsafe = not (self.trusted or isinstance(planner, SafeLoadPlanner))
        if unsafe and any(req.type == _BYTES for req in plan.items):
            raise UnsafeCheckpointError(
                f"refused to load {self.folder} with {type(planner).__name__}: it "
                "unpickles non-tensor items with plain pickle, which could run "
                "code. Pass dcp.load the planner open_step returned, or, if you "
                f"trust the checkpoint, set {TRUST_ENV}=1"
            )
        self.check_extensions()
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for req in plan.items:
            name = self.storage_data[req.storage_index].relative_path
            per_file.setdefault(name, {}).setdefault(req.storage_index, []).append(req)
        counting: Any = nullcontext(planner)
        if (waits := self.waits) is not None:  # each item's bytes, for progress
            sizes = {
                i: self.storage_data[i].length for by in per_file.values() for i in by
            }
            counting = waits.counting(planner, sizes)
        with counting as counted:
            for name, items in per_file.items():
                path = self.fs.concat_path(self.path, name)
                with self.fs.create_stream(path, "rb") as f:
                    for index, reqs in items.items():
                        self._read_item(f, index, reqs, counted)
        apply, self.after_reads = self.after_reads, None  # once
        filled = getattr(planner, "original_state_dict", None)
        if apply is not None and filled is not None:
            try:
                apply(filled)
            except Exception as e:  # DCP's last gather sends it to every rank
                if (sent := portable(e)) is e:
                    raise
                raise sent from e
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(
        self, f: Any, index: MetadataIndex, reqs: list[ReadItem], planner: LoadPlanner
    ) -> None:
        """Reads one item from ``f``, checks it, and hands it over to ``planner``."""
        info = self.storage_data[index]
        descriptors = getattr(info, "transform_descriptors", None)
        if info.length >= _STREAMED and not descriptors and reqs[0].type != _BYTES:
            # read straight into the tensor, checked before it is copied in
            item = _ItemReader(f, info.offset, info.length, crc=bool(self.manifest))
            try:
                file = cast(IO[bytes], item)
                tensor = torch.load(file, map_location="cpu", weights_only=True)
            finally:  # damage, named as such (also when torch.load failed on it)
                self._check_item(index.fqn, info, *item.finish())
        else:
            data = self._slice_file(f, info).read(-1)
            crc = crc32c(data) if self.manifest else None
            self._check_item(index.fqn, info, len(data), crc)
            stream = self.transforms.transform_load_stream(
                reqs[0], descriptors or (), io.BytesIO(data)
            )
            if reqs[0].type == _BYTES:  # handed over as DCP's reader does
                data = stream.read(-1)
                if index.fqn == "step" and crc is not None:
                    self._check_step(data)
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(data))
                return
            if not stream.seekable():  # torch.load seeks
                stream = io.BytesIO(stream.read(-1))
            tensor = torch.load(stream, map_location="cpu", weights_only=True)
        for req in reqs:  # the part of the tensor each reads, into the planner's
            part = tensor
            for dim, (offset, size) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                if size < part.size(dim):
                    part = part.narrow(dim, offset, size)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise self._damaged(
                    f"item {index.fqn!r} of {info.relative_path} holds "
                    f"{list(part.size())} where {list(target.size())} is read",
                    "Load an earlier step",
                )
            target.copy_(part)
            planner.commit_tensor(req, target)

    def _check_item(self, key: str, info: Any, size: int, crc: int | None) -> None:
        """Raises unless the item is whole (``size`` bytes), its CRC-32C ``crc``."""
        name, offset, length = info.relative_path, info.offset, info.length
        if size != length:
            raise self._damaged(
                f"{name} ends at byte {offset + size}, inside item {key!r}",
                f"Restore the file, or {MOVE_ASIDE}",
            )
        if self.manifest is None or crc is None:
            return
        verify_item(self.manifest, (name, offset, length), key, crc)

    def _check_step(self, data: bytes) -> None:
        """Raises unless the stored step (``data``) is the manifest's."""
        if self.manifest is not None:  # the stored step, the name and manifest agree
            step = _restricted_load(io.BytesIO(data))
            if step != self.manifest.step:
                raise CheckpointError(
                    f"{str(self.folder)!r} holds step {step!r}, its "
                    f"{MANIFEST_FILE} says {self.manifest.step}: the manifest "
                    "was edited or belongs to another step. Move the folder "
                    "out of the checkpoint folder"
                )

    def _damaged(self, what: str, fix: str) -> CheckpointError:
        """The error for this step's damage: ``what`` is wrong, and ``fix``."""
        return CheckpointError(f"{str(self.folder)!r} is damaged: {what}. {fix}")


def read_metadata(path: str | os.PathLike, *, trusted: bool | None = None) -> Metadata:
    """Reads a step folder's ``.metadata`` safely, in this process alone.

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`.
    """
    reader = SafeFileSystemReader(path, trusted=trusted, check_files=False)
    return reader.read_metadata()


def verify_step(
    path: str | os.PathLike,
    *,
    trusted: bool | None = None,
    storage: Storage | None = None,
    share: tuple[int, int] = (0, 1),
) -> int:
    """Checks every item of a step against its manifest, in this process alone.

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`.
        storage: See :class:`SafeFileSystemReader`.
        share: ``(index, count)``: this process checks every ``count``-th
            item (by file and offset) from the ``index``-th, so that
            ``count`` processes check all of it, each its share.

    Returns:
        The number of items verified.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader` with ``verify``.
    """
    reader = SafeFileSystemReader(path, trusted=trusted, storage=storage)
    assert reader.manifest is not None
    ranges = storage_ranges(reader.metadata)
    index, count = share
    mine = {place: ranges[place] for place in sorted(ranges)[index::count]}
    for place, crc in read_crcs(reader.storage, reader.folder, mine):
        verify_item(reader.manifest, place, mine[place], crc)
    return len(mine)


def _drop_leaves(state_dict: dict[str, Any], keys: set[str], prefix: str = "") -> None:
    """Deletes, in place, the leaves of a nested dict whose dotted key is in keys."""
    for key in list(state_dict):
        value = state_dict[key]
        if isinstance(value, dict):
            _drop_leaves(value, keys, f"{prefix}{key}.")
        elif f"{prefix}{key}" in keys:
            del state_dict[key]


def _section(key: str) -> str:
    """The ``must_read`` prefix of a pippy key's section: ``data.``, ``step``."""
    head, dot, _ = key.partition(".")
    return head + dot


def _quoted(names: list[str]) -> str:
    """``a 'x' section``, ``'x' and 'y' sections``: the sections named so."""
    names = [repr(n.rstrip(".")) for n in names]
    if len(names) == 1:
        return f"a {names[0]} section"
    return f"{', '.join(names[:-1])} and {names[-1]} sections"


class _NoGlobals(pickle.Unpickler):
    """pickle's C unpickler, refusing every global: it builds plain values only."""

    def find_class(self, module: str, name: str) -> Any:
        """Refuses: a global makes the item one for the weights_only unpickler."""
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


#: ``torch.load``'s ``pickle_module`` for :func:`_restricted_load`.
_NO_GLOBALS = SimpleNamespace(
    __name__="pippy_no_globals",
    Unpickler=_NoGlobals,
    load=lambda file, **kwargs: _NoGlobals(file, **kwargs).load(),
)


def _restricted_load(value: io.BytesIO, trusted: bool = False) -> Any:
    """A ``torch.save``d non-tensor item, unpickled with no global it may not name."""
    # Numbers, strings, lists, dicts and tuples need no global: pickle's C unpickler
    # builds them with every global refused, calling nothing, at plain dcp.load's
    # speed. Anything else (a tensor, bytes, a set, a class) goes to weights_only.
    if not trusted:
        try:
            return torch.load(value, weights_only=False, pickle_module=_NO_GLOBALS)
        except Exception:
            value.seek(0)
    return torch.load(value, weights_only=not trusted)


def _keys_read(plan: LoadPlan) -> list[str]:
    """The keys a rank's local plan reads: as its planner listed them, or its items'."""
    if isinstance(plan.planner_data, list):
        return plan.planner_data
    return [item.storage_index.fqn for item in plan.items]


def _empty(item: Any) -> bool:
    """Whether a checkpoint item is a tensor of no element (nothing to read)."""
    return isinstance(item, TensorStorageMetadata) and 0 in item.size


class SafeLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that runs no pickled code and drops no key.

    Non-tensor items of plain values are unpickled with every global refused,
    any other with ``torch.load(weights_only=True)``. Each requested key is
    checked (present, shape, dtype) before planning; on the coordinator, every
    checkpoint key under ``must_read`` must be read by some rank (a checkpoint
    with more layers than the model would otherwise load "successfully"). The
    state of a parameter saved without any is dropped from the state_dict
    being loaded.

    Args:
        trusted: True reads any pickle, as ``DefaultLoadPlanner`` does; None
            decides by :func:`resolve_trusted`.
        must_read: Prefixes of the checkpoint keys that some rank must read;
            ``("",)`` (the default) is every key, ``()`` none. Loading only
            the weights (a fine-tuning start) passes ``("model.",)``.
        **kwargs: Passed to ``DefaultLoadPlanner``.

    Raises:
        UnsafeCheckpointError: An item's pickle names a refused global (named
            with the key and file; for ``optim.scalars``, the message names
            ``torch.serialization.add_safe_globals``).
        CheckpointError: Requested keys missing or of another shape or dtype;
            checkpoint keys under ``must_read`` that no rank reads.
    """

    def __init__(
        self,
        *,
        trusted: bool | None = None,
        must_read: tuple[str, ...] = ("",),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trusted = resolve_trusted(trusted)
        self.must_read = must_read
        self._keys: tuple[Any, Any] = ((), {})  # wanted and saved: set_up_planner
        self._parser: OptimKeys | None = None  # of _keys, built when a message needs it
        self.layout_name: Callable[[str], str] = str  # a key's pippy name, likewise

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's, less the state of parameters saved without any."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        wanted = list(self.state_dict)  # as DCP flattened them
        saved = metadata.state_dict_metadata if metadata is not None else {}
        self._keys, self._parser = (wanted, saved), None
        self.layout_name = pippy_name if detect_layout(saved) == TORCHTITAN else str
        stateless = stateless_keys(wanted, saved) if metadata is not None else ()
        if stateless:  # not loaded: dropped from DCP's view and the caller's dict
            _drop_leaves(state_dict, stateless)
            for key in stateless:
                del self.state_dict[key]

    def _optim_section(self, key: str) -> str | None:
        """The optimizer section of a dotted key (``state``, ...), or None."""
        if self._parser is None:
            self._parser = OptimKeys.of_keys([*self._keys[0], *self._keys[1]])
        parsed = self._parser.split(key)
        return None if parsed is None else parsed[1]

    def create_local_plan(self) -> LoadPlan:
        """Checks every requested key (present, shape, dtype), then plans."""
        saved = self.metadata.state_dict_metadata if self.metadata else {}
        problems: dict[str, str] = {}  # key: what is wrong with it
        retyped: dict[str, torch.dtype] = {}  # key: its dtype in the checkpoint
        for key, value in self.state_dict.items():
            item = saved.get(key)
            if item is None:
                if not self.allow_partial_load:
                    problems[key] = f"{key!r} is not in the checkpoint"
            elif isinstance(value, torch.Tensor):
                if not isinstance(item, TensorStorageMetadata):
                    problems[key] = f"{key!r} is not a tensor in the checkpoint"
                elif tuple(item.size) != tuple(value.shape):
                    problems[key] = (
                        f"{key!r} has shape {list(item.size)} in the checkpoint, "
                        f"{list(value.shape)} here"
                    )
                elif item.properties.dtype != value.dtype:
                    problems[key] = (
                        f"{key!r} is {item.properties.dtype} in the checkpoint, "
                        f"{value.dtype} here"
                    )
                    retyped[key] = item.properties.dtype
        if problems:
            shown = "; ".join(list(problems.values())[:6])
            sections = {_section(self.layout_name(k)) for k in problems}
            what = (
                "this optimizer"
                if sections == {"optim."}
                else "this model"
                if self._in_model(problems)
                else "this run's state"
            )
            raise CheckpointError(
                f"the checkpoint does not match {what} ({len(problems)} "
                f"problem(s)): {shown}{' ...' if len(problems) > 6 else ''}. "
                f"{self._fix_for(problems, saved, retyped)}"
            )
        plan = super().create_local_plan()
        # The keys this rank reads, for the coordinator's check that every key
        # is read: the same str objects as the items' (pickle sends each once).
        return dataclasses.replace(
            plan, planner_data=[item.storage_index.fqn for item in plan.items]
        )

    def _in_model(self, keys: Any) -> bool:
        """Whether some of the keys are the model's or the optimizer's."""
        return any(_section(self.layout_name(k)) in ("model.", "optim.") for k in keys)

    def _fix_for(
        self, problems: dict[str, str], saved: Any, retyped: dict[str, torch.dtype]
    ) -> str:
        """What to do about the problems :meth:`create_local_plan` found.

        ``retyped`` maps the keys of another dtype to the checkpoint's dtype.
        """
        if len(retyped) == len(problems):
            dtypes = ", ".join(sorted({str(d) for d in retyped.values()}))
            return (
                f"Build it in the checkpoint's dtype ({dtypes}, for example with "
                "module.to(dtype)) before loading; a load would cast every tensor."
            )
        wants_packed = any(k.startswith("optim.scalars.") for k in self.state_dict)
        if wants_packed and any(k.startswith("optim.param_groups.") for k in saved):
            return (
                "It was written by pippy before optimizer options were packed "
                "into optim.scalars.<fqn> (it has optim.param_groups.* keys): "
                "load its weights alone (load_model, or a StageState, without "
                "an optimizer)."
            )
        if all(self._optim_section(k) == "state" for k in problems):
            return (
                "Only the optimizer's state differs: build the optimizer as the "
                "run that saved it did (its class, and options that add state, "
                "such as amsgrad or momentum)."
            )
        if all(_section(self.layout_name(k)) == "optim." for k in problems):
            return (
                "Only the optimizer differs: it holds other parameters than the "
                "saved one did (one frozen in a run and trained in the other), or "
                "is of another class. Build it over the same parameters as the "
                "run that saved it did."
            )
        if all(re.search(r"(^|\.)lr_scheduler\.", k) for k in problems):
            return "Build the LR scheduler (or none) as the run that saved it did."
        if self._in_model(problems):
            return "Build the model with the configuration it was saved with."
        name = self.layout_name  # the problems are of this state's other sections
        sections = sorted({_section(name(k)) for k in problems})
        if any(k in saved for k in problems):
            return (
                f"This run's state has {_quoted(sections)} unlike the "
                "checkpoint's: build it as the run that saved the checkpoint did."
            )
        elsewhere = [
            repr(key)
            for key in saved
            if any(name(key).endswith(f".{name(k)}") for k in problems)
        ]
        instead = f" (it holds {', '.join(elsewhere[:3])} instead)" if elsewhere else ""
        return (
            f"This run's state has {_quoted(sections)} that the checkpoint "
            f"lacks{instead}: load a step saved with the same state, or build "
            "this run's state without it."
        )

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's global plan, after checking that no required key is left unread."""
        global_plan = super().create_global_plan(global_plan)
        saved = self.metadata.state_dict_metadata if self.metadata else {}
        unread = (  # every key, the default: set-level work, not a loop in Python
            set(saved)
            if self.must_read == ("",)
            else {key for key in saved if key.startswith(self.must_read)}
        )
        for plan in global_plan:  # until all are read: one plan per stage, often
            if not unread:
                return global_plan
            unread.difference_update(_keys_read(plan))
        unread = {key for key in unread if not _empty(saved[key])}
        if not unread:
            return global_plan
        read = {key for plan in global_plan for key in _keys_read(plan)}
        keys = sorted(unread)
        shown = ", ".join(repr(k) for k in keys[:8])
        raise CheckpointError(
            f"{len(keys)} key(s) of the checkpoint are read by no rank and "
            f"would be dropped: {shown}{' ...' if len(keys) > 8 else ''}. "
            f"{self._why_unread(keys, read)}"
        )

    def _why_unread(self, unread: list[str], read: set[str]) -> str:
        """Why the checkpoint's keys that no rank reads are unread, and the fix."""
        name, why = self.layout_name, []
        sections = {_section(name(k)) for k in unread} - {"model.", "optim."}
        # This state's sections as a must_read: pippy's own first, then the extras.
        pippys = ("model.", "optim.", "lr_scheduler.", "step")
        have = {_section(name(k)) for k in self.state_dict}
        ours = tuple(s for s in pippys if s in have) + tuple(sorted(have - {*pippys}))
        if extra := sorted(sections - {"lr_scheduler.", "step"}):
            it, each = ("it", "that") if len(extra) == 1 else ("them", "each")
            why.append(
                f"This run's state lacks {_quoted(extra)}: to restore {it}, add "
                f"a Stateful of {each} name to the StageState's extra; to leave "
                f"{it} unread, load with must_read={ours!r}."
            )
        if own := sorted(sections & {"lr_scheduler.", "step"}):
            why.append(
                f"This run's state lacks {_quoted(own)}: build it with the LR "
                "scheduler and step of the run that saved it, or load with "
                f"must_read={ours!r}."
            )
        others = [k for k in unread if self._optim_section(k) != "state"]
        if len(others) < len(unread):
            why.append(
                f"{'Some are' if others else 'They are'} optimizer state that "
                "the optimizer loaded into has no place for: it is another class "
                "(SGD without momentum has no state), it has stepped only some "
                "parameters (a fresh one gets state for every parameter that "
                "requires grad), or they do not require grad here. Build the "
                "optimizer as the run that saved it did, freshly, and unfreeze "
                "them."
            )
        if not self._in_model(others):
            return " ".join(why)

        def modules(keys: Any) -> set[str]:  # the top-level modules model keys name
            model = (name(k) for k in keys if name(k).startswith("model."))
            return {k.removeprefix("model.").split(".")[0] for k in model}

        mine = modules(read)
        if mine and (theirs := sorted(modules(others) - mine)):  # a module it lacks
            missing, present = " or ".join(map(repr, theirs)), ", ".join(sorted(mine))
            why.append(
                f"This model has no module {missing} (its modules: {present}): "
                "those keys are another model's, or other state saved under "
                "'model.'. Load into the model that saved them, or remap those "
                "keys before loading."
            )
        else:
            why.append(
                "The model or its split does not match the checkpoint (fewer "
                "layers? per-stage state keyed by a stage index that no longer "
                "exists?). Fix the model, or remap those keys before loading."
            )
        return " ".join(why)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickles a non-tensor item once (weights_only unless trusted), in place."""
        fqn = read_item.dest_index.fqn
        try:
            item = _restricted_load(value, self.trusted)
        except pickle.UnpicklingError as e:
            if self.trusted:
                raise
            storage = self.metadata.storage_data if self.metadata else {}
            info = storage.get(read_item.storage_index)
            where = getattr(info, "relative_path", "its data file")
            what = f"item {fqn!r} of {where}"
            match = re.search(r"GLOBAL ([\w.]+)", str(e))
            if match is None:  # not a refused global: the bytes are damaged
                raise CheckpointError(f"{what} is damaged: {e}") from None
            error = _refusal(what, match.group(1))
            if self._optim_section(fqn) == "scalars":  # a param group's option
                module, _, name = match[1].rpartition(".")
                error = UnsafeCheckpointError(
                    f"{error} If {name} is a class of yours that a param group "
                    "holds (a dataclass option, say) and you trust it, allow that "
                    "class alone, before loading: "
                    f"torch.serialization.add_safe_globals([{name}]) "
                    f"({name} of {module})."
                )
            raise error from None
        if not self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            self.state_dict[fqn] = item
            return
        *path, last = self.mappings[fqn]
        parent: Any = self.original_state_dict  # dicts and lists along the path
        for key in path:
            parent = parent[key]
        parent[last] = item


def open_reader(
    path: Location,
    *,
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    extension_registry: ExtensionRegistry | None = None,
) -> SafeFileSystemReader:
    """A :class:`SafeFileSystemReader` made on rank 0, its metadata broadcast."""
    _refuse_none(path)

    def make() -> SafeFileSystemReader:
        reader = SafeFileSystemReader(
            path, trusted=trusted, verify=verify, extension_registry=extension_registry
        )
        reader.check_extensions()
        return reader

    if no_dist or not dist.is_initialized():
        return make()
    made: list[SafeFileSystemReader] = []

    def check() -> Any:  # on rank 0; a CheckpointError reaches every rank as itself
        made.append(make())
        # .metadata's bytes, not the object: pickling DCP's Metadata again
        # costs rank 0 more than the others' unpickling it
        return made[0].trusted, made[0].metadata_bytes, made[0].manifest, str(path)

    checked = on_coordinator(f"cannot read {os.fspath(path)}", check, process_group)
    if made:
        return made[0]
    reader = SafeFileSystemReader.__new__(SafeFileSystemReader)  # checked on rank 0
    reader._open(path, checked[0], None, extension_registry)
    reader.metadata_bytes, reader.manifest, theirs = checked[1:]
    data, name = reader.metadata_bytes, str(reader.folder)
    reader.metadata = _MetadataUnpickler(data, name, reader.trusted).load()
    if reader.storage.name(theirs) != reader.storage.name(path):  # another step
        reader.failure = ValueError(  # raised in DCP's planning, so on every rank
            f"this rank opened {str(path)!r} and rank 0 {theirs!r}: every rank "
            "must load the same step (one checkpoint_id for all ranks)"
        )
    return reader


def _unverifiable(storage: Storage, path: Location) -> str | None:
    """Why a step is passed over before its items are read, or None."""
    if not is_complete(storage, path):
        return "incomplete (no .metadata: its save did not finish)"
    if not holds_its_step(storage, path):  # or its manifest is damaged
        return "its manifest names another step"
    if read_manifest(storage, path) is None:  # read already: no error now
        raise CheckpointError(
            f"{os.fspath(path)} has no manifest.json, so it cannot be "
            "verified: resume from it without verification, or move it aside"
        )
    return None


def _newest_verified(
    checkpoint_dir: Location, process_group: dist.ProcessGroup | None
) -> Any:
    """The newest step that verifies, each rank reading its share of each.

    No rank of a group reads a step all alone (without one, this process
    reads it all); rank 0 logs each step passed over.
    """
    action = f"cannot check {os.fspath(checkpoint_dir)}"
    storage = storage_for(checkpoint_dir)
    share = (0, 1)
    if dist.is_initialized():
        share = (dist.get_rank(process_group), dist.get_world_size(process_group))
    found, passed, left = None, [], None  # on rank 0: passed, the steps left

    def next_step() -> Any:  # on rank 0: the next step to read, or None
        nonlocal left
        if left is None:
            left = list(reversed(list_steps(storage, checkpoint_dir).values()))
        while left:
            path = left.pop(0)
            if (why := _unverifiable(storage, path)) is None:
                return path
            passed.append((path, storage.name(path), why, False))
        return None

    while (path := on_coordinator(action, next_step, process_group)) is not None:
        problem = None
        try:
            verify_step(path, storage=storage, share=share)
        except UnsafeCheckpointError as e:
            problem = ("unsafe", str(e))
        except CheckpointError as e:
            problem = ("damaged", str(e))
        problems: list[Any] = [problem] * share[1]
        if share[1] > 1:
            group = pippy_group(process_group)
            dist.all_gather_object(problems, problem, group=group)
        found_ = [p for p in problems if p is not None]
        if unsafe := [text for kind, text in found_ if kind == "unsafe"]:
            raise UnsafeCheckpointError(unsafe[0])
        if not found_:
            found = path
            break
        passed.append((path, storage.name(path), found_[0][1], True))

    def finish() -> Any:  # on rank 0
        return _passed_over(storage, checkpoint_dir, found, passed)

    return on_coordinator(action, finish, process_group)


def _passed_over(
    storage: Storage, checkpoint_dir: Location, found: Any, passed: list
) -> Any:
    """``found``, once the damaged steps passed over are moved aside.

    Each step passed over is logged; CheckpointError if none verified and
    some are damaged.
    """
    if found is None and any(damaged for *_, damaged in passed):
        reasons = "; ".join(f"{name}: {why}" for _, name, why, _ in passed)
        raise CheckpointError(
            f"no step of {os.fspath(checkpoint_dir)} verifies ({reasons}). "
            "Restore one, or move them all out of the folder to start afresh"
        )
    for path, name, why, damaged in passed:  # moved only once one verifies
        if damaged:  # renamed, kept for a look
            aside = f".step-{parse_step(path)}.damaged-{int(time.time())}"
            storage.publish(path, storage.join(storage.parent(path), aside))
            why = f"moved aside to {aside}: {why}"
        logger.warning("skipped %s: %s", name, why)
    return found


def find_latest_step(
    checkpoint_dir: Location,
    *,
    verified: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> Any:
    """Finds the newest complete step folder, to resume from.

    Incomplete folders (no ``.metadata``: a crash mid-save) and folders whose
    ``manifest.json`` names another step (copied or renamed) are never
    chosen; a warning names those newer than the one returned. A complete
    step damaged afterwards is returned, and loading it fails on every
    restart. ``verified=True`` goes past such steps instead: each is moved to
    ``.step-<N>.damaged-<time>`` (kept for a look, never chosen nor saved
    over) and named, with why, in a warning on rank 0.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.
        verified: Verify complete steps from the newest down until one
            passes, every rank reading its share of each step's bytes (see
            :func:`verify_step`); call it as the folder's owner
            (:class:`~pippy.checkpoint.job.FolderOwner`).
        process_group: The ranks; the default group if None. Without an
            initialized process group, this process answers alone.

    Returns:
        The newest complete ``step-<N>`` folder (a ``Path``, or a URL for a
        URL), or None if there is none.

    Raises:
        CheckpointDirError: On every rank: ``checkpoint_dir`` exists and is
            not a folder, cannot be listed, or is a URL whose storage client
            is missing; with ``verified``, a step cannot be moved.
        UnsafeCheckpointError: On every rank: the manifest of a step it
            reaches is a link leading out of the step folder; with
            ``verified``, a step holds a pickle that would run code or such a
            link (not damage: nothing is passed over for it).
        CheckpointError: With ``verified``, on every rank: no complete step
            verifies (nothing is moved), or one to verify has no manifest.

    Note:
        Call it on every rank of ``process_group`` at once (a collective:
        called on rank 0 alone, it waits), or without a process group. Rank
        0 answers for all: every rank resumes from the same step.
    """
    if verified:
        return _newest_verified(checkpoint_dir, process_group)

    def decide() -> Any:  # on rank 0
        storage = storage_for(checkpoint_dir)
        latest, skipped = newest_complete_step(storage, checkpoint_dir)
        if skipped:
            logger.warning(
                "skipping steps never completed (no .metadata; on an object store "
                "also no manifest.json, the step's commit record) or whose "
                "manifest names another step: %s",
                skipped,
            )
        return latest

    return on_coordinator(
        f"cannot list {os.fspath(checkpoint_dir)}", decide, process_group
    )
