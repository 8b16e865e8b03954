"""Reading a step safely: its ``.metadata`` without running pickles, each item checked.

torch's ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load``:
whoever can write a checkpoint folder could run code on every rank that
loads it. :class:`SafeFileSystemReader` unpickles it under an allow-list of
DCP's own classes, reads each item only from a file inside its step and
within that file's size, and checks each against its CRC-32C in
``manifest.json``. Rank 0 opens the step for all (:func:`opened_on_rank_0`).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from contextlib import nullcontext, suppress
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
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

from pippy.checkpoint.collectives import Waits, on_coordinator
from pippy.checkpoint.errors import (
    MOVE_ASIDE,
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
    listed,
    own_error,
    portable,
)
from pippy.checkpoint.manifest import (
    MANIFEST_FILE,
    STREAMED,
    ItemReader,
    Manifest,
    check_manifest,
    crc32c,
    read_crcs,
    read_manifest,
    verify_item,
)
from pippy.checkpoint.safe_load import (
    TRUST_ENV,
    SafeLoadPlanner,
    refusal,
    resolve_trusted,
    restricted_load,
)
from pippy.checkpoint.steps import (
    METADATA_FILE,
    check_structure,
    find_damage,
    is_complete,
    list_steps,
    parse_step,
    storage_ranges,
)
from pippy.checkpoint.storage import (
    Location,
    Storage,
    is_url,
    join,
    same_location,
    step_file,
    storage_for,
)

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
_BYTES = LoadItemType.BYTE_IO
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
            raise refusal(self.name, f"{module}.{name}")
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
        folders = list_steps(storage, folder).values()
        if steps := [p for p in folders if is_complete(storage, p)]:
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
        newer = None
        with suppress(Exception):  # no manifest, or no version in it: no help here
            writer = cast(Manifest, read_manifest(storage, folder)).written_by["torch"]
            newer = writer if TorchVersion(writer) > torch.__version__ else None
        if newer:
            raise CheckpointError(
                f"{path} was written by torch {newer}, this is torch "
                f"{torch.__version__}, which cannot read it ({type(e).__name__}: "
                f"{e}). Read it with torch {newer} or newer"
            ) from None
        raise CheckpointError(
            f"{path} is damaged ({type(e).__name__}: {e}): restore it, or {MOVE_ASIDE}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} does not hold DCP metadata")
    return metadata, data


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
            decides by :func:`~pippy.checkpoint.safe_load.resolve_trusted`.
        check_files: Also check the data files; False reads the metadata alone.
        verify: Check the manifest, and each item's checksum as it is read
            (with ``check_files``). False loads one without a manifest.
        storage: ``path``'s storage, if the caller has it.
        extension_registry: DCP's registry of the stream extensions the step
            was written with (``FileSystemWriter``'s ``_extensions``); None:
            DCP's default one (ZStandard).
        after_reads: What ``read_data`` calls with the planner's state_dict
            once this rank has read (DCP's last collective carries its error).
        waits: The watch this rank reports its progress and arrival to.
        process_group: The group to pass ``dcp.load`` (in ``load_into``'s
            block, pippy's gloo group, which its ``timeout`` bounds).
        failure: This rank's error before reading, raised in DCP's planning.
        opened: ``(metadata_bytes, manifest, metadata)`` that another reader
            read and checked (``metadata`` None: unpickled from the bytes):
            none is read again.

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

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trusted: bool | None = None,
        check_files: bool = True,
        verify: bool = True,
        storage: Storage | None = None,
        extension_registry: ExtensionRegistry | None = None,
        after_reads: Callable[[dict[str, Any]], None] | None = None,
        waits: Waits | None = None,
        process_group: dist.ProcessGroup | None = None,
        failure: Exception | None = None,
        opened: tuple[bytes, Manifest | None, Metadata | None] | None = None,
    ) -> None:
        if path is None:
            raise CheckpointNotFoundError(
                "no step to load: the path is None (find_latest_step returns None "
                "where the folder holds no complete step); check for it first"
            )
        super().__init__(path, _extension_registry=extension_registry)
        self.extension_registry = extension_registry or ExtensionRegistry()
        self.storage = storage = storage or storage_for(path)
        if is_url(path):  # DCP's FileSystemReader would read a local folder
            self.fs = storage.dcp_filesystem(path)  # type: ignore[assignment]
            self.path = self.fs.init_path(path)
        self.trusted = resolve_trusted(trusted)
        self.folder = folder = join(path)
        self.after_reads, self.waits, self.failure = after_reads, waits, failure
        self.process_group = process_group
        self.manifest = None
        if opened is not None:  # read and checked by rank 0's reader
            self.metadata_bytes, self.manifest, metadata = opened
            self.metadata = metadata or (
                _MetadataUnpickler(opened[0], str(folder), self.trusted).load()
            )
            return
        read = _read_metadata_file(storage, folder, self.trusted)
        self.metadata, self.metadata_bytes = read
        check_structure(storage, folder, self.metadata)
        if not check_files:
            return
        sizes: dict[str, int | None] = {}  # each file's, asked once
        if problems := find_damage(storage, folder, self.metadata, sizes):
            shown = listed(problems, 4, "; ", str)
            raise self._damaged(shown, f"Restore those files, or {MOVE_ASIDE}")
        if verify:
            ranges = storage_ranges(self.metadata)
            self.manifest = check_manifest(
                storage, folder, ranges, sizes, parse_step(folder), self.metadata_bytes
            )

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
                    "pass load_into an extension_registry holding them, with "
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
                "open that step, or leave dcp.load's checkpoint_id out"
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

        Each stored byte is read once and checked (whole, and with ``verify``
        against its CRC-32C) before the planner gets it; an item of 1 MiB or more
        as ``torch.load`` reads it into a new tensor. Then, under :attr:`waits`,
        the rank waits for the others, and :attr:`after_reads` runs.

        Raises:
            UnsafeCheckpointError: Unless trusted, ``planner`` is not a
                :class:`~pippy.checkpoint.safe_load.SafeLoadPlanner` and the plan
                holds non-tensor items.
            CheckpointError: An item is damaged (cut short, or not its CRC-32C).
        """
        unsafe = not (self.trusted or isinstance(planner, SafeLoadPlanner))
        if unsafe and any(req.type == _BYTES for req in plan.items):
            raise UnsafeCheckpointError(
                f"refused to load {self.folder} with {type(planner).__name__}: it "
                "unpickles non-tensor items with plain pickle, which could run "
                "code. Pass dcp.load the planner load_into gives, or, if you "
                f"trust the checkpoint, set {TRUST_ENV}=1"
            )
        self.check_extensions()
        per_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = {}
        for req in plan.items:
            name = self.storage_data[req.storage_index].relative_path
            per_file.setdefault(name, {}).setdefault(req.storage_index, []).append(req)
        counting: Any = nullcontext(planner)
        if self.waits is not None:  # each item's bytes, for progress
            sizes = {
                i: self.storage_data[i].length for by in per_file.values() for i in by
            }
            counting = self.waits.counting(planner, sizes)
        with counting as counted:
            for name, items in per_file.items():
                path = self.fs.concat_path(self.path, name)
                with self.fs.create_stream(path, "rb") as f:
                    for index, reqs in items.items():
                        self._read_item(f, index, reqs, counted)
        filled = getattr(planner, "original_state_dict", None)
        if self.after_reads is not None and filled is not None:
            try:
                self.after_reads(filled)
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
        if info.length >= STREAMED and not descriptors and reqs[0].type != _BYTES:
            # read straight into the tensor, checked before it is copied in
            item = ItemReader(f, info.offset, info.length, crc=bool(self.manifest))
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
        declared = cast(
            TensorStorageMetadata, self.metadata.state_dict_metadata[index.fqn]
        )
        sizes = [list(c.sizes) for c in declared.chunks if c.offsets == index.offset]
        if tensor.dtype != declared.properties.dtype or [list(tensor.size())] != sizes:
            raise self._damaged(
                f"item {index.fqn!r} of {info.relative_path} is stored as "
                f"{tensor.dtype} {list(tensor.size())}, its .metadata says "
                f"{declared.properties.dtype} {sizes[0] if sizes else 'no chunk'}",
                f"Restore the step, or {MOVE_ASIDE}",
            )
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
        step = restricted_load(io.BytesIO(data))
        if self.manifest is not None and step != self.manifest.step:
            raise CheckpointError(
                f"{str(self.folder)!r} holds step {step!r}, its {MANIFEST_FILE} "
                f"says {self.manifest.step}: the manifest was edited or belongs to "
                "another step. Move the folder out of the checkpoint folder"
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


def opened_on_rank_0(
    path: Location,
    group: dist.ProcessGroup | None,
    no_dist: bool,
    **options: Any,
) -> dict[str, Any]:
    """A :class:`SafeFileSystemReader`'s arguments (``options``: its own), opened.

    Rank 0 of ``group`` opens and checks the step; the reader these make reads
    no file to open, on the other ranks what rank 0 broadcast.
    """
    made: list[SafeFileSystemReader] = []

    def make() -> Any:  # on rank 0; a CheckpointError reaches every rank as itself
        reader = SafeFileSystemReader(path, **options)
        reader.check_extensions()
        made.append(reader)
        # .metadata's bytes, not the object: pickling DCP's Metadata again
        # costs rank 0 more than the others' unpickling it
        return reader.trusted, reader.metadata_bytes, reader.manifest, str(path)

    if no_dist or not dist.is_initialized():
        trusted, data, manifest, theirs = make()
    else:
        action = f"cannot read {path}"  # None too: refused by rank 0 for all
        trusted, data, manifest, theirs = on_coordinator(action, make, group)
    storage, failure = made[0].storage if made else storage_for(path), None
    if storage.name(theirs) != storage.name(path):  # raised in DCP's planning
        failure = ValueError(
            f"this rank opened {str(path)!r} and rank 0 {theirs!r}: every rank "
            "must load the same step (one checkpoint_id for all ranks)"
        )
    opened = (data, manifest, made[0].metadata if made else None)
    options.update(trusted=trusted, storage=storage, failure=failure)
    return dict(options, opened=opened)
