"""What a job can know of its launcher's deadline after a stop signal.

A launcher that stops a job sends a signal, waits a grace period, then kills
what still runs: ``torchrun`` for ``--shutdown-timeout`` seconds after it
forwards a ``SIGTERM``, Slurm for ``KillWait``, Kubernetes for
``terminationGracePeriodSeconds``. A last save that takes longer is cut
short. :func:`launcher_deadline` finds ``torchrun``'s figure (its flag does
not reach the workers' environment); the other two are invisible to the job.
:func:`check_restarts` warns of ``torchrun`` restarts that cannot work.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

__all__ = ["Deadline", "check_restarts", "launcher_deadline"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deadline:
    """How long the launcher lets workers run after a stop signal.

    Attributes:
        seconds: From the signal it forwards to the ``SIGKILL`` it sends.
        source: Where the figure comes from: ``"torchrun --shutdown-timeout"``,
            ``"TORCH_ELASTIC_SHUTDOWN_TIMEOUT"``, ``"PET_SHUTDOWN_TIMEOUT"`` or
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


def launcher_deadline() -> Deadline | None:
    """The seconds ``torchrun`` gives its workers between a stop signal and SIGKILL.

    On ``SIGTERM`` (or another signal it handles), ``torchrun`` forwards the
    signal to its workers and kills those still running after its shutdown
    timeout: ``--shutdown-timeout``, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``,
    else 30 s. The flag does not reach the workers' environment, so it is
    read from the launcher's command line (this process's parent, in
    ``/proc``); ``PET_SHUTDOWN_TIMEOUT`` is the flag's environment form.

    Returns:
        The deadline and where it was read, or None outside ``torchrun``.

    Note:
        Other launchers' grace periods are invisible to the job: Slurm's
        ``KillWait`` and Kubernetes' ``terminationGracePeriodSeconds``
        (both 30 s by default) count from their own ``SIGTERM``.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun sets it for workers
        return None
    found = (
        (
            _launcher_option("--shutdown-timeout", "--shutdown_timeout"),
            "torchrun --shutdown-timeout",
        ),
        (os.environ.get("PET_SHUTDOWN_TIMEOUT"), "PET_SHUTDOWN_TIMEOUT"),
        (
            os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        ),
    )
    for value, source in found:  # torchrun's own order
        if value is not None:
            try:
                return Deadline(float(value), source)
            except ValueError:
                logger.warning("ignoring %s=%r: not a number of seconds", source, value)
    return Deadline(*_TORCHRUN_DEFAULT)


def _launcher_option(*names: str) -> str | None:
    """The value of one of the parent's options before this script's name, or None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline") as f:
            cmdline = f.read()
    except OSError:
        return None
    words, ours = cmdline.split("\0")[:-1], sys.argv[1:]
    if words[len(words) - len(ours) :] != ours:  # not this script's launcher
        return None
    options = words[: len(words) - len(ours) - 1]  # less the script, our flags
    for i, word in enumerate(options):
        for name in names:
            if word == name and i + 1 < len(options):
                return options[i + 1]
            if word.startswith(f"{name}="):
                return word.split("=", 1)[1]
    return None


def check_restarts() -> bool:
    """Warns (on rank 0) if ``torchrun``'s restarts of this job would hang.

    With ``--max-restarts`` above 0, ``torchrun`` restarts every worker after
    one fails. By default (torch 2.13) its workers share the launcher's
    rendezvous store, without a prefix per attempt, so the restarted ranks
    can read the addresses of the ranks that died and fail or hang while
    they connect (pytorch/pytorch#135712). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in the launcher's environment gives each attempt a store of its own.

    Returns:
        Whether it warned.
    """
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
