"""One rank answers every question about the checkpoint folder, for all ranks.

On a filesystem every node mounts, attribute caching (NFS) can make ranks
disagree on what the folder holds, and so resume from different steps or
wait in different collectives; on a bucket, hundreds of ranks listing at
once get throttled into "no checkpoint". So in a job, rank 0 of the process
group alone lists or looks up the run's folder, and broadcasts its answer
(or its error: :func:`~pippy.checkpoint.errors.on_coordinator`), so that
every rank acts on the same answer or fails with the same message:

=====================================  ==========================================
Question                               Answered on rank 0 by
=====================================  ==========================================
Is the folder a folder, is it free,    :class:`~pippy.checkpoint.FolderOwner`
who owns it, take it over              (``acquire``; ``release`` on rank 0 alone)
Which steps are complete, which is     :func:`~pippy.checkpoint.find_latest_step`
newest (and which verify)              (``verified=True``: ``newest_verified_step``)
Is the step new, what to move aside;   :class:`~pippy.checkpoint.api.StepWriter`,
publish it, what to delete             in DCP's planning and ``finish`` (no
(``keep_last``)                        broadcast: DCP's plans carry the answer)
Is the step complete, its              :func:`open_reader`, which
``.metadata``, its files' sizes, its   :func:`~pippy.checkpoint.api.open_step` and
manifest                               ``load_stage`` use
=====================================  ==========================================

The other ranks then open only the data files whose items they load, and
the staging folder they write. Without an initialized process group (one
process, the command line), the process answers alone. A test counts each
rank's system calls and bucket listings (``test/test_one_rank_decides.py``).

A step damaged after it was published (a file truncated by a copy, a bad
disk block) is refused when it is loaded, and
:func:`find_latest_step` picks it again on every
restart: a launcher that restarts the job (``torchrun --max-restarts``, a
requeued Slurm job) then fails the same way each time.
:func:`newest_verified_step` checks the newest steps against their
manifests first and resumes from the newest that passes, moving the damaged
ones aside; ``find_latest_step(..., verified=True)`` does the same and logs
why. It is an opt-in: by default a damaged step is refused.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch.distributed as dist

from pippy.checkpoint.errors import (
    CheckpointError,
    UnsafeCheckpointError,
    on_coordinator,
)
from pippy.checkpoint.manifest import read_manifest
from pippy.checkpoint.safe_load import SafeFileSystemReader, verify_step
from pippy.checkpoint.steps import (
    _holds_its_step,
    is_complete,
    list_steps,
    newest_complete_step,
    parse_step,
)
from pippy.checkpoint.storage import Location, storage_for

__all__ = ["find_latest_step", "newest_verified_step", "open_reader"]

logger = logging.getLogger(__name__)


def open_reader(
    path: Location,
    *,
    trusted: bool | None = None,
    check_files: bool = True,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> SafeFileSystemReader:
    """A :class:`SafeFileSystemReader` of a step, made on every rank at once.

    Rank 0 alone makes it as the class does (reads ``.metadata``, checks the
    folder, the data files' sizes and the manifest) and broadcasts the
    metadata and the manifest, or its error; the other ranks touch none of
    the step's files until ``dcp.load`` reads their items. The broadcast
    carries the whole ``Metadata``, as ``dcp.save`` itself does.

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`; rank 0's decision holds.
        check_files: As :class:`SafeFileSystemReader`.
        verify: As :class:`SafeFileSystemReader`.
        process_group: The ranks; the default group if None.
        no_dist: This process reads alone, with no collective (as
            ``dcp.load``'s ``no_dist``); so does a process without an
            initialized process group.

    Returns:
        The reader, on every rank.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`, on every rank.
        CheckpointDirError: On every rank, if rank 0 failed otherwise (a
            folder it may not read).
    """
    if no_dist or not dist.is_initialized():
        return SafeFileSystemReader(
            path, trusted=trusted, check_files=check_files, verify=verify
        )
    made: list[SafeFileSystemReader] = []

    def check() -> Any:  # on rank 0; a CheckpointError reaches every rank as itself
        reader = SafeFileSystemReader(
            path, trusted=trusted, check_files=check_files, verify=verify
        )
        made.append(reader)
        return reader.trusted, reader.metadata, reader.manifest

    checked = on_coordinator(f"cannot read {os.fspath(path)}", check, process_group)
    if made:
        return made[0]
    trusted, metadata, manifest = checked
    return SafeFileSystemReader.checked(
        path, trusted=trusted, metadata=metadata, manifest=manifest
    )


def newest_verified_step(
    checkpoint_dir: Location, *, process_group: dist.ProcessGroup | None = None
) -> tuple[Any, dict[str, str]]:
    """The newest step whose every item matches its manifest; damaged ones aside.

    Rank 0 verifies complete steps from the newest down
    (:func:`~pippy.checkpoint.verify_step`) until one passes, then moves the
    newer complete ones that failed to ``.step-<N>.damaged-<time>``, where
    they stay for a look and are never chosen nor saved over; every rank
    gets the same answer. Call it on every rank of ``process_group``, as the
    folder's owner (:class:`~pippy.checkpoint.FolderOwner`).

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.
        process_group: The ranks; the default group if None.

    Returns:
        ``(folder or None, skipped)``: the step to resume from, and
        ``{name: why}`` for each newer step folder passed over.

    Raises:
        CheckpointError: On every rank: no complete step verifies (nothing is
            moved), or one to verify has no manifest.
        UnsafeCheckpointError: On every rank: a step holds a pickle that
            would run code, or a file that is a link leading out of its
            folder (not damage: nothing is skipped for it).
        CheckpointDirError: On every rank: the folder cannot be listed, or a
            step cannot be moved.

    Note:
        Verifying reads every byte of each step it checks, on rank 0.
    """

    def decide() -> tuple[Any, dict[str, str]]:  # on rank 0; errors reach every rank
        skipped: dict[str, str] = {}
        damaged: list[Any] = []
        for path in reversed(list_steps(checkpoint_dir).values()):
            name, why = storage_for(path).name(path), _why_not_verified(path)
            if why is None:
                for old in damaged:  # only now: a step to resume from exists
                    name = storage_for(old).name(old)
                    skipped[name] = (
                        f"moved aside to {_move_aside(old)}: {skipped[name]}"
                    )
                return path, skipped
            if isinstance(why, CheckpointError):
                raise why
            skipped[name] = why
            damaged += [path] if is_complete(path) and _holds_its_step(path) else []
        if not damaged:
            return None, skipped
        reasons = "; ".join(f"{n}: {w}" for n, w in skipped.items())
        raise CheckpointError(
            f"no step of {os.fspath(checkpoint_dir)} verifies ({reasons}). "
            "Restore one, or move them all out of the folder to start afresh"
        )

    where = os.fspath(checkpoint_dir)
    return on_coordinator(f"cannot check {where}", decide, process_group)


def _why_not_verified(path: Any) -> str | CheckpointError | None:
    """Why a step cannot be resumed from; None if it verifies, an error to raise."""
    if not is_complete(path):
        return "incomplete (no .metadata: its save did not finish)"
    if not _holds_its_step(path):
        return "its manifest names another step"
    try:
        if read_manifest(path) is None:
            return CheckpointError(
                f"{os.fspath(path)} has no manifest.json, so it cannot be verified: "
                "resume from it without verification, or move it aside"
            )
        verify_step(path)
    except UnsafeCheckpointError as e:
        return e
    except CheckpointError as e:
        return str(e)
    return None


def _move_aside(path: Any) -> str:
    """Renames a damaged step to ``.step-<N>.damaged-<time>``; that name."""
    storage = storage_for(path)
    aside = storage.join(
        storage.parent(path), f".step-{parse_step(path)}.damaged-{int(time.time())}"
    )
    storage.publish(path, aside)
    return storage.name(aside)


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
    instead (:func:`newest_verified_step`); a
    warning on rank 0 names each and why.

    With a process group, rank 0 alone lists the folder and reads the
    manifests, and broadcasts the answer: every rank resumes from the same
    step, and no other rank lists the folder (on NFS, attribute caching can
    make ranks disagree on what exists; many ranks listing a bucket at once
    get throttled).

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.
        verified: Check the newest steps against their manifests and move
            those that fail aside, as the folder's owner.
        process_group: The ranks; the default group if None. Without an
            initialized process group, this process answers alone.

    Returns:
        The newest complete ``step-<N>`` folder (a ``Path``, or a URL for a
        URL), or None if there is none.

    Raises:
        CheckpointDirError: On every rank: ``checkpoint_dir`` exists and is
            not a folder, cannot be listed, or is a URL whose storage client
            is missing.
        UnsafeCheckpointError: On every rank: the manifest of a step it
            reaches is a link leading out of the step folder; with
            ``verified``, as ``newest_verified_step``.
        CheckpointError: With ``verified``, as ``newest_verified_step``.

    Note:
        Call it on every rank of ``process_group`` at once (it is a
        collective), or in a process without a process group; called on
        rank 0 alone, it waits for the others.
    """
    if verified:
        verified_step, reasons = newest_verified_step(
            checkpoint_dir, process_group=process_group
        )
        if not dist.is_initialized() or dist.get_rank(process_group) == 0:
            for name, why in reasons.items():
                logger.warning("skipped %s: %s", name, why)
        return verified_step
    where = os.fspath(checkpoint_dir)
    latest, skipped = on_coordinator(
        f"cannot list {where}",
        lambda: newest_complete_step(checkpoint_dir),
        process_group,
    )
    if skipped and (not dist.is_initialized() or dist.get_rank(process_group) == 0):
        logger.warning(
            "skipping incomplete checkpoints (no .metadata, or a manifest naming "
            "another step) %s",
            skipped,
        )
    return latest
