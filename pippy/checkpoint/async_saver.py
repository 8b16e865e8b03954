"""``AsyncSaver``: saves in the background, one save in flight at a time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import (
    AsyncStager,
    DefaultStager,
    StagingOptions,
)

from pippy.checkpoint.api import _gc_paused
from pippy.checkpoint.errors import explain_failures
from pippy.checkpoint.manifest import ManifestWriter
from pippy.checkpoint.steps import StepFolder, discard, prepare_step, publish

__all__ = ["AsyncSaver"]


class AsyncSaver:
    """Saves in the background with ``dcp.async_save``, one save at a time.

    ``save`` returns once DCP has copied the state (staging), so training can
    change the live tensors at once: the checkpoint holds the values of the
    moment of the call. The files are written by a background thread over a
    gloo group of their own (async saves must not share a group with training
    collectives, and CPU-capable collectives need gloo). The step is
    published, as by :func:`~pippy.checkpoint.publish_step`, as soon as it is
    on disk on every rank: :meth:`poll`, called once per training step, finds
    that out without waiting; the next ``save``, :meth:`wait` (which a load
    must call first) and ``close`` wait for it. Two saves in flight on one
    gloo group crash (torch 2.13: "Connection reset by peer"), hence one at a
    time.

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: If set, keep only this many newest complete steps.
        process_group: A gloo group of the ranks that save, used by no other
            collective; None creates one over all ranks.
        async_stager: How state is copied before ``save`` returns; None keeps
            one ``DefaultStager`` (see the note).

    Note:
        The default stager copies the state into CPU buffers that are
        allocated at the first save and kept for the next ones, so a rank
        holds a second copy of its state for as long as the saver lives:
        budget the state's size again per rank. Keeping them shortens the
        training loop's wait (``bench/README.md`` measures it). DCP's plan
        caching (``enable_plan_caching``) is not used: torch 2.13 compares
        plans without dtypes, so after a dtype change it writes the old dtype
        into ``.metadata`` and loads convert silently.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike,
        *,
        keep_last: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        async_stager: AsyncStager | None = None,
    ):
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        self._own_group = process_group is None and dist.is_initialized()
        if self._own_group:
            process_group = dist.new_group(backend="gloo")
        self.process_group = process_group
        self._pending: tuple[Any, StepFolder] | None = None
        # poll() agrees on progress over a gloo group of its own, made at the
        # first poll: the save's background thread uses process_group.
        self._poll_group: dist.ProcessGroup | None = None
        self._stager = async_stager or DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,  # staged before save() returns
                use_non_blocking_copy=False,
            )
        )

    @_gc_paused()
    def save(self, state_dict: dict[str, Any], step: int) -> Path:
        """Waits for the previous save, then starts saving ``state_dict``.

        Python's garbage collector is paused until it returns, as in
        :func:`~pippy.checkpoint.save_stage`; the background write is not.

        Args:
            state_dict: The state to save, e.g. ``StageState.state_dict()``,
                already checked with ``check_keys``.
            step: The step it holds; it is published as ``step-<step>``.

        Returns:
            The staging folder being written.

        Raises:
            CheckpointError: The previous save failed (see :meth:`wait`).
            CheckpointDirError: As :func:`~pippy.checkpoint.publish_step`.
        """
        self.wait()
        folder = prepare_step(self.checkpoint_dir, step, self.process_group)
        with explain_failures(f"saving step-{step}"):
            future = dcp.async_save(
                state_dict,
                checkpoint_id=folder.staging,
                storage_writer=ManifestWriter(folder.staging, step=step),
                process_group=self.process_group,
                async_stager=self._stager,
            )
        self._pending = (future, folder)
        return folder.staging

    def wait(self) -> Path | None:
        """Waits for the save in flight and publishes it.

        Returns:
            The published step folder, or None if no save was in flight.

        Raises:
            CheckpointError: The background save failed, on some rank; the
                step is not published and earlier steps are untouched.
        """
        if self._pending is None:
            return None
        future, folder = self._pending
        self._pending = None
        try:
            with explain_failures(f"saving step-{folder.step} in the background"):
                future.result()
        except BaseException:
            discard(folder, self.process_group)
            raise
        publish(folder, keep_last=self.keep_last, process_group=self.process_group)
        return folder.final

    def poll(self) -> Path | None:
        """Publishes the save in flight if it is on disk on every rank; never waits.

        Call it on every rank once per training step: each rank says whether
        its part is done (one ``all_reduce`` of one number, on a gloo group
        over all ranks made at the first call), so that all publish at the
        same step. A save is then visible, and ``keep_last``
        prunes, as soon as it is durable, not only at the next save.

        Returns:
            The published step folder, or None.

        Raises:
            CheckpointError: As :meth:`wait`.
        """
        if self._pending is None:
            return None
        done = torch.tensor([int(self._pending[0].done())])
        if dist.is_initialized():
            if self._poll_group is None:
                self._poll_group = dist.new_group(backend="gloo")
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        return self.wait() if done.item() else None

    def close(self) -> None:
        """Waits for the save in flight (publishing it), frees buffers and group."""
        try:
            self.wait()
        finally:
            self._stager.close()
            if self._poll_group is not None:
                dist.destroy_process_group(self._poll_group)
                self._poll_group = None
            if self._own_group:
                dist.destroy_process_group(self.process_group)
                self._own_group = False
                self.process_group = None
