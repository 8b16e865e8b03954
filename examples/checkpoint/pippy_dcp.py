"""Pipeline-parallel training where every rank checkpoints its own stage through DCP.

Each rank builds its pipeline stage(s) of a small byte-level GPT (gpt.py) whose
state_dict keys are the un-split model's FQNs; every --save-every steps all
ranks save at once into one folder per step with torch.distributed.checkpoint
(DCP), and a new run resumes from the newest complete step, on any layout.

    torchrun --nproc-per-node 4 examples/checkpoint/pippy_dcp.py
    torchrun --nproc-per-node 4 examples/checkpoint/pippy_dcp.py --dp 2 [--fsdp]
    torchrun --nproc-per-node 2 examples/checkpoint/pippy_dcp.py --stages-per-rank 2

A first run trains steps 1-20, each rank prints what it saved at step-10 and
step-20, and the run ends with "verified: ... bitwise equal". With
--stop-after 10 it stops as if interrupted; the same command without the flag
prints "resuming from checkpoints/step-10", then the very losses of steps 11-20.
The checkpoint idea comes first (state, save, resume, the job around training),
then the training harness; processes, the (dp, pp) mesh, a train step: parallel.py.
"""

import sys

from flags import check_saved_shape, parse_args  # standard library only

if __name__ == "__main__":  # a bad flag fails now, before torch loads, once
    ARGS = parse_args()

import contextlib
import dataclasses
import functools
import gc
import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import pippy
import pippy.checkpoint.job
import pippy.checkpoint.offline
from pippy import checkpoint

import parallel
from batches import BatchSampler, load_text
from gpt import GPT, ModelArgs, init_weights, rope_table
from parallel import log, report

# ---- The checkpoint idea ------------------------------------------------------


def build_state(args, stages: list, data: torch.Tensor) -> checkpoint.StageState:
    """What an exact resume needs: weights, AdamW moments keyed by FQN (an index
    restarts at 0 on every stage), LR schedule (--steps too), step, data order."""
    modules = [stage.submod for stage in stages]  # StageState looks inside DDP
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule(args.steps))
    sampler = BatchSampler(data, args.batch_size, args.seq_len, args.seed)
    return checkpoint.StageState(modules, optimizer, scheduler, extra={"data": sampler})


def save(state: checkpoint.StageState, args, mesh: DeviceMesh | None, owner) -> tuple:
    """Every rank at once: its stage(s) into <checkpoint-dir>/step-<N>, published
    once all have written, if owner still holds the folder; (tensors, bytes) written."""
    # Refused in DCP's planning: keys on two stages, replicas that differ, late ranks.
    ckpt, keep, wait = args.checkpoint_dir, args.keep_last, args.checkpoint_timeout
    state_dict, step, planner = checkpoint.take_state(state, mesh=mesh, timeout=wait)
    options = dict(keep_last=keep, owner=owner, timeout=wait)
    with checkpoint.publish_step(ckpt, step, **options) as writer:
        pg = writer.process_group  # pippy's gloo group, which the timeout bounds
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=pg)
    return writer.written


def load(state: checkpoint.StageState, path, args, check=None, must_read=("",)):
    """Every rank at once: fills the state in place from the step at path, which
    check(metadata, path) sees first; refused: pickled code, damage, unread keys."""
    options = dict(must_read=must_read, timeout=args.checkpoint_timeout)
    with checkpoint.load_into(state, path, **options) as (state_dict, reader, planner):
        if check is not None:
            check(reader.read_metadata(), path)
        pg = reader.process_group  # pippy's gloo group, which the timeout bounds
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=pg)


def resume(state: checkpoint.StageState, args, check=None) -> Path | None:
    """From the newest complete step (one whose save finished), if any: load()."""
    ckpt, skip_damaged = args.checkpoint_dir, args.skip_damaged
    latest = checkpoint.find_latest_step(ckpt, verified=skip_damaged)
    if latest is not None:
        load(state, latest, args, check)
    return latest


@contextlib.contextmanager
def checkpointing(args, mesh: DeviceMesh | None):
    """The job around training, entered once; yields (stop, owner, saver). Each step:
    saver.poll(); once stop.requested(), saver.wait(), save(..., owner) this step."""
    ckpt, keep, wait = args.checkpoint_dir, args.keep_last, args.checkpoint_timeout
    checkpoint.job.stop_with_launcher()  # a rank whose torchrun died stops at once
    stop = checkpoint.job.StopSignal(args.stop_signals)
    with checkpoint.job.FolderOwner(ckpt) as owner:  # a second job on it is refused
        options = dict(keep_last=keep, owner=owner, mesh=mesh, timeout=wait)
        saver = checkpoint.AsyncSaver(ckpt, **options) if args.async_save else None
        with saver or contextlib.nullcontext():
            yield stop, owner, saver


# ---- The training harness -----------------------------------------------------


@dataclasses.dataclass
class Schedule:
    """The LR factor at a step of a `steps`-step run (lr_factor). An object: the
    LambdaLR state saved keeps its `steps`, so a resume restores the schedule."""

    steps: int

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.steps)


def lr_factor(step: int, steps: int) -> float:
    """Warmup over the first tenth of --steps, then cosine down to 0.1."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def start_from_checkpoint(state, args, layout: parallel.Layout) -> None:
    """resume(), refusing a step saved with another --n-layers or --dim (naming
    the flag); else the weights alone of --init-from, a step or a Hugging Face
    folder (optimizer, schedule and step start afresh). Rank 0 says where the run
    starts from, each rank what it loaded; a run resumed with another --steps
    goes on along the new schedule."""
    start, source = time.perf_counter(), args.init_from
    check = functools.partial(check_saved_shape, args)
    latest = resume(state, args, check)
    if latest is None and source is None:
        return
    if latest is None and Path(source, "config.json").is_file():
        checkpoint.load_hf_stage(state, source)  # safetensors: each rank its own
    elif latest is None:  # a step's weights, its shape checked as a resume's is
        weights = checkpoint.StageState(state.module)
        load(weights, source, args, check, must_read=("model.",))
    if dist.get_rank() == 0:
        ignored = " (--init-from applies to new runs only)" * bool(source)
        resuming = f"resuming from {latest}{ignored}"
        log(resuming if latest else f"starting from the weights of {source}")
    tensors, nbytes = held(state.state_dict() if latest else state.module.state_dict())
    report(
        layout, f"loaded {tensors} tensors", nbytes, f"from {latest or source}", start
    )
    # The step restored the schedule the run was saved with, which ends at its
    # --steps: a changed --steps goes on from this step of its own schedule.
    scheduler, schedule = state.lr_scheduler, state.lr_scheduler.lr_lambdas[0]
    if schedule.steps != args.steps:
        schedule.steps = args.steps
        groups, bases = state.optimizer.param_groups, scheduler.base_lrs
        for group, base in zip(groups, bases, strict=True):
            group["lr"] = base * schedule(scheduler.last_epoch)


def held(value) -> tuple:
    """(tensors, bytes) of a nested state_dict on this rank; FSDP2: its shards."""
    if isinstance(value, dict):
        counts = [held(v) for v in value.values()]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)
    if not isinstance(value, torch.Tensor):
        return 0, 0
    local = value.to_local() if isinstance(value, DTensor) else value
    return 1, local.numel() * local.element_size()


def split_manual(model: GPT, stage_index: int, num_stages: int) -> GPT:
    """Deletes what the stage does not own. The blocks sit in a ModuleDict keyed
    by global layer index, so what is left keeps its FQNs (layers.5.*, never a
    renumbered layers.0.*): the ranks' keys are disjoint, their union the model."""
    owned = pippy.layer_range(stage_index, num_stages, len(model.layers))
    for i in list(model.layers):
        if int(i) not in owned:
            del model.layers[i]
    if stage_index > 0:
        model.tok_embeddings = None
    if stage_index < num_stages - 1:
        model.norm = model.output = None
    return model


def split_traced(model: GPT, num_stages: int, shape: tuple[int, int]):
    """Splits the model where split_manual would, tracing a `shape` microbatch."""
    microbatch = torch.zeros(shape, dtype=torch.long, device="meta")  # as the model
    n = len(model.layers)
    firsts = [pippy.layer_range(s, num_stages, n)[0] for s in range(1, num_stages)]
    split_spec = {f"layers.{i}": pippy.SplitPoint.BEGINNING for i in firsts}
    with warnings.catch_warnings():  # torch 2.13's tracer warns about pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        return pippy.pipeline(model, mb_args=(microbatch,), split_spec=split_spec)


def build_stage(args, index: int, num_stages: int, device, *, seed: int, mesh=None):
    """Builds one stage, allocating memory for that stage alone."""
    model_args = ModelArgs(args.n_layers, args.dim, max_seq_len=args.seq_len)
    with torch.device("meta"):  # shapes only: no rank holds the whole model
        model = GPT(model_args)
    pippy.check_untied(model)  # a weight tied across stages would drift
    if args.split == "manual":
        module = split_manual(model, index, num_stages)
    else:
        shape = (args.batch_size // args.microbatches, args.seq_len)
        pipe = split_traced(model, num_stages, shape)
        module = pipe.get_stage_module(index)
        # The tracer makes the rope buffer a persistent key of every stage.
        pippy.restore_non_persistent_buffers(module, model)
    module.to_empty(device=device)  # allocate the stage, then fill it
    init_weights(module, seed)
    module.get_buffer("rope").copy_(rope_table(model_args))
    group = mesh.get_group("pp") if mesh is not None else None
    if args.split == "trace":
        return pipe.build_stage(index, device, group)
    module = parallel.data_parallel(module, args, mesh) if mesh is not None else module
    return pippy.PipelineStage(module, index, num_stages, device, group=group)


def build_stages(args, layout: parallel.Layout, device, *, seed: int) -> list:
    """This rank's stages, in order, each replicated or sharded across dp."""
    n, mesh = layout.num_stages, layout.mesh
    return [
        build_stage(args, s, n, device, seed=seed, mesh=mesh) for s in layout.stages
    ]


def save_now(state, args, layout: parallel.Layout, owner, saver) -> float:
    """save(), or with --async-save a background save that returns once staged.
    Returns the seconds it took."""
    start = time.perf_counter()
    tensors, nbytes = held(state.state_dict())
    if saver is not None:  # published by its background thread once written
        saver.save(state)
        what, where = f"staged {tensors} tensors", f"for step-{state.step}"
    else:  # an entry several ranks hold (a dp replica, the data order) is written
        wrote = save(state, args, layout.mesh, owner)[0]  # once, by one of them
        here = f" ({wrote} written here)" if wrote != tensors else ""
        what, where = f"saved {tensors} tensors{here}", f"to step-{state.step}"
    report(layout, what, nbytes, where, start)
    return time.perf_counter() - start


def train(args, state, stages, schedule, device, layout, job) -> bool:
    """Trains up to --steps (or --stop-after, or a stop signal), saving as it goes.
    Returns True if a stop signal ended it. job: checkpointing()'s."""
    stop, owner, saver = job
    rank, dp_group = dist.get_rank(), layout.mesh.get_group("dp")
    last = min(args.steps, args.stop_after or args.steps)
    if state.step >= last and rank == 0:
        log(f"already at step {state.step} of {args.steps}: nothing to train")
    while state.step < last:
        start, lr = time.time(), state.optimizer.param_groups[0]["lr"]
        loss = parallel.train_step(state, stages, schedule, device, dp_group)
        if loss is not None and dist.get_rank(dp_group) == 0:  # last stage, replica 0
            secs = time.time() - start
            log(f"step {state.step:3d} | loss {loss:.4f} | lr {lr:.2e} | {secs:.2f} s")
        due = state.step % args.save_every == 0 or state.step == args.steps
        seconds = save_now(state, args, layout, owner, saver) if due else 0.0
        if due and saver is None:
            stop.check_save_time(seconds)  # warns if torchrun would cut it short
        elif saver is not None:
            saver.poll()  # a background save's outcome, on every rank at once
        if stop.requested():  # preempted, on any rank: this step is saved first
            start = time.perf_counter()
            if saver is not None:
                saver.wait()
            if not due:
                save_now(state, args, layout, owner, None)
            if rank == 0:
                step, seconds = state.step, seconds + time.perf_counter() - start
                saved = f"step-{step} saved in {seconds:.2f} s"
                log(f"stopping after step {step}: {stop.reason}, {saved}")
            return True
    if state.step < args.steps and rank == 0:
        log(f"stopping after step {state.step} (--stop-after), as if interrupted")
    return False


def verify(args, expected: dict, data, path: Path, layout, device) -> bool:
    """Loads `path` into freshly initialised stages and compares every entry
    with `expected`, the trained stages' fingerprints (a CRC-32C of each
    tensor; with FSDP2, every rank its own shards): the trained stages are
    freed first, so a GPU holds one set of stages, not two."""
    start = time.perf_counter()
    fresh_stages = build_stages(args, layout, device, seed=args.seed + 1)
    fresh = build_state(args, fresh_stages, data)
    note = " into a fresh stage" if len(fresh_stages) == 1 else " into fresh stages"
    tensors, nbytes = held(checkpoint.load_stage(fresh, path))
    report(layout, f"loaded {tensors} tensors", nbytes, f"from {path}{note}", start)
    found = checkpoint.offline.fingerprints(fresh.state_dict())
    differ = sorted(
        k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k)
    )
    if differ:
        log(f"{layout.label}: {len(differ)} entries differ: {differ[:5]}")
    failed = torch.tensor([len(differ)], device=device)
    dist.all_reduce(failed)
    if dist.get_rank() == 0 and not failed.item():
        fresh = f"loaded into fresh stages on all {dist.get_world_size()} ranks"
        log(f"verified: {path} {fresh}, model and optimizer bitwise equal")
    return not failed.item()


def show_deadline(args, stop: checkpoint.job.StopSignal) -> None:
    """Rank 0 shows torchrun's deadline for the last save on a stop signal,
    when one is set."""
    if dist.get_rank() == 0 and stop.deadline and stop.deadline.explicit:
        names = ", ".join(s.name for s in args.stop_signals)
        seconds, source = stop.deadline.seconds, stop.deadline.source
        log(f"{names}: a last save, then exit; {source} gives it {seconds:g} s")


def main(args) -> None:
    # set up distributed: gloo on CPU, nccl on GPU
    rank, device = parallel.setup_distributed()
    try:
        # lay the ranks out on a (dp, pp) mesh; build and split the model, the
        # schedule, and the state to checkpoint. A failure on one rank stops
        # them all, instead of the others waiting in a collective
        with checkpoint.fail_together("setting up", keep_own_error=True):
            layout = parallel.build_layout(args, device)
            stages = build_stages(args, layout, device, seed=args.seed)
            schedule = parallel.build_schedule(args, stages)
            state = build_state(args, stages, load_text(args.data))
        with checkpointing(args, layout.mesh) as job:
            show_deadline(args, job[0])
            # resume if a checkpoint exists (its optimizer and LR schedule win
            # over --lr), then train, saving every --save-every steps and at the
            # last; with --async-save in the background
            start_from_checkpoint(state, args, layout)
            resumed_at = state.step
            stopped = train(args, state, stages, schedule, device, layout, job)
        # verify: load the final checkpoint into fresh stages, compare bit for
        # bit; not after a stop signal, whose grace period a load would spend
        final = checkpoint.find_latest_step(args.checkpoint_dir)
        if stopped:
            ok = True
            if rank == 0:
                log(f"not verifying {final}: stopped by a signal, exiting now")
        else:  # the step this run saved: none if --stop-after ended it past the
            # last save, or if it had nothing to train
            saved = final is not None and Path(final).name == f"step-{state.step}"
            saved = saved and state.step > resumed_at
            if saved:  # the trained stages' fingerprints, then free them
                expected = checkpoint.offline.fingerprints(state.state_dict())
                data = state.extra["data"].data
                del state, stages, schedule
                gc.collect()  # and what reference cycles of theirs keep alive
            ok = not saved or verify(args, expected, data, final, layout, device)
    except (checkpoint.CheckpointError, ValueError, OSError) as e:  # not a traceback
        # pippy names no flag of ours: say which one a folder error is about
        dir_errors = checkpoint.CheckpointDirError, checkpoint.CheckpointDirInUseError
        flag = " (--checkpoint-dir)" * isinstance(e, dir_errors)
        log(f"[rank {rank}] error: {e}{flag}")
        ok = False
    finally:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(ARGS)
