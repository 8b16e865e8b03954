"""Waiting for the other ranks of a save or load: who is late, how far, how long.

A rank slow or stuck in a save or load used to leave the others waiting
silently in a collective until gloo's or NCCL's own timeout (30 or 10 minutes
by default). A rank blocked in a collective cannot be interrupted, so before
the first collective of a save or load (``start``) and before DCP gathers
what each rank wrote or read (``write``, ``read``), every rank records its
arrival in the c10d store ``init_process_group`` made, and waits there:

* every :func:`log_every` seconds (30 by default, ``PIPPY_WAIT_LOG_SECONDS``)
  the first rank there logs one WARNING line naming the ranks that are not,
  with the items and bytes each has written or read (recorded as they go);
* with a ``timeout``, at the deadline the operation is marked aborted in the
  store and every rank there raises one
  :class:`~pippy.checkpoint.errors.CheckpointTimeout` naming the ranks that
  did not arrive; one that arrives later reads the mark and raises it too,
  instead of entering a collective nobody joins.

Inside ``dcp.save`` or ``dcp.load``, DCP catches any exception and still runs
its next collective, so a rank that times out there first sets its group's
timeout to :data:`ABORT_WAIT_S` (``ProcessGroup.set_timeout``); the group is
then not fit for more collectives: end the job (a launcher restarts it).

A normal save or load costs a few store round trips per point (``set``,
``add``, ``wait``, ``get``, ``delete_key`` of the point before the last; a
``compare_set`` and two more deletes on the last rank there), and a ``set``
at most every :data:`PROGRESS_EVERY_S` seconds while writing or reading; no
collective. A ``wait`` that times out (each log interval, on the rank that
logs) makes c10d print two warnings of its own (``waitForInput ... likely a
timeout``), as torch's own store-based barrier does.

Note:
    The store is ``torch.distributed.distributed_c10d._get_default_store``, a
    private name (torch exposes no public getter for the store
    ``init_process_group`` made); :mod:`~pippy.checkpoint.metadata` lists it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from pippy.checkpoint.errors import CheckpointTimeout

__all__ = [
    "ABORT_WAIT_S",
    "LOG_ENV",
    "PROGRESS_EVERY_S",
    "Timeout",
    "Waits",
    "active",
    "loading",
    "log_every",
    "seconds",
    "start",
    "suspended",
    "waiting",
]

logger = logging.getLogger(__name__)

#: A timeout as torch's ``timeout=`` arguments take it, or seconds; None: off.
Timeout = timedelta | float | int | None

#: Environment variable: seconds between two lines about ranks not there yet.
LOG_ENV = "PIPPY_WAIT_LOG_SECONDS"
_DEFAULT_LOG_S = 30.0
#: Seconds between two progress records of one rank in the store.
PROGRESS_EVERY_S = 0.1
#: Seconds a collective may wait once its operation timed out.
ABORT_WAIT_S = 1.0
_GO = "go"
# The longest single wait on the store (a rank waiting without a deadline).
_LONGEST_WAIT_S = 600.0
# The next point's number, per process group: ranks call points in one order.
_next_point: dict[str, int] = {}
# The operation whose writer or reader records progress and arrives, per
# thread. Not a ContextVar: asyncio copies the context into its tasks (fsspec
# runs them in a thread of its own), and a Waits there, holding a process
# group, freed in that thread at exit, aborts the process (torch 2.13).
_active = threading.local()


def seconds(timeout: Timeout) -> float | None:
    """A ``timeout`` argument in seconds, checked.

    Args:
        timeout: A ``datetime.timedelta``, a number of seconds, or None (off).

    Returns:
        The seconds, or None.

    Raises:
        ValueError: It is zero, negative or not a number.
    """
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"timeout must be a positive number of seconds or a timedelta, not "
            f"{timeout!r}; None waits without a deadline"
        )
    return float(value)


def log_every() -> float:
    """Seconds between two lines about late ranks: ``PIPPY_WAIT_LOG_SECONDS``, or 30.

    Raises:
        ValueError: The variable is set to something that is not a positive
            number.
    """
    text = os.environ.get(LOG_ENV)
    if text is None:
        return _DEFAULT_LOG_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{LOG_ENV}={text!r}: set it to a positive number of seconds")
    return value


def active() -> Waits | None:
    """The operation whose storage writer or reader records progress now, if any."""
    return getattr(_active, "waits", None)


@contextmanager
def suspended() -> Iterator[None]:
    """No writer or reader in the block reports or arrives (a write some ranks skip)."""
    before, _active.waits = active(), None
    try:
        yield
    finally:
        _active.waits = before


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``."""
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


class Waits:
    """One point of a save or load where every rank of a group waits for the others.

    Made on every rank of ``process_group`` in the same order (points are
    numbered per group); :meth:`record` says how far this rank is on its way
    to the point, :meth:`arrive` waits there for the others. Without a
    process group (one process) both do nothing.

    Args:
        action: What the ranks do, for the messages (``"saving step-20"``).
        point: What the ranks wait for each other to do (``"start"``,
            ``"write"``, ``"read"``).
        timeout: Seconds (or a ``timedelta``) a rank waits at the point
            before the operation is aborted; None waits without a deadline.
        process_group: The ranks; the default group if None.

    Raises:
        ValueError: ``timeout`` is not a positive number (:func:`seconds`),
            or ``PIPPY_WAIT_LOG_SECONDS`` is set but not one.
    """

    def __init__(
        self,
        action: str,
        point: str,
        *,
        timeout: Timeout = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.action, self.point = action, point
        self.timeout = seconds(timeout)
        self.log_every = log_every()
        self.timed_out: CheckpointTimeout | None = None
        self.enabled = (
            dist.is_initialized()
            and dist.get_rank(process_group) >= 0
            and dist.get_world_size(process_group) > 1
        )
        if not self.enabled:
            return
        group = process_group or dist.group.WORLD
        assert group is not None  # initialized
        self.group: dist.ProcessGroup = group
        self.rank = dist.get_rank()
        self.ranks = dist.get_process_group_ranks(self.group)
        name = self.group.group_name
        number = _next_point.get(name, 0)
        _next_point[name] = number + 1
        self.prefix = f"pippy/{name}/{number}"
        # Every rank at this point is past the one before the last.
        self._older = f"pippy/{name}/{number - 2}" if number >= 2 else None
        self._recorded = 0.0

    @property
    def store(self) -> dist.Store:
        """The default group's store, not held between calls (see the note below)."""
        return _get_default_store()

    def record(self, done: int, total: int, nbytes: int, total_bytes: int) -> None:
        """Records how far this rank is (items and bytes), at most every 0.1 s."""
        now = time.monotonic()
        if not self.enabled or now - self._recorded < PROGRESS_EVERY_S:
            return
        self._recorded = now
        verb = {"write": "wrote", "read": "read"}.get(self.point, "did")
        mb = f"{nbytes / 1e6:.1f} of {total_bytes / 1e6:.1f} MB"
        self.store.set(
            f"{self.prefix}/r{self.rank}", f"{verb} {done} of {total} items, {mb}"
        )

    def arrive(self) -> None:
        """Waits at the point until every rank is there, logging those that are not.

        The first rank to arrive logs, and at the deadline decides the
        outcome; the others wait on the store for it (and, should that rank
        be gone, decide themselves :data:`ABORT_WAIT_S` seconds later).

        Raises:
            CheckpointTimeout: ``timeout`` passed before every rank arrived, or
                this rank arrived after another one's timeout: the ranks that
                did not arrive, the action and the point, on every rank.
        """
        if not self.enabled:
            return
        start = time.monotonic()
        store, outcome = self.store, f"{self.prefix}/outcome"
        store.set(f"{self.prefix}/r{self.rank}", "there")
        arrived = store.add(f"{self.prefix}/count", 1)
        if arrived == len(self.ranks):
            store.compare_set(outcome, "", _GO)
        first = arrived == 1
        deadline = None
        if self.timeout is not None:
            deadline = start + self.timeout + (0.0 if first else ABORT_WAIT_S)
        next_log = start + self.log_every if first else math.inf
        while not self._wait_for(outcome, min(next_log, deadline or math.inf)):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                late, line = self._missing()
                if late:  # else the last one is about to say go
                    store.compare_set(outcome, "", self._timeout_message(late, line))
                deadline = None
            if now >= next_log:
                next_log += self.log_every
                self._log_missing(now - start)
        result = store.get(outcome).decode()
        if result != _GO:
            self.timed_out = CheckpointTimeout(result)
            raise self.timed_out
        self._forget_older(last=arrived == len(self.ranks))

    def _forget_older(self, *, last: bool) -> None:
        """Deletes the keys of the point before the last, which no rank reads again.

        Every rank is at this point, so every rank read the older point's
        outcome (and no rank still lists its arrivals); without this, a long
        job's store would grow by a key per rank and save.
        """
        if self._older is None:
            return
        self.store.delete_key(f"{self._older}/r{self.rank}")
        if last:
            self.store.delete_key(f"{self._older}/count")
            self.store.delete_key(f"{self._older}/outcome")

    def _wait_for(self, key: str, until: float) -> bool:
        """Whether ``key`` was set before ``until`` (a ``time.monotonic()``)."""
        # torch's own store-based barrier waits and logs this way, too.
        seconds = min(until - time.monotonic(), _LONGEST_WAIT_S)
        try:
            self.store.wait([key], timedelta(seconds=max(seconds, 0.001)))
        except dist.DistStoreError:  # the wait timed out; the store is fine
            return False
        return True

    def _missing(self) -> tuple[list[int], str]:
        """The ranks not at the point, and a line with how far each is."""
        late, parts = [], []
        for rank in self.ranks:
            key = f"{self.prefix}/r{rank}"
            status = _store_value(self.store, key)
            if status == "there":
                continue
            late.append(rank)
            parts.append(f"rank {rank}: {status or 'not started'}")
        return late, "; ".join(parts)

    def _log_missing(self, waited: float) -> None:
        """Logs the ranks not there yet, with how far each is."""
        late, line = self._missing()
        if not late:
            return
        there = [r for r in self.ranks if r not in late]
        logger.warning(
            "%s: %s not at %s after %.0f s (%s); %s waiting",
            self.action,
            _ranks(late),
            self.point,
            waited,
            line,
            _ranks(there),
        )

    def _timeout_message(self, late: list[int], line: str) -> str:
        """The one line every rank raises at the deadline."""
        saving = self.action.startswith("saving")
        undone = "The step is not published" if saving else "The stage is not loaded"
        return (
            f"{self.action} timed out: {_ranks(late)} did not arrive at {self.point} "
            f"within {self.timeout:g} s ({line}). {undone}; find what holds them "
            "(a slow disk, a hung process), or raise the timeout"
        )

    def counting(self, planner: Any, sizes: Mapping[Any, int]) -> Any:
        """``planner``, recording progress as DCP hands it each item."""
        return _Counting(planner, self, sizes)

    @contextmanager
    def inside_dcp(self) -> Iterator[None]:
        """Arrives once the body ends, even if it failed; a timeout cuts DCP short."""
        try:
            yield
        finally:
            try:
                self.arrive()
            except CheckpointTimeout:  # DCP's own collective comes next: cut it short
                if hasattr(self.group, "set_timeout"):  # public since torch 2.7
                    self.group.set_timeout(timedelta(seconds=ABORT_WAIT_S))
                raise


def _store_value(store: dist.Store, key: str) -> str | None:
    """The value of ``key`` in ``store``, or None if it is not set."""
    return store.get(key).decode() if store.check([key]) else None


def start(
    action: str, *, timeout: Timeout, process_group: dist.ProcessGroup | None
) -> None:
    """Waits for every rank to start ``action``, before its first collective.

    Raises:
        ValueError, CheckpointTimeout: As :class:`Waits` and :meth:`Waits.arrive`.
    """
    Waits(action, "start", timeout=timeout, process_group=process_group).arrive()


@contextmanager
def waiting(
    action: str, point: str, timeout: Timeout, process_group: dist.ProcessGroup | None
) -> Iterator[Waits]:
    """The operation pippy's writer or reader reports to and waits in, for a block.

    Enter it around ``dcp.save`` or ``dcp.load``. A :class:`CheckpointTimeout`
    at its point is raised as itself even when what reaches the block is the
    failure of DCP's next collective, which the timeout cut short.

    Args:
        action: As :class:`Waits`.
        point: ``"write"`` or ``"read"``.
        timeout: As :class:`Waits`.
        process_group: As :class:`Waits`; the group ``dcp.save`` or
            ``dcp.load`` runs on.
    """
    waits = Waits(action, point, timeout=timeout, process_group=process_group)
    before, _active.waits = active(), waits
    try:
        yield waits
    except BaseException:
        if waits.timed_out is not None:
            raise waits.timed_out from None
        raise
    finally:
        _active.waits = before


@contextmanager
def loading(
    action: str, timeout: Timeout, process_group: dist.ProcessGroup | None
) -> Iterator[Waits]:
    """Waits for every rank to start ``action``, then reports reads to it."""
    start(action, timeout=timeout, process_group=process_group)
    with waiting(action, "read", timeout, process_group) as waits:
        yield waits


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
        self._waits.record(self._done, len(self._sizes), self._bytes, self._total)
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
