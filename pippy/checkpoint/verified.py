"""Resuming past damaged steps: the newest step that verifies, in a restart loop.

A step damaged after it was published (a file truncated by a copy, a bad
disk block) is refused when it is loaded, and
:func:`~pippy.checkpoint.steps.find_latest_step` picks it again on every
restart: a launcher that restarts the job (``torchrun --max-restarts``, a
requeued Slurm job) then fails the same way each time.
:func:`newest_verified_step` checks the newest steps against their
manifests first and resumes from the newest that passes, moving the damaged
ones aside; ``find_latest_step(..., verified=True)`` does the same and logs
why. It is an opt-in: by default a damaged step is refused.
"""

from __future__ import annotations

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
from pippy.checkpoint.safe_load import verify_step
from pippy.checkpoint.steps import (
    _holds_its_step,
    is_complete,
    list_steps,
    parse_step,
)
from pippy.checkpoint.storage import Location, storage_for

__all__ = ["newest_verified_step"]


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
            would run code (not damage: nothing is skipped for it).
        CheckpointDirError: On every rank: the folder cannot be listed, or a
            step cannot be moved.

    Note:
        Verifying reads every byte of each step it checks, on rank 0.
    """

    def decide() -> tuple[Any, dict[str, str], CheckpointError | None]:
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
                return path, skipped, None
            if isinstance(why, CheckpointError):
                return None, skipped, why
            skipped[name] = why
            damaged += [path] if is_complete(path) and _holds_its_step(path) else []
        if not damaged:
            return None, skipped, None
        reasons = "; ".join(f"{n}: {w}" for n, w in skipped.items())
        error = CheckpointError(
            f"no step of {os.fspath(checkpoint_dir)} verifies ({reasons}). "
            "Restore one, or move them all out of the folder to start afresh"
        )
        return None, skipped, error

    where = os.fspath(checkpoint_dir)
    latest, skipped, error = on_coordinator(
        f"cannot check {where}", decide, process_group
    )
    if error is not None:
        raise error
    return latest, skipped


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
