"""Step folders: one per saved step, published only once complete.

A run's checkpoint folder holds ``step-<N>`` folders, one per save. Ranks
write into a hidden staging folder, ``.step-<N>.partial-<token>``, that rank 0
renames to ``step-<N>`` once DCP's coordinator has written ``.metadata``: a
rename is atomic on a POSIX file system, so a step folder is either complete
or absent; the rename and the folders are fsynced, so it stays so after a
power loss. The token is new for every save, so that no save ever writes into
or deletes a staging folder it did not create. A step's ``manifest.json``
says which step it holds; a folder whose name says otherwise is never taken
for that step. The file operations themselves go through
:mod:`~pippy.checkpoint.storage`.

An object store (an fsspec URL: ``s3://``, ``gs://``) has no rename: there a
step is written in place under its final name, and its ``manifest.json``,
written last in one PUT, is its commit record. A step folder without it is
never taken as complete or newest, loaded, or counted by retention.

Retention never leaves part of a step under a step's name: on a POSIX file
system it renames the step aside to ``.step-<N>.deleting-<token>`` (one
atomic, fsynced rename) before deleting its files; a kill between the two
leaves that folder, which no step scan lists and the folder's next owner
deletes (:func:`remove_staging`). On an object store it deletes the commit
record first: a kill leaves an uncommitted step.

The functions here ask the storage from the process that calls them; in a
job, rank 0 asks and broadcasts the answer
(:func:`~pippy.checkpoint.find_latest_step` itself, publishing and ownership
around the others; see
:mod:`~pippy.checkpoint.coordinated`).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from typing import Any

from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointError,
    UnsafeCheckpointError,
)
from pippy.checkpoint.manifest import MANIFEST_FILE, read_manifest
from pippy.checkpoint.metadata import METADATA_FILE
from pippy.checkpoint.storage import Location, glob, storage_for

__all__ = [
    "is_complete",
    "list_steps",
    "newest_complete_step",
    "parse_step",
    "remove_old_steps",
    "remove_staging",
    "step_dir",
]

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(0|[1-9][0-9]*)$")
_STEP_LIKE = re.compile(r"^step-[0-9]+$")
#: A save's staging folder, and a step that retention has taken out of view.
_LEFTOVERS = (".step-*.partial-*", ".step-*.deleting-*")


def step_dir(checkpoint_dir: Location, step: int) -> Any:
    """Returns the folder of one step's checkpoint: ``<checkpoint_dir>/step-<step>``.

    Args:
        checkpoint_dir: The run's checkpoint folder: a local path or a URL.
        step: Number of optimizer steps taken when the checkpoint was saved.

    Returns:
        A ``Path`` for a local folder, a ``str`` for a URL.
    """
    return storage_for(checkpoint_dir).join(checkpoint_dir, f"step-{step}")


def is_complete(path: Location) -> bool:
    """Tells whether a step folder holds a complete checkpoint.

    DCP's coordinator writes ``.metadata`` only after every rank has written
    its data, so a folder without it was interrupted mid-save. On an object
    store, where a step is written in place, its commit record
    (``manifest.json``, written after ``.metadata``) must exist too.
    """
    storage = storage_for(path)
    marks = [METADATA_FILE] + [MANIFEST_FILE] * (not storage.atomic_rename)
    return all(storage.size(storage.join(path, m)) is not None for m in marks)


def parse_step(path: Location) -> int | None:
    """The step of a ``step-<N>`` folder name (no leading zeros), or None."""
    match = _STEP_RE.match(storage_for(path).name(path))
    return int(match.group(1)) if match else None


def list_steps(checkpoint_dir: Location) -> dict[int, Any]:
    """Lists the step folders of a checkpoint folder, complete or not.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        ``{step: folder}`` sorted by step; empty if the folder does not exist.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder, or
            holds a step folder under a name pippy does not write
            (``step-08`` beside, or instead of, ``step-8``).
    """
    storage = storage_for(checkpoint_dir)
    if storage.size(checkpoint_dir) is not None:
        raise CheckpointDirError(
            f"checkpoint dir {os.fspath(checkpoint_dir)!r} is a file, not a folder"
        )
    steps = {}
    for name in storage.listdir(checkpoint_dir):
        path = storage.join(checkpoint_dir, name)
        step = parse_step(path)
        if step is None and _STEP_LIKE.match(name):
            raise CheckpointDirError(
                f"{os.fspath(path)!r} is not a step folder name pippy writes (it "
                f"would be step-{int(name[5:])}): one step could have two names. "
                "Rename it, or move it out of the checkpoint folder"
            )
        if step is not None and storage.is_dir(path):
            steps[step] = path
    return dict(sorted(steps.items()))


def _holds_its_step(path: Location) -> bool:
    """False if its manifest names another step or is damaged; raises if unsafe."""
    try:
        manifest = read_manifest(path)
    except UnsafeCheckpointError:
        raise  # a link out of the folder: refused, not passed over as damage
    except CheckpointError:
        return False
    return manifest is None or manifest.step == parse_step(path)


def newest_complete_step(checkpoint_dir: Location) -> tuple[Any, list[str]]:
    """The newest complete step folder, and the newer ones passed over.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        ``(folder or None, skipped)``: as
        :func:`~pippy.checkpoint.find_latest_step`, with the step folders
        newer than it that are incomplete or hold another step.

    Raises:
        CheckpointDirError: As :func:`~pippy.checkpoint.find_latest_step`.
        UnsafeCheckpointError: The manifest of a step it reaches is a link
            leading out of the step folder.
    """
    skipped: list[str] = []
    for path in reversed(list_steps(checkpoint_dir).values()):
        if is_complete(path) and _holds_its_step(path):
            return path, skipped
        skipped.append(os.fspath(path))
    return None, skipped


def remove_old_steps(
    checkpoint_dir: Location, keep_last: int, *, keep: Location | None = None
) -> list[Any]:
    """Deletes all but the newest ``keep_last`` complete step folders.

    Steps are ranked by the step they hold (their manifest's), which is their
    name's: a folder whose manifest names another step (copied or renamed),
    or is a link leading out of it, is neither counted nor deleted.
    Incomplete folders are left alone (they may be a save in progress). Each
    step is taken out of view in one operation before its files are deleted
    (renamed aside on a POSIX file system, its commit record deleted on an
    object store), so a kill meanwhile never leaves part of a step under its
    name. It runs in this process alone: in a job,
    :meth:`~pippy.checkpoint.api.StepWriter.publish` calls it on rank 0.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: How many complete steps to keep; at least 1.
        keep: A step folder never deleted (the one just published).

    Returns:
        The folders deleted.

    Raises:
        ValueError: ``keep_last`` is less than 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    storage = storage_for(checkpoint_dir)
    complete = [p for p in list_steps(checkpoint_dir).values() if _counted(p)]
    old = [p for p in complete[:-keep_last] if p != keep]
    for path in old:
        _remove_step(storage, path)
    if old:
        names = ", ".join(storage.name(p) for p in old)
        logger.info("removed %s (keeping the newest %d)", names, keep_last)
    return old


def _counted(path: Location) -> bool:
    """Whether retention counts a step; one whose manifest links out is left alone."""
    try:
        return is_complete(path) and _holds_its_step(path)
    except UnsafeCheckpointError:
        return False


def _remove_step(storage: Any, path: Any) -> None:
    """Takes a step out of view in one operation, then deletes its files."""
    if storage.atomic_rename:  # one rename, fsynced: step-<N> is whole or gone
        aside = storage.join(
            storage.parent(path),
            f".{storage.name(path)}.deleting-{uuid.uuid4().hex[:12]}",
        )
        storage.publish(path, aside)
        path = aside
    else:  # no rename: uncommitted first, then never taken as a step
        storage.remove(storage.join(path, MANIFEST_FILE))
    storage.remove(path)


def remove_staging(checkpoint_dir: Location) -> list[str]:
    """Deletes a dead job's leftovers in ``checkpoint_dir``.

    They are its staging folders (``.step-<N>.partial-<token>``) and the
    steps its retention had taken out of view but not yet deleted
    (``.step-<N>.deleting-<token>``). Only the folder's owner may call it
    (see :class:`~pippy.checkpoint.FolderOwner`, which does, on rank 0).

    Args:
        checkpoint_dir: The run's checkpoint folder.

    Returns:
        The names removed.
    """
    storage = storage_for(checkpoint_dir)
    removed = []
    for pattern in _LEFTOVERS:
        for leftover in glob(storage, checkpoint_dir, pattern):
            storage.remove(leftover)
            removed.append(storage.name(leftover))
    return removed
