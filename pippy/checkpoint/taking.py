"""The state to save, taken on each rank, and checked across ranks in DCP's planning.

:func:`take_state` is the first piece of the save sequence
(:mod:`~pippy.checkpoint.api`): each rank takes its state_dict and checks
its step (:func:`state_to_save`), and gets the :class:`CheckedSavePlanner`
to pass to ``dcp.save``. The checks across ranks run inside DCP's own
planning, with no collective of pippy's: each rank's local plan carries its
failure, if taking the state failed, or its key check's offer
(:func:`~pippy.checkpoint.checks.offer_keys`), and the coordinator
judges the offers before it plans a write. ``AsyncSaver`` takes the state at
the call and plans its save in the background (:func:`take_together`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, SavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.device_mesh import DeviceMesh

from pippy.checkpoint import stall
from pippy.checkpoint.checks import offer_keys, refuse_losses
from pippy.checkpoint.errors import own_error
from pippy.checkpoint.stall import Timeout
from pippy.checkpoint.state import StageState

__all__ = [
    "CheckedSavePlanner",
    "state_to_save",
    "step_of",
    "take_state",
    "take_together",
]


class CheckedSavePlanner(SavePlanner):
    """DCP's save planner, refusing in DCP's own planning what DCP would lose.

    Each rank's local plan carries its key check's offer
    (:func:`~pippy.checkpoint.checks.offer_keys`); the coordinator judges
    every rank's offer (:func:`~pippy.checkpoint.checks.refuse_losses`)
    before it plans the write, inside DCP's first gather. A rank whose state
    could not be taken still plans: it raises its ``failure`` there, so that
    no rank waits for it alone. Everything else is ``planner``'s. Pass it to
    ``dcp.save`` inside :func:`~pippy.checkpoint.publishing.publish_step`,
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
            :func:`~pippy.checkpoint.publishing.publish_step`'s, which takes
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
