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
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import SavePlanner
from torch.distributed.device_mesh import DeviceMesh

from pippy.checkpoint import stall
from pippy.checkpoint.checks import named_leaves
from pippy.checkpoint.coordinated import open_reader
from pippy.checkpoint.errors import explain_failures, fail_together
from pippy.checkpoint.load_planner import SafeLoadPlanner
from pippy.checkpoint.publishing import publish_step
from pippy.checkpoint.safe_load import SafeFileSystemReader, after_reads
from pippy.checkpoint.stall import Timeout
from pippy.checkpoint.state import (
    PIPPY,
    StageState,
    detect_layout,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.steps import step_dir
from pippy.checkpoint.storage import Location
from pippy.checkpoint.taking import take_state

# publish_step and take_state live in publishing and taking; they are listed
# here as pieces of the save sequence, for a script that composes its own.
__all__ = [
    "gc_paused",
    "load_into",
    "load_stage",
    "open_step",
    "publish_step",
    "read_any_layout",
    "read_into",
    "save_stage",
    "take_state",
]


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
    staging folder (:func:`~pippy.checkpoint.publishing.publish_step`), published
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
        CheckpointDirError: As :func:`~pippy.checkpoint.publishing.publish_step`.
        CheckpointError: ``dcp.save`` failed on some rank (one line per rank);
            nothing is published.
        CheckpointTimeout: As :func:`~pippy.checkpoint.publishing.publish_step`.
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
    its answer (:func:`~pippy.checkpoint.coordinated.open_reader`).

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
