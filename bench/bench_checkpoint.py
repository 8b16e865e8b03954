"""What checkpointing a pipeline costs: pippy's DCP saves against baselines and disk.

One command launches its own ranks (``python -m torch.distributed.run``) for
P = 2 and P = 4 pipeline stages and, at each model size, times in one run:

* ``pippy_sync``: ``checkpoint.save_stage``'s pieces: ``take_state`` (the
  ``StageState.state_dict()`` and the planner that checks its keys across
  ranks), then ``dcp.save`` through pippy's ``StepWriter`` (``torch.save``'s
  CRC-32 off, a CRC-32C of every item in ``manifest.json``, the step staged
  and published in its ``finish``), noting when its writes start and end.
* The options tried, each ``pippy_sync`` with one change (``writers.py``):
  ``pippy_sync_crc32``: ``torch.save``'s CRC-32 left on (pippy before);
  ``pippy_sync_threads2``: ``thread_count=2``;
  ``pippy_sync_nomanifest``: DCP's own ``FileSystemWriter`` (no checksums,
  written in place: no staging).
* ``dcp_save``: plain ``dcp.save`` of the same ``state_dict()`` with DCP's own
  writer and planner: what target 1's fixed costs are judged against.
* ``pippy_async_tuned``: the example's async save, ``AsyncSaver.save(state)``
  on a gloo group of its own, one saver (and its stager's buffers) kept
  across saves: ``blocked`` until ``save`` returns, ``wall`` until ``wait``
  has published the step.
* The peers (``peers.py``), each saving the same stage: ``dcp_async_save``
  (plain ``dcp.async_save``, DCP's ``FileSystemWriter``, on the same gloo
  group); when installed, torchtitan's ``CheckpointManager`` (``tt_sync``,
  ``tt_async``; its load ``tt_load``) and torch_checkpointing's
  (``tc_sync``, ``tc_async``; ``tc_load``). Before the timed repeats each
  async save is checked once: every saved tensor changed in place as soon
  as the save returned (after what the checkpointer documents first), the
  step read back and compared bitwise with the values of the call.
* ``torch_save_stage``: ``torch.save`` of each stage's state_dicts, all at once.
* ``gather_rank0``: the stages' tensors sent to rank 0, one ``torch.save``.
* ``raw_write``: the ceiling: the same bytes by the same writers, one file
  each. ``copy_fresh`` / ``copy_reuse``: the floor of async staging: a bare
  copy of the same tensors into new / already allocated memory.
* ``load_same``: ``checkpoint.load_stage`` of a P-rank checkpoint on P ranks
  (``load_same_dcp``: plain ``dcp.load``, without pippy's safe reader and
  planner). ``load_reshard``: a 4-rank checkpoint loaded on 2 ranks.
  ``load_unsplit``: ``offline.load_model`` of the 4-rank checkpoint into
  the un-split model in one plain process, against ``torch_load_full``:
  ``torch.load`` of ``gather_rank0``'s file. ``load_torch_stage``: each rank
  ``torch.load``s its own ``torch.save``d stage into a new one.

Every file written is ``fsync``ed (DCP does by default) and deleted after each
repeat. Before each load the checkpoint's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``) unless ``--warm-cache``. Peak memory is each
rank's RSS high-water mark, ``VmHWM`` of ``/proc/self/status``, reset through
``/proc/self/clear_refs`` (after ``malloc_trim``) just before each method:
``peak`` is the highest over ranks, ``extra`` the highest rise over the RSS
the rank had just before the method. ``CPU s`` is the CPU time of all ranks
together (every thread), and ``cpu_x_dcp_load`` a load's over
``load_same_dcp``'s: with fewer cores than ranks, what a method costs the
machine, apart from how its ranks' waits line up on the cores.

    python bench/bench_checkpoint.py --quick --out-dir bench/results
    python bench/bench_checkpoint.py --out-dir bench/results-full
    python bench/bench_checkpoint.py --fixed-cost --out-dir bench/results-fixed

``--quick``: 50 and 150 MB of model + AdamW state per rank, a 50 MB case with
4x the keys, 5 repeats; the full mode goes up to 500 MB per rank with 7
repeats. ``--fixed-cost``: stages of 0.5 MB (16 layers) on P = 2, 4, 8 and
16 ranks, where a save's time is its fixed cost. The output folder gets
``results.json`` (every repeat, medians, ratios, target checks),
``results.md`` (the tables), ``results.png`` (time against bytes per
method) and ``peers.png`` (pippy against the peers). Compare the ratios of
one run, never absolute times across runs. ``--only METHOD ...`` times just
those methods of the save phase (e.g. ``load_same load_same_dcp``) and
skips the other phases; its ``results.md`` is the table of all methods, with
each method's ratio to ``load_same_dcp`` (``x_dcp_load``) and the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from harness import (
    MB,
    ROOT,
    STEP,
    Case,
    Ctx,
    all_ranks,
    barrier,
    build_state,
    case_tag,
    is_load,
    log,
    make_cases,
    memory_kb,
    reset_peak_memory,
    run_repeats,
    verify_load,
)
from methods import load_into_fresh, load_unsplit, save_methods, torch_load_full
from peers import check, peers
from report import write_report

from pippy import checkpoint
from pippy.checkpoint.steps import step_dir

# --------------------------------------------------------------------------
# Phases: what the launched ranks (or one plain process) run
# --------------------------------------------------------------------------


def init_ranks() -> tuple[int, int]:
    """Joins the gloo group torch.distributed.run set up: (rank, world size)."""
    if "RANK" not in os.environ:
        sys.exit("--phase runs under torch.distributed.run; run without it")
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def cases_in(opts: argparse.Namespace) -> list[Case]:
    """The cases the driver passed to this phase."""
    return [Case(**c) for c in json.loads(opts.cases)]


def write_rows(opts: argparse.Namespace, rows: list[dict]) -> None:
    """Rank 0 writes the phase's rows for the driver; the group is torn down."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(opts.result_file).write_text(json.dumps(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


def check_peers(ctx: Ctx) -> dict[str, dict]:
    """Each peer's save checked once, before (and warming) the timed repeats.

    A sync save must load back bitwise (else this raises); an async one is
    recorded: whether it held the values of its call (``held_at_call``; for
    torch_checkpointing also without its ``lock()``: ``held_unguarded``).

    Returns:
        Per method: those, and ``kept_mb``: the RSS the save left behind on a
        rank (kept stagers and buffers), the most of any rank.
    """
    found: dict[str, dict] = {}
    for name, peer in ctx.peers.items():
        if is_load(name):
            continue  # read by the same load as its save's check
        reset_peak_memory()
        before = memory_kb("VmRSS")
        held = check(ctx, name, peer)
        if not peer.is_async and not held:
            raise RuntimeError(f"{name}'s checkpoint does not load back bitwise")
        found[name] = {"held_at_call": held} if peer.is_async else {}
        if name == "tc_async":
            found[name]["held_unguarded"] = check(ctx, name, peer, guarded=False)
        reset_peak_memory()
        kept = (memory_kb("VmRSS") - before) * 1024 / MB
        found[name]["kept_mb"] = max(all_ranks(kept))
        if ctx.rank == 0:
            log.info("checked %s: %s", name, found[name])
    return found


def phase_save(opts: argparse.Namespace) -> None:
    """Every save method and the same-degree loads, for each case of one degree."""
    rank, world = init_ranks()
    async_group = dist.new_group(backend="gloo")
    rows: list[dict] = []
    for case in cases_in(opts):
        work = Path(opts.work_dir) / f"P{world}-{case.label}"
        state = build_state(case, rank, world)
        ctx = Ctx(case, state, rank, world, work, async_group)
        ctx.peers = {k: v for k, v in peers(ctx).items() if chosen(opts, k)}
        keep = Path(opts.keep_dir) / case.label if opts.keep_dir else None
        saved = checkpoint.save_stage(state, work / "ckpt")  # for load_same
        verify_load(state, saved, case, rank, world)
        methods = save_methods(ctx, keep and keep / "full.pt", not opts.warm_cache)
        methods = {k: v for k, v in methods.items() if chosen(opts, k)}
        checked = check_peers(ctx)
        tag = case_tag(case, state, world) | {"phase": "save"}
        case_rows = run_repeats(methods, opts.repeats, tag)
        for method in methods.values():
            if method.close:
                method.close()
        stager_mb = checked.get("pippy_async_tuned", {}).get("kept_mb")
        rows += [
            r | {"stager_held_mb": stager_mb, **checked.get(r["method"], {})}
            for r in case_rows
        ]
        barrier()
        if rank == 0:
            if keep is not None:
                shutil.move(str(work / "ckpt"), keep / "ckpt")
            shutil.rmtree(work, ignore_errors=True)
        del ctx, state, methods
        barrier()
    write_rows(opts, rows)


def chosen(opts: argparse.Namespace, method: str) -> bool:
    """Whether ``--only`` (if given) names the method."""
    return not opts.only or method in opts.only


def phase_reshard(opts: argparse.Namespace) -> None:
    """A checkpoint saved by 4 ranks loaded by 2, against one saved by 2."""
    rank, world = init_ranks()
    rows: list[dict] = []
    cold = not opts.warm_cache
    for case in cases_in(opts):
        kept = step_dir(Path(opts.keep_dir) / case.label / "ckpt", STEP)
        work = Path(opts.work_dir) / f"reshard-{case.label}"
        state = build_state(case, rank, world)  # the same model, split in `world`
        same = checkpoint.save_stage(state, work)
        verify_load(state, kept, case, rank, world)
        tag = case_tag(case, state, world) | {"phase": "reshard"}
        del state
        methods = {
            "load_same": load_into_fresh(case, rank, world, same, cold),
            "load_reshard": load_into_fresh(case, rank, world, kept, cold),
        }
        for row in run_repeats(methods, opts.repeats, tag):
            if row["method"] == "load_reshard":
                row["saved_by"] = case.stages
            rows.append(row)
        barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    write_rows(opts, rows)


def phase_unsplit(opts: argparse.Namespace) -> None:
    """The 4-rank checkpoint into the un-split model, in one plain process."""
    rows: list[dict] = []
    cold = not opts.warm_cache
    for case in cases_in(opts):
        kept = Path(opts.keep_dir) / case.label
        ckpt = step_dir(kept / "ckpt", STEP)
        state = build_state(case, 0, 1)
        verify_load(state, ckpt, case, 0, 1, load=load_unsplit)
        tag = case_tag(case, state, 1) | {"phase": "unsplit", "saved_by": case.stages}
        del state
        methods = {
            "load_unsplit": load_into_fresh(case, 0, 1, ckpt, cold, load=load_unsplit),
            "torch_load_full": torch_load_full(case, kept / "full.pt", cold),
        }
        rows += run_repeats(methods, opts.repeats, tag)
    write_rows(opts, rows)


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
        *(["--only", *opts.only] if opts.only else []),
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
    """The cases of one degree: ``--dim``'s model, or one per ``--sizes-mb``."""
    if opts.dim:
        return [Case(f"dim{opts.dim}", stages, opts.dim, opts.n_layers)]
    return make_cases(opts.sizes_mb, stages, opts.n_layers, keys_x)


def run_all(opts: argparse.Namespace) -> None:
    """Every phase on its ranks, then the report; the checkpoints are deleted."""
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
        if top >= 2 and not opts.only:
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
        "only": opts.only,
    }
    # The measurements first, so that a failing report loses nothing.
    (out / "rows.json").write_text(json.dumps({"machine": machine, "rows": rows}))
    write_report(rows, machine, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--help`` shows this module's docstring."""
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog="\n\n".join(doc.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--quick", action="store_true", help="50 and 150 MB per rank, 5 repeats")
    add("--fixed-cost", action="store_true", help="0.5 MB per rank, P=2,4,8,16")
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
    add("--only", nargs="+", metavar="METHOD", help="these save-phase methods alone")
    # Internal: what the driver passes to the ranks it launches.
    add("--phase", choices=["save", "reshard", "unsplit"], help=argparse.SUPPRESS)
    add("--cases", help=argparse.SUPPRESS)
    add("--keep-dir", help=argparse.SUPPRESS)
    add("--result-file", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.fixed_cost:  # stages under 1 MB: the fixed costs per save (target 1)
        opts.sizes_mb = opts.sizes_mb or [0.5]
        opts.stages, opts.n_layers, opts.keys_x = [2, 4, 8, 16], 16, 1
    if opts.sizes_mb is None:
        opts.sizes_mb = [50, 150] if opts.quick else [50, 150, 500]
    if opts.repeats is None:
        opts.repeats = 5 if opts.quick else 7
    return opts


def main() -> None:
    """Runs a phase (``--phase``), redoes a report (``--report``), or all of it."""
    # INFO on the handler too: the DEBUG records methods.sync_save asks pippy for
    # reach the root logger's handler as well.
    handler = logging.StreamHandler()
    handler.setLevel(logging.INFO)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[handler],
    )
    opts = parse_args()
    phases = {"save": phase_save, "reshard": phase_reshard, "unsplit": phase_unsplit}
    if opts.phase:
        phases[opts.phase](opts)
    elif opts.report:
        saved = json.loads(Path(opts.report).read_text())
        Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
        write_report(saved["rows"], saved["machine"], Path(opts.out_dir))
    else:
        run_all(opts)


if __name__ == "__main__":
    main()
