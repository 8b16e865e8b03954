"""pippy's checkpoint errors, and the one way failures on several ranks are worded.

Every error is a :class:`CheckpointError` and, where one fits, the builtin a
caller would catch anyway. DCP's ``CheckpointException`` is a ``BaseException``
that ``except Exception`` misses: :func:`explain_failures` turns it into one
error with a line per failed rank, as
:func:`~pippy.checkpoint.collectives.fail_together` does for a step that each
rank runs alone.
"""

from __future__ import annotations

import errno
import math
import pickle
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

#: How to build what a load refuses, in most of their messages: ``build the
#: optimizer {AS_SAVED}``.
AS_SAVED = "as the run that saved it did"


class CheckpointError(Exception):
    """Base of pippy's checkpoint errors; the message says what to do."""


class KeyCollisionError(CheckpointError, ValueError):
    """Two or more ranks offer the same checkpoint key: DCP would write one."""


class DivergedReplicasError(KeyCollisionError):
    """A stage's data-parallel replicas differ: DCP would mix them key by key."""


class NestedStateError(CheckpointError, ValueError):
    """Model or optimizer state is nested under another section (``stage0.model.``)."""


class CheckpointDirError(CheckpointError, NotADirectoryError):
    """The checkpoint folder is not a folder, or cannot be written."""


class CheckpointDirInUseError(CheckpointError):
    """Another job owns the checkpoint folder, or took it over (a lost lease)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was asked for."""


class CheckpointTimeout(CheckpointError, TimeoutError):
    """Some ranks did not arrive at a save or load in time; raised on every rank."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint holds a pickle that could run code, or a link out of its step."""


def listed(items: Any, first: int = 5, sep: str = ", ", show: Any = repr) -> str:
    """The ``first`` items shown, joined, and how many more: ``'a', 'b' and 3 more``."""
    more = f" and {len(items) - first} more" if len(items) > first else ""
    return sep.join(map(show, items[:first])) + more


def _message(error: BaseException) -> str:
    """An exception's message, saying plainly when the disk is full."""
    text = str(error)
    if isinstance(error, EOFError):
        return text or "the file ended early"
    # torch.save's zip writer reports a short write as "unexpected pos".
    if getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in text:
        return (
            "no space left on device (the write stopped short); free space, or "
            "save into a folder on another file system"
        )
    return text


class _OwnError(Exception):
    """A rank's own error sent through DCP, which :func:`explain_failures` raises."""

    def __init__(self, rank: int, error: Exception) -> None:
        super().__init__(rank, error)
        self.rank, self.error = rank, error

    def __str__(self) -> str:
        return one_line(self.error)


def one_line(error: BaseException) -> str:
    """``type: message`` of an error; of a rank's own error, what it carries."""
    if isinstance(error, _OwnError):
        error = error.error
    return f"{type(error).__name__}: {_message(error)}"


def portable(error: Exception, action: str | None = None) -> Exception:
    """``error`` if it unpickles (to be sent to the other ranks), else its line.

    The line, a ``CheckpointError``: ``<type>: <message>``, or ``<action>: <type>
    on rank 0: <message>`` with the ``action`` rank 0 ran alone.
    """
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        if action is None:
            return CheckpointError(one_line(error))
        name = type(error).__name__
        return CheckpointError(f"{action}: {name} on rank 0: {_message(error)}")
    return error


def own_error(error: Exception) -> Exception:
    """``error`` wrapped to raise inside DCP: itself here, named on other ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return _OwnError(rank, portable(error))


def name_ranks(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 0, 2``, ``ranks 0-3, 6``: sorted ranks, runs joined."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(
        f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run))
        for run in runs
    )
    return f"rank{'s' * (len(ranks) > 1)} {text}"


def failed_on(action: str, failures: Mapping[int, str]) -> CheckpointError:
    """One error for failures on several ranks: a line per rank, or one if alike."""
    if len(failures) > 1 and len(set(failures.values())) == 1:
        ranks, [line] = name_ranks(sorted(failures)), set(failures.values())
        return CheckpointError(f"{action} failed on {ranks}: {line}")
    lines = "\n".join(f"  rank {rank}: {failures[rank]}" for rank in sorted(failures))
    return CheckpointError(f"{action} failed on {len(failures)} rank(s):\n{lines}")


@contextmanager
def explain_failures(action: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` as this rank's own error, else one error."""
    try:
        yield
    except CheckpointException as e:
        failures = {rank: exc for rank, (exc, _trace) in sorted(e.failures.items())}
        here = dist.get_rank() if dist.is_initialized() else 0
        for exc in failures.values():
            if isinstance(exc, _OwnError) and exc.rank == here:
                raise exc.error from None
        for exc in failures.values():  # one line, as these say what to do
            if isinstance(
                exc,
                UnsafeCheckpointError
                | CheckpointTimeout
                | CheckpointDirInUseError
                | CheckpointDirError
                | KeyCollisionError
                | NestedStateError,
            ):
                raise type(exc)(str(exc)) from None
        raise failed_on(action, {r: one_line(x) for r, x in failures.items()}) from None


def dir_error(action: str, error: OSError) -> CheckpointDirError:
    """``error`` as one line: ``<action>: <reason> (<file>)``."""
    where = f" ({error.filename})" if error.filename else ""
    return CheckpointDirError(f"{action}: {error.strerror or error}{where}")


_SHOWN = object()  # check_number's default: show the value checked


def check_number(
    value: Any,
    message: str,
    *,
    whole: bool = False,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float = math.inf,
    text: bool = False,
    shown: Any = _SHOWN,
) -> Any:
    """``value`` if a number (an ``int`` if ``whole``) in the range, else ValueError.

    A ``bool`` is no number, NaN in no range; ``text``: ``value`` (an environment
    variable) is read as a float, and returned so. ``message`` has ``{}`` or
    ``{!r}`` where ``shown`` (``value`` by default) goes.
    """
    number = value
    if text:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
    if (
        isinstance(number, bool)
        or not isinstance(number, int if whole else int | float)
        or not (above is None or number > above)
        or not (at_least is None or number >= at_least)
        or not number <= at_most
    ):
        raise ValueError(message.format(value if shown is _SHOWN else shown))
    return number


#: How to resume past a damaged step (after "Restore the file, or").
MOVE_ASIDE = (
    "move the folder out of the checkpoint folder to resume from an earlier step"
)
