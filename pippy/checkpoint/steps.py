"""Step folders: one per saved step, published only once complete.

A run's checkpoint folder holds ``step-<N>`` folders, one per save. Ranks
write into a hidden staging folder, ``.step-<N>.partial-<token>``, that rank 0
renames to ``step-<N>`` once DCP's coordinator has written ``.metadata``: a
rename is atomic on a POSIX file system, so a step folder is either complete
or absent. The token is new for every save, so that no save ever writes into
or deletes a staging folder it did not create. A step's ``manifest.json``
says which step it holds; a folder whose name says otherwise is never taken
for that step. Every path and file operation on step folders lives here, so that
another storage (an object store) would be added in this module alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pippy.checkpoint.errors import CheckpointDirError, CheckpointError
from pippy.checkpoint.manifest import read_manifest

__all__ = [
    "METADATA_FILE",
    "StepFolder",
    "check_writable",
    "find_latest_step",
    "is_complete",
    "list_steps",
    "parse_step",
    "publish_step",
    "remove_old_steps",
    "step_dir",
]

logger = logging.getLogger(__name__)

#: The file DCP's coordinator writes last; a step folder without it is partial.
METADATA_FILE = ".metadata"
_STEP_RE = re.compile(r"^step-(0|[1-9][0-9]*)$")
_STEP_LIKE = re.compile(r"^step-[0-9]+$")


def step_dir(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    """Returns the folder of one step's checkpoint: ``<checkpoint_dir>/step-<step>``.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        step: Number of optimizer steps taken when the checkpoint was saved.
    """
    return Path(checkpoint_dir) / f"step-{step}"


@dataclass(frozen=True)
class StepFolder:
    """The two paths of one step's save: where it is written, where it is published.

    Attributes:
        step: The step being saved.
        final: ``<checkpoint_dir>/step-<step>``, what readers see.
        staging: ``<checkpoint_dir>/.step-<step>.partial-<token>``, what ranks
            write into.
    """

    step: int
    final: Path
    staging: Path

    @classmethod
    def of(cls, checkpoint_dir: str | os.PathLike, step: int, token: str) -> StepFolder:
        """The step folder of ``step`` in ``checkpoint_dir``, staged under ``token``."""
        final = step_dir(checkpoint_dir, step)
        return cls(step, final, final.with_name(f".{final.name}.partial-{token}"))


def is_complete(path: str | os.PathLike) -> bool:
    """Tells whether a step folder holds a complete checkpoint.

    DCP's coordinator writes ``.metadata`` only after every rank has written
    its data, so a folder without it was interrupted mid-save.
    """
    return (Path(path) / METADATA_FILE).is_file()


def parse_step(path: str | os.PathLike) -> int | None:
    """The step of a ``step-<N>`` folder name (no leading zeros), or None."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_steps(checkpoint_dir: str | os.PathLike) -> dict[int, Path]:
    """Lists the step folders of a checkpoint folder, complete or not.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        ``{step: folder}`` sorted by step; empty if the folder does not exist.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder, or
            holds a step folder under a name pippy does not write
            (``step-08`` beside, or instead of, ``step-8``).
    """
    root = Path(checkpoint_dir)
    if not root.exists():
        return {}
    if not root.is_dir():
        raise CheckpointDirError(
            f"checkpoint dir {str(root)!r} is a file, not a folder"
        )
    steps = {}
    for path in root.iterdir():
        step = parse_step(path)
        if step is None and _STEP_LIKE.match(path.name):
            raise CheckpointDirError(
                f"{str(path)!r} is not a step folder name pippy writes (it would "
                f"be step-{int(path.name[5:])}): one step could have two names. "
                "Rename it, or move it out of the checkpoint folder"
            )
        if step is not None and path.is_dir():
            steps[step] = path
    return dict(sorted(steps.items()))


def _holds_its_step(path: Path) -> bool:
    """False if the step's manifest names another step (or cannot be read)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return False
    return manifest is None or manifest.step == parse_step(path)


def find_latest_step(checkpoint_dir: str | os.PathLike) -> Path | None:
    """Finds the newest complete step folder, to resume from.

    Incomplete folders (no ``.metadata``: a crash mid-save) and folders whose
    ``manifest.json`` names another step (copied or renamed) are never
    chosen; a warning names those newer than the one returned.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        The newest complete ``step-<N>`` folder, or None if there is none.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder.
    """
    skipped: list[str] = []
    latest = None
    for path in reversed(list_steps(checkpoint_dir).values()):
        if is_complete(path) and _holds_its_step(path):
            latest = path
            break
        skipped.append(str(path))
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "skipping incomplete checkpoints (no .metadata, or a manifest naming "
            "another step) %s",
            skipped,
        )
    return latest


def on_coordinator(
    action: str, fn: Callable[[], Any], process_group: dist.ProcessGroup | None
) -> Any:
    """Runs ``fn`` on rank 0 only and gives every rank its result or its error.

    A failure on rank 0 alone would leave the other ranks waiting in the next
    collective; broadcasting it lets all of them stop with the same message.

    Args:
        action: What ``fn`` does, for the message (``"cannot write to X"``).
        fn: The file operations; a ``CheckpointDirError`` it raises is raised
            on every rank, any other ``Exception`` as a ``CheckpointDirError``.
        process_group: The ranks; the default group if None.

    Returns:
        What ``fn`` returned on rank 0 (it must pickle).

    Raises:
        CheckpointDirError: On every rank, if ``fn`` failed.
    """
    rank0 = not dist.is_initialized() or dist.get_rank(process_group) == 0
    outcome: list[Any] = [None, None]  # error, result
    if rank0:
        try:
            outcome[1] = fn()
        except CheckpointDirError as e:
            outcome[0] = e
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            outcome[0] = CheckpointDirError(f"{action}: {e.strerror or e}{where}")
        except Exception as e:  # any other failure: every rank stops with it
            outcome[0] = CheckpointDirError(f"{action}: {type(e).__name__}: {e}")
    if dist.is_initialized():
        src = dist.get_global_rank(process_group, 0) if process_group else 0
        dist.broadcast_object_list(outcome, src=src, group=process_group)
    if outcome[0] is not None:
        raise outcome[0]
    return outcome[1]


def prepare_step(
    checkpoint_dir: str | os.PathLike,
    step: int,
    process_group: dist.ProcessGroup | None = None,
) -> StepFolder:
    """Checks that ``step-<step>`` is new and makes its empty staging folder.

    An incomplete ``step-<step>`` (not written by :func:`publish_step`), or
    one whose manifest names another step (a copy), is moved aside. The
    staging folder is new, named by a token rank 0 draws.
    Call it on every rank of ``process_group``; rank 0 does the file
    operations.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing.
        step: The step about to be saved.
        process_group: The ranks that save; the default group if None.

    Returns:
        The step's folder, its staging folder empty and ready.

    Raises:
        CheckpointDirError: On every rank: the step exists, or the folder is a
            file or cannot be written.
    """
    list_steps(checkpoint_dir)  # a file where the folder should be: say so
    final = step_dir(checkpoint_dir, step)
    if is_complete(final) and _holds_its_step(final):
        raise CheckpointDirError(
            f"{str(final)!r} already exists; checkpoints are never "
            "overwritten. Resume from it, or save into another checkpoint folder."
        )

    def make_staging() -> StepFolder:
        folder = StepFolder.of(checkpoint_dir, step, uuid.uuid4().hex[:12])
        if final.exists():  # incomplete, or holding another step: keep it aside
            aside = final.with_name(f".{final.name}.incomplete-{int(time.time())}")
            final.rename(aside)
            logger.warning(
                "moved %s aside to %s: it was incomplete or held another step",
                final,
                aside.name,
            )
        folder.staging.mkdir(parents=True)
        return folder

    staging = final.with_name(f".{final.name}.partial-*")
    return on_coordinator(f"cannot create {staging}", make_staging, process_group)


def publish(
    folder: StepFolder,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Renames a step's staging folder to ``step-<N>``, then prunes old steps.

    Call it on every rank once the save returned everywhere.

    Args:
        folder: The step folder from :func:`prepare_step`.
        keep_last: If set, then keep only this many newest complete steps.
        process_group: The ranks that saved; the default group if None.

    Raises:
        CheckpointDirError: On every rank, if the rename or pruning failed.
    """

    def rename_and_prune() -> None:
        folder.staging.rename(folder.final)
        if keep_last is not None:
            remove_old_steps(folder.final.parent, keep_last, keep=folder.final)

    on_coordinator(
        f"cannot publish {folder.final.name}", rename_and_prune, process_group
    )


def check_writable(
    checkpoint_dir: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Checks, before training, that checkpoints can be written there.

    Rank 0 creates the folder if needed and writes and deletes a probe file,
    so that a wrong path fails in the first second, not at the first save.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        process_group: The ranks that will save; the default group if None.

    Raises:
        CheckpointDirError: On every rank, if the folder is a file, cannot be
            created, or cannot be written.
    """
    list_steps(checkpoint_dir)
    root = Path(checkpoint_dir)

    def probe() -> None:
        root.mkdir(parents=True, exist_ok=True)
        probe_file = root / f".write-test-{os.getpid()}"
        probe_file.write_bytes(b"")
        probe_file.unlink()

    on_coordinator(f"cannot write to {root}", probe, process_group)


def remove_old_steps(
    checkpoint_dir: str | os.PathLike, keep_last: int, *, keep: Path | None = None
) -> list[Path]:
    """Deletes all but the newest ``keep_last`` complete step folders.

    Steps are ranked by the step they hold (their manifest's), which is their
    name's: a folder whose manifest names another step (copied or renamed)
    is neither counted nor deleted. Incomplete folders are left alone (they
    may be a save in progress).

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: How many complete steps to keep; at least 1.
        keep: A step folder never deleted (the one just published).

    Returns:
        The folders deleted.

    Raises:
        ValueError: ``keep_last`` is less than 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    complete = [
        p
        for p in list_steps(checkpoint_dir).values()
        if is_complete(p) and _holds_its_step(p)
    ]
    old = [p for p in complete[:-keep_last] if p != keep]
    for path in old:
        shutil.rmtree(path)
    if old:
        logger.info("removed old checkpoints %s", [p.name for p in old])
    return old


@contextmanager
def publish_step(
    checkpoint_dir: str | os.PathLike,
    step: int,
    *,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Iterator[Path]:
    """Gives every rank a staging folder and publishes it as ``step-<step>``.

    Use it around ``dcp.save``, on every rank::

        with publish_step(checkpoint_dir, step) as checkpoint_id:
            dcp.save(state_dict, checkpoint_id=checkpoint_id)

    The save goes into ``.step-<step>.partial-<token>``; once it returned on
    every rank (so the coordinator has written ``.metadata``), rank 0 renames
    the folder to ``step-<step>``, which is atomic on a POSIX file system, and
    only then removes steps beyond ``keep_last``. A crash before that leaves
    only the hidden staging folder, which :func:`find_latest_step` never
    picks. An existing step folder is never written into. If the body raises,
    nothing is published and rank 0 removes the staging folder.

    Args:
        checkpoint_dir: The run's checkpoint folder; created if missing. On
            several nodes it must be storage that every node sees.
        step: The step being saved.
        keep_last: If set, keep only this many newest complete steps.
        process_group: Group of the ranks that save; the default group if None.

    Yields:
        The staging folder, to pass to ``dcp.save`` as ``checkpoint_id``.

    Raises:
        CheckpointDirError: On every rank: ``step-<step>`` exists, or
            ``checkpoint_dir`` is a file or cannot be written.
    """
    folder = prepare_step(checkpoint_dir, step, process_group)
    try:
        yield folder.staging
    except BaseException:
        discard(folder, process_group)
        raise
    publish(folder, keep_last=keep_last, process_group=process_group)


def discard(folder: StepFolder, process_group: dist.ProcessGroup | None = None) -> None:
    """Removes a failed save's staging folder, on rank 0, without a collective.

    Args:
        folder: The step folder from :func:`prepare_step`.
        process_group: The ranks that saved; rank 0 of it removes the folder.
    """
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        shutil.rmtree(folder.staging, ignore_errors=True)
