"""Step folders: one per saved step, published only once complete.

A run's checkpoint folder holds ``step-<N>`` folders, one per save. Ranks
write into a hidden staging folder, ``.step-<N>.partial``, that rank 0
renames to ``step-<N>`` once DCP's coordinator has written ``.metadata``: a
rename is atomic on a POSIX file system, so a step folder is either complete
or absent. Every path and file operation on step folders lives here, so that
another storage (an object store) would be added in this module alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from pippy.checkpoint.errors import CheckpointDirError

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
_STEP_RE = re.compile(r"^step-(\d+)$")


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
        staging: ``<checkpoint_dir>/.step-<step>.partial``, what ranks write into.
    """

    step: int
    final: Path
    staging: Path

    @classmethod
    def of(cls, checkpoint_dir: str | os.PathLike, step: int) -> StepFolder:
        """The step folder of ``step`` in ``checkpoint_dir``."""
        final = step_dir(checkpoint_dir, step)
        return cls(step, final, final.with_name(f".{final.name}.partial"))


def is_complete(path: str | os.PathLike) -> bool:
    """Tells whether a step folder holds a complete checkpoint.

    DCP's coordinator writes ``.metadata`` only after every rank has written
    its data, so a folder without it was interrupted mid-save.
    """
    return (Path(path) / METADATA_FILE).is_file()


def parse_step(path: str | os.PathLike) -> int | None:
    """The step of a ``step-<N>`` folder name, or None for any other name."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_steps(checkpoint_dir: str | os.PathLike) -> dict[int, Path]:
    """Lists the step folders of a checkpoint folder, complete or not.

    Args:
        checkpoint_dir: The run's checkpoint folder; it may not exist yet.

    Returns:
        ``{step: folder}`` sorted by step; empty if the folder does not exist.

    Raises:
        CheckpointDirError: ``checkpoint_dir`` exists and is not a folder.
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
        if step is not None and path.is_dir():
            steps[step] = path
    return dict(sorted(steps.items()))


def find_latest_step(checkpoint_dir: str | os.PathLike) -> Path | None:
    """Finds the newest complete step folder, to resume from.

    Incomplete folders (no ``.metadata``: a crash mid-save) are never chosen;
    a warning names those newer than the one returned.

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
        if is_complete(path):
            latest = path
            break
        skipped.append(str(path))
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("skipping incomplete checkpoints (no .metadata) %s", skipped)
    return latest


def _on_coordinator(
    action: str, fn: Callable[[], None], process_group: dist.ProcessGroup | None
) -> None:
    """Runs ``fn`` on rank 0 only; if it fails, every rank raises the error."""
    rank0 = not dist.is_initialized() or dist.get_rank(process_group) == 0
    error: list[str | None] = [None]
    if rank0:
        try:
            fn()
        except OSError as e:
            error[0] = f"{action}: {e.strerror or e} ({e.filename or ''})"
    if dist.is_initialized():
        src = dist.get_global_rank(process_group, 0) if process_group else 0
        dist.broadcast_object_list(error, src=src, group=process_group)
    if error[0] is not None:
        raise CheckpointDirError(error[0])


def prepare_step(
    checkpoint_dir: str | os.PathLike,
    step: int,
    process_group: dist.ProcessGroup | None = None,
) -> StepFolder:
    """Checks that ``step-<step>`` is new and makes its empty staging folder.

    An incomplete ``step-<step>`` (not written by :func:`publish_step`) is
    moved aside, and a staging folder left by a crash is replaced. Call it on
    every rank of ``process_group``; rank 0 does the file operations.

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
    folder = StepFolder.of(checkpoint_dir, step)
    list_steps(checkpoint_dir)  # a file where the folder should be: say so
    if is_complete(folder.final):
        raise CheckpointDirError(
            f"{str(folder.final)!r} already exists; checkpoints are never "
            "overwritten. Resume from it, or save into another checkpoint folder."
        )

    def make_staging() -> None:
        if folder.final.exists():  # incomplete, not published by us: keep it aside
            aside = folder.final.with_name(
                f".{folder.final.name}.incomplete-{int(time.time())}"
            )
            folder.final.rename(aside)
            logger.warning("moved incomplete %s aside to %s", folder.final, aside.name)
        if folder.staging.exists():  # left by a crash during an earlier save
            shutil.rmtree(folder.staging)
        folder.staging.mkdir(parents=True)

    _on_coordinator(f"cannot create {folder.staging}", make_staging, process_group)
    return folder


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
            remove_old_steps(folder.final.parent, keep_last)

    _on_coordinator(
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

    _on_coordinator(f"cannot write to {root}", probe, process_group)


def remove_old_steps(checkpoint_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Deletes all but the newest ``keep_last`` complete step folders.

    Incomplete folders are left alone (they may be a save in progress).

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: How many complete steps to keep; at least 1.

    Returns:
        The folders deleted.

    Raises:
        ValueError: ``keep_last`` is less than 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    complete = [p for p in list_steps(checkpoint_dir).values() if is_complete(p)]
    old = complete[:-keep_last]
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

    The save goes into ``.step-<step>.partial``; once it returned on every
    rank (so the coordinator has written ``.metadata``), rank 0 renames the
    folder to ``step-<step>``, which is atomic on a POSIX file system, and
    only then removes steps beyond ``keep_last``. A crash before that leaves
    only the hidden staging folder, which :func:`find_latest_step` never picks
    and the next save of that step replaces. An existing step folder is never
    written into. If the body raises, nothing is published.

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
    yield folder.staging
    publish(folder, keep_last=keep_last, process_group=process_group)
