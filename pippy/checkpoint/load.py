"""Which step to load, and the one load sequence, ``load_stage``, and its pieces.

Rank 0 alone answers every question about the checkpoint folder and
broadcasts its answer or its error: NFS attribute caching can make ranks
disagree on what a folder holds, and hundreds of ranks listing a bucket at
once get throttled into "no checkpoint". A load is ``dcp.load`` inside
:func:`load_into` (the step opened on rank 0 for pippy's reader, made with
the stage's state_dict to apply once this rank has read); :func:`open_step`
opens a step for a reader without a stage.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

from pippy.checkpoint import collectives
from pippy.checkpoint.checks import leaf_places, named_leaves
from pippy.checkpoint.collectives import (
    Timeout,
    fail_together,
    on_coordinator,
    pippy_group,
)
from pippy.checkpoint.errors import (
    CheckpointError,
    UnsafeCheckpointError,
    explain_failures,
)
from pippy.checkpoint.keys import (
    PIPPY,
    detect_layout,
    from_torchtitan,
    pippy_name,
    to_torchtitan,
)
from pippy.checkpoint.manifest import MANIFEST_FILE
from pippy.checkpoint.reader import (
    SafeFileSystemReader,
    opened_on_rank_0,
    verify_step,
)
from pippy.checkpoint.safe_load import SafeLoadPlanner
from pippy.checkpoint.save import gc_paused
from pippy.checkpoint.state import StageState, statefuls_taken, take_or_failure
from pippy.checkpoint.steps import (
    hidden_name,
    list_steps,
    newest_complete_step,
    refuse_step_folder,
    why_not_whole,
)
from pippy.checkpoint.storage import Location, storage_for

logger = logging.getLogger(__name__)


@gc_paused()
def open_step(
    path: Location,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    timeout: Timeout = None,
    extension_registry: ExtensionRegistry | None = None,
) -> tuple[SafeFileSystemReader, SafeLoadPlanner]:
    """The storage reader and load planner to pass to ``dcp.load`` for a step.

    Call it on every rank of ``process_group`` at once: rank 0 alone reads
    the step's ``.metadata`` and manifest, and the others take its answer. To
    load a stage, :func:`load_into` opens the step itself.

    Args:
        path: A ``step-<N>`` folder.
        must_read: Prefixes of the checkpoint's keys that some rank must read
            (see :class:`SafeLoadPlanner`); ``("model.",)`` for weights alone.
        trusted: True loads any pickle, as plain DCP does (only for a
            trusted checkpoint); None: if ``PIPPY_TRUST_CHECKPOINT`` is 1.
        verify: Check every item read against the step's ``manifest.json``;
            False loads a checkpoint without one (plain DCP's), unverified.
        process_group: The ranks that load; the default group if None.
        no_dist: This process opens it alone, as ``dcp.load``'s ``no_dist``.
        timeout: Seconds (or a ``timedelta``) the ranks wait for each other;
            None: no deadline. Late ranks are logged either way.
        extension_registry: DCP's registry of the stream extensions the step
            was written with (``publish_step``'s ``_extensions``); None: DCP's
            default (ZStandard).

    Returns:
        ``(storage_reader, planner)``. The reader reads this step alone (another
        ``checkpoint_id``: ``ValueError``) and, unless trusted, hands non-tensor
        items only to a :class:`SafeLoadPlanner`; the planner refuses, before
        any read, a ``dcp.load`` with another reader.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`, before anything is read, on every
            rank.
        CheckpointTimeout: Some rank was not there within ``timeout``, on
            every rank, naming it.
        ValueError: ``timeout`` is not a number of seconds in (0, 365 days].
    """
    waiting = collectives.waiting(f"opening {path}", "read", timeout, process_group)
    options = dict(
        trusted=trusted, verify=verify, extension_registry=extension_registry
    )
    with nullcontext() if no_dist else waiting:
        opened = opened_on_rank_0(path, process_group, no_dist, **options)
        reader = SafeFileSystemReader(path, **opened)
    planner = SafeLoadPlanner(
        trusted=reader.trusted, must_read=must_read, reads_from=reader.metadata
    )
    return reader, planner


def read_into(
    state_dict: dict[str, Any],
    reader: SafeFileSystemReader,
    planner: SafeLoadPlanner,
    **options: Any,
) -> None:
    """``dcp.load`` in place (``options``: its own), failures one line per rank."""
    with explain_failures(f"loading {reader.folder}"), warnings.catch_warnings():
        # Without a process group, one process reading alone is the intent.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state_dict, storage_reader=reader, planner=planner, **options)


@contextmanager
def load_into(
    state: Stateful | dict[str, Any],
    path: Location | StorageReader,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    timeout: Timeout = None,
    extension_registry: ExtensionRegistry | None = None,
) -> Iterator[tuple[dict[str, Any], StorageReader, SafeLoadPlanner | None]]:
    """Opens a step for ``dcp.load`` into the stage; if one rank fails, all do.

    Use it around ``dcp.load``, on every rank at once: rank 0 alone opens the
    step (as :func:`open_step`), then each rank takes its stage's state_dict
    (``state.state_dict()``, which creates the optimizer's empty state; DCP
    loads in place, into the stage's own tensors) and makes pippy's reader,
    which applies it once this rank has read its items: DCP's last collective
    carries the outcome. A step in torchtitan's layout is read under
    torchtitan's names where they find more of it. Given another storage
    reader instead of a path, it applies after ``dcp.load``, and an
    ``all_gather_object`` carries the outcome. Python's cyclic garbage
    collector is paused in the block.

    Note:
        When a load fails on some rank, every rank raises, but the ranks that
        read their items hold the step's tensors, applied, and a rank whose
        read failed those read before the failure: load another step, or build
        the stages anew, before training on.

    Args:
        state: The stage's :class:`StageState` (``StageState(module)`` without
            an optimizer loads the weights alone), any ``Stateful`` whose
            ``state_dict()`` holds the tensors to fill, or a nested state_dict,
            filled in place (its top-level ``Stateful`` objects loaded, as
            ``dcp.load`` does).
        path: A ``step-<N>`` folder; or the ``StorageReader`` that ``dcp.load``
            in the block reads with (the options below but ``process_group``
            and ``timeout`` then unused).
        must_read: As :func:`open_step`.
        trusted: As :func:`open_step`.
        verify: As :func:`open_step`.
        process_group: The ranks that load; the default group if None.
            ``dcp.load`` must run on the same ranks: pass it
            ``process_group=reader.process_group`` (pippy's gloo group over
            them, which ``timeout`` bounds).
        no_dist: As :func:`open_step`.
        timeout: Seconds (or a ``timedelta``) a rank waits for the others at
            the start of the load and, with pippy's reader, once it has read its
            items; None: no deadline. Late ranks are logged either way.
        extension_registry: As :func:`open_step`.

    Yields:
        ``(state_dict, storage_reader, planner)`` to pass to ``dcp.load``:
        pippy's reader and :class:`SafeLoadPlanner` (with a reader given: it,
        and None, DCP's default planner).

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError: As :func:`open_step`.
        CheckpointError: Opening the step, taking the state, ``dcp.load`` or
            applying failed on some rank (one line per rank), on every other
            rank; the rank where it failed raises its own error.
        CheckpointTimeout: Some rank was not there within ``timeout``, on every
            rank; nothing is applied. After one inside ``dcp.load``,
            ``reader.process_group`` is not fit for more collectives.
        ValueError: ``timeout`` is not a number of seconds in (0, 365 days];
            ``dcp.load`` in the block did not read with pippy's reader, or read
            another ``checkpoint_id``.
    """
    options = dict(
        trusted=trusted, verify=verify, extension_registry=extension_registry
    )
    opening = _loading(
        state, path, must_read, process_group, no_dist, timeout, **options
    )
    with opening as (_, state_dict, reader, planner):
        yield state_dict, reader, planner


@contextmanager
def _loading(
    state: Stateful | dict[str, Any],
    path: Location | StorageReader,
    must_read: tuple[str, ...],
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
    timeout: Timeout,
    **options: Any,
) -> Iterator[tuple[dict[str, Any], dict[str, Any], Any, Any]]:
    """:func:`load_into`'s block; it also yields the state_dict under pippy's names."""
    if not isinstance(state, dict):
        take, give = state.state_dict, state.load_state_dict
    else:  # taken and loaded as DCP does
        take, give = partial(statefuls_taken, state), partial(_load_plain, state)
    applied, torchtitan = False, False

    def apply(filled: dict[str, Any]) -> None:  # by pippy's reader, once it has read
        nonlocal applied
        applied = True
        if torchtitan:  # read under torchtitan's names: placed under pippy's
            places = {name: (p, key) for name, p, key in leaf_places(state_dict)}
            for name, value in from_torchtitan(filled).items():
                if name in places:
                    parent, key = places[name]
                    parent[key] = value
            filled = state_dict
        give(filled)

    action = f"loading {getattr(path, 'path', path)}"
    waiting = collectives.waiting(action, "read", timeout, process_group)
    with gc_paused(), nullcontext() if no_dist else waiting as waits:
        if isinstance(path, StorageReader):  # applied after its dcp.load
            state_dict, failure = take_or_failure(take)
            with explain_failures(action):
                yield state_dict, state_dict, path, None
            with fail_together(action, process_group):
                if failure is not None:  # its planning did not raise it
                    raise failure
                give(state_dict)
            return
        opened = opened_on_rank_0(path, process_group, no_dist, **options)
        state_dict, failure = take_or_failure(take)  # once the step is open
        group = waits.ours if waits else process_group
        opened.update(after_reads=apply, waits=waits, process_group=group)
        opened["failure"] = failure or opened["failure"]
        reader = SafeFileSystemReader(path, **opened)
        # by torchtitan's names where they find more of it than pippy's
        saved = reader.metadata.state_dict_metadata
        wanted = dict(named_leaves(state_dict))
        found, to_read = sum(k in saved for k in wanted), state_dict
        if detect_layout(saved) != PIPPY and found < len(wanted):
            with suppress(ValueError):  # a key with no torchtitan name: by name
                flat = to_torchtitan(wanted)
                if sum(k in saved for k in flat) > found:
                    to_read = flat
        if torchtitan := to_read is not state_dict:
            # torchtitan keeps an LR scheduler's initial_lr as a key of its own:
            # an optimizer without one may leave it unread (pippy: in scalars)
            must_read = tuple(
                k
                for k in saved
                if pippy_name(k).startswith(must_read)
                and not (
                    k.startswith("optimizer.param_groups.")
                    and k.endswith(".initial_lr")
                )
            )
        planner = SafeLoadPlanner(
            trusted=reader.trusted, must_read=must_read, reads_from=reader.metadata
        )
        with explain_failures(action):
            yield state_dict, to_read, reader, planner
        if not applied:
            raise ValueError(
                f"dcp.load in load_into's block did not read with its reader, so "
                f"{reader.folder} is not loaded, though the stage's tensors may hold "
                "what it read unchecked: pass it storage_reader=reader and load again"
            )


def _load_plain(state: dict[str, Any], filled: dict[str, Any]) -> None:
    """Loads a plain state_dict's top-level Statefuls, as DCP does; sets the rest."""
    for key, value in filled.items():
        if isinstance(held := state.get(key), Stateful):
            held.load_state_dict(value)
        else:
            state[key] = value


def load_stage(
    state: StageState | dict[str, Any],
    path: Location,
    *,
    must_read: tuple[str, ...] = ("",),
    trusted: bool | None = None,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    timeout: Timeout = None,
) -> dict[str, Any]:
    """Loads a step into this rank's stage, on every rank.

    Build the stage and its optimizer first (DCP loads in place). Each rank
    reads only the keys its stage owns; a step in torchtitan's layout is read
    under pippy's names. Python's cyclic garbage collector is paused meanwhile.

    Args:
        state: The stage's :class:`StageState`, or a nested state_dict, as
            :func:`load_into`'s.
        path: A ``step-<N>`` folder.
        must_read: As :func:`open_step`.
        trusted: As :func:`open_step`.
        verify: As :func:`open_step`.
        process_group: The ranks that load; the default group if None.
        no_dist: This process loads alone, with no collective (as
            ``dcp.load``'s ``no_dist``), whatever group it is a rank of.
        timeout: As :func:`load_into`.

    Returns:
        The state_dict as loaded (tensors are the stage's own).

    Raises:
        CheckpointNotFoundError: ``path`` is None or not a complete checkpoint.
        UnsafeCheckpointError: It holds a pickle that could run code.
        CheckpointError: It is damaged or does not match the stage (keys,
            shapes, dtypes, optimizer or param groups), or a ``Stateful``
            raised: on every rank, one line per rank that refused. Damage found
            in an item leaves the tensors read before it loaded.
        CheckpointTimeout: As :func:`load_into`.
    """
    options = dict(trusted=trusted, verify=verify)
    opening = _loading(
        state, path, must_read, process_group, no_dist, timeout, **options
    )
    with opening as (filled, state_dict, reader, planner):
        group = reader.process_group
        read_into(state_dict, reader, planner, process_group=group, no_dist=no_dist)
    return filled if isinstance(state, StageState) else state


def _newest_verified(
    checkpoint_dir: Location, process_group: dist.ProcessGroup | None
) -> Any:
    """The newest step that verifies, each rank reading its share of each.

    Rank 0 picks each step to verify and, at the end, moves the damaged ones
    passed over aside and logs each step passed over.
    """
    action = f"cannot check {os.fspath(checkpoint_dir)}"
    storage = storage_for(checkpoint_dir)
    share = (0, 1)
    if dist.is_initialized():
        share = (dist.get_rank(process_group), dist.get_world_size(process_group))
    passed: list[tuple[Any, str, bool]] = []  # on rank 0: (step, why, damaged)
    left: list[Any] | None = None  # on rank 0: the steps not looked at, oldest first

    def next_step() -> Any:  # on rank 0: the next step to verify, or None
        nonlocal left
        if left is None:
            refuse_step_folder(storage, checkpoint_dir)
            left = list(list_steps(storage, checkpoint_dir).values())
        while left:
            path = left.pop()
            if (why := why_not_whole(storage, path)) is not None:
                passed.append((path, why, False))
            elif storage.size(storage.join(path, MANIFEST_FILE)) is None:
                # a damaged one is verify_step's to name, as damage
                raise CheckpointError(
                    f"{os.fspath(path)} has no manifest.json, so it cannot be "
                    "verified: resume from it without verification, or move it aside"
                )
            else:
                return path
        return None

    found = None
    while (path := on_coordinator(action, next_step, process_group)) is not None:
        problem = None
        try:
            verify_step(path, storage=storage, share=share)
        except CheckpointError as e:  # unsafe: refused, not passed over
            problem = (isinstance(e, UnsafeCheckpointError), str(e))
        problems = [problem] * share[1]
        if share[1] > 1:
            dist.all_gather_object(problems, problem, group=pippy_group(process_group))
        failed = [p for p in problems if p is not None]
        if unsafe := [text for is_unsafe, text in failed if is_unsafe]:
            raise UnsafeCheckpointError(unsafe[0])
        if not failed:
            found = path
            break
        passed.append((path, failed[0][1], True))

    def finish() -> Any:  # on rank 0: the damaged steps moved aside once one verifies
        if found is None and any(damaged for *_, damaged in passed):
            reasons = "; ".join(f"{storage.name(p)}: {why}" for p, why, _ in passed)
            raise CheckpointError(
                f"no step of {os.fspath(checkpoint_dir)} verifies ({reasons}). "
                "Restore one, or move them all out of the folder to start afresh"
            )
        for step, why, damaged in passed:
            name = storage.name(step)
            if damaged:  # renamed, kept for a look
                aside = hidden_name(name, "damaged")
                storage.publish(step, storage.join(storage.parent(step), aside))
                why = f"moved aside to {aside}: {why}"
            logger.warning("skipped %s: %s", name, why)
        return found

    return on_coordinator(action, finish, process_group)


def find_latest_step(
    checkpoint_dir: Location,
    *,
    verified: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> Any:
    """Finds the newest complete step folder, to resume from; rank 0 answers for all.

    Incomplete folders (no ``.metadata``: a crash mid-save) and folders whose
    ``manifest.json`` names another step are never chosen; a warning names
    those newer than the one returned. A complete step damaged afterwards is
    returned, and loading it fails on every restart; ``verified=True`` goes
    past such steps instead: each is moved to ``.step-<N>.damaged-<time>``
    (kept for a look, never chosen nor saved over) and named, with why, in a
    warning on rank 0.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.
        verified: Verify complete steps from the newest down until one passes,
            every rank reading its share of each (see :func:`verify_step`); call
            it as the folder's owner (:class:`~pippy.checkpoint.job.FolderOwner`).
        process_group: The ranks, which call it at once; the default group if
            None. Without an initialized process group, this process answers
            alone.

    Returns:
        The newest complete ``step-<N>`` folder (a ``Path``, or a URL for a
        URL), or None if there is none.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder,
            cannot be listed, is or lies in a step folder, or is a URL whose
            storage client is missing; with ``verified``, a step cannot be
            moved.
        UnsafeCheckpointError: The manifest of a step it reaches is a link out
            of the step folder; with ``verified``, a step holds a pickle that
            would run code or such a link (nothing is passed over for it).
        CheckpointError: With ``verified``: no complete step verifies (nothing
            is moved), or one to verify has no manifest.
    """
    if verified:
        return _newest_verified(checkpoint_dir, process_group)

    def decide() -> Any:  # on rank 0
        storage = storage_for(checkpoint_dir)
        refuse_step_folder(storage, checkpoint_dir)  # a run's folder, not a step's
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
