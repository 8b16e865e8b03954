"""Publishing a step: staged, then renamed whole, or committed by its record.

Ranks write into a hidden staging folder, ``.step-<N>.partial-<token>``, that
DCP's coordinator makes in its global planning and renames to ``step-<N>``
once it has written ``.metadata`` and the manifest, in the writer's
``finish`` (:class:`StepWriter`, which :func:`publish_step` gives): a save
runs DCP's collectives and none of pippy's own. On an object store the step
is written in place and its manifest, written last, commits it (see
:mod:`~pippy.checkpoint.steps`). A failed save is discarded: nothing is
published.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from pippy.checkpoint import stall
from pippy.checkpoint.errors import CheckpointDirError, dir_error, explain_failures
from pippy.checkpoint.job import check_lease, lease_lost
from pippy.checkpoint.stall import Timeout
from pippy.checkpoint.steps import (
    ManifestWriter,
    _holds_its_step,
    is_complete,
    list_steps,
    remove_old_steps,
    step_dir,
)
from pippy.checkpoint.storage import Location, storage_for

__all__ = ["StepWriter", "publish_step"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Staged:
    """A rank's storage plan: its files' prefix (as DCP's) and the folder to write."""

    prefix: str
    staging: Any


class StepWriter(ManifestWriter):
    """pippy's writer of one step: staged and published inside ``dcp.save``.

    In DCP's global planning (after the save planner's checks, before any
    rank writes), the coordinator checks that ``step-<step>`` is new and
    makes its staging folder; the plans DCP scatters carry that folder to
    every rank, which writes there. An incomplete ``step-<step>``, or one
    whose manifest names another step (a copy), is moved aside first. In
    ``finish``, after ``.metadata`` and ``manifest.json``, the coordinator
    publishes the step (:meth:`publish`). A refusal reaches every rank as
    DCP's ``CheckpointException``, which
    :func:`~pippy.checkpoint.errors.explain_failures` turns into the refusal
    itself.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing.
        step: The step being saved.
        keep_last: If set, keep only this many newest complete steps.
        **kwargs: Passed to :class:`~pippy.checkpoint.steps.ManifestWriter`
            (``thread_count``, ...).

    Attributes:
        final: ``<checkpoint_dir>/step-<step>``, what readers see.
        staging: The folder the coordinator made, on the coordinator once
            made; None elsewhere. On an object store (no rename), ``final``.

    Raises:
        CheckpointDirError: In ``dcp.save``: the step exists, or the folder
            is a file or cannot be written.
        CheckpointDirInUseError: In ``dcp.save``: this job lost the folder's
            lease to another job (:func:`~pippy.checkpoint.job.check_lease`).
    """

    def __init__(
        self,
        checkpoint_dir: Location,
        step: int,
        *,
        keep_last: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.final = step_dir(checkpoint_dir, step)
        super().__init__(self.final, step=step, **kwargs)
        self.checkpoint_dir, self.keep_last = checkpoint_dir, keep_last
        self.staging: Any = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as is: the coordinator alone looks at the folder, and makes it."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's plans, each carrying the staging folder made here."""
        storage = storage_for(self.checkpoint_dir)
        pattern = storage.join(self.checkpoint_dir, f".step-{self.step}.partial-*")
        try:
            self.staging = self._make_staging()
        except OSError as e:
            raise dir_error(f"cannot create {pattern}", e) from e
        return [
            dataclasses.replace(
                p, storage_data=_Staged(p.storage_data.prefix, self.staging)
            )
            for p in super().prepare_global_plan(plans)
        ]

    def _make_staging(self) -> Any:
        """On the coordinator: checks that the step is new, makes its staging folder."""
        storage, final = storage_for(self.checkpoint_dir), self.final
        check_lease(self.checkpoint_dir)  # a job that lost the folder writes nothing
        list_steps(self.checkpoint_dir)  # a file where the folder should be: say so
        if is_complete(final) and _holds_its_step(final):
            raise CheckpointDirError(
                f"{os.fspath(final)!r} already exists; checkpoints are never "
                "overwritten. Resume from it, or save into another checkpoint "
                "folder."
            )
        staging = storage.join(
            self.checkpoint_dir, f".step-{self.step}.partial-{uuid.uuid4().hex[:12]}"
        )
        if not storage.atomic_rename:
            staging = final
            if storage.exists(final):
                # Written in place and never committed (a save cut short): this
                # job owns the folder, and no reader takes an uncommitted step.
                storage.remove(final)
                logger.warning("removed %s: a save of it never committed", final)
        elif storage.exists(final):  # incomplete, or another step's: keep it aside
            aside = storage.join(
                self.checkpoint_dir, f".step-{self.step}.incomplete-{int(time.time())}"
            )
            storage.publish(final, aside)
            logger.warning(
                "moved %s aside to %s: it was incomplete or held another step",
                final,
                storage.name(aside),
            )
        storage.makedirs(staging)
        return staging

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """Writes this rank's items, as the manifest writer, into the staging folder."""
        self.path = self.fs.init_path(plan.storage_data.staging)
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Writes ``.metadata`` and ``manifest.json``, then publishes the step.

        First, on an object store, checks that this job still holds the
        folder's lease (:func:`~pippy.checkpoint.job.check_lease`): a job that
        stalled and lost the folder commits nothing there.
        """
        check_lease(self.checkpoint_dir)
        super().finish(metadata, results)
        self.publish()

    def publish(self) -> None:
        """On the coordinator: renames the staging folder to ``step-<N>``, then prunes.

        The rename is durable when this returns
        (:meth:`~pippy.checkpoint.storage.Storage.publish`); on an object
        store the step was committed by its manifest.

        Raises:
            CheckpointDirError: The rename or pruning failed.
            CheckpointDirInUseError: This job lost the folder's lease to
                another job; nothing is renamed or pruned.
        """
        storage = storage_for(self.final)
        name = storage.name(self.final)
        try:
            check_lease(self.checkpoint_dir)
            if self.staging != self.final:  # on a store: committed by its record
                storage.publish(self.staging, self.final)
            if self.keep_last is None:
                return
            removed = remove_old_steps(
                self.checkpoint_dir, self.keep_last, keep=self.final
            )
        except OSError as e:
            raise dir_error(f"cannot publish {name}", e) from e
        if removed:
            names = ", ".join(storage.name(p) for p in removed)
            logger.info("published %s, removed %s", name, names)

    def discard(self) -> None:
        """Removes a failed save's staging folder, where made, without a collective.

        A job that lost its lease removes nothing: on an object store the
        step is written in place, and the folder may be the new owner's.
        """
        if self.staging is not None and not lease_lost(self.checkpoint_dir):
            storage_for(self.staging).remove(self.staging)


@contextmanager
def publish_step(
    checkpoint_dir: Location,
    step: int,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    **writer_options: Any,
) -> Iterator[StepWriter]:
    """Gives every rank the writer of ``step-<step>``, which publishes it.

    Use it around ``dcp.save``, on every rank::

        with publish_step(checkpoint_dir, step) as writer:
            dcp.save(state_dict, storage_writer=writer)

    In DCP's planning the coordinator checks that the step is new and makes
    its staging folder, ``.step-<step>.partial-<token>``, where every rank
    writes; once every rank has written, the coordinator writes
    ``.metadata`` and ``manifest.json`` and, still inside ``dcp.save`` (the
    writer's ``finish``), renames the folder to ``step-<step>``, which is
    atomic on a POSIX file system, and only then removes steps beyond
    ``keep_last`` (:class:`StepWriter`). No collective runs but DCP's. A
    crash before that leaves only the hidden staging folder, which
    :func:`find_latest_step` never picks. An existing step folder is never
    written into. If the body raises, nothing is published and the
    coordinator removes the staging folder; DCP's ``CheckpointException``
    (a ``BaseException``) is raised as a ``CheckpointError`` with one line
    per failed rank.

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
        **writer_options: Passed to the :class:`StepWriter` (DCP's
            ``thread_count``, ...).

    Yields:
        The :class:`StepWriter` to pass to ``dcp.save`` as ``storage_writer``.

    Raises:
        CheckpointDirError: On every rank: ``step-<step>`` exists, or
            ``checkpoint_dir`` is a file or cannot be written.
        CheckpointDirInUseError: On every rank: this job lost the folder's
            lease to another job.
        CheckpointError: ``dcp.save`` in the body failed on some rank.
        CheckpointTimeout: Some rank had not written its items within
            ``timeout``: on every rank that had, naming those that had not;
            nothing is published. The group then holds a collective that
            timed out: end the job.
        ValueError: ``timeout`` is not a positive number.
    """
    action = f"saving step-{step}"
    stall.seconds(timeout)  # a bad timeout is refused before anything is made
    writer = StepWriter(checkpoint_dir, step, keep_last=keep_last, **writer_options)
    try:
        with stall.waiting(action, "write", timeout, process_group):
            with explain_failures(action):
                yield writer
    except BaseException:
        writer.discard()
        raise
