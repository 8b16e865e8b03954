"""The one save sequence and the one load sequence, and the pieces they are made of.

Saving a stage, on every rank at once::

    state_dict, step, planner = take_state(state)  # checked in DCP's planning
    with publish_step(checkpoint_dir, step) as writer:  # published once complete
        dcp.save(state_dict, storage_writer=writer, planner=planner)

Loading, after building the stage (DCP loads in place)::

    with load_into(state, path) as state_dict:  # applied, or every rank raises
        reader, planner = open_step(path)  # checked on rank 0 before any read
        dcp.load(state_dict, storage_reader=reader, planner=planner)

:func:`save_stage` and :func:`load_stage` are these sequences; ``AsyncSaver``,
the command line and the reference example use the same pieces.

:func:`take_state` is the first piece of the save sequence: each rank takes
its state_dict and checks its step (:func:`state_to_save`), and gets the
:class:`CheckedSavePlanner` to pass to ``dcp.save``. The checks across ranks
run inside DCP's own planning, with no collective of pippy's: each rank's
local plan carries its failure, if taking the state failed, or its key
check's offer (:func:`~pippy.checkpoint.checks.offer_keys`), and the
coordinator judges the offers before it plans a write. ``AsyncSaver`` takes the state at
the call and plans its save in the background (:func:`take_together`).

:func:`publish_step` gives the second piece, the :class:`StepWriter`: ranks
write into a hidden staging folder, ``.step-<N>.partial-<token>``, that DCP's
coordinator makes in its global planning and renames to ``step-<N>`` in the
writer's ``finish``, once it has written ``.metadata`` and the manifest. On an
object store the step is written in place and its manifest, written last,
commits it (see :mod:`~pippy.checkpoint.steps`). A failed save is discarded:
nothing is published.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.futures import Future

from pippy.checkpoint import stall
from pippy.checkpoint.checks import named_leaves, offer_keys, refuse_losses
from pippy.checkpoint.errors import (
    CheckpointDirError,
    dir_error,
    explain_failures,
    fail_together,
    own_error,
)
from pippy.checkpoint.job import check_lease, lease_lost
from pippy.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    after_reads,
    open_reader,
)
from pippy.checkpoint.stall import Timeout
from pippy.checkpoint.state import (
    PIPPY,
    StageState,
    detect_layout,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.steps import (
    ManifestWriter,
    _holds_its_step,
    is_complete,
    list_steps,
    remove_old_steps,
    step_dir,
)
from pippy.checkpoint.storage import Location, storage_for

logger = logging.getLogger(__name__)


class CheckedSavePlanner(SavePlanner):
    """DCP's save planner, refusing in DCP's own planning what DCP would lose.

    Each rank's local plan carries its key check's offer
    (:func:`~pippy.checkpoint.checks.offer_keys`); the coordinator judges
    every rank's offer (:func:`~pippy.checkpoint.checks.refuse_losses`)
    before it plans the write, inside DCP's first gather. A rank whose state
    could not be taken still plans: it raises its ``failure`` there, so that
    no rank waits for it alone. Everything else is ``planner``'s. Pass it to
    ``dcp.save`` inside :func:`publish_step`,
    whose :func:`~pippy.checkpoint.errors.explain_failures` raises what it
    refused as one line.

    Args:
        planner: The planner that plans the save; ``DefaultSavePlanner`` if
            None.
        mesh: As :func:`take_state`.
        process_group: The ranks that save (``dcp.save``'s); the default
            group if None.
        failure: This rank's failure taking its state, raised by
            :meth:`create_local_plan`.

    Raises:
        KeyCollisionError, DivergedReplicasError, NestedStateError: From
            ``dcp.save``, as :func:`~pippy.checkpoint.checks.check_keys`,
            on every rank, before anything is written.
        CheckpointError: From ``dcp.save``: taking the state failed on some
            rank, naming it (that rank raises its own ``failure``).
    """

    def __init__(
        self,
        planner: SavePlanner | None = None,
        *,
        mesh: DeviceMesh | None = None,
        process_group: dist.ProcessGroup | None = None,
        failure: Exception | None = None,
    ) -> None:
        if getattr(planner, "_enable_plan_caching", False):
            raise ValueError(
                "DCP's plan caching (enable_plan_caching=True) cannot save "
                "pippy's steps: a cached plan names an earlier step's staging "
                "folder (and torch 2.13 compares cached plans without dtypes); "
                "pass a planner without it"
            )
        self.planner = planner or DefaultSavePlanner()
        self.mesh, self.process_group, self.failure = mesh, process_group, failure
        self._state_dict: dict[str, Any] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """As ``planner``'s; keeps the state_dict (nested) for the key check."""
        self._state_dict = state_dict
        self.planner.set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        """``planner``'s plan, carrying this rank's offer; raises its failure."""
        try:
            if self.failure is not None:
                raise self.failure
            offer = offer_keys(
                self._state_dict, process_group=self.process_group, mesh=self.mesh
            )
        except Exception as e:
            raise own_error(e) from e
        plan = self.planner.create_local_plan()
        return dataclasses.replace(plan, planner_data=(offer, plan.planner_data))

    def create_global_plan(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], Metadata]:
        """Judges every rank's offer, then ``planner``'s global plan."""
        refuse_losses(
            [p.planner_data[0] for p in all_plans], process_group=self.process_group
        )
        return self.planner.create_global_plan(
            [dataclasses.replace(p, planner_data=p.planner_data[1]) for p in all_plans]
        )

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """As ``planner``'s."""
        return self.planner.finish_plan(new_plan)

    def resolve_data(self, write_item: WriteItem) -> Any:
        """As ``planner``'s."""
        return self.planner.resolve_data(write_item)


def take_state(
    state: StageState | Mapping[str, Any],
    *,
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    planner: SavePlanner | None = None,
    timeout: Timeout = None,
) -> tuple[dict[str, Any], int, CheckedSavePlanner]:
    """Takes the state to save, and the planner that checks it across ranks.

    Call it on every rank at once; then, on every rank, even one whose state
    could not be taken, ``dcp.save`` with what it returns::

        state_dict, step, planner = take_state(state)
        with publish_step(checkpoint_dir, step) as writer:
            dcp.save(state_dict, storage_writer=writer, planner=planner)

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict.
        step: The step saved; defaults to ``state.step`` for a
            :class:`StageState` and is required otherwise.
        process_group: The ranks that save; the default group if None.
        mesh: The ranks' ``DeviceMesh`` with a ``"pp"`` dim and data-parallel
            dims, for :func:`~pippy.checkpoint.checks.check_keys`: stages
            replicated over data-parallel ranks are compared, not taken for
            collisions.
        planner: DCP's save planner, wrapped; ``DefaultSavePlanner`` if None.
        timeout: Checked here (``ValueError``); the save's waits are
            :func:`publish_step`'s, which takes
            the same ``timeout``.

    Returns:
        ``(state_dict, step, planner)``: what to pass to ``dcp.save`` (an
        empty state_dict where taking the state failed), its step, and the
        :class:`CheckedSavePlanner` that carries the checks.

    Raises:
        ValueError: No ``step`` for a plain state_dict, a ``timeout``
            that is not a positive number, or a ``planner`` with DCP's plan
            caching on, at once. The state's
            own ``step`` entry is another: from ``dcp.save``, on the rank
            that has it (the others raise ``CheckpointError`` naming it),
            at once without a process group.
        KeyCollisionError: From ``dcp.save``, as ``check_keys`` (also
            ``DivergedReplicasError`` and ``NestedStateError``), on every rank.
    """
    step = step_of(state, step)
    state_dict, checked = take_together(
        lambda: state_to_save(state, step)[0],
        action=f"saving step-{step}",
        process_group=process_group,
        mesh=mesh,
        planner=planner,
        timeout=timeout,
    )
    return state_dict, step, checked


def take_together(
    take: Callable[[], dict[str, Any]],
    *,
    action: str,
    process_group: dist.ProcessGroup | None,
    mesh: DeviceMesh | None,
    planner: SavePlanner | None = None,
    timeout: Timeout,
) -> tuple[dict[str, Any], CheckedSavePlanner]:
    """:func:`take_state` for a state_dict taken by ``take``, on every rank at once.

    Each rank runs ``take``; a failure there goes into the planner, which raises
    it inside ``dcp.save`` (at once without a process group). ``AsyncSaver``
    calls it in the background on the copy it took.

    Raises:
        ValueError: As :func:`take_state`; ``take``'s own exception
            without a process group.
    """
    stall.seconds(timeout)  # refused at once; the waits are the save's
    ranks: dict[str, Any] = {"process_group": process_group}
    try:
        state_dict = take()
    except Exception as e:
        if not dist.is_initialized():  # no rank waits for this one
            raise
        return {}, CheckedSavePlanner(planner, failure=e, **ranks)
    return state_dict, CheckedSavePlanner(planner, mesh=mesh, **ranks)


def step_of(state: StageState | Mapping[str, Any], step: int | None) -> int:
    """The step ``state`` is saved as: ``step``, else a :class:`StageState`'s own.

    Raises:
        ValueError: A plain state_dict without ``step`` (alike on every rank).
    """
    if step is None and isinstance(state, StageState):
        return state.step
    if step is None:
        raise ValueError("saving a plain state_dict needs its step")
    return step


def state_to_save(
    state: StageState | Mapping[str, Any], step: int | None
) -> tuple[dict[str, Any], int]:
    """:func:`take_state`'s part that runs on each rank alone: the state and its step.

    Raises:
        ValueError: As :func:`take_state`, on this rank.
    """
    step = step_of(state, step)
    state_dict = state.state_dict() if isinstance(state, StageState) else dict(state)
    stored = state_dict.get("step")
    if isinstance(stored, int) and stored != step:
        raise ValueError(f"the state holds step {stored}; it cannot be step-{step}")
    return state_dict, step


@dataclasses.dataclass(frozen=True)
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

    The :class:`StepWriter` stages the step and, once every rank has
    written, publishes it inside ``dcp.save`` (a rename, atomic on a POSIX
    file system), and only then removes steps beyond ``keep_last``. A crash
    before that leaves only the hidden staging folder, which
    :func:`~pippy.checkpoint.find_latest_step` never picks. If the body
    raises, nothing is published and the coordinator removes the staging
    folder; DCP's ``CheckpointException`` (a ``BaseException``) is raised as
    a ``CheckpointError`` with one line per failed rank.

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


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, if it was on.

    A save allocates many short-lived objects, which would otherwise set off
    a full collection of the whole process in some saves.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@gc_paused()
def save_stage(
    state: StageState | Mapping[str, Any],
    checkpoint_dir: Location,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    thread_count: int = 1,
    planner: SavePlanner | None = None,
    timeout: Timeout = None,
) -> Any:
    """Saves this rank's stage into ``<checkpoint_dir>/step-<step>``, on every rank.

    The save sequence: :func:`take_state`, then ``dcp.save`` into the step's
    staging folder (:func:`publish_step`), published
    once complete and durable. Call it on every rank of ``process_group`` at
    once. Python's cyclic garbage collector is paused meanwhile
    (:func:`gc_paused`).

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict.
        checkpoint_dir: The run's checkpoint folder; created if missing.
        step: As :func:`take_state`.
        keep_last: If set, keep only this many newest complete steps.
        process_group: The ranks that save; the default group if None.
        mesh: As :func:`take_state`. DCP writes each replicated item once,
            spread over the replicas.
        thread_count: Threads each rank writes its files with (DCP's
            ``FileSystemWriter``'s).
        planner: DCP's save planner, wrapped by :func:`take_state`'s; None
            uses ``DefaultSavePlanner``.
        timeout: Seconds (or a ``timedelta``) a rank waits for the others at
            the start of the save and once it has written its items; None
            (the default): no deadline. Late ranks are logged either way.

    Returns:
        The published step folder (a ``Path`` for a local folder).

    Raises:
        ValueError, KeyCollisionError: As :func:`take_state`; nothing is
            written (the checkpoint folder may be created).
        CheckpointDirError: As :func:`publish_step`.
        CheckpointError: ``dcp.save`` failed on some rank (one line per rank);
            nothing is published.
        CheckpointTimeout: As :func:`publish_step`.
    """
    ranks: dict[str, Any] = {"process_group": process_group, "timeout": timeout}
    state_dict, step, checked = take_state(
        state, step=step, mesh=mesh, planner=planner, **ranks
    )
    with publish_step(
        checkpoint_dir, step, keep_last=keep_last, thread_count=thread_count, **ranks
    ) as writer:
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=checked,
            process_group=process_group,
        )
    return step_dir(checkpoint_dir, step)


def open_step(
    path: Location,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> tuple[SafeFileSystemReader, SafeLoadPlanner]:
    """The storage reader and load planner to pass to ``dcp.load`` for a step.

    Call it on every rank of ``process_group`` at once: rank 0 alone looks
    at the step's folder, ``.metadata`` and manifest, and the others take
    its answer (:func:`~pippy.checkpoint.safe_load.open_reader`).

    Args:
        path: A ``step-<N>`` folder.
        must_read: Prefixes of the checkpoint's keys that some rank must read
            (see :class:`SafeLoadPlanner`); ``("model.",)`` for weights alone.
        trusted: See :class:`SafeFileSystemReader`.
        verify: Check every item read against the step's ``manifest.json``;
            False loads a checkpoint without one (plain DCP's), unverified.
        process_group: The ranks that load; the default group if None.
        no_dist: This process opens it alone, with no collective, as
            ``dcp.load``'s ``no_dist``.

    Returns:
        ``(storage_reader, planner)``.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`, before anything is read, on every
            rank.
    """
    reader = open_reader(
        path,
        trusted=trusted,
        verify=verify,
        process_group=process_group,
        no_dist=no_dist,
    )
    return reader, SafeLoadPlanner(trusted=reader.trusted, must_read=must_read)


def read_into(
    state_dict: dict[str, Any],
    reader: SafeFileSystemReader,
    planner: SafeLoadPlanner,
    *,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` in place, DCP's failures turned into one line per rank."""
    with explain_failures(f"loading {reader.folder}"), warnings.catch_warnings():
        # Without a process group, one process reading alone is the intent.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )


def _set_leaf(state_dict: dict[str, Any], key: str, value: Any) -> None:
    """Sets the leaf of a nested state_dict that DCP names ``key``."""
    for name, child in state_dict.items():
        if key == name:
            state_dict[name] = value
            return
        if isinstance(child, dict) and key.startswith(f"{name}."):
            return _set_leaf(child, key[len(name) + 1 :], value)
    raise KeyError(key)


def read_any_layout(
    state_dict: dict[str, Any],
    path: Location,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Fills a state_dict in pippy's names from a step in either layout, in place."""
    reader, planner = open_step(
        path,
        must_read=must_read,
        trusted=trusted,
        verify=verify,
        process_group=process_group,
    )
    saved = reader.read_metadata().state_dict_metadata
    if detect_layout(saved) == PIPPY:
        return read_into(state_dict, reader, planner, process_group=process_group)
    wanted = dict(named_leaves(state_dict))
    flat = to_torchtitan(wanted)
    # An LR scheduler's initial_lr, which torchtitan keeps as a key of its
    # own, may stay unread by an optimizer without one (as in pippy's layout,
    # where it is an entry of the parameter's scalars item).
    planner.must_read = tuple(
        k
        for k in saved
        if pippy_name(k).startswith(must_read)
        and not (k.startswith("optimizer.param_groups.") and k.endswith(".initial_lr"))
    )

    def convert(filled: dict[str, Any]) -> None:  # then apply, as load_into's would
        for key, value in from_torchtitan(filled).items():
            if key in wanted:
                _set_leaf(state_dict, key, value)
        if apply is not None:
            apply(state_dict)

    with after_reads(convert) as apply:
        read_into(flat, reader, planner, process_group=process_group)


@contextmanager
def load_into(
    state: StageState,
    path: Location,
    *,
    process_group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
) -> Iterator[dict[str, Any]]:
    """Gives the stage's state_dict to fill, then applies it; if one rank fails, all do.

    Use it around ``dcp.load``, on every rank. DCP loads in place, into
    tensors that must exist: ``state.state_dict()`` returns the stage's own
    tensors (and creates the optimizer's empty state). DCP's
    ``CheckpointException`` in the body is raised as one ``CheckpointError``
    line per failed rank. Applying (:meth:`StageState.load_state_dict`) runs
    on each rank alone; if it refuses on one, every rank raises its error,
    instead of the others training on into a dead peer. With pippy's reader
    (:func:`open_step`), each rank applies inside ``dcp.load`` once its
    reads are done (:func:`~pippy.checkpoint.safe_load.after_reads`), and
    DCP's own last collective carries the outcome; a rank whose read failed
    applies nothing. With another reader, it applies after ``dcp.load``, and
    an ``all_gather_object`` carries the outcome.

    Args:
        state: The stage's :class:`StageState`; ``StageState(module)``
            without an optimizer loads the weights alone.
        path: The step it is read from, for the messages.
        process_group: The ranks that load; the default group if None.
            ``dcp.load`` in the body must run on the same group.
        timeout: Seconds (or a ``timedelta``) a rank waits for the others at
            the start of the load and, reading with pippy's reader, once it
            has read its items (:mod:`~pippy.checkpoint.stall`); None: no
            deadline. Late ranks are logged either way, with their progress.

    Yields:
        The state_dict to pass to ``dcp.load``.

    Raises:
        CheckpointError: ``dcp.load`` failed on some rank, or applying
            refused on some rank (one line per rank), on every rank.
        CheckpointTimeout: Some rank was not there within ``timeout``, on
            every rank, naming it; nothing is applied. After one inside
            ``dcp.load`` the group is not fit for more collectives.
        ValueError: ``timeout`` is not a positive number.
    """
    applied = False

    def apply(filled: dict[str, Any]) -> None:
        nonlocal applied
        applied = True
        state.load_state_dict(filled)

    with stall.loading(f"loading {path}", timeout, process_group), after_reads(apply):
        state_dict = state.state_dict()
        with explain_failures(f"loading {path}"):
            yield state_dict
    if not applied:  # not read by pippy's reader: its own all_gather
        with fail_together(f"loading {path}", process_group):
            state.load_state_dict(state_dict)


def load_stage(
    state: StageState | dict[str, Any],
    path: Location,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
) -> dict[str, Any]:
    """Loads a step into this rank's stage, on every rank.

    The load sequence: build the stage and its optimizer first (DCP loads in
    place), then ``dcp.load`` through :func:`open_step`'s reader and planner
    inside :func:`load_into`. Each rank reads only the keys its stage owns.
    A step in torchtitan's layout is read under pippy's names.

    Args:
        state: The stage's :class:`StageState` (``StageState(module)``
            without an optimizer loads the weights alone), or a nested
            state_dict that is filled in place and not applied.
        path: A ``step-<N>`` folder.
        must_read: As :func:`open_step`.
        trusted: As :func:`open_step`.
        verify: As :func:`open_step`.
        process_group: The ranks that load; the default group if None.
        timeout: As :func:`load_into`; None (the default) waits without a
            deadline.

    Returns:
        The state_dict as loaded (tensors are the stage's own).

    Raises:
        CheckpointNotFoundError: ``path`` is not a complete checkpoint.
        UnsafeCheckpointError: It holds a pickle that could run code.
        CheckpointError: It is damaged or does not match the stage (keys,
            shapes, dtypes, optimizer or param groups): on every rank, one
            line per rank that refused. Damage found in an item leaves the
            tensors read before it loaded (see
            :meth:`~pippy.checkpoint.safe_load.SafeFileSystemReader.read_data`).
        CheckpointTimeout: As :func:`load_into`.
    """

    def read(state_dict: dict[str, Any]) -> dict[str, Any]:
        read_any_layout(
            state_dict,
            path,
            must_read=must_read,
            trusted=trusted,
            verify=verify,
            process_group=process_group,
        )
        return state_dict

    if not isinstance(state, StageState):  # a plain state_dict: filled, no more
        with stall.loading(f"loading {path}", timeout, process_group):
            return read(state)
    ranks: dict[str, Any] = {"process_group": process_group, "timeout": timeout}
    with load_into(state, path, **ranks) as state_dict:
        return read(state_dict)
