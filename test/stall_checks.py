"""A rank put to sleep in a save or a load, on real ranks; launched with torchrun.

    torchrun --nproc-per-node 3 test/stall_checks.py CHECK[,CHECK...] OUT_DIR

As test/dist_checks.py: each rank writes OUT_DIR/<check>-rank<R>.json. Rank 1
sleeps (SLOW): in DCP's hands, a third of the way through its items (a slow
disk: every item takes 0.15 s, the third one seconds), or before the save
starts. Each check runs on a gloo group of its own, since one whose save
timed out inside DCP is left with a collective that timed out.
"""

import hashlib
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.distributed_c10d import _get_default_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint.collectives import pippy_group
from pippy.checkpoint.load import load_into  # noqa: E402
from pippy.checkpoint.safe_load import SafeLoadPlanner  # noqa: E402
from pippy.checkpoint.steps import list_steps  # noqa: E402
from pippy.checkpoint.storage import LocalStorage

import parallel  # noqa: E402
import pippy_dcp  # noqa: E402
from helpers import TINY_FLAGS, CountedOps, run_checks  # noqa: E402

#: pippy's waits log every second (PIPPY_WAIT_LOG_SECONDS).
LOG_SECONDS = "1"
SLOW = 1
PER_ITEM_S = 0.15
TIMEOUT_S = 1.0


class Lines(logging.Handler):
    """The WARNING lines this rank's waits log, with the seconds since
    ``start`` (ranks may be threads of one process, sharing the logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.start, self.rank = time.monotonic(), dist.get_rank()
        self.lines: list[tuple[float, str]] = []
        logging.getLogger("pippy.checkpoint.collectives").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if dist.get_rank() == self.rank:
            self.lines.append((time.monotonic() - self.start, record.getMessage()))

    def close(self) -> None:
        logging.getLogger("pippy.checkpoint.collectives").removeHandler(self)
        super().close()


def nap(rank: int, count: list[int], stall_s: float) -> None:
    """On the slow rank: 0.15 s per item, and ``stall_s`` at the third."""
    if rank == SLOW:
        count[0] += 1
        time.sleep(stall_s if count[0] == 3 else PER_ITEM_S)


class SlowSaver(DefaultSavePlanner):
    """DCP's planner, slow to hand over items on the slow rank."""

    def __init__(self, rank: int, stall_s: float) -> None:
        super().__init__()
        self.rank, self.stall_s, self.count = rank, stall_s, [0]

    def resolve_data(self, write_item):
        if write_item.tensor_data is not None:
            nap(self.rank, self.count, self.stall_s)
        return super().resolve_data(write_item)


class SlowLoader(SafeLoadPlanner):
    """pippy's load planner, slow to take items on the slow rank."""

    def __init__(self, rank: int, stall_s: float) -> None:
        super().__init__()
        self.rank, self.stall_s, self.count = rank, stall_s, [0]

    def resolve_tensor(self, read_item):
        nap(self.rank, self.count, self.stall_s)
        return super().resolve_tensor(read_item)


def stage(rank: int, value: float) -> checkpoint.StageState:
    """Four 256 KB tensors under keys of this rank's own (1 MB a rank)."""
    layers = [torch.nn.Linear(256, 256, bias=False) for _ in range(4)]
    module = torch.nn.ModuleDict({f"r{rank}": torch.nn.Sequential(*layers)})
    for p in module.parameters():
        p.data.fill_(value)
    state = checkpoint.StageState(module)
    state.step = 1
    return state


def digest(folder: Path) -> dict:
    """Each file of a step folder, by its SHA-256."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
    }


def outcome(fn) -> dict:
    """What ``fn`` raised (type and message) and when, in seconds."""
    start = time.monotonic()
    try:
        fn()
        error = None
    except checkpoint.CheckpointError as e:
        error = [type(e).__name__, str(e)]
    return {"error": error, "seconds": time.monotonic() - start}


def check_save_logs(out: Path, rank: int, world_size: int) -> dict:
    """No timeout: the slow rank stalls 2.2 s mid-write; the save completes."""
    group = dist.new_group(backend="gloo")
    lines = Lines()
    try:
        checkpoint.save_stage(
            stage(rank, 1.0),
            out / "ckpt",
            planner=SlowSaver(rank, 2.2),
            process_group=group,
        )
    finally:
        lines.close()
    return {
        "lines": lines.lines,
        "steps": sorted(list_steps(LocalStorage(), out / "ckpt")),
    }


def check_save_timeout(out: Path, rank: int, world_size: int) -> dict:
    """A 1 s timeout; the slow rank stalls 3.5 s mid-write of step-2."""
    group = dist.new_group(backend="gloo")
    before = digest(out / "ckpt" / "step-1")
    state = stage(rank, 2.0)
    state.step = 2

    def save():
        checkpoint.save_stage(
            state,
            out / "ckpt",
            planner=SlowSaver(rank, 3.5),
            process_group=group,
            timeout=TIMEOUT_S,
        )

    result = outcome(save)
    dist.barrier()  # every rank done, the late one included
    result["folder"] = sorted(p.name for p in (out / "ckpt").iterdir())
    result["step1_untouched"] = digest(out / "ckpt" / "step-1") == before
    return result


def check_start_timeout(out: Path, rank: int, world_size: int) -> dict:
    """A 1 s timeout; the slow rank comes to the save of step-3 after 2.5 s."""
    group = dist.new_group(backend="gloo")
    state = stage(rank, 3.0)
    state.step = 3

    def save():
        if rank == SLOW:
            time.sleep(2.5)
        checkpoint.save_stage(
            state, out / "ckpt", process_group=group, timeout=TIMEOUT_S
        )

    result = outcome(save)
    dist.barrier()  # every rank done, the late one included
    result["steps"] = sorted(list_steps(LocalStorage(), out / "ckpt"))
    return result


def check_load_logs(out: Path, rank: int, world_size: int) -> dict:
    """No timeout: the slow rank stalls 2.2 s mid-read of step-1; the load
    completes (with the pieces the example uses)."""
    group = dist.new_group(backend="gloo")
    path = out / "ckpt" / "step-1"
    state = stage(rank, 0.0)
    lines = Lines()
    try:
        with load_into(state, path, process_group=group) as (state_dict, reader, _):
            dcp.load(
                state_dict,
                storage_reader=reader,
                planner=SlowLoader(rank, 2.2),
                process_group=reader.process_group,
            )
    finally:
        lines.close()
    loaded = all(bool((p == 1.0).all()) for p in state.module.parameters())
    return {"lines": lines.lines, "loaded": loaded}


def check_load_timeout(out: Path, rank: int, world_size: int) -> dict:
    """A 1 s timeout; the slow rank stalls 3.5 s mid-read of step-1."""
    group = dist.new_group(backend="gloo")
    path = out / "ckpt" / "step-1"
    state = stage(rank, 0.0)

    def load():
        options = dict(process_group=group, timeout=TIMEOUT_S)
        with load_into(state, path, **options) as (sd, reader, _):
            dcp.load(
                sd,
                storage_reader=reader,
                planner=SlowLoader(rank, 3.5),
                process_group=reader.process_group,  # pippy's: the timeout's
            )

    result = outcome(load)
    dist.barrier()
    return result


def check_example(out: Path, rank: int, world_size: int) -> dict:
    """The example's save with --checkpoint-timeout 1, the slow rank coming to
    it 2 s late (the last check: the default group is not fit after it)."""
    flags = ["--checkpoint-dir", str(out / "example"), "--checkpoint-timeout", "1"]
    args = pippy_dcp.parse_args([*TINY_FLAGS, *flags])
    device = torch.device("cpu")
    layout = parallel.build_layout(args, device)
    stages = pippy_dcp.build_stages(args, layout, device, seed=0)
    state = pippy_dcp.build_state(args, stages, pippy_dcp.load_text(None))
    pippy_dcp.save(state, args, layout.mesh, None)  # step-0, every rank on time
    state.step = 1

    def save():
        if rank == SLOW:
            time.sleep(2.0)
        pippy_dcp.save(state, args, layout.mesh, None)

    saved = outcome(save)
    return {"save": saved, "steps": sorted(list_steps(LocalStorage(), out / "example"))}


#: The (group, timeout) of each ProcessGroup.set_timeout call, by thread.
_timeouts_set: dict = {}
_record_lock = threading.Lock()


def _record_timeouts():
    """Records every set_timeout into _timeouts_set (once per process: ranks
    may be threads of one)."""
    with _record_lock:
        if getattr(ProcessGroup, "_recorded", False):
            return
        set_timeout = ProcessGroup.set_timeout

        def recorded(self, timeout):
            _timeouts_set.get(threading.current_thread(), []).append((self, timeout))
            return set_timeout(self, timeout)

        ProcessGroup.set_timeout = recorded
        ProcessGroup._recorded = True


def check_store(out: Path, rank: int, world_size: int) -> dict:
    """The private names pippy waits with: the store getter (one store that
    all ranks share, which 4 saves and a load nobody is late for do not touch)
    and a group's timeout (a save's or load's timeout bounds the collectives
    of pippy's own group, then is put back; the caller's group is never used
    nor touched)."""
    store = _get_default_store()
    store.set(f"stall-checks/{rank}", str(rank))
    dist.barrier()
    group = dist.new_group(backend="gloo")
    backend = group._get_backend(torch.device("cpu"))
    before = backend.options._timeout
    ours = pippy_group(group)  # made before the saves counted: they reuse it
    theirs = ours._get_backend(torch.device("cpu"))
    ours_before = theirs.options._timeout
    set_to = _timeouts_set[threading.current_thread()] = []
    _record_timeouts()
    with CountedOps() as counted:
        for step in range(1, 5):
            state = stage(rank, step)
            state.step = step
            ckpt = out / "store-ckpt"
            checkpoint.save_stage(state, ckpt, process_group=group, timeout=60)
        checkpoint.load_stage(state, ckpt / "step-4", process_group=group, timeout=60)
    set_to = [(g is ours, t) for g, t in set_to]
    return {
        "is_store": isinstance(store, dist.Store),
        "seen": [store.get(f"stall-checks/{r}").decode() for r in range(world_size)],
        "store_ops": sum(n for k, n in counted.counts.items() if "store" in k),
        "timeout_back": theirs.options._timeout == ours_before,
        "caller_untouched": backend.options._timeout == before,
        "set_on_ours_only": set_to
        == [(True, timedelta(seconds=60.5)), (True, ours_before)] * 5,
        "collectives_on_ours": counted.total > 0
        and all(g is ours for g in counted.groups),
    }


CHECKS = {
    "store": check_store,
    "save_logs": check_save_logs,
    "save_timeout": check_save_timeout,
    "start_timeout": check_start_timeout,
    "load_logs": check_load_logs,
    "load_timeout": check_load_timeout,
    "example": check_example,
}

if __name__ == "__main__":
    os.environ["PIPPY_WAIT_LOG_SECONDS"] = LOG_SECONDS
    run_checks(CHECKS)
