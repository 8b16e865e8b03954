"""Which step to resume from: the newest complete one, or the newest that verifies.

Rank 0 of the process group alone answers every question about the checkpoint
folder, and broadcasts its answer or its error
(:func:`~pippy.checkpoint.collectives.on_coordinator`): NFS attribute caching can
make ranks disagree on what a folder holds (and resume from different steps),
and hundreds of ranks listing a bucket at once get throttled into "no
checkpoint". With ``verified=True`` every rank reads its share of each step
it checks (:func:`~pippy.checkpoint.reader.verify_step`), so that no rank
reads a step alone. ``test/test_one_rank_decides.py`` counts who lists what.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from pippy.checkpoint.collectives import on_coordinator, pippy_group
from pippy.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from pippy.checkpoint.manifest import read_manifest
from pippy.checkpoint.reader import verify_step
from pippy.checkpoint.steps import (
    hidden_name,
    list_steps,
    newest_complete_step,
    why_not_whole,
)
from pippy.checkpoint.storage import (
    Location,
    Storage,
    storage_for,
)

logger = logging.getLogger(__name__)


def _unverifiable(storage: Storage, path: Location) -> str | None:
    """Why a step is passed over before its items are read, or None."""
    if (why := why_not_whole(storage, path)) is not None:
        return why
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
            aside = hidden_name(storage.name(path), "damaged")
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
