"""Publishing a step: staged, then renamed whole, or committed by its record.

Ranks write into a hidden staging folder, ``.step-<N>.partial-<token>``, that
DCP's coordinator renames to ``step-<N>`` once it has written ``.metadata``
and the manifest, in the writer's ``finish`` (:func:`publish_step`, made of
:func:`prepare_step`, :func:`publisher` and :func:`discard`, which the async
saver calls apart). On
an object store the step is written in place and its manifest, written last,
commits it (see :mod:`~pippy.checkpoint.steps`). A failed save is discarded:
nothing is published.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pippy.checkpoint import stall
from pippy.checkpoint.errors import (
    CheckpointDirError,
    dir_error,
    explain_failures,
    on_coordinator,
)
from pippy.checkpoint.lease import check_lease, lease_lost
from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.stall import Timeout
from pippy.checkpoint.steps import (
    _holds_its_step,
    is_complete,
    list_steps,
    remove_old_steps,
    step_dir,
)
from pippy.checkpoint.storage import Location, storage_for

__all__ = [
    "StepFolder",
    "discard",
    "prepare_step",
    "publish",
    "publish_step",
    "publisher",
]

logger = logging.getLogger(__name__)


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
        CheckpointDirInUseError: On every rank: this job lost the folder's
            lease to another job (:func:`~pippy.checkpoint.lease.check_lease`).
    """
    storage = storage_for(checkpoint_dir)
    final = step_dir(checkpoint_dir, step)

    def make_staging() -> StepFolder:  # on rank 0 alone: no other rank lists
        check_lease(checkpoint_dir)  # a job that lost the folder writes nothing
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

    Call it on every rank once the save returned everywhere, for a save
    whose writer did not publish it (:func:`publisher` does so inside
    ``dcp.save``). The rename is durable when this returns
    (:meth:`~pippy.checkpoint.storage.Storage.publish`).

    Args:
        folder: The step folder from :func:`prepare_step`.
        keep_last: If set, then keep only this many newest complete steps.
        process_group: The ranks that saved; the default group if None.

    Returns:
        The names of the step folders removed, on every rank.

    Raises:
        CheckpointDirError: On every rank, if the rename or pruning failed.
        CheckpointDirInUseError: On every rank: this job lost the folder's
            lease to another job; nothing is pruned.
    """
    return on_coordinator(
        f"cannot publish {storage_for(folder.final).name(folder.final)}",
        lambda: _rename_and_prune(folder, keep_last),
        process_group,
    )


def publisher(folder: StepFolder, keep_last: int | None = None) -> Callable[[], None]:
    """What publishes ``folder`` from its writer's ``finish``, on the coordinator.

    Give it to :class:`~pippy.checkpoint.manifest.ManifestWriter` as
    ``on_finish``: the step is renamed to ``step-<N>`` (and old steps pruned)
    inside DCP's last step, with no collective of its own; a failure reaches
    every rank through DCP.

    Args:
        folder: The step folder from :func:`prepare_step`.
        keep_last: If set, then keep only this many newest complete steps.

    Returns:
        The function to run; it raises ``CheckpointDirError`` if the rename or
        pruning failed and ``CheckpointDirInUseError`` if the lease was lost.
    """

    def publish_here() -> None:
        name = storage_for(folder.final).name(folder.final)
        try:
            removed = _rename_and_prune(folder, keep_last)
        except OSError as e:
            raise dir_error(f"cannot publish {name}", e) from e
        if removed:
            logger.info("published %s, removed %s", name, ", ".join(removed))

    return publish_here


def _rename_and_prune(folder: StepFolder, keep_last: int | None) -> list[str]:
    """On one rank: renames the staging folder to the step's, then prunes."""
    storage = storage_for(folder.final)
    check_lease(storage.parent(folder.final))
    if folder.staging != folder.final:  # on a store: committed by its record
        storage.publish(folder.staging, folder.final)
    if keep_last is None:
        return []
    parent = storage.parent(folder.final)
    removed = remove_old_steps(parent, keep_last, keep=folder.final)
    return [storage.name(p) for p in removed]


@contextmanager
def publish_step(
    checkpoint_dir: Location,
    step: int,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
) -> Iterator[ManifestWriter]:
    """Gives every rank a staging folder and publishes it as ``step-<step>``.

    Use it around ``dcp.save``, on every rank::

        with publish_step(checkpoint_dir, step) as writer:
            dcp.save(state_dict, storage_writer=writer)

    The save goes into ``.step-<step>.partial-<token>``; once every rank has
    written, the coordinator writes ``.metadata`` and ``manifest.json`` and,
    still inside ``dcp.save`` (the writer's ``finish``), renames the folder to
    ``step-<step>``, which is atomic on a POSIX file system, and only then
    removes steps beyond ``keep_last``. A body that saves through another
    writer is published after it, with one broadcast. A crash before that leaves
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
            ``dcp.save`` in the body must run on the same group.
        timeout: Seconds (or a ``timedelta``) a rank that has written its
            items waits for the others before the save is abandoned; None
            waits without a deadline. Either way, every
            :func:`~pippy.checkpoint.stall.log_every` seconds the ranks not
            done are logged with what they wrote so far.

    Yields:
        A :class:`~pippy.checkpoint.manifest.ManifestWriter` of the staging
        folder (its ``path``), to pass to ``dcp.save`` as ``storage_writer``.

    Raises:
        CheckpointDirError: On every rank: ``step-<step>`` exists, or
            ``checkpoint_dir`` is a file or cannot be written.
        CheckpointError: ``dcp.save`` in the body failed on some rank.
        CheckpointTimeout: Some rank had not written its items within
            ``timeout``: on every rank that had, naming those that had not;
            nothing is published. The group then holds a collective that
            timed out: end the job.
        ValueError: ``timeout`` is not a positive number.
    """
    action = f"saving step-{step}"
    # Watched from before the first collective: a late rank is named there too.
    with stall.waiting(action, "write", timeout, process_group):
        folder = prepare_step(checkpoint_dir, step, process_group)
        try:
            writer = ManifestWriter(
                folder.staging, step=step, on_finish=publisher(folder, keep_last)
            )
            with explain_failures(action):
                yield writer
        except BaseException:
            discard(folder, process_group)
            raise
        if not writer.set_up:  # the body saved through a writer of its own
            publish(folder, keep_last=keep_last, process_group=process_group)


def discard(folder: StepFolder, process_group: dist.ProcessGroup | None = None) -> None:
    """Removes a failed save's staging folder, on rank 0, without a collective.

    A job that lost its lease removes nothing: on an object store the step
    is written in place, and the folder may be the new owner's.

    Args:
        folder: The step folder from :func:`prepare_step`.
        process_group: The ranks that saved; rank 0 of it removes the folder.
    """
    storage = storage_for(folder.staging)
    if lease_lost(storage.parent(folder.final)):
        return
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        storage.remove(folder.staging)
