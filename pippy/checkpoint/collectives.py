"""pippy's collectives: its own gloo group, one outcome for all, a late rank named.

pippy's collectives run on a gloo group of its own (:func:`pippy_group`),
whatever backend the caller's group has; only its timeout is ever changed.
:func:`fail_together` and :func:`on_coordinator` give every rank one outcome
of a step that some rank runs alone.

:func:`waiting` watches a save or load from a thread of its own, past two
points: ``start`` and ``write`` or ``read``. Past :func:`log_every` seconds
each rank records its point and progress in the c10d store, and the lowest
rank waiting logs one WARNING naming the late ranks. With a ``timeout``, at
the deadline a waiting rank marks the operation aborted; every collective on
pippy's group waits at most ``timeout`` + :data:`ABORT_WAIT_S`, so every rank
raises one :class:`~pippy.checkpoint.errors.CheckpointTimeout` (a rank that
arrived within an interval of the deadline may still be named). pippy's group
is then unfit for more collectives: end the job. The caller's group (NCCL's
watchdog would stop the process) is never touched.

Private torch names (:mod:`~pippy.checkpoint.steps` lists them): the store
(``_get_default_store``) and a gloo backend's ``options._timeout``.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.distributed_c10d import _get_default_store

from pippy.checkpoint.errors import (
    CheckpointError,
    CheckpointTimeout,
    check_number,
    dir_error,
    failed_on,
    name_ranks,
    one_line,
    portable,
)

logger = logging.getLogger(__name__)

#: pippy's own gloo group of each caller's group, by id (the group kept with
#: it, so that its id is not reused while the entry lives).
_groups: dict[int, tuple[Any, Any]] = {}


def pippy_group(
    process_group: dist.ProcessGroup | None = None, timeout: float | None = None
) -> dist.ProcessGroup | None:
    """Pippy's own gloo group over the ranks of ``process_group``.

    Made on first use, by those ranks at once, then kept. Only its timeout is
    ever changed (a save's or load's ``timeout=``), never the caller's group's.

    Args:
        process_group: The caller's group; the default group if None.
        timeout: Seconds the making waits for every rank of the group; None:
            torch's default.

    Returns:
        The group (the same one on every later call), or None where
        torch.distributed is not initialized.
    """
    if not dist.is_initialized():
        return None
    group = process_group or dist.group.WORLD
    held = _groups.get(id(group))
    if held is not None and held[0] is group:
        return held[1]
    ours = _gloo_group(group, timedelta(seconds=timeout) if timeout else None)
    if timeout:  # its collectives' bound from now on: torch's default
        ours.set_timeout(default_pg_timeout)
    _groups[id(group)] = (group, ours)
    return ours


def _gloo_group(
    group: dist.ProcessGroup | None, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """A new gloo group over ``group``'s ranks (all: None), made by them alone."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)  # type: ignore[arg-type]
    # A subgroup is named by its ranks, so that the other ranks need not take part.
    subgroup = len(ranks) < dist.get_world_size()
    return dist.new_group(
        ranks, backend="gloo", timeout=timeout, use_local_synchronization=subgroup
    )


def made_group(
    process_group: dist.ProcessGroup | None = None,
) -> dist.ProcessGroup | None:
    """A new gloo group of pippy's own over ``process_group``'s ranks (all: None).

    :func:`pippy_group` gives it back for itself; forget it with
    :func:`drop_group`. None where torch.distributed is not initialized.
    """
    if not dist.is_initialized():
        return None
    ours = _gloo_group(process_group)
    _groups[id(ours)] = (ours, ours)
    return ours


@atexit.register
def _release_groups() -> None:
    """Destroys pippy's groups at exit, so that their gloo threads end in time."""
    held = {id(ours): ours for _, ours in _groups.values()}
    _groups.clear()
    if not dist.is_initialized():
        return
    for ours in held.values():
        with suppress(Exception):  # destroyed already, with the world
            dist.destroy_process_group(ours)


def drop_group(group: dist.ProcessGroup) -> None:
    """Forgets, then destroys, a group from :func:`made_group`."""
    _groups.pop(id(group), None)
    dist.destroy_process_group(group)


def global_rank(process_group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` of ``process_group`` (the default group: None)."""
    return dist.get_global_rank(process_group, rank) if process_group else rank


@contextmanager
def fail_together(
    action: str,
    process_group: dist.ProcessGroup | None = None,
    *,
    keep_own_error: bool = False,
) -> Iterator[None]:
    """Makes a step that each rank runs alone fail on every rank, or on none.

    Otherwise the other ranks would die in their next collective with an error
    that hides the cause. One ``all_gather_object`` (on :func:`pippy_group`):
    every rank of ``process_group`` must enter it.

    Args:
        action: What was attempted, for the message (``"loading step-20"``).
        process_group: The ranks that agree; the default group if None.
        keep_own_error: A rank whose body failed raises its own exception;
            only the others raise the ``CheckpointError``.

    Raises:
        CheckpointError: On every rank, if the body raised on some rank: one
            line per failed rank. Without a process group, the body's own.
        ValueError: This rank is not in ``process_group``.
    """
    if not dist.is_initialized():
        yield
        return
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"fail_together: rank {dist.get_rank()} is not in the process group"
        )
    error: str | None = None
    own: Exception | None = None
    try:
        yield
    except Exception as e:
        error, own = one_line(e).replace("\n", "\n    "), e
    errors: list[str | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(errors, error, group=pippy_group(process_group))
    failed = {
        global_rank(process_group, r): e for r, e in enumerate(errors) if e is not None
    }
    if own is not None and keep_own_error:
        raise own
    if failed:
        raise failed_on(action, failed)


def on_coordinator(
    action: str, fn: Callable[[], Any], process_group: dist.ProcessGroup | None
) -> Any:
    """Runs ``fn`` on rank 0 alone; every rank gets its result or raises its error."""
    rank0 = not dist.is_initialized() or dist.get_rank(process_group) == 0
    outcome: list[Any] = [None, None]  # error, result
    own: Exception | None = None
    if rank0:
        try:
            outcome[1] = fn()
        except CheckpointError as e:
            outcome[0] = own = e
        except OSError as e:
            outcome[0] = dir_error(action, e)
        except Exception as e:  # a bug: the same exception on every rank
            own, outcome[0] = e, portable(e, action)
    if dist.is_initialized():
        src = global_rank(process_group, 0)
        dist.broadcast_object_list(outcome, src=src, group=pippy_group(process_group))
    error = own if own is not None else outcome[0]
    if error is not None:  # this rank's own, else as rank 0 sent it
        raise error
    return outcome[1]


#: A timeout as torch's ``timeout=`` arguments take it, or seconds; None: off.
Timeout = timedelta | float | int | None

#: Environment variable: seconds between two lines about ranks not there yet.
LOG_ENV = "PIPPY_WAIT_LOG_SECONDS"
_DEFAULT_LOG_S = 30.0
#: Seconds a collective waits past the deadline: time to mark the abort.
ABORT_WAIT_S = 0.5
#: The longest ``timeout`` taken, in seconds (365 days).
MAX_TIMEOUT_S = 365 * 24 * 3600.0


def seconds(timeout: Timeout) -> float | None:
    """A ``timeout`` in seconds (None: None); ValueError unless in (0, 365 days]."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    value = check_number(  # far longer ones overflow a group's timeout
        value,
        "timeout must be a positive number of seconds or a timedelta, of at most "
        "365 days, not {!r}; None waits without a deadline",
        above=0,
        at_most=MAX_TIMEOUT_S,
        shown=timeout,
    )
    return float(value)


def log_every() -> float:
    """Seconds between lines on late ranks: ``PIPPY_WAIT_LOG_SECONDS`` (> 0), or 30."""
    text = os.environ.get(LOG_ENV)
    if text is None:
        return _DEFAULT_LOG_S
    message = f"{LOG_ENV}={{!r}}: set it to a positive number of seconds"
    return check_number(text, message, above=0, text=True)


class Waits:
    """One save or load on this rank (``action``: ``"saving step-20"``), watched."""

    def __init__(
        self, action: str, point: str, timeout: float | None, every: float, group: Any
    ) -> None:
        self.action, self.points = action, ("start", point)
        self.timeout, self.log_every = timeout, every
        self.group: dist.ProcessGroup = group
        self.rank, self.ranks = dist.get_rank(), dist.get_process_group_ranks(group)
        self.prefix = f"pippy/{group.group_name}/{action}"
        # Set by the caller's thread: points reached, since when, progress.
        self.reached, self.since = 1, time.monotonic()
        self.progress: tuple[int, int, int, int] | None = None
        self.mark: tuple[int, str] | None = None
        self._begun, self._posted, self._marked = self.since, False, False
        self._closed, self._changed = False, threading.Condition()
        # pippy's group's old bound; with a timeout, its collectives wait that
        # + 0.5 s (the caller's group is never touched)
        self.ours: dist.ProcessGroup | None = None
        self._timeout_before: timedelta | None = None
        self._thread = threading.Thread(target=self._watch, name="pippy-stall")
        self._thread.daemon = True
        self._thread.start()

    def bound(self) -> None:
        """Takes pippy's group (made now, watched, if new) and bounds its waits."""
        limit = None if self.timeout is None else self.timeout + ABORT_WAIT_S
        self.ours = ours = pippy_group(self.group, timeout=limit)
        if limit is not None and ours is not None:
            backend = ours._get_backend(torch.device("cpu"))
            self._timeout_before = backend.options._timeout
            ours.set_timeout(timedelta(seconds=limit))

    def arrive(self) -> None:
        """Notes arrival; CheckpointTimeout if another rank's deadline passed."""
        with self._changed:
            self.reached, self.since = 2, time.monotonic()
            self._changed.notify()
        if self.mark is not None and self.mark[0] == 2:  # cut DCP's next one short
            if self.ours is not None:
                self.ours.set_timeout(timedelta(seconds=ABORT_WAIT_S))
            raise CheckpointTimeout(self.mark[1])

    def close(self, failed: bool = False) -> CheckpointTimeout | None:
        """Ends the watch, restores the timeout; what a failed block raises, or None."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()
        if self.ours is not None and self._timeout_before is not None:
            self.ours.set_timeout(self._timeout_before)
        if not dist.is_initialized():  # the group was destroyed: no store to read
            return None
        try:
            if failed and self.timeout is not None:  # no deadline: nobody marks one
                self._read_mark()
            if self._posted:
                _get_default_store().delete_key(f"{self.prefix}/r{self.rank}")
        except dist.DistError:  # the store is gone (its launcher killed, say)
            if not failed:
                raise
            return None  # the block's own error says what happened
        if self._marked and not failed:  # the late rank came in time
            _get_default_store().delete_key(f"{self.prefix}/abort")
        return CheckpointTimeout(self.mark[1]) if failed and self.mark else None

    def _watch(self) -> None:
        """Wakes at each interval of the block and of each wait, until closed."""
        every = min(self.log_every, self.timeout or math.inf)
        next_post, point = self._begun + every, 0
        while True:
            with self._changed:
                if point != self.reached:  # a new point: its own intervals
                    point, since = self.reached, self.since
                    next_log = since + self.log_every
                    deadline = since + (self.timeout or math.inf)
                    if self._posted:  # talking already: record the arrival now
                        next_post = since
                wake = min(next_post, next_log, deadline)
                while not self._closed and point == self.reached:
                    left = wake - time.monotonic()
                    if left <= 0 or not self._changed.wait(left):
                        break
                if self._closed:
                    return
                if point != self.reached:
                    continue
                waiting = self.reached == 2 or self.progress is None  # not working
            now = time.monotonic()
            next_post = now + every
            log, decide = now >= next_log, now >= deadline
            if log:
                next_log += self.log_every * (1 + (now - next_log) // self.log_every)
            if decide:
                deadline = math.inf
            self._post()
            if not self._read_mark() and waiting and (log or decide):
                self._check(now - since, log, decide)

    def _state(self) -> str:
        """What this rank records: the points it reached, and how far it is."""
        if self.reached == 2:
            return "2|there"
        if self.progress is None:
            return "1|started"
        done, total, nbytes, total_bytes = self.progress
        verb = "wrote" if self.points[1] == "write" else "read"
        mb = f"{nbytes / 1e6:.1f} of {total_bytes / 1e6:.1f} MB"
        return f"1|{verb} {done} of {total} items, {mb}"

    def _post(self) -> None:
        """Records this rank's state in the store."""
        _get_default_store().set(f"{self.prefix}/r{self.rank}", self._state())
        self._posted = True

    def _read_mark(self) -> bool:
        """Whether the operation is marked aborted; keeps the mark."""
        key, store = f"{self.prefix}/abort", _get_default_store()
        if self.mark is None and store.check([key]):
            point, _, line = store.get(key).decode().partition("|")
            self.mark = (int(point), line)
        return self.mark is not None

    def _check(self, waited: float, log: bool, decide: bool) -> None:
        """Reads the others' states; logs the late ranks, or marks the abort."""
        keys, store = [f"{self.prefix}/r{r}" for r in self.ranks], _get_default_store()
        end = time.monotonic() + min(ABORT_WAIT_S, self.log_every) / 2
        while not store.check(keys) and time.monotonic() < end:
            time.sleep(0.05)  # a rank that just came records at its interval
        late, parts, there = [], [], []
        for rank, key in zip(self.ranks, keys, strict=True):
            state = store.get(key).decode() if store.check([key]) else ""
            reached, _, status = state.partition("|")
            if int(reached or 0) >= self.reached:
                there.append(rank)
                continue
            late.append(rank)
            parts.append(f"rank {rank}: {status or 'not started'}")
        if not late:
            return
        line, point = "; ".join(parts), self.points[self.reached - 1]
        skipped = "not started" in line  # maybe never: code that skips the call
        if decide:
            saving = self.action.startswith("saving")
            undone = "step is not published" if saving else "stage is not loaded"
            why = ", code that skips the call on them" if skipped else ""
            message = (
                f"{self.reached}|{self.action} timed out: {name_ranks(late)} did not "
                f"arrive at {point} within {self.timeout:g} s ({line}). The "
                f"{undone}; find what holds them (a slow disk, a hung process{why}),"
                " or raise the timeout"
            )
            mark = store.compare_set(f"{self.prefix}/abort", "", message)
            self._marked = mark.decode() == message
            self._read_mark()
        elif log and there and there[0] == self.rank:
            logger.warning(
                "%s: %s not at %s after %.0f s (%s); %s waiting%s",
                self.action,
                name_ranks(late),
                point,
                waited,
                line,
                name_ranks(there),
                " (every rank must make this call)" if skipped else "",
            )

    @contextmanager
    def counting(self, planner: Any, sizes: Mapping[Any, int]) -> Iterator[Any]:
        """``planner`` counting DCP's items; then :meth:`arrive`, even if it failed."""
        try:
            yield _Counting(planner, self, sizes)
        finally:
            self.arrive()


@contextmanager
def waiting(
    action: str, point: str, timeout: Timeout, process_group: dist.ProcessGroup | None
) -> Iterator[Waits | None]:
    """Watches the block (enter before any collective); raises a timeout as itself.

    Yields the :class:`Waits` that the block's storage writer or reader reports
    its progress and arrival to, or None where no other rank is waited for.
    """
    limit, every = seconds(timeout), log_every()
    group = process_group or dist.group.WORLD
    if group is None or dist.get_world_size(group) < 2:  # -1: not in it
        yield None  # no other rank to wait for
        return
    waits = Waits(action, point, limit, every, group)
    failed = True
    try:
        waits.bound()
        yield waits
        failed = False
    finally:
        timed_out = waits.close(failed)
        if timed_out is not None:  # what reached the block was a collective's end
            raise timed_out from None


class _Counting:
    """A DCP planner that records, as each item is handed over, how many came before."""

    def __init__(self, planner: Any, waits: Waits, sizes: Mapping[Any, int]) -> None:
        self._planner, self._waits, self._sizes = planner, waits, sizes
        self._total = sum(sizes.values())
        self._done, self._bytes = 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def _next(self, index: Any) -> None:
        """Records the items before this one as done, then counts this one."""
        self._waits.progress = (self._done, len(self._sizes), self._bytes, self._total)
        self._done += 1
        self._bytes += self._sizes.get(index, 0)

    def resolve_data(self, item: Any) -> Any:
        """The item to write (``SavePlanner.resolve_data``), counted."""
        self._next(item.index)
        return self._planner.resolve_data(item)

    def resolve_tensor(self, item: Any) -> Any:
        """The tensor to read into (``LoadPlanner.resolve_tensor``), counted."""
        self._next(item.storage_index)
        return self._planner.resolve_tensor(item)

    def load_bytes(self, item: Any, value: Any) -> None:
        """A non-tensor item read (``LoadPlanner.load_bytes``), counted."""
        self._next(item.storage_index)
        self._planner.load_bytes(item, value)
