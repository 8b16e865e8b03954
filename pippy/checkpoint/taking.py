"""Taking the state to save: on each rank alone, then checked across ranks.

:func:`take_state` is the first piece of the save sequence
(:mod:`~pippy.checkpoint.api`): each rank takes its state_dict and checks
its step (:func:`state_to_save`), then one gather tells every rank whether
that failed anywhere and brings the key check's offers, which are judged on
every rank (:func:`take_together`) before anything is written.
``AsyncSaver`` takes the state at the call and runs :func:`take_together`
on its copy in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pippy.checkpoint import stall
from pippy.checkpoint.collisions import offer_keys, refuse_losses
from pippy.checkpoint.errors import fail_together
from pippy.checkpoint.stage_state import StageState
from pippy.checkpoint.stall import Timeout

__all__ = ["state_to_save", "take_state", "take_together"]


def take_state(
    state: StageState | Mapping[str, Any],
    *,
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    timeout: Timeout = None,
) -> tuple[dict[str, Any], int]:
    """Takes the state to save and checks it, on every rank at once.

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict.
        step: The step saved; defaults to ``state.step`` for a
            :class:`StageState` and is required otherwise.
        process_group: The ranks that save; the default group if None.
        mesh: The ranks' ``DeviceMesh`` with a ``"pp"`` dim and data-parallel
            dims, for :func:`~pippy.checkpoint.collisions.check_keys`: stages
            replicated over data-parallel ranks are compared, not taken for
            collisions.
        timeout: Seconds (or a ``timedelta``) a rank waits for the others to
            start saving (:mod:`~pippy.checkpoint.stall`); None: no deadline.

    Returns:
        ``(state_dict, step)``: what to pass to ``dcp.save``, and its step.

    Raises:
        ValueError: No ``step`` for a plain state_dict, or the state's own
            ``step`` entry is another (on the rank that has it; the others
            raise ``CheckpointError``).
        CheckpointError: Taking the state failed on another rank.
        KeyCollisionError: As ``check_keys`` (also ``DivergedReplicasError``
            and ``NestedStateError``), on every rank.
        CheckpointTimeout: Some rank did not start within ``timeout``.
    """
    shown = step if step is not None else getattr(state, "step", "?")
    return take_together(
        lambda: state_to_save(state, step),
        action=f"saving step-{shown}",
        process_group=process_group,
        mesh=mesh,
        timeout=timeout,
    )


def take_together(
    take: Callable[[], tuple[dict[str, Any], int]],
    *,
    action: str,
    process_group: dist.ProcessGroup | None,
    mesh: DeviceMesh | None,
    timeout: Timeout,
) -> tuple[dict[str, Any], int]:
    """:func:`take_state` for a state taken by ``take``, on every rank at once.

    Each rank waits for the others (:func:`~pippy.checkpoint.stall.start`),
    then runs ``take``; one gather tells every rank whether it failed
    anywhere and brings the key check's offers
    (:func:`~pippy.checkpoint.collisions.offer_keys`), which are then judged.
    ``AsyncSaver`` calls it in the background on the copy it took.

    Raises:
        CheckpointError, KeyCollisionError, CheckpointTimeout: As
            :func:`take_state`; ``take``'s own exception on the rank where it
            failed.
    """
    stall.start(action, timeout=timeout, process_group=process_group)
    # Taking the state runs on each rank alone: a refusal on one rank (its
    # parts' LR schedulers differ) stops all, not only the one.
    with fail_together("saving", process_group, keep_own_error=True) as sent:
        state_dict, step = take()
        sent.value = offer_keys(state_dict, process_group=process_group, mesh=mesh)
    refuse_losses(sent.everyone, process_group=process_group)
    return state_dict, step


def state_to_save(
    state: StageState | Mapping[str, Any], step: int | None
) -> tuple[dict[str, Any], int]:
    """:func:`take_state`'s part that runs on each rank alone: the state and its step.

    Raises:
        ValueError: As :func:`take_state`, on this rank.
    """
    if isinstance(state, StageState):
        state_dict = state.state_dict()
        step = state.step if step is None else step
    elif step is None:
        raise ValueError("saving a plain state_dict needs its step")
    else:
        state_dict = dict(state)
    stored = state_dict.get("step")
    if isinstance(stored, int) and stored != step:
        raise ValueError(f"the state holds step {stored}; it cannot be step-{step}")
    return state_dict, step
