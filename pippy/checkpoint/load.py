"""Which step to load, and the one load sequence, ``load_stage``, and its pieces.

Rank 0 alone answers every question about the checkpoint folder and
broadcasts its answer or its error: NFS attribute caching can make ranks
disagree on what a folder holds, and hundreds of ranks listing a bucket at
once get throttled into "no checkpoint". A load is :func:`open_step` (pippy's
reader and planner, the step opened on rank 0), then ``dcp.load`` inside
:func:`load_into` (the stage's state_dict to fill, applied once every rank
has read); :func:`read_any_layout` reads a step in torchtitan's layout too.
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
from pippy.checkpoint.reader import SafeFileSystemReader, open_reader, verify_step
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
    the step's ``.metadata`` and manifest, and the others take its answer.

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
        items only to a :class:`SafeLoadPlanner`.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`, before anything is read, on every
            rank.
        CheckpointTimeout: Some rank was not there within ``timeout``, on
            every rank, naming it.
        ValueError: ``timeout`` is not a number of seconds in (0, 365 days].
    """
    waiting = collectives.waiting(f"opening {path}", "read", timeout, process_group)
    with nullcontext() if no_dist else waiting:
        reader = open_reader(
            path,
            trusted=trusted,
            verify=verify,
            process_group=process_group,
            no_dist=no_dist,
            extension_registry=extension_registry,
        )
    return reader, SafeLoadPlanner(trusted=reader.trusted, must_read=must_read)


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


def read_any_layout(
    state_dict: dict[str, Any],
    reader: SafeFileSystemReader,
    planner: SafeLoadPlanner,
    **options: Any,
) -> None:
    """Fills a state_dict from a step in either layout, in place.

    By name, unless the step is in torchtitan's layout and pippy's names
    renamed to torchtitan's find more of it.
    """
    saved = reader.read_metadata().state_dict_metadata
    wanted = dict(named_leaves(state_dict))
    found, flat = sum(k in saved for k in wanted), None
    if detect_layout(saved) != PIPPY and found < len(wanted):
        with suppress(ValueError):  # a key with no torchtitan name: by name
            flat = to_torchtitan(wanted)
    if flat is None or sum(k in saved for k in flat) <= found:
        return read_into(state_dict, reader, planner, **options)
    # torchtitan keeps an LR scheduler's initial_lr as a key of its own: an
    # optimizer without one may leave it unread (pippy keeps it in scalars).
    planner.must_read = tuple(
        k
        for k in saved
        if pippy_name(k).startswith(planner.must_read)
        and not (k.startswith("optimizer.param_groups.") and k.endswith(".initial_lr"))
    )
    apply = reader.after_reads

    def convert(filled: dict[str, Any]) -> None:  # then apply, as load_into's would
        places = {name: (parent, key) for name, parent, key in leaf_places(state_dict)}
        for name, value in from_torchtitan(filled).items():
            if name in places:
                parent, key = places[name]
                parent[key] = value
        if apply is not None:
            apply(state_dict)

    reader.after_reads = convert
    read_into(flat, reader, planner, **options)


@contextmanager
def load_into(
    state: Stateful | dict[str, Any],
    reader: StorageReader,
    *,
    process_group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
) -> Iterator[dict[str, Any]]:
    """Gives the stage's state_dict to fill, then applies it; if one rank fails, all do.

    Use it around ``dcp.load``, on every rank: DCP loads in place, into the
    stage's own tensors (``state.state_dict()``, which creates the optimizer's
    empty state). With pippy's reader each rank applies inside ``dcp.load``
    once its reads are done, and DCP's last collective carries the outcome;
    with another reader it applies after ``dcp.load``, and an
    ``all_gather_object`` carries it. Python's cyclic garbage collector is
    paused in the block.

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
        reader: The storage reader ``dcp.load`` in the body reads with:
            pippy's, from :func:`open_step`, or another.
        process_group: The ranks that load; the default group if None.
            ``dcp.load`` must run on the same ranks: with pippy's reader, pass
            it ``process_group=reader.process_group`` (pippy's gloo group over
            them, which ``timeout`` bounds).
        timeout: Seconds (or a ``timedelta``) a rank waits for the others at
            the start of the load and, with pippy's reader, once it has read its
            items; None: no deadline. Late ranks are logged either way.

    Yields:
        The state_dict to pass to ``dcp.load``.

    Raises:
        CheckpointError: Taking the state, ``dcp.load`` or applying failed on
            some rank (one line per rank), on every other rank; the rank where
            it failed raises its own error.
        CheckpointTimeout: Some rank was not there within ``timeout``, on every
            rank; nothing is applied. After one inside ``dcp.load``,
            ``reader.process_group`` is not fit for more collectives.
        TypeError: ``reader`` is not a ``StorageReader`` (a path, say).
        ValueError: ``timeout`` is not a number of seconds in (0, 365 days];
            ``dcp.load`` in the body did not read with ``reader``, or read
            another ``checkpoint_id``.
    """
    if not isinstance(reader, StorageReader):
        raise TypeError(
            f"load_into takes the storage reader dcp.load reads with, not "
            f"{reader!r}: reader, planner = open_step(path), then "
            "load_into(state, reader)"
        )
    ours = reader if isinstance(reader, SafeFileSystemReader) else None
    action = f"loading {ours.folder if ours else getattr(reader, 'path', reader)}"
    with (
        gc_paused(),
        collectives.waiting(action, "read", timeout, process_group) as waits,
        _filled(state, reader, action, process_group, waits) as state_dict,
    ):
        yield state_dict


@contextmanager
def _filled(
    state: Stateful | dict[str, Any],
    reader: StorageReader,
    action: str,
    process_group: dist.ProcessGroup | None,
    waits: collectives.Waits | None,
) -> Iterator[dict[str, Any]]:
    """:func:`load_into`'s block, inside the watch ``waits``."""
    if not isinstance(state, dict):
        take, give = state.state_dict, state.load_state_dict
    else:  # taken and loaded as DCP does
        take, give = partial(statefuls_taken, state), partial(_load_plain, state)
    applied = False

    def apply(filled: dict[str, Any]) -> None:
        nonlocal applied
        applied = True
        give(filled)

    state_dict, failure = take_or_failure(take)
    ours = reader if isinstance(reader, SafeFileSystemReader) else None
    if ours:  # what its dcp.load needs of this block, for that load only
        ours.waits, ours.after_reads = waits, apply
        ours.process_group = waits.ours if waits else process_group
        ours.failure = failure or ours.failure  # or open_step's (another step)
    try:
        with explain_failures(action):
            yield state_dict
        if ours and ours.after_reads is not None:  # its read_data never ran
            raise ValueError(
                f"dcp.load in load_into's block did not read with its reader, "
                f"so {ours.folder} is not loaded: pass it storage_reader=reader"
            )
    finally:
        if ours:
            ours.waits = ours.after_reads = ours.failure = ours.process_group = None
    if not applied:  # not read by pippy's reader: its own all_gather
        with fail_together(action, process_group):
            if failure is not None:  # another reader's planning did not raise it
                raise failure
            give(state_dict)


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
    action, group = f"loading {path}", process_group
    waiting = collectives.waiting(action, "read", timeout, group)
    with gc_paused(), nullcontext() if no_dist else waiting as waits:
        # one watch over the open and the load
        reader = open_reader(
            path, trusted=trusted, verify=verify, process_group=group, no_dist=no_dist
        )
        planner = SafeLoadPlanner(trusted=reader.trusted, must_read=must_read)
        with _filled(state, reader, action, group, waits) as filled:
            ours = reader.process_group
            read_any_layout(
                filled, reader, planner, process_group=ours, no_dist=no_dist
            )
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
