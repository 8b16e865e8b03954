"""One rank answers every question about the checkpoint folder, for all ranks.

On a filesystem every node mounts, attribute caching (NFS) can make ranks
disagree on what the folder holds, and so resume from different steps or
wait in different collectives; on a bucket, hundreds of ranks listing at
once get throttled into "no checkpoint". So in a job, rank 0 of the process
group alone lists or looks up the run's folder, and broadcasts its answer
(or its error: :func:`~pippy.checkpoint.errors.on_coordinator`), so that
every rank acts on the same answer or fails with the same message:

=====================================  ==========================================
Question                               Answered on rank 0 by
=====================================  ==========================================
Is the folder a folder, is it free,    :class:`~pippy.checkpoint.FolderOwner`
who owns it, take it over              (``acquire``; ``release`` on rank 0 alone)
Which steps are complete, which is     :func:`~pippy.checkpoint.find_latest_step`
newest (and which verify)              (``verified=True``: ``newest_verified_step``)
Is the step new, what to move aside;   :class:`~pippy.checkpoint.publishing.StepWriter`,
publish it, what to delete             in DCP's planning and ``finish`` (no
(``keep_last``)                        broadcast: DCP's plans carry the answer)
Is the step complete, its              :func:`open_reader`, which
``.metadata``, its files' sizes, its   :func:`~pippy.checkpoint.api.open_step` and
manifest                               ``load_stage`` use
=====================================  ==========================================

The other ranks then open only the data files whose items they load, and
the staging folder they write. Without an initialized process group (one
process, the command line), the process answers alone. A test counts each
rank's system calls and bucket listings (``test/test_one_rank_decides.py``).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from pippy.checkpoint.errors import on_coordinator
from pippy.checkpoint.safe_load import SafeFileSystemReader
from pippy.checkpoint.storage import Location

__all__ = ["open_reader"]


def open_reader(
    path: Location,
    *,
    trusted: bool | None = None,
    check_files: bool = True,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> SafeFileSystemReader:
    """A :class:`SafeFileSystemReader` of a step, made on every rank at once.

    Rank 0 alone makes it as the class does (reads ``.metadata``, checks the
    folder, the data files' sizes and the manifest) and broadcasts the
    metadata and the manifest, or its error; the other ranks touch none of
    the step's files until ``dcp.load`` reads their items. The broadcast
    carries the whole ``Metadata``, as ``dcp.save`` itself does.

    Args:
        path: A ``step-<N>`` folder.
        trusted: See :class:`SafeFileSystemReader`; rank 0's decision holds.
        check_files: As :class:`SafeFileSystemReader`.
        verify: As :class:`SafeFileSystemReader`.
        process_group: The ranks; the default group if None.
        no_dist: This process reads alone, with no collective (as
            ``dcp.load``'s ``no_dist``); so does a process without an
            initialized process group.

    Returns:
        The reader, on every rank.

    Raises:
        CheckpointNotFoundError, UnsafeCheckpointError, CheckpointError: As
            :class:`SafeFileSystemReader`, on every rank.
        CheckpointDirError: On every rank, if rank 0 failed otherwise (a
            folder it may not read).
    """
    if no_dist or not dist.is_initialized():
        return SafeFileSystemReader(
            path, trusted=trusted, check_files=check_files, verify=verify
        )
    made: list[SafeFileSystemReader] = []

    def check() -> Any:  # on rank 0; a CheckpointError reaches every rank as itself
        reader = SafeFileSystemReader(
            path, trusted=trusted, check_files=check_files, verify=verify
        )
        made.append(reader)
        return reader.trusted, reader.metadata, reader.manifest

    checked = on_coordinator(f"cannot read {os.fspath(path)}", check, process_group)
    if made:
        return made[0]
    trusted, metadata, manifest = checked
    return SafeFileSystemReader.checked(
        path, trusted=trusted, metadata=metadata, manifest=manifest
    )
