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
The checkpoint idea comes first (stages, state, save, load, resume); the
training harness (mesh, schedules, data, verification, job guards) follows.
"""

import sys

from flags import parse_args  # standard library only

if __name__ == "__main__":  # a bad flag fails now, before torch loads, once
    ARGS = parse_args()

import functools
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import pippy
from pippy import checkpoint
from pippy.checkpoint.api import load_into, open_step, publish_step, take_state
from pippy.checkpoint.checks import (
    check_untied,
    restore_non_persistent_buffers,
    state_dict_size,
)
from pippy.checkpoint.coordinated import open_reader
from pippy.checkpoint.errors import fail_together
from pippy.checkpoint.launcher import check_restarts
from pippy.checkpoint.steps import step_dir
from pippy.checkpoint.verified import newest_verified_step

from batches import BatchSampler, load_text
from gpt import GPT, ModelArgs, init_weights, rope_table

# ---- The checkpoint idea ------------------------------------------------------


def stage_layers(stage_index: int, num_stages: int, n_layers: int) -> range:
    """The global indices of one stage's layers; stage sizes differ by at most 1."""
    per_stage, rest = divmod(n_layers, num_stages)
    start = stage_index * per_stage + min(stage_index, rest)
    return range(start, start + per_stage + (stage_index < rest))


def split_manual(model: GPT, stage_index: int, num_stages: int) -> GPT:
    """Deletes what the stage does not own. The blocks sit in a ModuleDict keyed
    by global layer index, so what is left keeps its FQNs (layers.5.*, never a
    renumbered layers.0.*): the ranks' keys are disjoint, their union the model."""
    owned = stage_layers(stage_index, num_stages, len(model.layers))
    for i in list(model.layers):
        if int(i) not in owned:
            del model.layers[i]
    if stage_index > 0:
        model.tok_embeddings = None
    if stage_index < num_stages - 1:
        model.norm = model.output = None
    return model


def lr_factor(step: int, steps: int) -> float:
    """Warmup over the first tenth of --steps, then cosine down to 0.1."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def build_state(args, stages: list, data: torch.Tensor) -> checkpoint.StageState:
    """What an exact resume needs: weights, AdamW moments (keyed by FQN, not by
    index, which restarts at 0 on every stage), LR schedule, step, data order."""
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
    # DCP takes equal keys on two ranks for replicas and keeps one: a collision
    # would lose a stage without a word, and diverged dp replicas would mix key
    # by key. take_state checks first: keys disjoint across the pipeline dim,
    # replicas equal across the dp dim, and the stored step is the one saved.
    state_dict, step = take_state(state, mesh=mesh)
    # One checkpoint_id for all ranks: each writes its own file, rank 0 writes
    # .metadata (every key's file and offset). publish_step stages the files in
    # a hidden folder, fsynced, renamed to step-<N> once every rank is done; its
    # writer adds manifest.json, a CRC-32C of every item, which loads verify.
    with publish_step(args.checkpoint_dir, step, keep_last=args.keep_last) as writer:
        dcp.save(state_dict, storage_writer=writer)
    return writer.written


def load(state: checkpoint.StageState, path, *, weights_only=False) -> tuple:
    """Every rank at once: fills its stage(s) from a step, in place.
    Returns the (tensors, bytes) loaded."""
    # A checkpoint is partly pickle: pippy's reader and planner refuse pickled
    # code (PIPPY_TRUST_CHECKPOINT=1 lifts that), damaged files and keys that
    # no rank would read, before anything is read.
    reader, planner = open_step(path, must_read=("model.",) if weights_only else ("",))
    # DCP loads in place, into tensors that must exist: load_into gives
    # state_dict(), this stage's own tensors (AdamW's moments made empty), so
    # each rank reads only its keys; then applies it on every rank, or on none.
    target = checkpoint.StageState(state.module) if weights_only else state
    with load_into(target, path) as state_dict:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    return state_dict_size(state_dict)


def resume(state: checkpoint.StageState, args, layout) -> None:
    """From the newest complete step (one whose save finished), else the weights
    alone of --init-from (optimizer, schedule and step start afresh)."""
    if args.skip_damaged:  # a restart loop: past steps damaged since they were saved
        latest = skip_damaged(args, layout)
    else:
        latest = checkpoint.find_latest_step(args.checkpoint_dir)
    source = latest or args.init_from
    if source is None:
        return
    check_flags_match(args, source)
    if dist.get_rank() == 0:
        ignored = " (--init-from applies to new runs only)" * bool(args.init_from)
        log(
            f"resuming from {latest}{ignored}"
            if latest
            else f"starting from the weights of {source}"
        )
    start = time.perf_counter()
    tensors, nbytes = load(state, source, weights_only=latest is None)
    report(layout, f"loaded {tensors} tensors", nbytes, f"from {source}", start)
    # The schedule is a function of --steps, not saved: a raised --steps goes
    # on at this step of its own schedule (the same LR, bitwise, if unchanged).
    scheduler, groups = state.lr_scheduler, state.optimizer.param_groups
    for group, base in zip(groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)


# ---- The training harness -----------------------------------------------------

SCHEDULES = {"gpipe": pippy.ScheduleGPipe, "1f1b": pippy.Schedule1F1B}
LOOPED = {  # all of a rank's stages; stage s runs on pipeline rank s % pp
    "interleaved-1f1b": pippy.ScheduleInterleaved1F1B,
    "looped-bfs": pippy.ScheduleLoopedBFS,
    "zero-bubble": pippy.ScheduleInterleavedZeroBubble,
}
SCHEDULES.update(LOOPED)


@dataclass
class Layout:
    """This rank's place on the (dp, pp) mesh: its stages, and a name for them."""

    mesh: DeviceMesh
    stages: list[int]
    num_stages: int
    label: str  # "[rank 3] stage 1 (dp 1)", "[rank 1] stages 1, 3"


def build_layout(args, device: torch.device) -> Layout:
    """--dp pipelines of pp ranks; pipeline rank r runs stages r, r + pp, ..."""
    pp = dist.get_world_size() // args.dp
    mesh = init_device_mesh(device.type, (args.dp, pp), mesh_dim_names=("dp", "pp"))
    stages = list(range(mesh.get_local_rank("pp"), pp * args.stages_per_rank, pp))
    label = f"[rank {dist.get_rank()}] stage{'s' * (len(stages) > 1)} "
    label += ", ".join(map(str, stages))
    label += f" (dp {mesh.get_local_rank('dp')})" if args.dp > 1 else ""
    return Layout(mesh, stages, pp * args.stages_per_rank, label)


def split_traced(model: GPT, num_stages: int, microbatch: torch.Tensor):
    """Traces the model and splits the graph where split_manual would."""
    n = len(model.layers)
    firsts = [stage_layers(s, num_stages, n)[0] for s in range(1, num_stages)]
    split_spec = {f"layers.{i}": pippy.SplitPoint.BEGINNING for i in firsts}
    with warnings.catch_warnings():  # torch 2.13's tracer warns about pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        return pippy.pipeline(model, mb_args=(microbatch,), split_spec=split_spec)


def data_parallel(module: torch.nn.Module, args, mesh: DeviceMesh) -> torch.nn.Module:
    """Across the dp dim: DDP replicas, or FSDP2 shards (each rank holds 1/dp)."""
    if args.dp == 1:
        return module
    if args.fsdp:  # parameters and AdamW state become DTensors: a shard per rank
        return fully_shard(module, mesh=mesh["dp"])
    ddp = DistributedDataParallel(module, process_group=mesh.get_group("dp"))
    # The stage all-reduces gradients itself, at the last microbatch's backward;
    # else torch 2.13's shape inference runs DDP's forward outside no_sync() and
    # DDP's bucket rebuild fails at step 2.
    ddp.require_backward_grad_sync = False
    return ddp


def build_stage(args, index: int, num_stages: int, device, *, seed: int, mesh=None):
    """Builds one stage, allocating memory for that stage alone."""
    model_args = ModelArgs(args.n_layers, args.dim, max_seq_len=args.seq_len)
    with torch.device("meta"):  # shapes only: no rank holds the whole model
        model = GPT(model_args)
    check_untied(model)  # a weight tied across stages would drift
    if args.split == "manual":
        module = split_manual(model, index, num_stages)
    else:
        shape = (args.batch_size // args.microbatches, args.seq_len)
        pipe = split_traced(model, num_stages, torch.zeros(shape, dtype=torch.long))
        module = pipe.get_stage_module(index)
        # The tracer makes the rope buffer a persistent key of every stage.
        restore_non_persistent_buffers(module, model)
    module.to_empty(device=device)  # allocate the stage, then fill it
    init_weights(module, seed)
    module.get_buffer("rope").copy_(rope_table(model_args))
    group = mesh.get_group("pp") if mesh is not None else None
    if args.split == "trace":
        return pipe.build_stage(index, device, group)
    module = data_parallel(module, args, mesh) if mesh is not None else module
    return pippy.PipelineStage(module, index, num_stages, device, group=group)


def build_stages(args, layout: Layout, device, *, seed: int) -> list:
    """This rank's stages, in order, each replicated or sharded across dp."""
    n, mesh = layout.num_stages, layout.mesh
    return [
        build_stage(args, s, n, device, seed=seed, mesh=mesh) for s in layout.stages
    ]


def log(message: str) -> None:
    """Prints a line in one write, so that lines of concurrent ranks never mix."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def report(layout: Layout, what: str, nbytes: int, where: str, start: float) -> None:
    seconds = time.perf_counter() - start
    log(f"{layout.label}: {what}, {nbytes / 1e6:.1f} MB {where} in {seconds:.2f} s")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(state, stages: list, schedule, device, dp_group=None) -> float | None:
    """One optimizer step over all microbatches; on the last stage, the batch's
    mean loss (averaged over the dp replicas); None elsewhere."""
    inputs, targets = state.extra["data"].next_batch()  # every rank draws: stay in step
    if dp_group is not None:  # a replica's slice of the global batch, in rank order
        share, i = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        inputs, targets = inputs.chunk(share)[i], targets.chunk(share)[i]
    losses: list[torch.Tensor] = []
    first, last = stages[0].is_first, stages[-1].is_last
    args = (inputs.to(device),) if first else ()
    kwargs = {"target": targets.to(device), "losses": losses} if last else {}
    schedule.step(*args, **kwargs)
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.lr_scheduler.step()
    state.step += 1
    if not losses:
        return None
    loss = torch.stack(losses).mean()
    if dp_group is not None:  # the global batch's loss, whatever the layout
        dist.all_reduce(loss, group=dp_group)
        loss /= dist.get_world_size(dp_group)
    return loss.item()


def save_now(state, args, layout: Layout, saver) -> float:
    """save(), or with --async-save a background save that returns once staged.
    Returns the seconds it took."""
    start, step = time.perf_counter(), state.step
    if saver is not None:  # published by a later poll(), wait() or close()
        saver.save(state)
        tensors, nbytes = state_dict_size(state.state_dict())
        report(layout, f"staged {tensors} tensors", nbytes, f"for step-{step}", start)
        return time.perf_counter() - start
    (wrote, nbytes), (held, _) = (
        save(state, args, layout.mesh),
        state_dict_size(state.state_dict()),
    )
    # An entry several ranks hold (a dp replica, the sampler's state) is
    # written once, by one of them: a rank may write fewer tensors than it loads.
    report(
        layout, f"saved {wrote} of its {held} tensors", nbytes, f"to step-{step}", start
    )
    return time.perf_counter() - start


def train(args, state, stages, schedule, device, layout, saver, stop) -> None:
    """Trains up to --steps (or --stop-after, or a stop signal), saving as it goes."""
    rank, dp_group = dist.get_rank(), layout.mesh.get_group("dp")
    last = min(args.steps, args.stop_after or args.steps)
    if state.step >= last and rank == 0:
        log(f"already at step {state.step} of {args.steps}: nothing to train")
    while state.step < last:
        start, lr = time.time(), state.optimizer.param_groups[0]["lr"]
        loss = train_step(state, stages, schedule, device, dp_group)
        if loss is not None and dist.get_rank(dp_group) == 0:  # last stage, replica 0
            secs = time.time() - start
            log(f"step {state.step:3d} | loss {loss:.4f} | lr {lr:.2e} | {secs:.2f} s")
        due = state.step % args.save_every == 0 or state.step == args.steps
        seconds = save_now(state, args, layout, saver) if due else 0.0
        if due and saver is None:
            stop.check_save_time(seconds)  # warns if torchrun would cut it short
        elif saver is not None:
            saver.poll()  # publishes a background save as soon as it is on disk
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
            return
    if state.step < args.steps and rank == 0:
        log(f"stopping after step {state.step} (--stop-after), as if interrupted")


def check_flags_match(args, path) -> None:
    """Refuses a step saved with another --n-layers or --dim, naming the flag."""
    # rank 0 reads the step's index, the other ranks get it (one broadcast)
    items = open_reader(path, check_files=False).metadata.state_dict_metadata
    layers = {k.split(".")[2] for k in items if k.startswith("model.layers.")}
    embedding = items.get("model.tok_embeddings.weight")
    saved = {"--n-layers": len(layers), "--dim": embedding and embedding.size[1]}
    for flag, value in saved.items():
        ours = getattr(args, flag[2:].replace("-", "_"))
        if value and value != ours:
            raise ValueError(
                f"{path} was saved with {flag} {value}, this run has {ours}: "
                f"pass {flag} {value}, or another --checkpoint-dir"
            )


def verify(args, state, path: Path, layout: Layout, device) -> bool:
    """Loads `path` into freshly initialised stages and compares every tensor
    (with FSDP2, every rank its own shards)."""
    start = time.perf_counter()
    fresh_stages = build_stages(args, layout, device, seed=args.seed + 1)
    fresh = build_state(args, fresh_stages, state.extra["data"].data)
    note = " into a fresh stage" if len(fresh_stages) == 1 else " into fresh stages"
    tensors, nbytes = load(fresh, path)
    report(layout, f"loaded {tensors} tensors", nbytes, f"from {path}{note}", start)
    differ = checkpoint.diff_state_dicts(state.state_dict(), fresh.state_dict())
    if differ:
        log(f"{layout.label}: {len(differ)} entries differ: {differ[:5]}")
    failed = torch.tensor([len(differ)], device=device)
    dist.all_reduce(failed)
    if dist.get_rank() == 0 and not failed.item():
        ranks = dist.get_world_size()
        fresh = f"loaded into fresh stages on all {ranks} ranks"
        log(f"verified: {path} {fresh}, model and optimizer bitwise equal")
    return not failed.item()


def skip_damaged(args, layout: Layout):
    """--skip-damaged: the newest step that verifies; each rank says what it
    skipped (moved aside, so that no later save meets it)."""
    latest, skipped = newest_verified_step(args.checkpoint_dir)
    for name, why in skipped.items():
        log(f"{layout.label}: skipped {name} ({why})")
    return latest


def stop_on_signals(args, device) -> checkpoint.StopSignal:
    """--stop-signals end training with a save; rank 0 shows torchrun's deadline
    for it when one is set, and warns of restarts that would hang."""
    stop = checkpoint.StopSignal(args.stop_signals, device=device)
    if dist.get_rank() == 0 and stop.deadline and stop.deadline.explicit:
        names = ", ".join(s.name for s in args.stop_signals)
        seconds, source = stop.deadline.seconds, stop.deadline.source
        log(f"{names}: a last save, then exit; {source} gives it {seconds:g} s")
    check_restarts()
    return stop


def setup_distributed() -> tuple[int, torch.device]:
    if "RANK" not in os.environ:
        sys.exit(f"launch with torchrun: torchrun --nproc-per-node 4 {sys.argv[0]}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # pippy logs what it does beyond a save (steps removed by --keep-last, a
    # background save published): rank 0 shows it.
    form = f"[rank {dist.get_rank()}] %(message)s"
    logging.basicConfig(format=form, level=logging.WARNING, stream=sys.stdout)
    if dist.get_rank() == 0:
        logging.getLogger("pippy").setLevel(logging.INFO)
    return dist.get_rank(), device


def main(args) -> None:
    # set up distributed: gloo on CPU, nccl on GPU. A rank whose torchrun
    # died stops at once; a SIGTERM or SIGUSR1 ends training with a save
    rank, device = setup_distributed()
    checkpoint.stop_with_launcher()
    stop = stop_on_signals(args, device)
    owner = checkpoint.FolderOwner(args.checkpoint_dir)
    try:
        # lay the ranks out on a (dp, pp) mesh; build and split the model, the
        # schedule, and the state to checkpoint. A failure on one rank stops
        # them all, instead of the others waiting in a collective
        with fail_together("setting up", keep_own_error=True):
            layout = build_layout(args, device)
            stages = build_stages(args, layout, device, seed=args.seed)
            runs = stages if args.schedule in LOOPED else stages[0]
            schedule = SCHEDULES[args.schedule](
                runs, args.microbatches, loss_fn=loss_fn
            )
            state = build_state(args, stages, load_text(args.data))
        # own the checkpoint folder: one job writes it, a second is refused
        owner.acquire()
        # resume if a checkpoint exists (its optimizer and LR schedule win over --lr)
        resume(state, args, layout)
        # train, saving every --save-every steps and at the last; with
        # --async-save, in the background, one save at a time
        saver = None
        if args.async_save:
            keep, mesh = args.keep_last, layout.mesh
            saver = checkpoint.AsyncSaver(
                args.checkpoint_dir, keep_last=keep, mesh=mesh
            )
        train(args, state, stages, schedule, device, layout, saver, stop)
        if saver is not None:
            saver.close()  # waits for the last save, then publishes it
        # verify: load the final checkpoint into fresh stages, compare bit for bit
        final = step_dir(args.checkpoint_dir, state.step)
        saved = checkpoint.find_latest_step(args.checkpoint_dir) == final
        ok = not saved or verify(args, state, final, layout, device)
    except (checkpoint.CheckpointError, ValueError, OSError) as e:  # not a traceback
        # pippy names no flag of ours: say which one a folder error is about
        flag = " (--checkpoint-dir)" * isinstance(e, checkpoint.CheckpointDirError)
        log(f"[rank {rank}] error: {e}{flag}")
        ok = False
    finally:
        owner.release()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(ARGS)
