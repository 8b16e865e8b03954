"""Step folders: names, completeness, retention, the newest; ``.metadata`` checked.

A run's checkpoint folder holds one ``step-<N>`` folder per save, published
whole by :func:`~pippy.checkpoint.save.publish_step`. On an object store (no
rename) a step is written in place; ``manifest.json``, written last in one PUT,
is its commit record. A folder whose name says another step than its manifest
is never taken for that step. In a job, rank 0 alone calls these.

Private torch names pippy relies on, each tested in
test/test_torch_internals.py on torch 2.10 to 2.15
(test/golden/version_matrix.py):

* ``torch.distributed.checkpoint.state_dict._get_fqns`` (optimizer keys);
* ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``
  (a shard's place, for the replica check);
* ``torch.distributed.checkpoint._fsspec_filesystem.FileSystem`` (URLs);
* the ``.metadata`` globals :mod:`~pippy.checkpoint.reader` allows, and
  ``_StorageInfo``'s ``relative_path``, ``offset`` and ``length``;
* ``FileSystemWriter``/``FileSystemReader``'s ``fs``, ``path`` and
  ``sync_files``, which pippy's writer and reader replace;
* the ``GLOBAL module.name`` text of ``torch.load(weights_only=True)``'s
  refusal, which the load planner parses;
* ``torch.serialization.set_crc32_options`` being per thread from torch 2.12
  (``manifest.CRC32_PER_THREAD``; per process before, so kept on there);
* ``torch.distributed.distributed_c10d._get_default_store`` and a group's
  ``_get_backend`` and ``options._timeout`` (of pippy's own gloo group:
  :mod:`~pippy.checkpoint.collectives`; no public getters);
* ``DefaultLoadPlanner.original_state_dict`` (undocumented), the dict
  ``dcp.load`` fills, filled when ``read_data`` returns;
* ``DefaultSavePlanner._enable_plan_caching`` (refused by the save planner);
* an LR scheduler's ``_last_lr`` list in its state;
* ``nn.Module``'s ``_parameters``, ``_buffers``, ``_modules``,
  ``_non_persistent_buffers_set``, ``_state_dict_hooks`` and
  ``_state_dict_pre_hooks``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from pippy.checkpoint.errors import (
    MOVE_ASIDE,
    CheckpointDirError,
    CheckpointError,
    UnsafeCheckpointError,
    check_number,
)
from pippy.checkpoint.manifest import (
    MANIFEST_FILE,
    METADATA_FILE,
    file_ends,
    read_manifest,
)
from pippy.checkpoint.storage import Location, Storage, is_url, join, step_file

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(0|[1-9][0-9]*)$")
_STEP_LIKE = re.compile(r"^step-[0-9]+$")
#: Hidden step folders, ``.step-<N>.<kind>-<token>``: a save's staging (``partial``)
#: and a step retention took out of view (``deleting``), random token, deleted once
#: their job is gone; steps moved aside for a look (``incomplete``, ``damaged``),
#: the time as token.
_HIDDEN = re.compile(r"\.step-[0-9]+\.(partial|deleting|incomplete|damaged)-.*")
_LEFTOVER = ("partial", "deleting")


def hidden_name(step: str, kind: str) -> str:
    """The hidden name of a step folder (``step-<N>``): ``.step-<N>.<kind>-<token>``."""
    token = uuid.uuid4().hex[:12] if kind in _LEFTOVER else str(int(time.time()))
    return f".{step}.{kind}-{token}"


def hidden_kind(name: str) -> str | None:
    """The kind of a hidden step folder's name (:func:`hidden_name`), or None."""
    match = _HIDDEN.fullmatch(name)
    return match[1] if match else None


def check_step(step: Any) -> int:
    """``step``; ValueError unless it is a whole number >= 0 (a ``bool`` is not)."""
    message = "a step is a whole number >= 0, not {!r}"
    return check_number(step, message, whole=True, at_least=0)


def check_keep_last(keep_last: Any) -> int | None:
    """``keep_last``; ValueError unless None or a whole number >= 1."""
    if keep_last is None:
        return None
    message = "keep_last must be None or a whole number >= 1, not {!r}"
    return check_number(keep_last, message, whole=True, at_least=1)


def step_dir(checkpoint_dir: Location, step: int) -> Any:
    """``<checkpoint_dir>/step-<step>``: a ``Path`` locally, a ``str`` for a URL."""
    return join(checkpoint_dir, f"step-{check_step(step)}")


def is_complete(storage: Storage, path: Location) -> bool:
    """Whether a step folder has ``.metadata`` (and, on an object store, a manifest)."""
    marks = [METADATA_FILE] + [MANIFEST_FILE] * (not storage.atomic_rename)
    return all(storage.size(storage.join(path, m)) is not None for m in marks)


def is_step_name(name: str) -> bool:
    """Whether ``name`` reads as a step folder's: ``step-<digits>``, ``step-08`` too."""
    return _STEP_LIKE.match(name) is not None


def parse_step(path: Location) -> int | None:
    """The step of a ``step-<N>`` folder name (no leading zeros), or None."""
    match = _STEP_RE.match(os.fspath(path).rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def step_holding(storage: Storage, location: Location) -> Any:
    """The complete step folder ``location`` is or lies in (links resolved), or None."""
    places: list[Any]
    if is_url(location):
        scheme, _, path = os.fspath(location).rstrip("/").partition("://")
        parts = path.split("/")
        places = [f"{scheme}://{'/'.join(parts[:n])}" for n in range(len(parts), 0, -1)]
    else:
        real = Path(location).resolve()
        places = [real, *real.parents]
    return next((p for p in places if is_complete(storage, p)), None)


def refuse_step_folder(storage: Storage, checkpoint_dir: Location) -> None:
    """CheckpointDirError if ``checkpoint_dir`` is or lies in a step folder."""
    real = storage.same_place(checkpoint_dir)
    inside = step_holding(storage, real)
    if parse_step(real) is not None or inside is not None:
        step = inside or real
        raise CheckpointDirError(
            f"{str(checkpoint_dir)!r} is or lies in the step folder {str(step)!r}, "
            f"not a run's checkpoint folder (its parent {str(storage.parent(step))!r} "
            "is)"
        )


def step_names(storage: Storage, checkpoint_dir: Location) -> dict[int, Any]:
    """``{step: path}`` of each ``step-<N>`` name (no stat); refuses as list_steps."""
    if storage.size(checkpoint_dir) is not None:
        raise CheckpointDirError(
            f"checkpoint dir {os.fspath(checkpoint_dir)!r} is a file, not a folder"
        )
    steps = {}
    for name in storage.listdir(checkpoint_dir):
        path = storage.join(checkpoint_dir, name)
        step = parse_step(path)
        if step is None and is_step_name(name):
            raise CheckpointDirError(
                f"{os.fspath(path)!r} is not a step folder name pippy writes (it "
                f"would be step-{int(name[5:])}): one step could have two names. "
                "Rename it, or move it out of the checkpoint folder"
            )
        if step is not None:
            steps[step] = path
    return dict(sorted(steps.items()))


def list_steps(storage: Storage, checkpoint_dir: Location) -> dict[int, Any]:
    """``{step: folder}`` of all step folders; refuses a file or a ``step-08``."""
    names = step_names(storage, checkpoint_dir).items()
    return {step: path for step, path in names if storage.is_dir(path)}


def why_not_whole(storage: Storage, path: Location) -> str | None:
    """None if a step folder is complete and holds its step, else why not.

    A damaged manifest does not make a step less whole: reading it refuses the
    damage; one that links out of the folder raises ``UnsafeCheckpointError``.
    """
    if not is_complete(storage, path):
        return "incomplete (no .metadata: its save did not finish)"
    try:
        manifest = read_manifest(storage, path)
    except UnsafeCheckpointError:
        raise  # a link out of the folder: refused, not passed over as damage
    except CheckpointError:  # damaged: refused where it is read
        return None
    if manifest is None or manifest.step == parse_step(path):
        return None
    return "its manifest names another step"


def newest_complete_step(
    storage: Storage, checkpoint_dir: Location
) -> tuple[Any, list[str]]:
    """``(newest complete step folder or None, newer ones passed over)``."""
    skipped: list[str] = []
    for path in reversed(list_steps(storage, checkpoint_dir).values()):
        if why_not_whole(storage, path) is None:
            return path, skipped
        skipped.append(os.fspath(path))
    return None, skipped


def remove_old_steps(
    storage: Storage,
    checkpoint_dir: Location,
    keep_last: int,
    *,
    keep: Location | None = None,
) -> list[Any]:
    """Removes all but the newest ``keep_last`` complete steps, never ``keep``.

    Each goes out of view at once (renamed aside, or its manifest deleted on a
    store); a thread deletes its files, and what earlier deletions left, off the
    critical path (:func:`wait_for_deletions`). Folders not counted as steps
    (incomplete, another step's, linking out) are left alone.
    """
    check_keep_last(keep_last)
    steps = list_steps(storage, checkpoint_dir).values()
    complete = [p for p in steps if _counted(storage, p)]
    old = [p for p in complete[:-keep_last] if p != keep]
    doomed = []
    for path in old:
        if storage.atomic_rename:  # one rename, fsynced: step-<N> is whole or gone
            name = hidden_name(storage.name(path), "deleting")
            doomed.append(storage.join(checkpoint_dir, name))
            storage.publish(path, doomed[-1])
        else:  # uncommitted first, then never taken as a step
            storage.remove(storage.join(path, MANIFEST_FILE))
            doomed.append(path)
    if old:
        names = ", ".join(storage.name(p) for p in old)
        logger.info("removed %s (keeping the newest %d)", names, keep_last)
    with _deleting_lock:  # and what an earlier deletion left (a kill, an error)
        _deleting.update(map(os.fspath, doomed))
        for path in _leftovers(storage, checkpoint_dir, ("deleting",)):
            if os.fspath(path) not in _deleting:
                _deleting.add(os.fspath(path))
                doomed.append(path)
    if doomed:
        thread = threading.Thread(
            target=_delete, args=(storage, doomed), name="pippy-delete"
        )
        thread.start()  # not a daemon: the interpreter waits for it at exit
        _deleters.append(thread)
    return old


#: Folders out of view that this process's deletion threads delete, and those.
_deleting: set[str] = set()
_deleting_lock = threading.Lock()
_deleters: list[threading.Thread] = []


def _delete(storage: Storage, paths: list[Any]) -> None:
    """Deletes each folder, off every rank's critical path; logs what fails."""
    for path in paths:
        try:
            storage.remove(path)
        except OSError as e:
            logger.warning(
                "could not delete %s (%s): the next save with keep_last retries",
                path,
                e,
            )
        finally:
            with _deleting_lock:
                _deleting.discard(os.fspath(path))


def wait_for_deletions() -> None:
    """Waits until the old steps that this process's saves removed are deleted."""
    while _deleters:
        _deleters.pop().join()


def _counted(storage: Storage, path: Location) -> bool:
    """Whether retention counts a step; one whose manifest links out is not."""
    with suppress(UnsafeCheckpointError):
        return why_not_whole(storage, path) is None
    return False


def _leftovers(
    storage: Storage, checkpoint_dir: Location, kinds: tuple[str, ...]
) -> list[Any]:
    """The hidden step folders of these kinds in ``checkpoint_dir``."""
    names = storage.listdir(checkpoint_dir)
    return [storage.join(checkpoint_dir, n) for n in names if hidden_kind(n) in kinds]


def remove_staging(storage: Storage, checkpoint_dir: Location) -> list[str]:
    """Deletes a dead job's staging and ``.deleting-`` folders (owner only)."""
    removed = _leftovers(storage, checkpoint_dir, _LEFTOVER)
    for path in removed:
        storage.remove(path)
    return [storage.name(p) for p in removed]


def find_damage(
    storage: Storage,
    path: Location,
    metadata: Metadata,
    sizes: dict[str, int | None] | None = None,
) -> list[str]:
    """One line per data file ``.metadata`` names that is missing, no file, or short.

    ``sizes``, if given, is filled with each file's size (None: missing).
    """
    problems = []  # check_structure passed: each item has a place
    for name, size in sorted(file_ends(metadata.storage_data.values()).items()):
        actual = storage.size(storage.join(path, name))
        if sizes is not None:
            sizes[name] = actual
        if actual is None:
            there = storage.exists(storage.join(path, name))  # a folder, say
            problems.append(f"{name} is {'not a file' if there else 'missing'}")
        elif actual < size:
            problems.append(f"{name} has {actual} bytes, its items need {size}")
    return problems


def check_structure(storage: Storage, folder: Location, metadata: Metadata) -> None:
    """Refuses ``.metadata`` whose items are not where, or not as large as, it says."""
    path = os.fspath(storage.join(folder, METADATA_FILE))

    def damage(what: str) -> CheckpointError:
        return CheckpointError(
            f"{path!r} is damaged: {what}. Restore it, or {MOVE_ASIDE}"
        )

    try:  # a malformed entry raises anything: it is damage, not a KeyError
        places, items = metadata.storage_data, metadata.state_dict_metadata
        if not isinstance(places, dict) or not isinstance(items, dict):
            raise damage("it has no table of items and files")
        contained: set[str] = set()  # each file once: resolving a path stats it
        lengths: dict[tuple[str, Any], int] = {}  # (key, chunk offsets): bytes
        for index, info in places.items():
            name: Any = getattr(info, "relative_path", None)
            if not (isinstance(name, str) and name in contained):
                plain = isinstance(name, str) and name not in ("", ".", "..")
                if not plain or any(c in name for c in "/\\\0"):
                    raise UnsafeCheckpointError(
                        f"refused to load {str(folder)!r}: its {METADATA_FILE} names "
                        f"the data file {name!r}, which is not a plain file name "
                        "inside the step folder (a path). DCP would open it wherever "
                        "it points; no checkpoint written by DCP or pippy does that"
                    )
                step_file(storage, folder, name)
                contained.add(name)
            offset, length = (getattr(info, a, None) for a in ("offset", "length"))
            if not (type(offset) is type(length) is int and min(offset, length) >= 0):
                raise damage(f"item {index.fqn!r} has no valid place")
            if index.fqn not in items:  # stored, and left out of the keys loaded
                raise damage(f"it stores {index.fqn!r} but lists no such key")
            # a stream extension (compression) may store fewer bytes than it holds
            transformed = getattr(info, "transform_descriptors", None)
            lengths[index.fqn, index.offset] = -1 if transformed else length
        for key, item in items.items():
            if isinstance(item, BytesStorageMetadata):
                chunks: list[tuple[Any, int]] = [(None, 0)]
            elif isinstance(item, TensorStorageMetadata):
                itemsize, shape = item.properties.dtype.itemsize, item.size
                if not all(type(d) is int and d >= 0 for d in shape):
                    raise damage(f"{key!r} has shape {list(shape)}")
                chunks, volume, inside = [], 0, True
                for c in item.chunks:
                    n = math.prod(c.sizes)
                    chunks.append((c.offsets, n * itemsize))
                    volume += n
                    fits = zip(c.offsets, c.sizes, shape, strict=True)
                    inside = inside and len(c.offsets) == len(c.sizes) == len(shape)
                    inside = inside and all(0 <= o and o + s <= d for o, s, d in fits)
                if not inside or volume != math.prod(shape):
                    raise damage(
                        f"{key!r} declares shape {list(shape)}, which "
                        "its stored chunks do not fill"
                    )
            else:
                raise damage(f"{key!r} is neither tensor nor object")
            for offsets, nbytes in chunks:
                length = lengths.get((key, offsets))
                if length is None:
                    raise damage(f"no file holds {key!r}")
                if nbytes > length >= 0:  # torch.save adds headers, removes none
                    raise damage(
                        f"{key!r} declares {nbytes} bytes, but its file "
                        f"holds {length} for it"
                    )
    except (AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
        raise damage(f"{type(e).__name__}: {e}") from None


def storage_ranges(metadata: Metadata) -> dict:
    """``{(file, offset, length): key}`` of every item ``.metadata`` places."""
    return {
        (info.relative_path, info.offset, info.length): index.fqn
        for index, info in metadata.storage_data.items()
    }
