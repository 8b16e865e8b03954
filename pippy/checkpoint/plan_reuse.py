"""Repeat saves of an unchanged layout, with the plan of the previous save.

Every ``dcp.save`` plans afresh, with four object collectives: every rank's
plan gathered to the coordinator, the global plan scattered back, the write
results gathered, and the whole global ``Metadata`` broadcast to every rank
(``torch/distributed/checkpoint/state_dict_saver.py``, torch 2.13 and 2.15).
A training job saves the same layout again and again. :class:`SavePlanCache`
keeps what a save planned and reuses it while nothing changed:

* Each rank keeps its local plan (``DefaultSavePlanner.create_local_plan``:
  every key, and for tensors the shape, dtype, properties and chunks, DTensor
  shards included) and its final plan; the coordinator keeps the global
  ``Metadata``'s ``state_dict_metadata`` and ``planner_data``.
* A repeat save makes the local plan again (no collective) and, if it equals
  the kept one, writes with the kept final plan. Then one gather brings each
  rank's verdict and write results to the coordinator, which writes
  ``.metadata`` with this save's storage data (the form ``dcp.save`` writes:
  DCP's own ``FileSystemWriter.finish``), and one broadcast tells every rank
  the outcome. Two collectives; the metadata is never sent.
* Anything else plans afresh, on every rank: a rank without a kept plan, or
  whose local plan, writer settings or process group changed, or whose kept
  plan is not the one the coordinator keeps (each fresh plan gets a token
  from the coordinator). Then every rank runs ``dcp.save`` into the same
  files, which DCP overwrites; the step is published only after it (see
  :mod:`~pippy.checkpoint.publishing`).

DCP's own ``DefaultSavePlanner(enable_plan_caching=True)`` is not this: it
skips only the first gather, keeps its cache per planner class for the whole
process, and on torch 2.13 compares plans without dtypes (see bench/README.md).
"""

from __future__ import annotations

import logging
import pickle
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultSavePlanner,
    FileSystemWriter,
    StorageWriter,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.stateful import Stateful

from pippy.checkpoint import stall

__all__ = ["SavePlanCache"]

logger = logging.getLogger(__name__)

# A rank's verdict in the repeat round, and the coordinator's outcome.
_FRESH, _WRITTEN, _FAILED, _DONE = "fresh", "written", "failed", "done"


@dataclass(frozen=True)
class _Layout:
    """What a rank's plan depends on: its local plan, its writer, its ranks."""

    plan: SavePlan
    writer: tuple
    ranks: tuple[int, ...]
    rank: int


@dataclass(frozen=True)
class _Kept:
    """One rank's kept plan; ``metadata`` on the coordinator only."""

    token: str
    layout: _Layout
    final_plan: SavePlan
    metadata: Metadata | None


class _KeepingPlanner(DefaultSavePlanner):
    """DCP's default planner, noting its local plan, final plan and metadata."""

    local_plan: SavePlan | None = None
    final_plan: SavePlan | None = None
    kept_metadata: Metadata | None = None

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, kept."""
        self.local_plan = super().create_local_plan()
        return self.local_plan

    def create_global_plan(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan; the layout part of its metadata kept."""
        plans, metadata = super().create_global_plan(all_plans)
        self.kept_metadata = Metadata(
            metadata.state_dict_metadata, planner_data=metadata.planner_data
        )
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's final plan, kept."""
        self.final_plan = super().finish_plan(new_plan)
        return self.final_plan


class _Group:
    """The saving ranks, with the two object collectives of a repeat save."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group, self.on = group, dist.is_initialized()
        self.rank = dist.get_rank(group) if self.on else 0
        self.size = dist.get_world_size(group) if self.on else 1
        self.ranks = tuple(dist.get_process_group_ranks(group)) if self.on else (0,)
        self.coordinator = (
            dist.get_global_rank(group, 0) if group is not None and self.on else 0
        )

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on the coordinator; ``[]`` elsewhere."""
        if not self.on:
            return [obj]
        got: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, got, dst=self.coordinator, group=self.group)
        return got or []

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj``, on every rank."""
        box = [obj]
        if self.on:
            dist.broadcast_object_list(box, src=self.coordinator, group=self.group)
        return box[0]


def _writer_settings(writer: StorageWriter) -> tuple | None:
    """What of a writer shapes its files' names; None if a plan cannot be kept.

    Reuse needs one set of files per rank, ``__<rank>_<n>.distcp`` for ``n``
    below ``thread_count`` (``single_file_per_rank``), so that a save planned
    afresh after a reuse was refused writes, and so overwrites, the very files
    that the refused one wrote (``FileSystemWriter.write_data``, torch 2.13).
    """
    if not isinstance(writer, FileSystemWriter) or not writer.single_file_per_rank:
        return None
    kind = f"{type(writer).__module__}.{type(writer).__qualname__}"
    return (kind, writer.thread_count, str(writer.serialization_format))


def _describe(items: list[WriteItem]) -> str:
    """An item's kind for a message: ``torch.float32[4, 4]`` or ``bytes``."""
    data = items[0].tensor_data
    if data is None:
        return "bytes"
    return f"{data.properties.dtype}{list(data.size)}"


def _what_changed(kept: _Layout, now: _Layout) -> str | None:
    """How the layout differs from the kept one, in a few words; None if not."""
    if (kept.ranks, kept.rank) != (now.ranks, now.rank):
        return (
            f"the ranks changed (rank {kept.rank} of {list(kept.ranks)} is now "
            f"rank {now.rank} of {list(now.ranks)})"
        )
    if kept.writer != now.writer:
        return f"the storage writer changed ({kept.writer} -> {now.writer})"
    if kept.plan == now.plan:
        return None
    old: dict[str, list[WriteItem]] = {}
    new: dict[str, list[WriteItem]] = {}
    for items, plan in ((old, kept.plan), (new, now.plan)):
        for item in plan.items:
            items.setdefault(item.index.fqn, []).append(item)
    words = [f"{k!r} added" for k in sorted(new.keys() - old.keys())]
    words += [f"{k!r} removed" for k in sorted(old.keys() - new.keys())]
    for k in sorted(old.keys() & new.keys()):
        if old[k] != new[k]:
            was, now_is = _describe(old[k]), _describe(new[k])
            what = f"{was} -> {now_is}" if was != now_is else "properties or chunks"
            words.append(f"{k!r} changed ({what})")
    if not words:
        words = ["the state_dict's nesting changed"]
    more = f" and {len(words) - 3} more" if len(words) > 3 else ""
    return ", ".join(words[:3]) + more


def _wrapped(error: Exception) -> tuple[BaseException, traceback.StackSummary]:
    """An exception as DCP's failures hold it, made sure to pickle."""
    try:
        pickle.dumps(error)
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    frames = traceback.extract_tb(error.__traceback__)
    lines = [(f.filename, f.lineno or 0, f.name, f.line) for f in frames]
    return error, traceback.StackSummary.from_list(lines)


class SavePlanCache:
    """Keeps a save's plan, to save the same layout again with fewer collectives.

    Keep one per kind of save (its state_dict's layout) for the whole run and
    pass it to every save, on every rank: ``save_stage(..., plan_cache=cache)``,
    ``AsyncSaver(..., plan_cache=cache)``, or :meth:`save` in place of
    ``dcp.save`` inside
    :func:`~pippy.checkpoint.publishing.publish_step`. The first save plans
    as ``dcp.save`` does (``DefaultSavePlanner``); a repeat of the same
    layout skips DCP's plan exchange and the broadcast of ``.metadata``
    (module docstring), and any change plans afresh, on every rank. The
    ``.metadata`` is the one ``dcp.save`` would write: plain ``dcp.load``
    reads it.

    What plans afresh: any change of a key, a tensor's shape, dtype or other
    property DCP records (``requires_grad``, ...), its chunks (a DTensor's
    placements or mesh), the state_dict's nesting, the writer's class,
    ``thread_count`` or format, or the process group's ranks; a rank without
    a kept plan (a new cache, :meth:`forget`, a failed save); caches of
    different saves on different ranks. Non-tensor items are written anew
    each time, whatever their type and size. Why it planned is logged at
    INFO by the coordinator (``pippy.checkpoint.plan_reuse``).

    Attributes:
        plans_made: Saves that planned afresh (the first included).
        plans_reused: Saves that reused the kept plan.

    Note:
        A plan is kept only for DCP's ``FileSystemWriter`` and its subclasses
        (pippy's ``ManifestWriter``) with ``single_file_per_rank=True`` (the
        default); with any other writer every save plans afresh. A change of
        layout costs one more round and, on the ranks whose layout did not
        change, one more write of their items. One save at a time per cache
        (:class:`~pippy.checkpoint.AsyncSaver` takes one: ``plan_cache=``).
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.plans_made = 0
        self.plans_reused = 0

    def forget(self) -> None:
        """Drops this rank's kept plan: its next save plans afresh, on every rank."""
        self._kept = None

    def save(
        self,
        state_dict: Mapping[str, Any],
        *,
        storage_writer: StorageWriter,
        checkpoint_id: Any = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``dcp.save``, reusing the kept plan where the layout is unchanged.

        Call it on every rank of ``process_group`` at once, each with its
        cache.

        Args:
            state_dict: What to save, as for ``dcp.save``.
            storage_writer: DCP's storage writer of this save.
            checkpoint_id: If set, the writer is pointed there first
                (``StorageWriter.reset``), as ``dcp.save`` does.
            process_group: The ranks that save; the default group if None.

        Raises:
            CheckpointException: The save failed on some rank (DCP's error,
                a ``BaseException``: one entry per failed rank), on every
                rank; the kept plan is dropped.
        """
        group = _Group(process_group)
        plain: dict[str, Any] = {}
        try:
            if checkpoint_id is not None:
                storage_writer.reset(checkpoint_id)
            plain = {
                k: v.state_dict() if isinstance(v, Stateful) else v
                for k, v in state_dict.items()
            }
            verdict = self._write_with_kept(plain, storage_writer, group)
        except Exception as e:
            verdict = (_FAILED, _wrapped(e))
        verdicts = group.gather(verdict)
        outcome = None
        if group.rank == 0:
            try:
                outcome = self._decide(verdicts, storage_writer)
            except Exception as e:
                outcome = (_FAILED, {0: _wrapped(e)})
        kind, detail = group.broadcast(outcome)
        if kind == _DONE:
            self.plans_reused += 1
            return
        self._kept = None
        if kind == _FAILED:
            raise CheckpointException("write", detail)
        self._plan_afresh(plain, storage_writer, group, *detail)

    def _layout(
        self, planner: _KeepingPlanner, writer: StorageWriter, group: _Group
    ) -> _Layout:
        """This rank's layout, from the local plan its planner made."""
        assert planner.local_plan is not None
        settings = _writer_settings(writer) or ()
        return _Layout(planner.local_plan, settings, group.ranks, group.rank)

    def _write_with_kept(
        self, state_dict: dict[str, Any], writer: StorageWriter, group: _Group
    ) -> tuple[str, Any]:
        """Writes with the kept plan if this rank's layout is unchanged."""
        kept = self._kept
        if kept is None:
            return _FRESH, "no plan kept"
        if _writer_settings(writer) is None:
            return _FRESH, f"{type(writer).__name__} cannot keep a plan"
        is_coordinator = group.rank == 0
        planner = _KeepingPlanner()
        planner.set_up_planner(state_dict, writer.storage_meta(), is_coordinator)
        writer.set_up_storage_writer(
            is_coordinator, rank=group.rank, use_collectives=True
        )
        planner.create_local_plan()
        changed = _what_changed(kept.layout, self._layout(planner, writer, group))
        if changed is not None:
            return _FRESH, changed
        assert planner.local_plan is not None
        writer.prepare_local_plan(planner.local_plan)  # its folder, as dcp.save
        final_plan = planner.finish_plan(kept.final_plan)
        # A rank whose layout changed writes nothing here, so no rank waits
        # for the others in the writer (pippy.checkpoint.stall): the gather
        # that follows is where they meet; a fresh plan's dcp.save waits as usual.
        with stall.suspended():
            results = writer.write_data(final_plan, planner).wait()
        return _WRITTEN, (kept.token, results)

    def _decide(
        self, verdicts: list[tuple[str, Any]], writer: StorageWriter
    ) -> tuple[str, Any]:
        """On the coordinator: finish with the kept metadata, or say why not."""
        failures = {r: v[1] for r, v in enumerate(verdicts) if v[0] == _FAILED}
        if failures:
            return _FAILED, failures
        kept = self._kept
        token = kept.token if kept is not None and kept.metadata else None
        reasons = {r: v[1] for r, v in enumerate(verdicts) if v[0] == _FRESH}
        for r, (kind, detail) in enumerate(verdicts):
            if kind == _WRITTEN and detail[0] != token and r not in reasons:
                reasons[r] = "its kept plan is another save's than the coordinator's"
        if reasons:
            return _FRESH, (uuid.uuid4().hex, reasons)
        assert kept is not None and kept.metadata is not None
        metadata = Metadata(
            kept.metadata.state_dict_metadata, planner_data=kept.metadata.planner_data
        )
        writer.finish(metadata, [detail[1] for _, detail in verdicts])
        return _DONE, None

    def _plan_afresh(
        self,
        state_dict: dict[str, Any],
        writer: StorageWriter,
        group: _Group,
        token: str,
        reasons: dict[int, str],
    ) -> None:
        """``dcp.save`` with DCP's default planner; its plan kept where it can be."""
        why = "; ".join(f"rank {r}: {reasons[r]}" for r in sorted(reasons))
        if group.rank == 0:
            first = len(reasons) == group.size and all(
                v == "no plan kept" for v in reasons.values()
            )
            logger.log(
                logging.DEBUG if first else logging.INFO, "planning afresh: %s", why
            )
        planner = _KeepingPlanner()
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=group.group,
            no_dist=not group.on,
        )
        self.plans_made += 1
        if _writer_settings(writer) is None or planner.final_plan is None:
            return
        self._kept = _Kept(
            token,
            self._layout(planner, writer, group),
            planner.final_plan,
            planner.kept_metadata,
        )
