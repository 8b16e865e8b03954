"""A job's guards: one writer per folder, no save after its launcher dies, a last save.

:class:`FolderOwner` (:mod:`~pippy.checkpoint.owner`) lets one job at a time
write a folder; a torchrun worker whose launcher died saves nothing
(:func:`check_launcher`) or ends at once (:func:`stop_with_launcher`);
:class:`StopSignal` turns a preemption signal on any rank into a last save by
every rank, within the launcher's grace period (:func:`launcher_deadline`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pippy.checkpoint.errors import CheckpointDirInUseError, name_ranks
from pippy.checkpoint.owner import FolderOwner

__all__ = ["FolderOwner", "StopSignal", "stop_with_launcher"]

logger = logging.getLogger(__name__)

#: Set to ``0`` to let a torchrun worker save on after its launcher is gone.
LAUNCHER_CHECK_ENV = "PIPPY_LAUNCHER_CHECK"

# This process's parent when it started (or was forked): under torchrun, its
# launcher. A worker re-parented since is an orphan.
_launcher = os.getppid()


def _forked() -> None:
    global _launcher
    _launcher = os.getppid()


os.register_at_fork(after_in_child=_forked)


def check_launcher() -> None:
    """Refuses a save by a torchrun worker whose launcher is gone.

    A ``torchrun`` killed with ``-9`` leaves its workers running, re-parented;
    they would publish steps beside the job restarted in their place. Every
    save calls this first, inside DCP's planning, so all ranks raise together.
    It compares the parent's pid with the one at start, in a worker that
    torchrun started (``TORCHELASTIC_RUN_ID`` set) unless
    ``PIPPY_LAUNCHER_CHECK=0``.

    Raises:
        CheckpointDirInUseError: This torchrun worker's launcher is gone.
    """
    off = os.environ.get(LAUNCHER_CHECK_ENV) == "0"
    if "TORCHELASTIC_RUN_ID" in os.environ and not off and os.getppid() != _launcher:
        raise CheckpointDirInUseError(
            f"this worker's launcher (pid {_launcher}) is gone, so a restarted "
            "job may write the checkpoint folder now: nothing is saved, end this "
            f"process ({LAUNCHER_CHECK_ENV}=0 saves anyway)"
        )


def stop_with_launcher(poll_seconds: float = 0.5) -> None:
    """Kills this process (``SIGKILL``) as soon as its launcher (its parent) is gone.

    Workers of a ``torchrun`` killed with ``-9`` are re-parented and would
    train on; a daemon thread compares the parent's pid with the one at the call.

    Args:
        poll_seconds: How often the parent is checked.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="pippy-launcher-watch", daemon=True).start()


class StopSignal:
    """Turns a stop signal (``SIGTERM`` by default) into a stop agreed by all ranks.

    Schedulers send ``SIGTERM`` (Slurm can send ``SIGUSR1`` earlier) some
    seconds before they preempt a job, and ``torchrun`` passes it on; it may
    reach some ranks only. The handler only notes it; :meth:`requested`,
    called by every rank once per step, has all ranks stop (and save) at the
    same step without holding up the loop: each call starts an asynchronous
    ``all_reduce`` of the ranks' signals on a gloo group of its own and reads
    the one the previous call started. At construction, rank 0 warns if
    ``torchrun``'s restarts would hang (:func:`check_restarts`).

    Attributes:
        received: The signal this rank received, or None.
        deadline: The launcher's grace period after a stop signal
            (:func:`launcher_deadline`, read at construction), or None.

    Args:
        signals: The signals to catch.
        deadline_seconds: The launcher's grace period, where the caller knows
            it (Slurm's ``KillWait``, Kubernetes'
            ``terminationGracePeriodSeconds``); None: torchrun's, from the
            environment (:func:`launcher_deadline`).

    Note:
        With an initialized process group, construct it on every rank at
        once: it creates a gloo process group (a collective). Otherwise the
        first call of :meth:`requested` does.
    """

    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
        deadline_seconds: float | None = None,
    ) -> None:
        self.received: signal.Signals | None = None
        self._received_by: dict[int, signal.Signals] = {}
        self.deadline = launcher_deadline(deadline_seconds)
        check_restarts()
        self._warned = False
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        for sig in signals:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: object) -> None:
        """The handler: notes the signal, nothing else."""
        self.received = signal.Signals(signum)

    def requested(self) -> bool:
        """Tells, on every rank alike, whether any rank has received a signal.

        Call it on every rank of the default group, once per step.

        Returns:
            True on every rank from the same call on: one call (two for a
            signal that arrives during a call) after the first signal.
            :attr:`received_by` and :attr:`reason` then say who got which.
        """
        if self._received_by:
            return True
        if not dist.is_initialized():
            self._received_by = {0: self.received} if self.received else {}
            return bool(self._received_by)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        if self._pending is not None:  # started one call ago, on every rank
            self._received_by = _gathered(self._pending)  # any: a stop, on every rank
        # Who has a signal by now (after a stop, read when received_by is: a
        # launcher's signal reaches its workers one after the other).
        numbers = torch.zeros(dist.get_world_size(), dtype=torch.long)
        numbers[dist.get_rank()] = int(self.received or 0)
        work = dist.all_reduce(numbers, group=self._group, async_op=True)
        self._pending = (work, numbers)
        return bool(self._received_by)

    @property
    def received_by(self) -> dict[int, signal.Signals]:
        """Once :meth:`requested` said yes: the signal of each rank with one by then."""
        if self._received_by and self._pending is not None:
            # Started by the call that said stop, on every rank.
            self._received_by = {**_gathered(self._pending), **self._received_by}
            self._pending = None
        return self._received_by

    @property
    def reason(self) -> str:
        """Who stopped the job: ``"SIGTERM received by rank 1"``; empty before."""
        ranks: dict[str, list[int]] = {}
        for rank, sig in sorted(self.received_by.items()):
            ranks.setdefault(sig.name, []).append(rank)
        return ", ".join(
            f"{name} received by {name_ranks(r)}" for name, r in ranks.items()
        )

    def check_save_time(self, seconds: float) -> None:
        """Warns once (rank 0) if a save took longer than the launcher's deadline.

        A last save on a stop signal (plus the rest of its step) that long
        would be cut short: the step lost, the job killed.

        Args:
            seconds: How long a save took, from its start to its publication.
        """
        deadline, rank = self.deadline, dist.get_rank() if dist.is_initialized() else 0
        if deadline is None or self._warned or seconds <= deadline.seconds or rank:
            return
        self._warned = True
        logger.warning(
            "a save took %.1f s, longer than the %g s the launcher waits after a "
            "stop signal before it kills the workers (%s): a last save on "
            "preemption would be cut short. Give the launcher a longer grace "
            "period (for torchrun, PET_SHUTDOWN_TIMEOUT in its environment), or "
            "save less",
            seconds,
            deadline.seconds,
            deadline.source,
        )


def _gathered(pending: tuple[dist.Work, torch.Tensor]) -> dict[int, signal.Signals]:
    """{rank: its signal} once a pending ``all_reduce`` of signal numbers ends."""
    work, numbers = pending
    work.wait()
    return {r: signal.Signals(n) for r, n in enumerate(numbers.tolist()) if n}


@dataclass(frozen=True)
class Deadline:
    """How long the launcher lets workers run after a stop signal.

    Attributes:
        seconds: From the signal it forwards to the ``SIGKILL`` it sends.
        source: Where the figure comes from: ``"the caller"``,
            ``"PET_SHUTDOWN_TIMEOUT"``, ``"TORCH_ELASTIC_SHUTDOWN_TIMEOUT"`` or
            ``"torchrun's default"``.
    """

    seconds: float
    source: str

    @property
    def explicit(self) -> bool:
        """Whoever launched the job set it (not torchrun's default)."""
        return self.source != _TORCHRUN_DEFAULT[1]


#: torchrun's grace period when none is set (torch.distributed.launcher.api).
_TORCHRUN_DEFAULT = (30.0, "torchrun's default")


def launcher_deadline(seconds: float | None = None) -> Deadline | None:
    """The launcher's grace period from a stop signal to its ``SIGKILL``.

    torchrun's ``--shutdown-timeout`` does not reach its workers; given as
    ``PET_SHUTDOWN_TIMEOUT`` in torchrun's environment (torchrun reads each
    flag from its ``PET_`` variable), it reaches both.

    Args:
        seconds: The grace period, where the caller knows it (any launcher);
            None: torchrun's, from the environment.

    Returns:
        The deadline; None where ``seconds`` is None outside torchrun.
    """
    if seconds is not None:
        return Deadline(float(seconds), "the caller")
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun sets it for workers
        return None
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        value = os.environ.get(name)  # torchrun's own order
        if value is not None:
            try:
                return Deadline(float(value), name)
            except ValueError:
                logger.warning("ignoring %s=%r: not a number of seconds", name, value)
    return Deadline(*_TORCHRUN_DEFAULT)


def check_restarts() -> bool:
    """Warns (rank 0) if ``torchrun``'s restarts would hang; whether it warned."""
    # torch 2.13: attempts share the launcher's store, no prefix per attempt.
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restarts in ("", "0") or not shared or os.environ.get("RANK", "0") != "0":
        return False
    logger.warning(
        "torchrun restarts these workers (max restarts %s) on its shared store, "
        "where restarted ranks can find the dead ones' addresses and hang "
        "(pytorch/pytorch#135712): start torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment",
        restarts,
    )
    return True
