"""The one save sequence, ``save_stage``, and the DCP plug-ins it is made of.

Each rank takes its state (:func:`take_state`, whose :class:`CheckedSavePlanner`
checks it in DCP's own planning), then ``dcp.save`` writes it through
:class:`StepWriter`, which stages the step and publishes it whole
(:func:`publish_step`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Iterator, Mapping
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

from pippy.checkpoint import collectives
from pippy.checkpoint.checks import offer_keys, refuse_losses
from pippy.checkpoint.collectives import Timeout
from pippy.checkpoint.errors import (
    CheckpointDirError,
    CheckpointError,
    check_number,
    dir_error,
    explain_failures,
    name_ranks,
    own_error,
)
from pippy.checkpoint.job import check_launcher
from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.owner import FolderOwner, check_owner, refuse_unowned
from pippy.checkpoint.state import StageState, statefuls_taken, take_or_failure
from pippy.checkpoint.steps import (
    check_keep_last,
    check_step,
    hidden_name,
    refuse_step_folder,
    remove_old_steps,
    step_dir,
    step_names,
    why_not_whole,
)
from pippy.checkpoint.storage import Location, is_url, same_location, storage_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A local plan's data from :class:`CheckedSavePlanner`: its offer and step."""

    offer: Any
    step: int | None
    inner: Any  # the wrapped planner's own


class CheckedSavePlanner(SavePlanner):
    """DCP's save planner, refusing in DCP's own planning what DCP would lose.

    Each rank's local plan carries its step and its key check's offer
    (:func:`~pippy.checkpoint.checks.offer_keys`), or raises its ``failure``
    (taking the state failed) there, so that no rank waits for it alone; the
    coordinator judges them all (:func:`~pippy.checkpoint.checks.refuse_losses`)
    in DCP's first gather, before it plans the write. The rest is ``planner``'s
    (``DefaultSavePlanner`` if None). Made by :func:`take_state`, whose errors
    it raises.
    """

    def __init__(
        self,
        planner: SavePlanner | None = None,
        *,
        mesh: DeviceMesh | None = None,
        process_group: dist.ProcessGroup | None = None,
        step: int | None = None,
    ) -> None:
        if getattr(planner, "_enable_plan_caching", False):
            raise ValueError(
                "DCP's plan caching (enable_plan_caching=True) cannot save "
                "pippy's steps: a cached plan names an earlier step's staging "
                "folder (and torch 2.13 compares cached plans without dtypes); "
                "pass a planner without it"
            )
        self.planner = planner or DefaultSavePlanner()
        self.mesh, self.process_group, self.step = mesh, process_group, step
        self.failure: Exception | None = None  # set where taking the state failed
        self._state_dict: dict[str, Any] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """As ``planner``'s; keeps the state_dict for the key check."""
        self._state_dict = state_dict
        self.planner.set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        """``planner``'s plan, carrying this rank's offer; raises its failure."""
        try:
            if self.failure is not None:
                raise self.failure
            if self.step is not None:
                check_holds(self._state_dict, self.step)
            offer = offer_keys(
                self._state_dict, process_group=self.process_group, mesh=self.mesh
            )
        except Exception as e:
            raise own_error(e) from e
        plan = self.planner.create_local_plan()
        data = _Checked(offer, self.step, plan.planner_data)
        return dataclasses.replace(plan, planner_data=data)

    def create_global_plan(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], Metadata]:
        """Judges every rank's step and offer, then ``planner``'s global plan."""
        steps = [p.planner_data.step for p in all_plans]
        if len(set(steps)) > 1:  # counters that drifted apart: one folder for all
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            named = ", ".join(
                f"rank {r}: {s}" for r, s in zip(ranks, steps, strict=True)
            )
            raise ValueError(
                f"the ranks save different steps ({named}); every rank must save "
                "the same step: keep one step counter for the job"
            )
        refuse_losses(
            [p.planner_data.offer for p in all_plans], process_group=self.process_group
        )
        inner = [
            dataclasses.replace(p, planner_data=p.planner_data.inner) for p in all_plans
        ]
        return self.planner.create_global_plan(inner)

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
    could not be taken, ``dcp.save`` what it returns inside :func:`publish_step`.

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict.
        step: The step saved; defaults to ``state.step`` for a
            :class:`StageState` and is required otherwise.
        process_group: The ranks that save; the default group if None.
        mesh: The ranks' ``DeviceMesh`` with a ``"pp"`` dim and data-parallel
            dims: stages replicated over data-parallel ranks are compared,
            not taken for collisions.
        planner: DCP's save planner, wrapped; ``DefaultSavePlanner`` if None.
        timeout: Only checked here; the save's waits are :func:`publish_step`'s,
            which takes the same ``timeout``.

    Returns:
        ``(state_dict, step, planner)`` for ``dcp.save``; the state_dict is
        empty where taking the state failed.

    Raises:
        TypeError: ``state`` is neither a :class:`StageState` nor a mapping.
        ValueError: At once: no ``step`` for a plain state_dict, a ``timeout``
            not in (0, 365 days], or a ``planner`` with DCP's plan caching on.
            From ``dcp.save`` (at once without a process group): the state
            holds another step, on that rank; the others raise
            ``CheckpointError`` naming it.
        KeyCollisionError: From ``dcp.save``, on every rank (also
            ``DivergedReplicasError`` and ``NestedStateError``).
        CheckpointDirInUseError: From ``dcp.save`` (at once without a process
            group), nothing written: this torchrun worker's launcher is gone
            (:func:`~pippy.checkpoint.job.check_launcher`); the other ranks
            raise ``CheckpointError`` naming it.
    """
    step = step_of(state, step)
    collectives.seconds(timeout)  # refused at once; the waits are the save's
    checked = CheckedSavePlanner(
        planner, mesh=mesh, process_group=process_group, step=step
    )
    state_dict, checked.failure = take_or_failure(lambda: state_to_save(state, step))
    return state_dict, step, checked


def step_of(state: StageState | Mapping[str, Any], step: int | None) -> int:
    """The step ``state`` is saved as: ``step``, else a :class:`StageState`'s own."""
    if not isinstance(state, StageState | Mapping):
        raise TypeError(
            f"the state to save is a StageState or a state_dict (a dict), not a "
            f"{type(state).__name__}"
        )
    if step is None and isinstance(state, StageState):
        return state.step
    if step is None:
        raise ValueError("saving a plain state_dict needs its step")
    return check_step(step)


def state_to_save(state: StageState | Mapping[str, Any], step: int) -> dict[str, Any]:
    """The state taken, on this rank alone; raises if it holds another step."""
    check_launcher()
    if isinstance(state, StageState):
        state_dict = state.state_dict()
    else:  # its Statefuls taken here, not in dcp.save: a failure reaches every rank
        state_dict = statefuls_taken(state)
    check_holds(state_dict, step)
    return state_dict


def check_holds(state_dict: Mapping[str, Any], step: int) -> None:
    """ValueError if ``state_dict``'s own ``step`` entry is another step."""
    stored = state_dict.get("step")
    if isinstance(stored, int) and stored != step:
        raise ValueError(f"the state holds step {stored}; it cannot be step-{step}")


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A rank's storage plan: its files' prefix (as DCP's) and the folder to write."""

    prefix: str
    staging: Any


class StepWriter(ManifestWriter):
    """pippy's writer of one step: staged and published inside ``dcp.save``.

    In DCP's global planning (after the save planner's checks, before any
    rank writes) the coordinator checks that ``step-<step>`` is new and makes
    the staging folder ``.step-<step>.partial-<token>``, which DCP's plans
    carry to every rank; an incomplete ``step-<step>``, or one whose manifest
    names another step, is moved aside first. In ``finish``, after
    ``.metadata`` and ``manifest.json``, the coordinator publishes the step.
    On an object store the step is written in place and its manifest,
    written last, commits it. Made by :func:`publish_step`, whose arguments
    and errors it takes; ``ranks``, if given, is how many ranks were to save
    when the save was asked for: DCP's planning refuses any other number (a
    process group destroyed meanwhile would leave each rank saving alone).

    Attributes:
        final: ``<checkpoint_dir>/step-<step>``, what readers see.
        staging: The folder made, on the coordinator once made; None
            elsewhere. On an object store (no rename), ``final``.
        written: After the save, ``(tensors, bytes)`` this rank wrote (bytes
            with ``torch.save``'s framing): replicated items count on the one
            replica that wrote them.
        process_group: In :func:`publish_step`'s block, the group to pass
            ``dcp.save``: pippy's own gloo group over the saving ranks, whose
            collectives ``timeout`` bounds; None where no other rank saves.
    """

    def __init__(
        self,
        checkpoint_dir: Location,
        step: int,
        *,
        keep_last: int | None = None,
        ranks: int | None = None,
        owner: FolderOwner | None = None,
        **kwargs: Any,
    ) -> None:
        if "overwrite" in kwargs:  # DCP's option, which a new folder makes moot
            raise ValueError(
                f"overwrite={kwargs['overwrite']!r} cannot be honoured: a step is "
                "written into a folder of its own and never overwritten once "
                "published; save another step, or delete the old one first"
            )
        self.final, self.ranks = step_dir(checkpoint_dir, step), ranks
        super().__init__(storage_for(checkpoint_dir), self.final, step=step, **kwargs)
        self.checkpoint_dir, self.keep_last = checkpoint_dir, check_keep_last(keep_last)
        self.owner = check_owner(owner, checkpoint_dir)
        self.staging: Any = None
        self.waits: collectives.Waits | None = None  # in saving()
        self.process_group: dist.ProcessGroup | None = None  # pippy's, in saving()
        self.used = False  # by a dcp.save
        self.checked = False  # by a CheckedSavePlanner's plan

    def reset(self, checkpoint_id: Location | None = None) -> None:
        """As DCP's; ValueError for a ``checkpoint_id`` other than ``final``."""
        if checkpoint_id is not None and not same_location(checkpoint_id, self.final):
            raise ValueError(
                f"this writer saves {self.final}, not {checkpoint_id}: make one "
                "for that step, or leave dcp.save's checkpoint_id out"
            )
        super().reset()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan, naming the step's folder; refuses a planner of another step."""
        checked = plan.planner_data
        self.checked = isinstance(checked, _Checked)  # the keys checked across ranks
        if self.checked and checked.step not in (None, self.step):
            raise ValueError(
                f"the planner saves step {checked.step} and the writer step-"
                f"{self.step}: give both the same step"
            )
        self.used = True
        final = self.final  # as written: only the coordinator looks at the folder
        named = os.fspath(final) if is_url(final) else os.path.abspath(final)
        return dataclasses.replace(plan, storage_data=named)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's plans, each carrying the staging folder made here."""
        if len(plans) > 1 and not self.checked:
            raise ValueError(
                "several ranks save with a StepWriter, so they save with pippy's "
                "CheckedSavePlanner (DCP's own planner keeps one copy of a key two "
                "ranks offer, silently): pass dcp.save planner=CheckedSavePlanner(), "
                "or take_state's"
            )
        if self.ranks is not None and len(plans) != self.ranks:
            raise CheckpointError(
                f"step-{self.step} was to be saved by {self.ranks} ranks, but "
                f"{len(plans)} took part (the process group was destroyed while "
                "the save was in flight?): nothing is published. Wait for a "
                "save to finish (close the AsyncSaver) before ending the group"
            )
        by_name: dict[str, list[int]] = {}  # <folder>/step-<N>: alike on any mount
        for rank, plan in enumerate(plans):
            name = "/".join(plan.storage_data.rstrip("/").rsplit("/", 2)[-2:])
            by_name.setdefault(name, []).append(rank)
        places = (self.storage.same_place(p.storage_data) for p in plans)
        if len(by_name) > 1 and len(set(places)) > 1:  # not one folder, linked
            saved = "; ".join(f"{name_ranks(r)}: {n!r}" for n, r in by_name.items())
            raise CheckpointDirError(
                f"the ranks save into different step folders ({saved}): every "
                "rank must pass the same checkpoint folder and step"
            )
        try:
            self.staging = self._make_staging()
        except CheckpointDirError:  # its own reason, said whole
            raise
        except OSError as e:
            where = self.storage.join(
                self.checkpoint_dir, f".step-{self.step}.partial-*"
            )
            raise dir_error(f"cannot create {where}", e) from e
        plans = [dataclasses.replace(p, storage_data=None) for p in plans]
        return [
            dataclasses.replace(
                p, storage_data=_Staged(p.storage_data.prefix, self.staging)
            )
            for p in super().prepare_global_plan(plans)
        ]

    def _make_staging(self) -> Any:
        """On the coordinator: checks that the step is new, makes its staging folder."""
        storage, final = self.storage, self.final
        if self.owner is None:
            refuse_unowned(storage, self.checkpoint_dir)  # another job's, or forgotten
        self._check_owner()  # a job that lost the folder writes nothing
        refuse_step_folder(storage, self.checkpoint_dir)  # a step holds no steps
        step_names(storage, self.checkpoint_dir)  # a file, a step-08: say so
        if why_not_whole(storage, final) is None:
            raise CheckpointDirError(
                f"{os.fspath(final)!r} already exists; checkpoints are never "
                "overwritten. Resume from it, or save into another checkpoint "
                "folder. (A step is named by the state's step: does this run "
                "advance StageState.step with each optimizer step?)"
            )
        staging = storage.join(
            self.checkpoint_dir, hidden_name(storage.name(final), "partial")
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
                self.checkpoint_dir, hidden_name(storage.name(final), "incomplete")
            )
            storage.publish(final, aside)
            logger.warning(
                "moved %s aside to %s: it was incomplete or held another step",
                final,
                storage.name(aside),
            )
        storage.makedirs(staging, staged=staging != final)
        return staging

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> Future[list[WriteResult]]:
        """Writes this rank's items, as the manifest writer, into the staging folder."""
        self.path = self.fs.init_path(plan.storage_data.staging)
        if self.waits is None:
            return super().write_data(plan, planner)
        sizes = {i.index: i.tensor_storage_size() or 0 for i in plan.items}
        with self.waits.counting(planner, sizes) as counted:  # progress, then arrival
            return super().write_data(plan, counted)

    def before_commit(self) -> None:
        """The lease checked again: on a store the manifest commits the step."""
        self._check_owner()

    def _check_owner(self) -> None:
        """Raises unless the owner given (if any) still holds the folder."""
        if self.owner is not None:
            self.owner.check()

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Writes ``.metadata`` and the manifest, then publishes, if the lease holds."""
        self._check_owner()
        super().finish(metadata, results)
        self.publish()

    def publish(self) -> None:
        """On the coordinator: renames staging to ``step-<N>``, durably; then prunes."""
        try:
            self._check_owner()
            if self.staging != self.final:  # on a store: committed by its record
                self.storage.publish(self.staging, self.final)
        except OSError as e:
            theirs = self.staging != self.final and self.storage.exists(self.staging)
            if theirs and self.storage.exists(self.final):  # not renamed: another's
                raise CheckpointDirError(
                    f"{os.fspath(self.final)!r} was published by another save while "
                    "this one wrote (a second process group or job saving into this "
                    "folder?): this save is discarded. Give each its own folder"
                ) from e
            raise dir_error(f"cannot publish {self.storage.name(self.final)}", e) from e
        if self.keep_last is None:
            return
        try:  # it logs what it removes; the step is saved whatever happens here
            remove_old_steps(
                self.storage, self.checkpoint_dir, self.keep_last, keep=self.final
            )
        except OSError as e:
            logger.warning(
                "saved %s, but could not remove the steps beyond keep_last=%d: %s",
                self.final,
                self.keep_last,
                e,
            )

    @contextmanager
    def saving(
        self, action: str, timeout: Timeout, process_group: dist.ProcessGroup | None
    ) -> Iterator[None]:
        """Watches the block (``dcp.save``) for stalls, its failures as one error.

        If it fails, the staging folder is removed, unless this job lost the lease.
        """
        try:
            with collectives.waiting(
                action, "write", timeout, process_group
            ) as self.waits:
                self.process_group = self.waits.ours if self.waits else process_group
                with explain_failures(action):
                    yield
        except BaseException:
            lost = self.owner is not None and self.owner.lost
            if self.staging is not None and not lost:
                self.storage.remove(self.staging)
            raise
        finally:
            self.waits = None


@contextmanager
def publish_step(
    checkpoint_dir: Location,
    step: int,
    *,
    keep_last: int | None = None,
    owner: FolderOwner | None = None,
    process_group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    **writer_options: Any,
) -> Iterator[StepWriter]:
    """Gives every rank the writer of ``step-<step>``, which publishes it.

    Use it around ``dcp.save``, on every rank. The :class:`StepWriter`
    publishes the step inside ``dcp.save`` once every rank has written (a
    rename, atomic and durable on a POSIX file system), then removes steps
    beyond ``keep_last``. A crash before that leaves only a hidden staging
    folder, which :func:`~pippy.checkpoint.find_latest_step` never picks; if
    the body raises, nothing is published and the coordinator removes it.
    Every rank must reach ``dcp.save``: one that raises before it leaves the
    others waiting in DCP's first collective until ``timeout`` (a
    ``CheckpointTimeout`` naming it) or the process group's own timeout.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing. On
            several nodes it must be storage that every node sees.
        step: The step being saved.
        keep_last: If set, keep only this many newest complete steps.
        owner: The folder's :class:`~pippy.checkpoint.job.FolderOwner`, if
            this job holds one: the coordinator checks that it still does
            before it makes the staging folder, the manifest and the
            publishing. Without one, a folder that holds an owner record is
            refused.
        process_group: The ranks that save; the default group if None.
            ``dcp.save`` in the body must run on them: pass it
            ``process_group=writer.process_group`` (pippy's gloo group over
            them, which ``timeout`` bounds; the caller's is never touched).
        timeout: Seconds (or a ``timedelta``) a rank that has written its
            items waits for the others before the save is abandoned; None
            waits without a deadline. Ranks not done are logged with what
            they wrote, every :func:`~pippy.checkpoint.collectives.log_every`
            seconds.
        **writer_options: Passed to the :class:`StepWriter` (DCP's
            ``thread_count``, ...).

    Yields:
        The :class:`StepWriter` to pass to ``dcp.save`` as ``storage_writer``.

    Raises:
        CheckpointDirError: On every rank: ``step-<step>`` exists,
            ``checkpoint_dir`` is a file or cannot be written, the ranks pass
            folders of different names, or another save published the step
            meanwhile.
        CheckpointDirInUseError: On every rank: this job lost the folder, or
            no ``owner`` was given for a folder that holds an owner record.
        CheckpointError: ``dcp.save`` failed on some rank (a line per rank).
        CheckpointTimeout: Some rank had not written its items within
            ``timeout``: on the others, naming it; nothing is published, and
            the group holds a collective that timed out: end the job.
        ValueError: ``timeout`` is not a number of seconds in (0, 365 days];
            ``owner`` holds another folder; ``overwrite`` is among
            ``writer_options``; ``dcp.save`` in the body saved with another
            writer, or another ``checkpoint_id``.
    """
    collectives.seconds(timeout)  # a bad timeout is refused before anything is made
    writer = StepWriter(
        checkpoint_dir, step, keep_last=keep_last, owner=owner, **writer_options
    )
    with writer.saving(f"saving step-{step}", timeout, process_group):
        yield writer
        if not writer.used:
            raise ValueError(
                f"dcp.save in publish_step's block did not save with its writer, "
                f"so {writer.final} is not saved: pass it storage_writer=writer"
            )


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off for the block: a save's many objects would trigger it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@gc_paused()
def save_stage(
    state: StageState | Mapping[str, Any],
    checkpoint_dir: Location,
    *,
    step: int | None = None,
    keep_last: int | None = None,
    owner: FolderOwner | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    thread_count: int = 1,
    planner: SavePlanner | None = None,
    timeout: Timeout = None,
) -> Any:
    """Saves this rank's stage into ``<checkpoint_dir>/step-<step>``, on every rank.

    :func:`take_state`, then ``dcp.save`` inside :func:`publish_step`: the
    step is published once complete and durable. Call it on every rank of
    ``process_group`` at once. Python's cyclic garbage collector is paused
    meanwhile.

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict.
        checkpoint_dir: The run's checkpoint folder; created if missing.
        step: As :func:`take_state`.
        keep_last: If set, keep only this many newest complete steps.
        owner: As :func:`publish_step`.
        process_group: The ranks that save; the default group if None.
        mesh: As :func:`take_state`. DCP writes each replicated item once,
            spread over the replicas.
        thread_count: Threads each rank writes its files with (DCP's).
        planner: As :func:`take_state`.
        timeout: Seconds (or a ``timedelta``) a rank waits for the others at
            the start of the save and once it has written its items; None
            (the default): no deadline. Late ranks are logged either way.

    Returns:
        The published step folder (a ``Path`` for a local folder).

    Raises:
        TypeError, ValueError, KeyCollisionError: As :func:`take_state`, and
            a ``thread_count`` under 1; nothing is written (the checkpoint
            folder may be created).
        CheckpointDirError, CheckpointTimeout: As :func:`publish_step`.
        CheckpointDirInUseError: As :func:`take_state` and :func:`publish_step`.
        CheckpointError: ``dcp.save`` failed on some rank (one line per rank);
            nothing is published.
    """
    message = "thread_count must be a whole number >= 1, not {!r}"
    check_number(thread_count, message, whole=True, at_least=1)
    ranks: dict[str, Any] = {"process_group": process_group, "timeout": timeout}
    state_dict, step, checked = take_state(
        state, step=step, mesh=mesh, planner=planner, **ranks
    )
    with publish_step(
        checkpoint_dir,
        step,
        keep_last=keep_last,
        owner=owner,
        thread_count=thread_count,
        **ranks,
    ) as writer:
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=checked,
            process_group=writer.process_group,
        )
    return step_dir(checkpoint_dir, step)
