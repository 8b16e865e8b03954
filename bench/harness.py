"""The benchmark's model and its measuring harness, shared by every phase.

The model is the example's GPT (``examples/checkpoint/gpt.py``), split like
the example's manual split, its width chosen for a given size of stage. A
method is measured on every rank at once: its time is the slowest rank's, its
memory each rank's RSS high-water mark (``VmHWM``), reset just before it.
Every checkpoint kind that is timed loading is first checked bitwise
(:func:`verify_load`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
)

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.checks import named_leaves, state_dict_size

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "checkpoint"))
from gpt import GPT, ModelArgs, init_weights, rope_table  # noqa: E402
from pippy_dcp import split_manual  # noqa: E402

log = logging.getLogger("bench")
MB = 1e6
STEP = 1  # the step every save writes; its folder is deleted after each repeat
Loader = Callable[[checkpoint.StageState, Path], Any]
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


def build_module(case: Case, rank: int, stages: int, seed: int) -> GPT:
    """The example's GPT split like its manual split, built on ``meta`` first."""
    margs = ModelArgs(n_layers=case.n_layers, dim=case.dim, max_seq_len=32)
    with torch.device("meta"):
        model = GPT(margs)
    module = split_manual(model, rank, stages)
    module.to_empty(device="cpu")
    init_weights(module, seed)
    module.get_buffer("rope").copy_(rope_table(margs))
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


def flat_optim(state: checkpoint.StageState) -> dict[str, Any]:
    """The state_dict with the optimizer as torchtitan and OLMo-core save it."""
    model, optim = get_state_dict(state.module, state.optimizer, options=FLAT_OPTIM)
    return {"model": model, "optim": optim, "step": state.step}


def tensors_of(state: checkpoint.StageState) -> list[torch.Tensor]:
    """The tensors of the stage's state_dict, in DCP's item order."""
    items = named_leaves(state.state_dict())
    return [v for _, v in items if isinstance(v, torch.Tensor)]


def case_tag(case: Case, state: checkpoint.StageState, world: int) -> dict:
    """The case's bytes and keys: per rank (the largest stage) and in all."""
    sd = state.state_dict()
    n_tensors, nbytes = state_dict_size(sd)
    leaves = named_leaves
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


# --------------------------------------------------------------------------
# Measuring one method on every rank: time and RSS high-water mark
# --------------------------------------------------------------------------


def memory_kb(field_name: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", status).group(1))


def reset_peak_memory() -> None:
    """Returns what malloc keeps free to the OS, then sets VmHWM to the RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def fsync_path(path: Path) -> None:
    """Flushes a file's data to the disk."""
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
    """``dist.barrier()``, or nothing in a plain process."""
    if dist.is_initialized():
        dist.barrier()


def all_ranks(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` in a plain process)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@dataclass
class Method:
    """``run`` is timed; it may return ``{"blocked_s": s}`` (default: its wall)
    and ``{"parts": {name: s}}``, the seconds of each part of its time.

    ``prepare`` and ``cleanup`` run on every rank, outside the timed region,
    around each run; ``close`` once, after the last repeat.
    """

    run: Callable[[], dict | None]
    prepare: Callable[[], None] | None = None
    cleanup: Callable[[], None] | None = None
    close: Callable[[], None] | None = None


@dataclass
class Ctx:
    """What the methods of one case share on one rank."""

    case: Case
    state: checkpoint.StageState
    rank: int
    world: int
    work: Path
    async_group: Any = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    peers: dict[str, Any] = field(default_factory=dict)  # peers.Peer by method

    def remover(self, name: str) -> Callable[[], None]:
        """A cleanup that deletes the method's folder once every rank is done."""

        def cleanup() -> None:
            barrier()
            if self.rank == 0:
                shutil.rmtree(self.work / name, ignore_errors=True)
            barrier()

        return cleanup


def measure(method: Method) -> dict[str, float]:
    """Runs a method on all ranks at once; its time is the slowest rank's.

    ``cpu_s`` is the CPU time of all ranks together: what the method costs
    the machine, apart from how the ranks' waits line up on its cores.
    """
    if method.prepare:
        method.prepare()
    os.sync()  # no method pays for the write-back of the one before
    reset_peak_memory()
    barrier()
    before = memory_kb("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    out = method.run() or {}
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = memory_kb("VmHWM")
    if method.cleanup:
        method.cleanup()
    ranks = all_ranks((wall, out.get("blocked_s", wall), before, peak, out, cpu))
    slowest = max(ranks, key=lambda r: r[0])
    return {
        "wall_s": slowest[0],
        "cpu_s": sum(r[5] for r in ranks),  # every thread of every rank
        "blocked_s": max(r[1] for r in ranks),
        "peak_rss_mb": max(r[3] for r in ranks) * 1024 / MB,
        "extra_rss_mb": max(r[3] - r[2] for r in ranks) * 1024 / MB,
        # the parts of the slowest rank's time, if the method reports them
        **{f"{k}_s": v for k, v in slowest[4].get("parts", {}).items()},
        # the step's files each rank saw (the coordinator wrote them)
        **{
            f"{name}_bytes": max(r[4].get("sizes", {}).get(name, 0) for r in ranks)
            for name in (".metadata", "manifest.json")
            if any("sizes" in r[4] for r in ranks)
        },
    }


def is_load(name: str) -> bool:
    """Whether a method is a load (``load_*``, ``*_load``), timed after the saves."""
    return name.startswith("load") or name.endswith("_load")


def run_repeats(methods: dict[str, Method], repeats: int, tag: dict) -> list[dict]:
    """Each repeat runs every method once: the saves, then the loads.

    Each group is shuffled per repeat (the same order on every rank), so that
    no method always follows the same one: a method can slow the next (a cold
    load the next write, freeing large buffers the next save; bench/README.md
    has the figures), and a fixed or merely rotated order would charge that
    to one method every time.
    """
    rows = []
    saves = [n for n in methods if not is_load(n)]
    loads = [n for n in methods if is_load(n)]
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


def verify_load(
    reference: checkpoint.StageState,
    path: Path,
    case: Case,
    rank: int,
    world: int,
    load: Loader = checkpoint.load_stage,
) -> None:
    """Loads ``path`` into a new stage and checks it bitwise against ``reference``."""
    fresh = build_state(case, rank, world, seed=1, stepped=False)
    load(fresh, path)
    differ = offline.diff_state_dicts(fresh.state_dict(), reference.state_dict())
    if any(all_ranks(bool(differ))):
        raise RuntimeError(f"{path} loaded on rank {rank} differs: {differ[:5]}")
