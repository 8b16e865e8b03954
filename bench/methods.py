"""The methods the benchmark times: pippy's saves and loads, and the baselines.

The driver's docstring (``--help``) and bench/README.md describe each.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import (
    STEP,
    Case,
    Ctx,
    Loader,
    Method,
    barrier,
    build_state,
    drop_page_cache,
    flat_optim,
    fsync_path,
    is_load,
    tensors_of,
)
from peers import load_method, save_method
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from writers import (
    Crc32Writer,
    Marks,
    PlainTimedWriter,
    TimedWriter,
)

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.checks import named_leaves
from pippy.checkpoint.steps import step_dir

# --------------------------------------------------------------------------
# pippy's saves
# --------------------------------------------------------------------------


def sync_save(
    state: checkpoint.StageState,
    folder: Path,
    planner: DefaultSavePlanner | None = None,
    *,
    writer: type[Marks] = TimedWriter,
    flat: bool = False,
    **writer_kwargs: Any,
) -> dict[str, float]:
    """``save_stage``'s sequence into ``folder``, its time split into parts.

    The pieces ``save_stage`` is made of: ``take_state``, then ``dcp.save``
    through pippy's step writer (staged, published in its ``finish``).
    ``writer``: that writer with marks, or a variant of ``writers.py``, built
    with ``writer_kwargs`` (``thread_count``, ...); DCP's own writer
    (:class:`PlainTimedWriter`) writes ``step-<N>`` in place, unstaged.
    ``flat``: the optimizer keyed as DCP's helpers flatten it (torchtitan's
    keys: an item per option and per 0-dim ``step``), not packed.

    Returns:
        Seconds of each part: ``pippy`` (``state_dict()`` and the planner's
        checks), and of ``dcp.save``: ``dcp_plan`` (until the writes start),
        ``dcp_write`` (every item through ``torch.save`` and ``fsync``),
        ``dcp_finish`` (write results to the coordinator, ``.metadata``,
        manifest, publishing, outcome back to every rank).
    """
    start = time.perf_counter()
    taken = flat_optim(state) if flat else state
    state_dict, step, checked = checkpoint.take_state(taken, step=STEP, planner=planner)
    if writer is PlainTimedWriter:
        storage = writer(folder / f"step-{step}", **writer_kwargs)
    else:
        storage = writer(folder, step, **writer_kwargs)
    before = time.perf_counter()
    dcp.save(state_dict, storage_writer=storage, planner=checked)
    after = time.perf_counter()
    marks = storage.marks
    return {
        "pippy": before - start,
        "dcp_plan": marks["write"] - before,
        "dcp_write": marks["written"] - marks["write"],
        "dcp_finish": after - marks["written"],
    }


def sync_method(ctx: Ctx, name: str, **variant: Any) -> Method:
    """:func:`sync_save` into ``work/<name>``."""

    def run() -> dict:
        parts = sync_save(ctx.state, ctx.work / name, **variant)
        return {"parts": parts, "sizes": step_sizes(ctx.work / name / f"step-{STEP}")}

    return Method(run=run, cleanup=ctx.remover(name))


def step_sizes(folder: Path) -> dict[str, int]:
    """Bytes of a step's ``.metadata`` and ``manifest.json`` (0 where absent)."""
    return {
        name: (folder / name).stat().st_size if (folder / name).exists() else 0
        for name in (".metadata", "manifest.json")
    }


def dcp_save(ctx: Ctx, name: str) -> Method:
    """Baseline: plain ``dcp.save`` of the same state, DCP's own writer and planner.

    The state is taken as pippy takes it (``StageState.state_dict()``), inside
    the timed region; no key check, manifest or publishing.
    """
    folder = ctx.work / name / f"step-{STEP}"

    def run() -> dict:
        dcp.save(ctx.state.state_dict(), storage_writer=FileSystemWriter(folder))
        return {"sizes": step_sizes(folder)}

    return Method(run=run, cleanup=ctx.remover(name))


# --------------------------------------------------------------------------
# The baselines, the ceiling and the floor
# --------------------------------------------------------------------------


def gather_rank0(ctx: Ctx, name: str, keep: Path | None) -> Method:
    """Baseline: each stage's tensors to rank 0 as one flat byte buffer, one file.

    Rank 0 writes the un-split model's flat ``{key: value}`` dict; ``keep``
    holds the last one for ``torch_load_full``.
    """

    def run() -> None:
        flat = dict(named_leaves(ctx.state.state_dict()))
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        layout = [(k, t.dtype, t.shape, t.nbytes) for k, t in tensors.items()]
        others = {k: v for k, v in flat.items() if k not in tensors}
        infos: list[Any] = [None] * ctx.world
        dist.gather_object((layout, others), infos if ctx.rank == 0 else None, dst=0)
        if ctx.rank != 0:
            buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
            dist.send(buf, dst=0)
            return
        for src in range(1, ctx.world):
            src_layout, src_others = infos[src]
            flat.update(src_others)
            buf = torch.empty(sum(n for *_, n in src_layout), dtype=torch.uint8)
            dist.recv(buf, src=src)
            offset = 0
            for key, dtype, shape, nbytes in src_layout:
                flat[key] = buf[offset : offset + nbytes].view(dtype).view(shape)
                offset += nbytes
        (ctx.work / name).mkdir(parents=True, exist_ok=True)
        torch.save(flat, ctx.work / name / "full.pt")
        fsync_path(ctx.work / name / "full.pt")

    def cleanup() -> None:
        if ctx.rank == 0 and keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            os.replace(ctx.work / name / "full.pt", keep)
        ctx.remover(name)()

    return Method(run=run, cleanup=cleanup)


def raw_write(ctx: Ctx, name: str) -> Method:
    """The ceiling: this rank's tensor bytes straight into one file, fsynced."""

    def run() -> None:
        (ctx.work / name).mkdir(parents=True, exist_ok=True)
        with open(ctx.work / name / f"rank-{ctx.rank}.bin", "wb", buffering=0) as f:
            for t in tensors_of(ctx.state):
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            os.fsync(f.fileno())

    return Method(run=run, cleanup=ctx.remover(name))


def copy_fresh(ctx: Ctx) -> Method:
    """The floor of staging: every tensor copied into newly allocated memory."""

    def run() -> None:
        copies = [t.clone() for t in tensors_of(ctx.state)]
        del copies

    return Method(run=run)


def copy_reuse(ctx: Ctx) -> Method:
    """Every tensor copied into buffers allocated (and touched) beforehand."""

    def prepare() -> None:
        ctx.buffers = [torch.zeros_like(t) for t in tensors_of(ctx.state)]

    def run() -> None:
        for dst, src in zip(ctx.buffers, tensors_of(ctx.state), strict=True):
            dst.copy_(src)

    def cleanup() -> None:
        ctx.buffers = []

    return Method(run=run, prepare=prepare, cleanup=cleanup)


# --------------------------------------------------------------------------
# Loads
# --------------------------------------------------------------------------


def load_plain(state: checkpoint.StageState, path: Path) -> None:
    """Bare ``dcp.load`` and ``load_state_dict``: no safe reader, planner or check."""
    state_dict = state.state_dict()
    dcp.load(state_dict, checkpoint_id=path)
    state.load_state_dict(state_dict)


def load_unverified(state: checkpoint.StageState, path: Path) -> None:
    """``checkpoint.load_stage`` without checking items against manifest.json."""
    checkpoint.load_stage(state, path, verify=False)


def load_unsplit(state: checkpoint.StageState, path: Path) -> None:
    """``offline.load_model`` into the (un-split) stage's module and optimizer."""
    offline.load_model(path, state.module, state.optimizer)


def load_into_fresh(
    case: Case,
    rank: int,
    world: int,
    path: Path,
    cold: bool,
    load: Loader = checkpoint.load_stage,
) -> Method:
    """``load`` (pippy's ``load_stage`` by default) into a new stage.

    The stage and its (empty) AdamW are built outside the timed region, as a
    resumed run would have them; the page cache is dropped if ``cold``.
    """
    holder: dict[str, checkpoint.StageState] = {}

    def prepare() -> None:
        holder["state"] = build_state(case, rank, world, seed=1, stepped=False)
        barrier()
        if cold and rank == 0:
            drop_page_cache(path)

    def run() -> None:
        load(holder["state"], path)

    return Method(run=run, prepare=prepare, cleanup=holder.clear)


def torch_load_full(case: Case, path: Path, cold: bool) -> Method:
    """Baseline: ``torch.load`` of gather_rank0's file into the un-split model."""
    holder: dict[str, checkpoint.StageState] = {}

    def prepare() -> None:
        holder["state"] = build_state(case, 0, 1, seed=1, stepped=False)
        if cold:
            drop_page_cache(path.parent)

    def run() -> None:
        state = holder["state"]
        full = torch.load(path, weights_only=True)
        state_dict = state.state_dict()
        fill_from_flat(state_dict, full)
        state.load_state_dict(state_dict)

    return Method(run=run, prepare=prepare, cleanup=holder.clear)


def fill_from_flat(nested: dict, flat: dict, prefix: str = "") -> None:
    """Copies ``flat[dotted key]`` into a nested state_dict, in place."""
    for key, value in nested.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            fill_from_flat(value, flat, dotted + ".")
        elif isinstance(value, torch.Tensor):
            value.copy_(flat[dotted])
        else:
            nested[key] = flat[dotted]


def save_methods(ctx: Ctx, keep: Path | None, cold: bool) -> dict[str, Method]:
    """The save phase's methods by name, the peers' whose package imports
    included; its loads read ``work/ckpt``."""
    loaded = step_dir(ctx.work / "ckpt", STEP)
    args = (ctx.case, ctx.rank, ctx.world, loaded, cold)
    methods = {
        "pippy_sync": sync_method(ctx, "pippy_sync"),
        "pippy_sync_flat": sync_method(ctx, "pippy_sync_flat", flat=True),
        "pippy_sync_crc32": sync_method(ctx, "pippy_sync_crc32", writer=Crc32Writer),
        "pippy_sync_threads2": sync_method(ctx, "pippy_sync_threads2", thread_count=2),
        "pippy_sync_nomanifest": sync_method(
            ctx, "pippy_sync_nomanifest", writer=PlainTimedWriter
        ),
        "dcp_save": dcp_save(ctx, "dcp_save"),
        "gather_rank0": gather_rank0(ctx, "gather_rank0", keep),
        "raw_write": raw_write(ctx, "raw_write"),
        "copy_fresh": copy_fresh(ctx),
        "copy_reuse": copy_reuse(ctx),
        "load_same": load_into_fresh(*args),
        "load_same_dcp": load_into_fresh(*args, load=load_plain),
        "load_same_unverified": load_into_fresh(*args, load=load_unverified),
    }
    for name, peer in ctx.peers.items():
        if is_load(name):
            methods[name] = load_method(ctx, name, peer, cold)
        else:
            methods[name] = save_method(ctx, name, peer)
    return methods
