"""pippy's checkpoint errors, and the one way failures on several ranks are worded.

Every error is a :class:`CheckpointError` and, where one fits, the builtin a
caller would catch anyway. DCP's ``CheckpointException`` is a ``BaseException``
that ``except Exception`` misses: :func:`explain_failures` turns it into one
error with a line per failed rank, as :func:`fail_together` does for a step
that each rank runs alone.
"""

from __future__ import annotations

import atexit
import errno
import math
import pickle
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.constants import default_pg_timeout


class CheckpointError(Exception):
    """Base of pippy's checkpoint errors; the message says what to do."""


class KeyCollisionError(CheckpointError, ValueError):
    """Two or more ranks offer the same checkpoint key: DCP would write one."""


class DivergedReplicasError(KeyCollisionError):
    """A stage's data-parallel replicas differ: DCP would mix them key by key."""


class NestedStateError(CheckpointError, ValueError):
    """Model or optimizer state is nested under another section (``stage0.model.``)."""


class TiedParametersError(CheckpointError, ValueError):
    """The model shares a parameter under several FQNs (tied weights)."""


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
        return _line(self.error)


def _line(error: BaseException) -> str:
    """``type: message`` of an error; of a rank's own error, what it carries."""
    if isinstance(error, _OwnError):
        error = error.error
    return f"{type(error).__name__}: {_message(error)}"


def portable(error: Exception, action: str | None = None) -> Exception:
    """``error`` if it unpickles (it is sent to the other ranks), else its line.

    The line, a ``CheckpointError``: ``<type>: <message>``; with the ``action``
    that rank 0 ran alone (:func:`on_coordinator`), ``<action>: <type> on rank
    0: <message>``.
    """
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        if action is None:
            return CheckpointError(_line(error))
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


def _failed_on(action: str, failures: Mapping[int, str]) -> CheckpointError:
    """One error for failures on several ranks: a line per rank, by rank."""
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
        raise _failed_on(action, {r: _line(x) for r, x in failures.items()}) from None


#: pippy's own gloo group of each caller's group, by id (the group kept with
#: it, so that its id is not reused while the entry lives).
_groups: dict[int, tuple[Any, Any]] = {}


def pippy_group(
    process_group: dist.ProcessGroup | None = None, timeout: float | None = None
) -> dist.ProcessGroup | None:
    """Pippy's own gloo group over the ranks of ``process_group``.

    pippy's collectives run on it, whatever backend the caller's group has
    (NCCL alone included), and only its timeout is ever changed (a save's or
    load's ``timeout=``); the caller's group is never touched. Made on first
    use, on the ranks of ``process_group`` at once, then kept.

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
    """A new gloo group over ``group``'s ranks, made by them alone."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)  # type: ignore[arg-type]
    if len(ranks) == dist.get_world_size():  # named by torch's count, as usual
        return dist.new_group(ranks, backend="gloo", timeout=timeout)
    # named by its ranks: the other ranks need not take part
    return dist.new_group(
        ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
    )


def made_group(
    process_group: dist.ProcessGroup | None = None,
) -> dist.ProcessGroup | None:
    """A new gloo group of pippy's own over ``process_group``'s ranks.

    All ranks if None. :func:`pippy_group` gives it back for itself; forget
    it with :func:`drop_group`. None where torch.distributed is not
    initialized.
    """
    if not dist.is_initialized():
        return None
    ours = _gloo_group(process_group or dist.group.WORLD)
    _groups[id(ours)] = (ours, ours)
    return ours


@atexit.register
def _release_groups() -> None:
    """Destroys and forgets pippy's groups at exit, while Python still runs.

    Those the caller's ``destroy_process_group()`` left, so that their gloo
    threads end then, not in the interpreter's teardown.
    """
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
        error, own = _line(e).replace("\n", "\n    "), e
    errors: list[str | None] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(errors, error, group=pippy_group(process_group))
    failed = {
        dist.get_global_rank(process_group, r) if process_group else r: e
        for r, e in enumerate(errors)
        if e is not None
    }
    if own is not None and keep_own_error:
        raise own
    if failed:
        raise _failed_on(action, failed)


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
        src = dist.get_global_rank(process_group, 0) if process_group else 0
        dist.broadcast_object_list(outcome, src=src, group=pippy_group(process_group))
    error = own if own is not None else outcome[0]
    if error is not None:  # this rank's own, else as rank 0 sent it
        raise error
    return outcome[1]


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
    """``value`` if it is a number of the kind and in the range asked, else ValueError.

    Args:
        value: What to check; a ``bool`` is no number, NaN in no range.
        message: The error, one sentence, with ``{}`` or ``{!r}`` where
            ``shown`` goes: ``"a step is a whole number >= 0, not {!r}"``.
        whole: An ``int`` only; else an ``int`` or a ``float``.
        above: The range's lower end, not in it.
        at_least: The range's lower end, in it.
        at_most: The range's upper end, in it.
        text: ``value`` is text (an environment variable) read as a float.
        shown: What the message shows, if not ``value``.

    Returns:
        ``value``, read as a float where ``text``.

    Raises:
        ValueError: ``message``, ``shown`` filled in.
    """
    number = value
    if text:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
    kind = int if whole else int | float
    if (
        isinstance(number, bool)
        or not isinstance(number, kind)
        or not (above is None or number > above)
        or not (at_least is None or number >= at_least)
        or not number <= at_most
    ):
        raise ValueError(message.format(value if shown is _SHOWN else shown))
    return number
