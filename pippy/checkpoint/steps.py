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
never taken as complete or newest, loaded, or counted by retention, which
deletes the commit record first.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointError,
    explain_failures,
    on_coordinator,
)
from pippy.checkpoint.manifest import MANIFEST_FILE, ManifestWriter, read_manifest
from pippy.checkpoint.storage import Location, glob, storage_for

__all__ = [
    "METADATA_FILE",
    "StepFolder",
    "discard",
    "find_latest_step",
    "is_complete",
    "list_steps",
    "newest_complete_step",
    "parse_step",
    "prepare_step",
    "publish",
    "publish_step",
    "remove_old_steps",
    "remove_staging",
    "step_dir",
]

logger = logging.getLogger(__name__)

#: The file DCP's coordinator writes last; a step folder without it is partial.
METADATA_FILE = ".metadata"
_STEP_RE = re.compile(r"^step-(0|[1-9][0-9]*)$")
_STEP_LIKE = re.compile(r"^step-[0-9]+$")


def step_dir(checkpoint_dir: Location, step: int) -> Any:
    """Returns the folder of one step's checkpoint: ``<checkpoint_dir>/step-<step>``.

    Args:
        checkpoint_dir: The run's checkpoint folder: a local path or a URL.
        step: Number of optimizer steps taken when the checkpoint was saved.

    Returns:
        A ``Path`` for a local folder, a ``str`` for a URL.
    """
    return storage_for(checkpoint_dir).join(checkpoint_dir, f"step-{step}")


@dataclass(frozen=True)
class StepFolder:
    """The two paths of one step's save: where it is written, where it is published.

    Attributes:
        step: The step being saved.
        final: ``<checkpoint_dir>/step-<step>``, what readers see.
        staging: ``<checkpoint_dir>/.step-<step>.partial-<token>``, what ranks
            write into.
    """

    step: int
    final: Any
    staging: Any

    @classmethod
    def of(cls, checkpoint_dir: Location, step: int, token: str) -> StepFolder:
        """The step folder of ``step`` in ``checkpoint_dir``, staged under ``token``.

        On an object store (no rename) the staging folder is the final one.
        """
        storage = storage_for(checkpoint_dir)
        final = step_dir(checkpoint_dir, step)
        if not storage.atomic_rename:
            return cls(step, final, final)
        staging = storage.join(checkpoint_dir, f".step-{step}.partial-{token}")
        return cls(step, final, staging)


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
    """False if the step's manifest names another step (or cannot be read)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return False
    return manifest is None or manifest.step == parse_step(path)


def newest_complete_step(checkpoint_dir: Location) -> tuple[Any, list[str]]:
    """The newest complete step folder, and the newer ones passed over.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        ``(folder or None, skipped)``: as :func:`find_latest_step`, with the
        step folders newer than it that are incomplete or hold another step.

    Raises:
        CheckpointDirError: As :func:`find_latest_step`.
    """
    skipped: list[str] = []
    for path in reversed(list_steps(checkpoint_dir).values()):
        if is_complete(path) and _holds_its_step(path):
            return path, skipped
        skipped.append(os.fspath(path))
    return None, skipped


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
    step damaged afterwards is returned, and loading it fails: in a restart
    loop, every restart fails alike. ``verified=True`` goes past such steps
    instead (:func:`~pippy.checkpoint.verified.newest_verified_step`); a
    warning on rank 0 names each and why.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.
        verified: Check the newest steps against their manifests and move
            those that fail aside. Then call it on every rank of
            ``process_group``, as the folder's owner.
        process_group: With ``verified``, the ranks; the default group if None.

    Returns:
        The newest complete ``step-<N>`` folder (a ``Path``, or a URL for a
        URL), or None if there is none.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder, or
            is a URL whose storage client is missing.
        CheckpointError: With ``verified``, as ``newest_verified_step``.
    """
    if verified:
        from pippy.checkpoint.verified import newest_verified_step  # imports us

        verified_step, reasons = newest_verified_step(
            checkpoint_dir, process_group=process_group
        )
        if not dist.is_initialized() or dist.get_rank(process_group) == 0:
            for name, why in reasons.items():
                logger.warning("skipped %s: %s", name, why)
        return verified_step
    latest, skipped = newest_complete_step(checkpoint_dir)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "skipping incomplete checkpoints (no .metadata, or a manifest naming "
            "another step) %s",
            skipped,
        )
    return latest


def prepare_step(
    checkpoint_dir: Location,
    step: int,
    process_group: dist.ProcessGroup | None = None,
) -> StepFolder:
    """Checks that ``step-<step>`` is new and makes its empty staging folder.

    An incomplete ``step-<step>`` (not written by :func:`publish_step`), or
    one whose manifest names another step (a copy), is moved aside. The
    staging folder is new, named by a token rank 0 draws.
    Call it on every rank of ``process_group``; rank 0 does the file
    operations.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing.
        step: The step about to be saved.
        process_group: The ranks that save; the default group if None.

    Returns:
        The step's folder, its staging folder empty and ready.

    Raises:
        CheckpointDirError: On every rank: the step exists, or the folder is a
            file or cannot be written.
    """
    storage = storage_for(checkpoint_dir)
    final = step_dir(checkpoint_dir, step)

    def make_staging() -> StepFolder:  # on rank 0 alone: no other rank lists
        list_steps(checkpoint_dir)  # a file where the folder should be: say so
        if is_complete(final) and _holds_its_step(final):
            raise CheckpointDirError(
                f"{os.fspath(final)!r} already exists; checkpoints are never "
                "overwritten. Resume from it, or save into another checkpoint "
                "folder."
            )
        folder = StepFolder.of(checkpoint_dir, step, uuid.uuid4().hex[:12])
        if not storage.atomic_rename and storage.exists(final):
            # Written in place and never committed (a save cut short): this
            # job owns the folder, and no reader takes an uncommitted step.
            storage.remove(final)
            logger.warning("removed %s: a save of it never committed", final)
        elif storage.exists(final):  # incomplete, or another step's: keep it aside
            aside = storage.join(
                checkpoint_dir, f".step-{step}.incomplete-{int(time.time())}"
            )
            storage.publish(final, aside)
            logger.warning(
                "moved %s aside to %s: it was incomplete or held another step",
                final,
                storage.name(aside),
            )
        storage.makedirs(folder.staging)
        return folder

    staging = storage.join(checkpoint_dir, f".step-{step}.partial-*")
    return on_coordinator(f"cannot create {staging}", make_staging, process_group)


def publish(
    folder: StepFolder,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> list[str]:
    """Renames a step's staging folder to ``step-<N>``, then prunes old steps.

    Call it on every rank once the save returned everywhere. The rename is
    durable when this returns (:meth:`~pippy.checkpoint.storage.Storage.publish`).
    The steps removed are logged (INFO) on rank 0.

    Args:
        folder: The step folder from :func:`prepare_step`.
        keep_last: If set, then keep only this many newest complete steps.
        process_group: The ranks that saved; the default group if None.

    Returns:
        The names of the step folders removed, on every rank.

    Raises:
        CheckpointDirError: On every rank, if the rename or pruning failed.
    """
    storage = storage_for(folder.final)

    def rename_and_prune() -> list[str]:
        if folder.staging != folder.final:  # on a store: committed by its record
            storage.publish(folder.staging, folder.final)
        if keep_last is None:
            return []
        parent = storage.parent(folder.final)
        removed = remove_old_steps(parent, keep_last, keep=folder.final)
        return [storage.name(p) for p in removed]

    return on_coordinator(
        f"cannot publish {storage.name(folder.final)}", rename_and_prune, process_group
    )


def remove_old_steps(
    checkpoint_dir: Location, keep_last: int, *, keep: Location | None = None
) -> list[Any]:
    """Deletes all but the newest ``keep_last`` complete step folders.

    Steps are ranked by the step they hold (their manifest's), which is their
    name's: a folder whose manifest names another step (copied or renamed)
    is neither counted nor deleted. Incomplete folders are left alone (they
    may be a save in progress).

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
    complete = [
        p
        for p in list_steps(checkpoint_dir).values()
        if is_complete(p) and _holds_its_step(p)
    ]
    old = [p for p in complete[:-keep_last] if p != keep]
    for path in old:
        storage.remove(storage.join(path, MANIFEST_FILE))  # uncommitted first
        storage.remove(path)
    if old:
        names = ", ".join(storage.name(p) for p in old)
        logger.info("removed %s (keeping the newest %d)", names, keep_last)
    return old


def remove_staging(checkpoint_dir: Location) -> list[str]:
    """Deletes every staging folder in ``checkpoint_dir`` (a dead job's).

    Only the folder's owner may call it (see :class:`~pippy.checkpoint.FolderOwner`).

    Returns:
        The names removed.
    """
    storage = storage_for(checkpoint_dir)
    removed = []
    for leftover in glob(storage, checkpoint_dir, ".step-*.partial-*"):
        storage.remove(leftover)
        removed.append(storage.name(leftover))
    return removed


@contextmanager
def publish_step(
    checkpoint_dir: Location,
    step: int,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Iterator[ManifestWriter]:
    """Gives every rank a staging folder and publishes it as ``step-<step>``.

    Use it around ``dcp.save``, on every rank::

        with publish_step(checkpoint_dir, step) as writer:
            dcp.save(state_dict, storage_writer=writer)

    The save goes into ``.step-<step>.partial-<token>``; once it returned on
    every rank (so the coordinator has written ``.metadata``), rank 0 renames
    the folder to ``step-<step>``, which is atomic on a POSIX file system, and
    only then removes steps beyond ``keep_last``. A crash before that leaves
    only the hidden staging folder, which :func:`find_latest_step` never
    picks. An existing step folder is never written into. If the body raises,
    nothing is published and rank 0 removes the staging folder; DCP's
    ``CheckpointException`` (a ``BaseException``) is raised as a
    ``CheckpointError`` with one line per failed rank.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing. On
            several nodes it must be storage that every node sees.
        step: The step being saved.
        keep_last: If set, keep only this many newest complete steps.
        process_group: Group of the ranks that save; the default group if None.

    Yields:
        A :class:`~pippy.checkpoint.manifest.ManifestWriter` of the staging
        folder (its ``path``), to pass to ``dcp.save`` as ``storage_writer``.

    Raises:
        CheckpointDirError: On every rank: ``step-<step>`` exists, or
            ``checkpoint_dir`` is a file, cannot be written, or is a URL (an
            object store cannot publish a step atomically yet).
        CheckpointError: ``dcp.save`` in the body failed on some rank.
    """
    folder = prepare_step(checkpoint_dir, step, process_group)
    try:
        with explain_failures(f"saving step-{step}"):
            yield ManifestWriter(folder.staging, step=step)
    except BaseException:
        discard(folder, process_group)
        raise
    publish(folder, keep_last=keep_last, process_group=process_group)


def discard(folder: StepFolder, process_group: dist.ProcessGroup | None = None) -> None:
    """Removes a failed save's staging folder, on rank 0, without a collective.

    Args:
        folder: The step folder from :func:`prepare_step`.
        process_group: The ranks that saved; rank 0 of it removes the folder.
    """
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        storage_for(folder.staging).remove(folder.staging)
