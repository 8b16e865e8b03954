"""What checkpointing a pipeline costs: pippy's DCP saves against baselines and disk.

One command launches its own ranks (``python -m torch.distributed.run``) for
P = 2 and P = 4 pipeline stages and, at each model size, times in one run:

* ``pippy_sync``: the steps of ``examples/checkpoint/pippy_dcp.py``'s
  ``save()``: ``StageState.state_dict()``, ``checkpoint.check_keys``, and
  ``dcp.save`` on every rank into one step folder of ``publish_step``.
  ``pippy_sync_cached``: the same with
  ``DefaultSavePlanner(enable_plan_caching=True)`` (not used by pippy: torch
  2.13 compares cached plans without dtypes). ``pippy_sync_nocrc``: the same
  without ``torch.save``'s CRC-32 of every item
  (``torch.serialization.set_crc32_options(False)``, a process-wide setting;
  ``torch.load`` never checks that CRC).
* ``pippy_async``: ``pippy_sync`` with ``dcp.async_save`` on a gloo group
  (``checkpoint.AsyncSaver`` untuned): ``blocked`` until it returns, ``wall``
  until ``future.result()`` and the step is published.
* ``pippy_async_tuned``: the same with one ``DefaultStager`` kept across
  saves (staging buffers allocated once), as ``checkpoint.AsyncSaver`` has it.
* ``dcp_flat_optim``: ``pippy_sync`` with the optimizer state as
  torchtitan saves it, ``get_optimizer_state_dict(...,
  flatten_optimizer_state_dict=True)``: one item per parameter and option,
  where ``StageState`` packs a parameter's options and step into one item.
* ``torch_save_stage``: ``torch.save`` of each stage's state_dict, all at once.
* ``gather_rank0``: the stages' tensors sent to rank 0, one ``torch.save``.
* ``raw_write``: the ceiling: the same bytes by the same writers, one file
  each. ``copy_fresh`` / ``copy_reuse``: the floor of async staging: a bare
  copy of the same tensors into new / already allocated memory.
* ``load_same``: the example's ``load()`` of a P-rank checkpoint on P ranks
  (``load_same_dcp``: plain ``dcp.load``, without pippy's safe reader and
  planner). ``load_reshard``: a 4-rank checkpoint loaded on 2 ranks, against
  ``load_same`` of the same model saved by 2 ranks. ``load_unsplit``: the
  4-rank checkpoint into the un-split model in one plain process, against
  ``torch_load_full``: ``torch.load`` of ``gather_rank0``'s file.

Every file written is ``fsync``ed (DCP does by default) and deleted after each
repeat. Before each load the checkpoint's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``) unless ``--warm-cache``. Peak memory is each
rank's RSS high-water mark, ``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs`` (after ``malloc_trim``) just before each method:
``peak`` is the highest over ranks, ``extra`` the highest rise over the RSS
the rank had just before the method.

    python bench/bench_checkpoint.py --quick --out-dir bench/results
    python bench/bench_checkpoint.py --out-dir bench/results-full

``--quick`` (a few minutes on 2 cores): 50 and 150 MB of model + AdamW state
per rank, a 50 MB case with 4x the keys, 5 repeats; the full mode goes up to
500 MB per rank with 7 repeats. The output folder gets ``results.json`` (every
repeat, medians, ratios, target checks), ``results.md`` (the tables) and
``results.png`` (time against bytes per method). Compare the ratios of one
run, never absolute times across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "checkpoint"))
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint import _leaves as leaves  # noqa: E402  (DCP's item names)

import pippy_dcp  # noqa: E402

log = logging.getLogger("bench")
MB = 1e6
STEP = 1  # the step every save writes; its folder is deleted after each repeat
# DCP's default staging on CPU, but kept across saves by pippy_async_tuned.
CPU_STAGING = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=False,
    use_non_blocking_copy=False,
)
# The cross-rank key check that the example's save() runs before dcp.save
# (check_keys; named check_disjoint_keys in earlier versions of pippy).
check_keys = getattr(checkpoint, "check_keys", None) or checkpoint.check_disjoint_keys
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


# --------------------------------------------------------------------------
# The model at a given size
# --------------------------------------------------------------------------


@dataclass
class Case:
    """One model: ``n_layers`` blocks of width ``dim``, split into ``stages``."""

    label: str
    stages: int
    dim: int
    n_layers: int


def dim_for(mb_per_rank: float, stages: int, n_layers: int) -> int:
    """Width whose stage holds about ``mb_per_rank`` MB of weights + AdamW state.

    A block has 12 dim^2 weights; with AdamW's two moments, in fp32, that is
    144 dim^2 bytes. Rounded to a multiple of 8 (4 heads of even size).
    """
    per_dim2 = 144 * n_layers / stages
    return max(8, round(math.sqrt(mb_per_rank * MB / per_dim2) / 8) * 8)


def make_cases(sizes_mb: list[float], stages: int, n_layers: int, keys_x: int):
    """Each size; and with ``keys_x`` > 1, the smallest with that many more layers."""
    cases = [
        Case(f"{mb:g}MB", stages, dim_for(mb, stages, n_layers), n_layers)
        for mb in sizes_mb
    ]
    if keys_x > 1:
        mb, layers = min(sizes_mb), n_layers * keys_x
        dim = dim_for(mb, stages, layers)
        cases.append(Case(f"{mb:g}MB-x{keys_x}keys", stages, dim, layers))
    return cases


def build_module(case: Case, rank: int, stages: int, seed: int) -> pippy_dcp.GPT:
    """The example's GPT split like its manual split, built on ``meta`` first."""
    margs = pippy_dcp.ModelArgs(n_layers=case.n_layers, dim=case.dim, max_seq_len=32)
    with torch.device("meta"):
        model = pippy_dcp.GPT(margs)
    module = pippy_dcp.split_manual(model, rank, stages)
    module.to_empty(device="cpu")
    pippy_dcp.init_weights(module, seed)
    module.get_buffer("rope").copy_(pippy_dcp.rope_table(margs))
    return module


def build_state(
    case: Case, rank: int, stages: int, *, seed: int = 0, stepped: bool = True
) -> checkpoint.StageState:
    """A stage and AdamW; ``stepped``: after one step with fixed gradients.

    The gradients depend on the weights alone, so any split of the same model
    holds bitwise the same state and a resharded load can be checked exactly.
    """
    module = build_module(case, rank, stages, seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    if stepped:
        for param in module.parameters():
            param.grad = param.detach() * 0.5
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return checkpoint.StageState(module, optimizer, step=STEP)


def tensors_of(state: checkpoint.StageState) -> list[torch.Tensor]:
    return [v for _, v in leaves(state.state_dict()) if isinstance(v, torch.Tensor)]


# --------------------------------------------------------------------------
# Measuring one method on every rank: time and RSS high-water mark
# --------------------------------------------------------------------------


def memory_kb(field_name: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", status).group(1))


def reset_peak_memory() -> None:
    """Returns what malloc keeps free to the OS, then sets VmHWM to the RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(folder: Path) -> None:
    """Evicts a folder's files from the page cache, so that a load reads the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # only clean pages can be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_ranks(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@dataclass
class Method:
    """``run`` is timed; it may return ``{"blocked_s": s}`` (default: its wall)
    and ``{"parts": {name: s}}``, the seconds of each part of its time.

    ``prepare`` and ``cleanup`` run on every rank, outside the timed region.
    """

    run: Callable[[], dict | None]
    prepare: Callable[[], None] | None = None
    cleanup: Callable[[], None] | None = None


def measure(method: Method) -> dict[str, float]:
    """Runs a method on all ranks at once; its time is the slowest rank's."""
    if method.prepare:
        method.prepare()
    os.sync()  # no method pays for the write-back of the one before
    reset_peak_memory()
    barrier()
    before = memory_kb("VmRSS")
    start = time.perf_counter()
    out = method.run() or {}
    wall = time.perf_counter() - start
    peak = memory_kb("VmHWM")
    if method.cleanup:
        method.cleanup()
    ranks = all_ranks((wall, out.get("blocked_s", wall), before, peak, out))
    slowest = max(ranks, key=lambda r: r[0])
    return {
        "wall_s": slowest[0],
        "blocked_s": max(r[1] for r in ranks),
        "peak_rss_mb": max(r[3] for r in ranks) * 1024 / MB,
        "extra_rss_mb": max(r[3] - r[2] for r in ranks) * 1024 / MB,
        # the parts of the slowest rank's time, if the method reports them
        **{f"{k}_s": v for k, v in slowest[4].get("parts", {}).items()},
    }


# --------------------------------------------------------------------------
# The methods
# --------------------------------------------------------------------------


@dataclass
class Ctx:
    """What the methods of one case share on one rank."""

    case: Case
    state: checkpoint.StageState
    rank: int
    world: int
    work: Path
    async_group: Any = None
    stager: Any = None
    buffers: list[torch.Tensor] = field(default_factory=list)

    def remover(self, name: str) -> Callable[[], None]:
        """A cleanup that deletes the method's folder once every rank is done."""

        def cleanup() -> None:
            barrier()
            if self.rank == 0:
                shutil.rmtree(self.work / name, ignore_errors=True)
            barrier()

        return cleanup


def quiet(fn: Callable, *args: Any) -> Any:
    """Calls one of the example's functions without its per-rank log line."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def flat_optim(state: checkpoint.StageState) -> dict[str, Any]:
    """The state_dict with the optimizer as torchtitan and OLMo-core save it.

    ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``: one item
    per parameter and option or scalar, where ``StageState`` packs those into
    one item per parameter.
    """
    state_dict = state.state_dict()
    state_dict["optim"] = get_optimizer_state_dict(
        state.module, state.optimizer, options=FLAT_OPTIM
    )
    return state_dict


class TimedWriter(FileSystemWriter):
    """DCP's file system writer, noting when its ``write_data`` starts and ends.

    ``dcp.save`` plans (every rank's plan to the coordinator and back), then
    calls ``write_data`` on every rank, then gathers the write results for the
    coordinator's ``.metadata``; these marks split its time into the three.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.marks: dict[str, float] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.marks["write"] = time.perf_counter()
        future = super().write_data(plan, planner)
        future.wait()  # FileSystemWriter writes before returning; to be sure
        self.marks["written"] = time.perf_counter()
        return future


def sync_save(
    state: checkpoint.StageState,
    folder: Path,
    planner=None,
    *,
    flat: bool = False,
    crc32: bool = True,
) -> dict[str, float]:
    """The example's save(): key check, one step folder, ``dcp.save`` on all ranks.

    ``flat``: the optimizer as :func:`flat_optim`; ``crc32=False``: without
    ``torch.save``'s CRC-32 of every item (a process-wide torch setting).

    Returns:
        Seconds of each part: ``pippy`` (``state_dict()``, the key check and
        ``publish_step``, with their collectives), and of ``dcp.save``:
        ``dcp_plan`` (until the writes start), ``dcp_write`` (every item
        through ``torch.save`` and ``fsync``), ``dcp_finish`` (write results
        to the coordinator, ``.metadata``, outcome back to every rank).
    """
    start = time.perf_counter()
    state_dict = flat_optim(state) if flat else state.state_dict()
    check_keys(state_dict)
    with checkpoint.publish_step(folder, STEP) as checkpoint_id:
        writer = TimedWriter(checkpoint_id)
        torch.serialization.set_crc32_options(crc32)
        try:
            before = time.perf_counter()
            dcp.save(state_dict, storage_writer=writer, planner=planner)
            after = time.perf_counter()
        finally:
            torch.serialization.set_crc32_options(True)
    marks = writer.marks
    dcp_s = {
        "dcp_plan": marks["write"] - before,
        "dcp_write": marks["written"] - marks["write"],
        "dcp_finish": after - marks["written"],
    }
    return {"pippy": time.perf_counter() - start - (after - before), **dcp_s}


def async_save(ctx: Ctx, folder: Path, planner=None, stager=None) -> float:
    """The same with ``dcp.async_save`` on the dedicated gloo group.

    Returns:
        Seconds until ``async_save`` returned (the training loop's wait); the
        function itself returns once the save is complete and published.
    """
    start = time.perf_counter()
    state_dict = ctx.state.state_dict()
    check_keys(state_dict)
    with checkpoint.publish_step(folder, STEP) as checkpoint_id:
        future = dcp.async_save(
            state_dict,
            checkpoint_id=checkpoint_id,
            planner=planner,
            process_group=ctx.async_group,
            async_stager=stager,
        )
        blocked = time.perf_counter() - start
        future.result()
    return blocked


def pippy_save(
    ctx: Ctx,
    name: str,
    *,
    asynchronous: bool,
    tuned: bool = False,
    cached: bool = False,
    **variant: bool,
) -> Method:
    """pippy's save, sync or async; ``tuned``: async with the kept stager.

    ``cached``: with DCP's plan caching; ``variant``: ``flat`` or ``crc32``
    of :func:`sync_save`.
    """
    planner = DefaultSavePlanner(enable_plan_caching=True) if cached else None
    stager = ctx.stager if tuned else None

    def run() -> dict:
        if asynchronous:
            return {"blocked_s": async_save(ctx, ctx.work / name, planner, stager)}
        return {"parts": sync_save(ctx.state, ctx.work / name, planner, **variant)}

    return Method(run=run, cleanup=ctx.remover(name))


def torch_save_stage(ctx: Ctx, name: str) -> Method:
    """Baseline: each rank ``torch.save``s its model and optimizer state_dicts."""

    def run() -> None:
        (ctx.work / name).mkdir(parents=True, exist_ok=True)
        path = ctx.work / name / f"stage-{ctx.rank}.pt"
        state = {
            "model": ctx.state.module.state_dict(),
            "optim": ctx.state.optimizer.state_dict(),
        }
        torch.save(state, path)
        fsync_path(path)

    return Method(run=run, cleanup=ctx.remover(name))


def gather_rank0(ctx: Ctx, name: str, keep: Path | None) -> Method:
    """Baseline: each stage's tensors to rank 0 as one flat byte buffer, one file.

    Rank 0 writes the un-split model's flat ``{key: value}`` dict; ``keep``
    holds the last one for ``torch_load_full``.
    """

    def run() -> None:
        flat = dict(leaves(ctx.state.state_dict()))
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


def load_into_fresh(
    case: Case, rank: int, world: int, path: Path, cold: bool, plain: bool = False
) -> Method:
    """The example's ``load()`` (``plain``: bare ``dcp.load``) into a new stage.

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
        state = holder["state"]
        if not plain:
            quiet(pippy_dcp.load, state, path, rank)
            return
        state_dict = state.state_dict()
        dcp.load(state_dict, checkpoint_id=path)
        state.load_state_dict(state_dict)

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


# --------------------------------------------------------------------------
# Worker phases: on P ranks, or in one plain process
# --------------------------------------------------------------------------


def init_ranks() -> tuple[int, int]:
    if "RANK" not in os.environ:
        sys.exit("--phase runs under torch.distributed.run; run without it")
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def verify_load(reference: checkpoint.StageState, path: Path, case, rank, world):
    """Loads ``path`` into a new stage and checks it bitwise against ``reference``."""
    fresh = build_state(case, rank, world, seed=1, stepped=False)
    quiet(pippy_dcp.load, fresh, path, rank)
    differ = checkpoint.diff_state_dicts(fresh.state_dict(), reference.state_dict())
    if any(all_ranks(bool(differ))):
        raise RuntimeError(f"{path} loaded on rank {rank} differs: {differ[:5]}")


def case_tag(case: Case, state: checkpoint.StageState, world: int) -> dict:
    """The case's bytes and keys: per rank (the largest stage) and in all."""
    sd = state.state_dict()
    n_tensors, nbytes = checkpoint.state_dict_size(sd)
    items, flat_items = (sum(1 for _ in leaves(d)) for d in (sd, flat_optim(state)))
    per_rank = all_ranks((n_tensors, items, nbytes, flat_items))
    return {
        **asdict(case),
        "case": case.label,
        "ranks": world,
        "saved_by": world,
        "bytes_per_rank": max(r[2] for r in per_rank),
        "total_bytes": sum(r[2] for r in per_rank),
        "tensors_per_rank": max(r[0] for r in per_rank),
        "items_per_rank": max(r[1] for r in per_rank),
        "flat_items_per_rank": max(r[3] for r in per_rank),
    }


def run_repeats(methods: dict[str, Method], repeats: int, tag: dict) -> list[dict]:
    """Each repeat runs every method once: the saves, then the loads.

    Each group is shuffled per repeat (the same order on every rank), so that
    no method always follows the same one: a method can slow the next (a cold
    load, the next write 2x; freeing 500 MB of buffers, the next save), and a
    fixed or merely rotated order would charge that to one method every time.
    """
    rows = []
    saves = [n for n in methods if not n.startswith("load")]
    loads = [n for n in methods if n.startswith("load")]
    for rep in range(repeats):
        shuffle = random.Random(rep).sample
        order = shuffle(saves, len(saves)) + shuffle(loads, len(loads))
        for name in order:
            row = {**tag, "method": name, "repeat": rep, **measure(methods[name])}
            rows.append(row)
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.info(
                    "%s P=%d %-12s rep %d %-18s wall %6.2f s  blocked %6.2f s  "
                    "extra %5.0f MB",
                    *(tag["phase"], tag["ranks"], tag["case"], rep, name),
                    *(row["wall_s"], row["blocked_s"], row["extra_rss_mb"]),
                )
    return rows


def save_methods(ctx: Ctx, keep: Path | None, cold: bool) -> dict[str, Method]:
    loaded = checkpoint.step_dir(ctx.work / "ckpt", STEP)
    args = (ctx.case, ctx.rank, ctx.world, loaded, cold)
    return {
        "pippy_sync": pippy_save(ctx, "pippy_sync", asynchronous=False),
        "pippy_sync_cached": pippy_save(
            ctx, "pippy_sync_cached", asynchronous=False, cached=True
        ),
        "pippy_sync_nocrc": pippy_save(
            ctx, "pippy_sync_nocrc", asynchronous=False, crc32=False
        ),
        "dcp_flat_optim": pippy_save(
            ctx, "dcp_flat_optim", asynchronous=False, flat=True
        ),
        "pippy_async": pippy_save(ctx, "pippy_async", asynchronous=True),
        "pippy_async_tuned": pippy_save(
            ctx, "pippy_async_tuned", asynchronous=True, tuned=True
        ),
        "torch_save_stage": torch_save_stage(ctx, "torch_save_stage"),
        "gather_rank0": gather_rank0(ctx, "gather_rank0", keep),
        "raw_write": raw_write(ctx, "raw_write"),
        "copy_fresh": copy_fresh(ctx),
        "copy_reuse": copy_reuse(ctx),
        "load_same": load_into_fresh(*args),
        "load_same_dcp": load_into_fresh(*args, plain=True),
    }


def verify_tuned(ctx: Ctx) -> float:
    """Checks that the cached-plan and kept-stager saves load back bitwise.

    This also fills the kept stager's buffers, so that the tuned async repeats
    measure the steady state.

    Returns:
        MB that the kept stager (and cached plans) hold on, the most of any
        rank: its RSS after these saves less before.
    """
    reset_peak_memory()
    before = memory_kb("VmRSS")
    for asynchronous in (False, True):
        method = pippy_save(
            ctx, "verify", asynchronous=asynchronous, tuned=True, cached=True
        )
        method.run()
        path = checkpoint.step_dir(ctx.work / "verify", STEP)
        verify_load(ctx.state, path, ctx.case, ctx.rank, ctx.world)
        method.cleanup()
    reset_peak_memory()
    return max(all_ranks((memory_kb("VmRSS") - before) * 1024 / MB))


def phase_save(opts: argparse.Namespace) -> None:
    """Every save method and the same-degree loads, for each case of one degree."""
    rank, world = init_ranks()
    async_group = dist.new_group(backend="gloo")
    rows: list[dict] = []
    for case in [Case(**c) for c in json.loads(opts.cases)]:
        work = Path(opts.work_dir) / f"P{world}-{case.label}"
        state = build_state(case, rank, world)
        ctx = Ctx(case, state, rank, world, work, async_group)
        ctx.stager = DefaultStager(CPU_STAGING)
        keep = Path(opts.keep_dir) / case.label if opts.keep_dir else None
        sync_save(state, work / "ckpt")  # for load_same
        verify_load(state, checkpoint.step_dir(work / "ckpt", STEP), case, rank, world)
        held = verify_tuned(ctx)
        methods = save_methods(ctx, keep and keep / "full.pt", not opts.warm_cache)
        tag = case_tag(case, state, world) | {"phase": "save"}
        case_rows = run_repeats(methods, opts.repeats, tag)
        ctx.stager.close()
        rows += [r | {"stager_held_mb": held} for r in case_rows]
        barrier()
        if rank == 0:
            if keep is not None:
                shutil.move(str(work / "ckpt"), keep / "ckpt")
            shutil.rmtree(work, ignore_errors=True)
        del ctx, state, methods
        barrier()
    if rank == 0:
        Path(opts.result_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def phase_reshard(opts: argparse.Namespace) -> None:
    """A checkpoint saved by 4 ranks loaded by 2, against one saved by 2."""
    rank, world = init_ranks()
    rows: list[dict] = []
    cold = not opts.warm_cache
    for case in [Case(**c) for c in json.loads(opts.cases)]:
        kept = checkpoint.step_dir(Path(opts.keep_dir) / case.label / "ckpt", STEP)
        work = Path(opts.work_dir) / f"reshard-{case.label}"
        state = build_state(case, rank, world)  # the same model, split in `world`
        sync_save(state, work)
        verify_load(state, kept, case, rank, world)
        tag = case_tag(case, state, world) | {"phase": "reshard"}
        del state
        methods = {
            "load_same": load_into_fresh(
                case, rank, world, checkpoint.step_dir(work, STEP), cold
            ),
            "load_reshard": load_into_fresh(case, rank, world, kept, cold),
        }
        for row in run_repeats(methods, opts.repeats, tag):
            if row["method"] == "load_reshard":
                row["saved_by"] = case.stages
            rows.append(row)
        barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    if rank == 0:
        Path(opts.result_file).write_text(json.dumps(rows))
    dist.destroy_process_group()


def phase_unsplit(opts: argparse.Namespace) -> None:
    """The 4-rank checkpoint into the un-split model, in one plain process."""
    rows: list[dict] = []
    cold = not opts.warm_cache
    for case in [Case(**c) for c in json.loads(opts.cases)]:
        kept = Path(opts.keep_dir) / case.label
        ckpt = checkpoint.step_dir(kept / "ckpt", STEP)
        state = build_state(case, 0, 1)
        verify_load(state, ckpt, case, 0, 1)
        tag = case_tag(case, state, 1) | {"phase": "unsplit", "saved_by": case.stages}
        del state
        methods = {
            "load_unsplit": load_into_fresh(case, 0, 1, ckpt, cold),
            "torch_load_full": torch_load_full(case, kept / "full.pt", cold),
        }
        rows += run_repeats(methods, opts.repeats, tag)
    Path(opts.result_file).write_text(json.dumps(rows))


# --------------------------------------------------------------------------
# Summary: medians, ratios, the targets
# --------------------------------------------------------------------------

# Each ratio column: the method's median wall time over this reference's, in
# the same phase, degree and case.
REFERENCES = {
    "x_raw": "raw_write",
    "x_torch_save": "torch_save_stage",
    "x_gather": "gather_rank0",
    "x_ref_load": "load_same",
    "x_torch_load": "torch_load_full",
}


def summarize(rows: list[dict]) -> list[dict]:
    """Median, min and max over repeats of each (phase, degree, case, method)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["phase"], row["ranks"], row["case"], row["method"])
        groups.setdefault(key, []).append(row)
    summary = []
    for (phase, ranks, case, method), group in groups.items():
        walls = [r["wall_s"] for r in group]
        blocked = [r["blocked_s"] for r in group]
        keep = ("saved_by", "bytes_per_rank", "total_bytes", "items_per_rank")
        keep += ("flat_items_per_rank", "tensors_per_rank")
        wall = statistics.median(walls)
        summary.append(
            {
                "phase": phase,
                "ranks": ranks,
                "case": case,
                "method": method,
                **{k: group[0][k] for k in keep},
                "repeats": len(group),
                "wall_s": wall,
                "wall_min_s": min(walls),
                "wall_max_s": max(walls),
                "blocked_s": statistics.median(blocked),
                "blocked_min_s": min(blocked),
                "blocked_max_s": max(blocked),
                "gb_per_s": group[0]["total_bytes"] / wall / 1e9,
                "peak_rss_mb": max(r["peak_rss_mb"] for r in group),
                "extra_rss_mb": statistics.median(r["extra_rss_mb"] for r in group),
                "extra_rss_max_mb": max(r["extra_rss_mb"] for r in group),
                "stager_held_mb": group[0].get("stager_held_mb"),
                **{
                    part: statistics.median(r[part] for r in group)
                    for part in PARTS
                    if part in group[0]
                },
            }
        )
    index = {(s["phase"], s["ranks"], s["case"], s["method"]): s for s in summary}
    for s in summary:
        for col, method in REFERENCES.items():
            ref = index.get((s["phase"], s["ranks"], s["case"], method))
            if ref is not None and ref is not s:
                s[col] = s["wall_s"] / ref["wall_s"]
    return summary


def check(
    target: str,
    where: str,
    num: dict,
    den: dict,
    limit: float,
    *,
    times: tuple[str, str] = ("wall", "wall"),
    factor: float = 1.0,
) -> dict:
    """``num``'s time over ``den``'s: of the medians (judged) and of the minima.

    The minima are the repeats least disturbed by other work on the machine.
    """
    (t_num, t_den) = times
    value = num[f"{t_num}_s"] / den[f"{t_den}_s"] * factor
    best = num[f"{t_num}_min_s"] / den[f"{t_den}_min_s"] * factor
    return {
        "target": target,
        "where": where,
        "value": value,
        "best": best,
        "limit": limit,
        "met": value <= limit,
    }


def save_checks(summary: list[dict]) -> list[dict]:
    """Sync against the ceiling and rank 0; async blocking against copy and sync."""
    checks = []
    for m in save_cases(summary):
        where = f"P={m['pippy_sync']['ranks']} {m['pippy_sync']['case']}"
        for sync in ("pippy_sync",):
            checks.append(
                check(f"{sync} / raw_write", where, m[sync], m["raw_write"], 1.3)
            )
            gather = m["gather_rank0"]
            checks.append(check(f"{sync} / gather_rank0", where, m[sync], gather, 1.0))
        blocked = ("blocked", "wall")
        for name in ("pippy_async", "pippy_async_tuned"):
            for ref, limit in (("copy_fresh", 1.5), ("pippy_sync", 0.2)):
                target = f"{name} blocked / {ref}"
                checks.append(
                    check(target, where, m[name], m[ref], limit, times=blocked)
                )
    return checks


def size_of(methods: dict[str, dict]) -> int:
    return next(iter(methods.values()))["total_bytes"]


def load_checks(summary: list[dict]) -> list[dict]:
    """A load into another degree against the same-degree load of the same model."""
    index = {(s["phase"], s["ranks"], s["case"], s["method"]): s for s in summary}
    checks = []
    for s in summary:
        if s["method"] == "load_reshard":
            same = index[s["phase"], s["ranks"], s["case"], "load_same"]
            where = f"{s['saved_by']}->{s['ranks']} ranks {s['case']}"
            checks.append(check("load_reshard / load_same", where, s, same, 1.3))
    return checks


def linearity_checks(summary: list[dict]) -> list[dict]:
    """Seconds per byte of the sync saves: large / small size, more keys / base.

    Fixed costs make small saves dearer per byte; growing faster than the
    bytes would show as a large size dearer per byte than a small one.
    """
    checks = []
    for s in summary:
        if s["phase"] != "save" or s["method"] not in ("pippy_sync", "dcp_flat_optim"):
            continue
        same = [
            t
            for t in summary
            if (t["phase"], t["ranks"], t["method"])
            == ("save", s["ranks"], s["method"])
            and "keys" not in t["case"]
        ]
        ordered = sorted(same, key=lambda t: t["total_bytes"])
        small, large = ordered[0], ordered[-1]
        if s is large and len(same) > 1:
            where = f"P={s['ranks']} {small['case']} vs {large['case']}"
            factor = small["total_bytes"] / large["total_bytes"]
            target = f"{s['method']} s/byte large / small"
            checks.append(check(target, where, large, small, 1.3, factor=factor))
        if "keys" in s["case"]:
            where = f"P={s['ranks']} {s['case']} vs {small['case']}"
            factor = small["total_bytes"] / s["total_bytes"]
            target = f"{s['method']} s/byte more keys / base"
            checks.append(check(target, where, s, small, 1.3, factor=factor))
    return checks


def evaluate_targets(summary: list[dict]) -> list[dict]:
    """The issue's targets, per degree and size, from this run's ratios alone."""
    return save_checks(summary) + load_checks(summary) + linearity_checks(summary)


# --------------------------------------------------------------------------
# Report: tables, plot
# --------------------------------------------------------------------------


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def full_table(summary: list[dict]) -> str:
    """Every method: bytes, seconds, GB/s, memory and the ratios."""

    def ratio(s: dict, col: str) -> str:
        return f"{s[col]:.2f}" if col in s else ""

    head = [
        "ranks",
        "case",
        "method",
        "MB/rank",
        "items/rank",
        "wall s: median [min-max]",
        "blocked s",
        "GB/s",
        "peak RSS MB",
        "extra MB",
        *REFERENCES,
    ]
    rows = []
    for s in summary:
        blocked = s["blocked_s"] < s["wall_s"] - 1e-9
        rows.append(
            [
                f"{s['saved_by']}->{s['ranks']}",
                s["case"],
                s["method"],
                f"{s['bytes_per_rank'] / MB:.0f}",
                str(s["items_per_rank"]),
                f"{s['wall_s']:.2f} [{s['wall_min_s']:.2f}-{s['wall_max_s']:.2f}]",
                f"{s['blocked_s']:.3f}" if blocked else "",
                f"{s['gb_per_s']:.2f}",
                f"{s['peak_rss_mb']:.0f}",
                f"{s['extra_rss_mb']:.0f}",
                *(ratio(s, col) for col in REFERENCES),
            ]
        )
    return markdown(head, rows)


def targets_table(checks: list[dict]) -> str:
    rows = [
        [
            c["target"],
            c["where"],
            f"{c['value']:.2f}",
            f"{c['best']:.2f}",
            f"<= {c['limit']}",
            "met" if c["met"] else "**not met**",
        ]
        for c in checks
    ]
    head = ["target", "where", "ratio of medians", "ratio of minima", "limit", ""]
    return markdown(head, rows)


def save_cases(summary: list[dict]) -> list[dict[str, dict]]:
    """The save phase's methods, one dict per (degree, case), smallest first."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for s in summary:
        if s["phase"] == "save":
            by_case.setdefault((s["ranks"], s["case"]), {})[s["method"]] = s
    order = sorted(by_case, key=lambda k: (k[0], "keys" in k[1], size_of(by_case[k])))
    return [by_case[k] for k in order]


def headline_table(summary: list[dict]) -> str:
    """Per degree and size: the saves' medians and their ratios to the references."""
    head = ["P", "case", "MB/rank", "items/rank (flat)", "raw_write s"]
    head += ["copy_fresh s", "pippy_sync s (x raw, x gather, x torch.save)"]
    head += [f"{name} s (x raw)" for name in SYNC_VARIANTS]
    head += ["pippy_async blocked s (x copy, x sync)", "pippy_async_tuned (same)"]
    rows = []
    for m in save_cases(summary):
        sync = m["pippy_sync"]
        rows.append(
            [
                str(sync["ranks"]),
                sync["case"],
                f"{sync['bytes_per_rank'] / MB:.0f}",
                f"{sync['items_per_rank']} ({sync['flat_items_per_rank']})",
                f"{m['raw_write']['wall_s']:.2f}",
                f"{m['copy_fresh']['wall_s']:.2f}",
                f"{sync['wall_s']:.2f} ({sync['x_raw']:.2f}, {sync['x_gather']:.2f}, "
                f"{sync['x_torch_save']:.2f})",
                *(f"{m[n]['wall_s']:.2f} ({m[n]['x_raw']:.2f})" for n in SYNC_VARIANTS),
                blocked_cell(m, "pippy_async"),
                blocked_cell(m, "pippy_async_tuned"),
            ]
        )
    return markdown(head, rows)


SYNC_VARIANTS = ("pippy_sync_cached", "dcp_flat_optim", "pippy_sync_nocrc")
# The parts of a sync save's time that sync_save reports, in order.
PARTS = ("pippy_s", "dcp_plan_s", "dcp_write_s", "dcp_finish_s")


def parts_table(summary: list[dict]) -> str:
    """Where a sync save's time goes: each part's median, in units of raw_write.

    *fixed* is everything but the writes: pippy's and DCP's per-save work and
    collectives, which a faster write path would not remove. Each part is its
    own median over the repeats, so the parts need not sum to the wall.
    """
    head = ["P", "case", "method", "items/rank", "raw_write s", "wall s (x raw)"]
    head += [f"{part.removesuffix('_s')} s (x raw)" for part in PARTS]
    head += ["fixed: all but dcp_write (x raw)"]
    rows = []
    for m in save_cases(summary):
        raw = m["raw_write"]["wall_s"]
        for name in ("pippy_sync", "dcp_flat_optim", "pippy_sync_nocrc"):
            s = m[name]
            if not all(part in s for part in PARTS):
                continue
            fixed = sum(s[part] for part in PARTS if part != "dcp_write_s")
            flat = name == "dcp_flat_optim"
            items = s["flat_items_per_rank"] if flat else s["items_per_rank"]
            rows.append(
                [
                    str(s["ranks"]),
                    s["case"],
                    name,
                    str(items),
                    f"{raw:.3f}",
                    f"{s['wall_s']:.3f} ({s['wall_s'] / raw:.2f})",
                    *(f"{s[part]:.3f} ({s[part] / raw:.2f})" for part in PARTS),
                    f"{fixed:.3f} ({fixed / raw:.2f})",
                ]
            )
    return markdown(head, rows)


def blocked_cell(m: dict[str, dict], name: str) -> str:
    """An async save's blocked time, and its ratios to the copy and the sync save."""
    blocked = m[name]["blocked_s"]
    copy, sync = m["copy_fresh"]["wall_s"], m["pippy_sync"]["wall_s"]
    return f"{blocked:.3f} ({blocked / copy:.2f}, {blocked / sync:.2f})"


def memory_table(summary: list[dict]) -> str:
    """Per degree and size: what each method adds to a rank's RSS, at its peak."""
    names = ["pippy_sync", "pippy_async", "pippy_async_tuned", "gather_rank0"]
    names += ["torch_save_stage", "load_same"]
    head = ["P", "case", "state MB/rank", *names, "kept stager holds"]
    rows = []
    for m in save_cases(summary):
        first = m["pippy_sync"]
        rows.append(
            [
                str(first["ranks"]),
                first["case"],
                f"{first['bytes_per_rank'] / MB:.0f}",
                *(f"{m[n]['extra_rss_max_mb']:.0f}" for n in names),
                f"{first['stager_held_mb']:.0f}",
            ]
        )
    return markdown(head, rows)


def plot(summary: list[dict], path: Path) -> None:
    """Median wall time (min-max bars) against bytes: saves per degree, and loads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    degrees = sorted({s["ranks"] for s in summary if s["phase"] == "save"})
    panels = len(degrees) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.8 * panels, 6.2))
    for ax, ranks in zip(axes[:-1], degrees, strict=True):
        rows = [s for s in summary if s["phase"] == "save" and s["ranks"] == ranks]
        draw(ax, rows, lambda s: s["method"], f"P={ranks}: saves, copies, same load")
    loads = [s for s in summary if s["phase"] in ("reshard", "unsplit")]
    label = lambda s: f"{s['method']} {s['saved_by']}->{s['ranks']}"  # noqa: E731
    draw(axes[-1], loads, label, "loads into another degree")
    fig.tight_layout()
    fig.savefig(path, dpi=56)
    plt.close(fig)


def draw(ax, rows: list[dict], label: Callable[[dict], str], title: str) -> None:
    """One line per method (the x-keys case left out); async adds its blocked time."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.set_prop_cycle(color=[*plt.get_cmap("tab10").colors, "black", "gold"])
    lines: dict[str, list[dict]] = {}
    for s in rows:
        if "keys" not in s["case"]:
            lines.setdefault(label(s), []).append(s)
    for name, pts in lines.items():
        pts.sort(key=lambda s: s["total_bytes"])
        x = [s["total_bytes"] / 1e9 for s in pts]
        y = [s["wall_s"] for s in pts]
        low = [s["wall_s"] - s["wall_min_s"] for s in pts]
        high = [s["wall_max_s"] - s["wall_s"] for s in pts]
        style = "--" if name.startswith(("copy", "raw")) else "-"
        bars = ax.errorbar(
            x, y, yerr=[low, high], marker="o", ms=3, capsize=2, ls=style, label=name
        )
        if any(s["blocked_s"] < s["wall_s"] for s in pts):
            blocked = [s["blocked_s"] for s in pts]
            color = bars.lines[0].get_color()
            ax.plot(x, blocked, "v:", ms=4, color=color, label=f"{name} (blocked)")
    ax.set(title=title, xlabel="GB, all ranks", ylabel="seconds, median of repeats")
    ax.set(xscale="log", yscale="log")
    ticks = sorted({p["total_bytes"] / 1e9 for pts in lines.values() for p in pts})
    ax.set_xticks(ticks, labels=[f"{t:.2f}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)


def rounded(obj: Any) -> Any:
    """Floats to 4 significant digits, for a JSON file of readable size."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


def report(rows: list[dict], machine: dict, out: Path) -> None:
    summary = summarize(rows)
    checks = evaluate_targets(summary)
    text = (
        f"Command: `{machine['command']}`\n\n"
        f"Machine: {machine['cpus']} CPUs, torch {machine['torch']}, disk probe "
        f"(one writer, 512 MiB + fsync) {machine['disk_probe_gb_per_s']:.2f} GB/s, "
        f"{machine['seconds']} s in all.\n\n"
        f"## Saves\n\n{headline_table(summary)}\n\n"
        "## Where a sync save's time goes (median seconds of the slowest rank)\n\n"
        f"{parts_table(summary)}\n\n"
        "## Extra RSS per rank, MB (highest over ranks and repeats)\n\n"
        f"{memory_table(summary)}\n\n"
        f"## Targets\n\n{targets_table(checks)}\n\n"
        f"## All methods\n\n{full_table(summary)}\n"
    )
    (out / "results.md").write_text(text)
    result = {"machine": machine, "summary": summary, "targets": checks, "rows": rows}
    (out / "results.json").write_text(json.dumps(rounded(result), indent=1))
    plot(summary, out / "results.png")
    print(text)
    print(f"wrote {out / 'results.json'}, results.md and results.png")


# --------------------------------------------------------------------------
# The driver: launches the phases, then reports
# --------------------------------------------------------------------------


def launch(
    opts, phase: str, nproc: int, cases: list[Case], keep: bool = False
) -> list[dict]:
    """Runs a phase on ``nproc`` ranks (0: one plain process), with a timeout.

    ``keep``: the save phase keeps its checkpoints for the load phases.
    """
    result = Path(opts.work_dir) / f"rows-{phase}-{nproc}.json"
    worker = [
        str(Path(__file__).resolve()),
        *("--phase", phase, "--cases", json.dumps([asdict(c) for c in cases])),
        *("--work-dir", str(opts.work_dir), "--repeats", str(opts.repeats)),
        *("--result-file", str(result)),
        *(["--keep-dir", str(opts.keep_dir)] if keep or phase != "save" else []),
        *(["--warm-cache"] if opts.warm_cache else []),
    ]
    if nproc:
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        cmd = [sys.executable, *launcher, f"--nproc-per-node={nproc}", *worker]
    else:
        cmd = [sys.executable, *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    where = f"{nproc} ranks" if nproc else "one process"
    log.info("phase %s on %s: %s", phase, where, [c.label for c in cases])
    subprocess.run(cmd, env=env, timeout=opts.timeout, check=True, cwd=ROOT)
    return json.loads(result.read_text())


def probe_disk(folder: Path, nbytes: int = 512 * 2**20) -> float:
    """GB/s of one writer writing ``nbytes`` and fsyncing, right now."""
    path = folder / "probe.bin"
    block = os.urandom(2**20)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds / 1e9


def cases_of(opts: argparse.Namespace, stages: int, keys_x: int) -> list[Case]:
    if opts.dim:
        return [Case(f"dim{opts.dim}", stages, opts.dim, opts.n_layers)]
    return make_cases(opts.sizes_mb, stages, opts.n_layers, keys_x)


def run_all(opts: argparse.Namespace) -> None:
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if opts.work_dir:
        Path(opts.work_dir).mkdir(parents=True, exist_ok=True)
    # A new folder, inside --work-dir if given; only it is deleted at the end.
    opts.work_dir = Path(tempfile.mkdtemp(prefix="pippy-bench-", dir=opts.work_dir))
    opts.keep_dir = opts.work_dir / "keep"
    started = time.time()
    disk = probe_disk(opts.work_dir)
    log.info("disk probe: one writer, 512 MiB + fsync: %.2f GB/s", disk)
    top = max(opts.stages)
    rows: list[dict] = []
    try:
        for stages in opts.stages:
            cases = cases_of(opts, stages, opts.keys_x)
            rows += launch(opts, "save", stages, cases, keep=stages == top)
        if top >= 2:
            cases = cases_of(opts, top, keys_x=1)
            rows += launch(opts, "reshard", top // 2, cases)
            rows += launch(opts, "unsplit", 0, cases)
    finally:
        shutil.rmtree(opts.work_dir, ignore_errors=True)
    machine = {
        "command": " ".join(["python", *sys.argv]),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "disk_probe_gb_per_s": disk,
        "seconds": round(time.time() - started),
    }
    # The measurements first, so that a failing report loses nothing.
    (out / "rows.json").write_text(json.dumps({"machine": machine, "rows": rows}))
    report(rows, machine, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog="\n\n".join(doc.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--quick", action="store_true", help="50 and 150 MB per rank, 5 repeats")
    add("--out-dir", default="bench-out", help="folder for the JSON, tables and PNG")
    add("--work-dir", help="where checkpoints are written (default: a temp folder)")
    add("--sizes-mb", type=float, nargs="+", help="state per rank, MB (model+AdamW)")
    add("--stages", type=int, nargs="+", default=[2, 4], help="pipeline degrees")
    add("--n-layers", type=int, default=8, help="decoder blocks (divisible by 4)")
    add("--dim", type=int, help="one model of this width instead of --sizes-mb")
    add("--keys-x", type=int, default=4, help="extra case: x layers, same bytes")
    add("--repeats", type=int, help="repeats per method (quick: 5, full: 7)")
    add("--report", metavar="JSON", help="redo tables and plot from a rows.json")
    add("--timeout", type=float, default=1800, help="seconds per launched phase")
    add("--warm-cache", action="store_true", help="keep files cached before loads")
    # Internal: what the driver passes to the ranks it launches.
    add("--phase", choices=["save", "reshard", "unsplit"], help=argparse.SUPPRESS)
    add("--cases", help=argparse.SUPPRESS)
    add("--keep-dir", help=argparse.SUPPRESS)
    add("--result-file", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.sizes_mb is None:
        opts.sizes_mb = [50, 150] if opts.quick else [50, 150, 500]
    if opts.repeats is None:
        opts.repeats = 5 if opts.quick else 7
    return opts


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    opts = parse_args()
    phases = {"save": phase_save, "reshard": phase_reshard, "unsplit": phase_unsplit}
    if opts.phase:
        phases[opts.phase](opts)
    elif opts.report:
        saved = json.loads(Path(opts.report).read_text())
        Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
        report(saved["rows"], saved["machine"], Path(opts.out_dir))
    else:
        run_all(opts)


if __name__ == "__main__":
    main()
