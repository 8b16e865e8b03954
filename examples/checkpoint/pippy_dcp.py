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
The checkpoint idea comes first (stages, state, save, load, resume), then the
training harness; processes, the (dp, pp) mesh and a train step: parallel.py.
"""

import sys

from flags import check_saved_shape, parse_args  # standard library only

if __name__ == "__main__":  # a bad flag fails now, before torch loads, once
    ARGS = parse_args()

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


def build_state(args, stages: list, data: torch.Tensor) -> checkpoint.StageState:
    """What an exact resume needs: weights, AdamW moments (keyed by FQN, not by
    index, which restarts at 0 on every stage), LR schedule, step, data order
    (with dropout, each rank's RNG state too, under a key naming its stage)."""
    modules = [stage.submod for stage in stages]  # StageState looks inside DDP
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    schedule = functools.partial(lr_factor, steps=args.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    sampler = BatchSampler(data, args.batch_size, args.seq_len, args.seed)
    return checkpoint.StageState(modules, optimizer, scheduler, extra={"data": sampler})


def save(state: checkpoint.StageState, args, mesh: DeviceMesh) -> tuple:
    """Every rank at once: its stage(s) into <checkpoint-dir>/step-<N>.
    Returns (tensors, bytes) this rank wrote."""
    # DCP takes equal keys on two ranks for replicas and keeps one, silently.
    # take_state's planner has DCP's own planning refuse, before any write, a
    # key on two pipeline stages and dp replicas that differ.
    wait = args.checkpoint_timeout  # for a late rank; then all fail, naming it
    state_dict, step, planner = checkpoint.take_state(state, mesh=mesh, timeout=wait)
    # One folder for all ranks: each writes its own file, rank 0 .metadata (each
    # key's file and offset). publish_step's writer fsyncs them in a hidden
    # folder, adds manifest.json (a CRC-32C of every item, which loads verify)
    # and renames it step-<N> once every rank is done.
    # DCP's collectives on pippy's gloo group (writer.process_group): the timeout
    # bounds them, whatever backend the job's group has (NCCL's is untouched).
    folder, keep = args.checkpoint_dir, args.keep_last
    with checkpoint.publish_step(folder, step, keep_last=keep, timeout=wait) as writer:
        group = writer.process_group
        dcp.save(
            state_dict, storage_writer=writer, planner=planner, process_group=group
        )
    return writer.written


def load(
    state: checkpoint.StageState, reader, planner, *, weights_only=False, timeout=None
):
    """Every rank at once: fills its stage(s) from a step opened by open_step,
    in place. Returns the state_dict it filled."""
    # DCP loads in place, into tensors that must exist: load_into gives
    # state_dict(), this stage's own tensors (AdamW's made by a step of lr 0), so
    # each rank reads only its keys, then applies them; if one fails, all raise.
    target = checkpoint.StageState(state.module) if weights_only else state
    with checkpoint.load_into(target, reader, timeout=timeout) as state_dict:
        group = reader.process_group  # pippy's gloo group, as in save()
        dcp.load(
            state_dict, storage_reader=reader, planner=planner, process_group=group
        )
    return state_dict


def resume(state: checkpoint.StageState, args, layout) -> None:
    """From the newest complete step (one whose save finished), else the weights
    alone of --init-from, a step or a Hugging Face folder (optimizer, schedule
    and step start afresh)."""
    # Rank 0 lists the folder, every rank gets its answer. --skip-damaged (a
    # restart loop): rank 0 verifies the newest steps first, moving aside those
    # damaged since they were saved, and logs them.
    folder, verified = args.checkpoint_dir, args.skip_damaged
    latest = checkpoint.find_latest_step(folder, verified=verified)
    source = latest or args.init_from
    if source is None:
        return
    if not latest and Path(source, "config.json").is_file():  # a Hugging Face folder
        # Safetensors shards hold no pickle: each rank reads its own tensors.
        start = time.perf_counter()
        tensors = checkpoint.load_hf_stage(state, source)
        if dist.get_rank() == 0:
            log(f"starting from the weights of {source}")
        nbytes = held(state.module.state_dict())[1]
        report(layout, f"loaded {tensors} tensors", nbytes, f"from {source}", start)
        return
    # A checkpoint is partly pickle: pippy's reader and planner refuse pickled
    # code (PIPPY_TRUST_CHECKPOINT=1 lifts that), damaged files and keys that
    # no rank would read; rank 0 checks the step, every rank gets its answer.
    start, wait, weights_only = time.perf_counter(), args.checkpoint_timeout, not latest
    must_read = ("model.",) if weights_only else ("",)
    reader, planner = checkpoint.open_step(source, must_read=must_read, timeout=wait)
    check_source(args, reader.read_metadata(), source, latest)
    loaded = load(state, reader, planner, weights_only=weights_only, timeout=wait)
    tensors, nbytes = held(loaded)  # this rank's share
    report(layout, f"loaded {tensors} tensors", nbytes, f"from {source}", start)
    # The schedule is a function of --steps, not saved: a raised --steps goes
    # on at this step of its own schedule (the same LR, bitwise, if unchanged).
    scheduler, groups = state.lr_scheduler, state.optimizer.param_groups
    for group, base in zip(groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)


# ---- The training harness -----------------------------------------------------


def lr_factor(step: int, steps: int) -> float:
    """Warmup over the first tenth of --steps, then cosine down to 0.1."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def check_source(args, metadata, source, latest) -> None:
    """Refuses a step saved with another --n-layers or --dim, naming the flag;
    then rank 0 says where the run starts from."""
    check_saved_shape(args, metadata.state_dict_metadata, source)
    if dist.get_rank() == 0:
        ignored = " (--init-from applies to new runs only)" * bool(args.init_from)
        resuming = f"resuming from {latest}{ignored}"
        log(resuming if latest else f"starting from the weights of {source}")


def held(value) -> tuple:
    """(tensors, bytes) of a nested state_dict on this rank; FSDP2: its shards."""
    if isinstance(value, dict):
        counts = [held(v) for v in value.values()]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)
    if not isinstance(value, torch.Tensor):
        return 0, 0
    local = value.to_local() if isinstance(value, DTensor) else value
    return 1, local.numel() * local.element_size()


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


def save_now(state, args, layout: parallel.Layout, saver) -> float:
    """save(), or with --async-save a background save that returns once staged.
    Returns the seconds it took."""
    start = time.perf_counter()
    tensors, nbytes = held(state.state_dict())
    if saver is not None:  # published by its background thread once written
        saver.save(state)
        what, where = f"staged {tensors} tensors", f"for step-{state.step}"
    else:  # an entry several ranks hold (a dp replica, the data order) is written
        wrote = save(state, args, layout.mesh)[0]  # once, by one of them
        here = f" ({wrote} written here)" if wrote != tensors else ""
        what, where = f"saved {tensors} tensors{here}", f"to step-{state.step}"
    report(layout, what, nbytes, where, start)
    return time.perf_counter() - start


def train(args, state, stages, schedule, device, layout, saver, stop) -> bool:
    """Trains up to --steps (or --stop-after, or a stop signal), saving as it goes.
    Returns True if a stop signal ended it."""
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
        seconds = save_now(state, args, layout, saver) if due else 0.0
        if due and saver is None:
            stop.check_save_time(seconds)  # warns if torchrun would cut it short
        elif saver is not None:
            saver.poll()  # a background save's outcome, on every rank at once
        if stop.requested():  # preempted, on any rank: this step is saved first
            start = time.perf_counter()
            if saver is not None:
                saver.wait()
            if not due:
                save_now(state, args, layout, None)
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
    tensors, nbytes = held(load(fresh, *checkpoint.open_step(path)))
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


def stop_on_signals(args) -> checkpoint.job.StopSignal:
    """--stop-signals end training with a save; rank 0 shows torchrun's deadline
    for it when one is set (and StopSignal warns of restarts that would hang)."""
    stop = checkpoint.job.StopSignal(args.stop_signals)
    if dist.get_rank() == 0 and stop.deadline and stop.deadline.explicit:
        names = ", ".join(s.name for s in args.stop_signals)
        seconds, source = stop.deadline.seconds, stop.deadline.source
        log(f"{names}: a last save, then exit; {source} gives it {seconds:g} s")
    return stop


def main(args) -> None:
    # set up distributed: gloo on CPU, nccl on GPU. A rank whose torchrun
    # died stops at once; a SIGTERM or SIGUSR1 ends training with a save
    rank, device = parallel.setup_distributed()
    checkpoint.job.stop_with_launcher()
    stop = stop_on_signals(args)
    owner, saver = checkpoint.job.FolderOwner(args.checkpoint_dir), None
    try:
        # lay the ranks out on a (dp, pp) mesh; build and split the model, the
        # schedule, and the state to checkpoint. A failure on one rank stops
        # them all, instead of the others waiting in a collective
        with checkpoint.fail_together("setting up", keep_own_error=True):
            layout = parallel.build_layout(args, device)
            stages = build_stages(args, layout, device, seed=args.seed)
            schedule = parallel.build_schedule(args, stages)
            state = build_state(args, stages, load_text(args.data))
        # own the checkpoint folder: one job writes it, a second is refused
        owner.acquire()
        # resume if a checkpoint exists (its optimizer and LR schedule win over --lr)
        resume(state, args, layout)
        resumed_at = state.step
        # train, saving every --save-every steps and at the last; with
        # --async-save, in the background, one save at a time
        if args.async_save:
            keep, wait = args.keep_last, args.checkpoint_timeout
            saver = checkpoint.AsyncSaver(
                args.checkpoint_dir, keep_last=keep, mesh=layout.mesh, timeout=wait
            )
        stopped = train(args, state, stages, schedule, device, layout, saver, stop)
        if saver is not None:
            saver.close()  # waits for the last save, which its thread publishes
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
        try:
            if saver is not None:  # a save in flight when training failed lands
                saver.close()
        except checkpoint.CheckpointError as e:
            log(f"[rank {rank}] error: {e}")
        finally:
            owner.release()
            dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(ARGS)
