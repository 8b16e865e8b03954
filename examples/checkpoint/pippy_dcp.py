"""Pipeline-parallel training where every rank checkpoints its own stage through DCP.

Each rank builds one pipeline stage of a language model and trains it with
a pipeline schedule; every ``--save-every`` steps all ranks save their stage at
the same time into one folder per step with ``torch.distributed.checkpoint``
(DCP), and a new run resumes from the newest complete step. At the end the last
checkpoint is loaded into freshly built stages and checked bit for bit. The
model, a small byte-level GPT, is in gpt.py beside this file.

    torchrun --nproc-per-node 4 examples/checkpoint/pippy_dcp.py
    torchrun --nproc-per-node 4 examples/checkpoint/pippy_dcp.py --dp 2 [--fsdp]
    torchrun --nproc-per-node 2 examples/checkpoint/pippy_dcp.py \
        --stages-per-rank 2 --schedule interleaved-1f1b

With ``--dp 2`` the ranks form 2 pipelines, whose stages are DDP replicas (or
FSDP2 shards, ``--fsdp``) across the data-parallel dim of a ``(dp, pp)`` mesh;
with ``--stages-per-rank 2`` each rank runs two stages of a looped schedule.
Any layout's checkpoint resumes on any other.

A first run trains steps 1-20, printing the loss, and each rank prints what it
saved at step-10 and step-20; it ends with "verified: ... bitwise equal". With
``--stop-after 10`` it stops after step 10 as if interrupted; the same command
without the flag then prints "resuming from checkpoints/step-10" and trains on
to step 20. Raise ``--steps`` to continue a finished run. A second run on the
same folder while one runs is refused; a SIGTERM (preemption) makes every rank
save the step it is on, then exit.
"""

import argparse
import math
import os
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import pippy
from pippy import checkpoint
from pippy.checkpoint.api import (
    ManifestWriter,
    apply_state,
    open_step,
    publish_step,
    take_state,
)
from pippy.checkpoint.checks import (
    check_untied,
    restore_non_persistent_buffers,
    state_dict_size,
)
from pippy.checkpoint.errors import explain_failures, fail_together
from pippy.checkpoint.steps import is_complete, step_dir

from gpt import GPT, ModelArgs, init_weights, rope_table

# Looped schedules take all of a rank's stages; stage s runs on pipeline rank s % pp.
LOOPED = {
    "interleaved-1f1b": pippy.ScheduleInterleaved1F1B,
    "looped-bfs": pippy.ScheduleLoopedBFS,
    "zero-bubble": pippy.ScheduleInterleavedZeroBubble,
}
SCHEDULES = {"gpipe": pippy.ScheduleGPipe, "1f1b": pippy.Schedule1F1B, **LOOPED}


@dataclass
class Layout:
    """This rank's place on the (dp, pp) mesh: its stages, and a name for them."""

    mesh: DeviceMesh
    stages: list[int]
    num_stages: int
    label: str  # "[rank 3] stage 1 (dp 1)", "[rank 1] stages 1, 3"


def build_layout(args, device: torch.device) -> Layout:
    """The mesh: --dp pipelines of pp ranks; pipeline rank r runs stages r, r+pp..."""
    pp = dist.get_world_size() // args.dp
    mesh = init_device_mesh(device.type, (args.dp, pp), mesh_dim_names=("dp", "pp"))
    num_stages = pp * args.stages_per_rank
    stages = list(range(mesh.get_local_rank("pp"), num_stages, pp))
    label = f"[rank {dist.get_rank()}] stage{'s' * (len(stages) > 1)} "
    label += ", ".join(map(str, stages))
    if args.dp > 1:
        label += f" (dp {mesh.get_local_rank('dp')})"
    return Layout(mesh, stages, num_stages, label)


def stage_layers(stage_index: int, num_stages: int, n_layers: int) -> range:
    """The contiguous layers of one stage; stage sizes differ by at most one."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {num_stages} stages: give at most "
            f"{n_layers} stages (ranks / --dp x --stages-per-rank)"
        )
    per_stage, rest = divmod(n_layers, num_stages)
    start = stage_index * per_stage + min(stage_index, rest)
    return range(start, start + per_stage + (stage_index < rest))


def split_manual(model: GPT, stage_index: int, num_stages: int) -> GPT:
    """Deletes what the stage does not own; what is left keeps its FQNs."""
    owned = stage_layers(stage_index, num_stages, len(model.layers))
    for i in list(model.layers):
        if int(i) not in owned:
            del model.layers[i]
    if stage_index > 0:
        model.tok_embeddings = None
    if stage_index < num_stages - 1:
        model.norm = model.output = None
    return model


def split_traced(model: GPT, num_stages: int, microbatch: torch.Tensor):
    """Traces the model and splits the graph before the first layer of each stage."""
    n_layers = len(model.layers)
    firsts = [stage_layers(s, num_stages, n_layers)[0] for s in range(1, num_stages)]
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
    # The stage all-reduces gradients itself, at the last microbatch's backward.
    # Without this, torch 2.13's first-step shape inference runs DDP's forward
    # outside no_sync(), and DDP's bucket rebuild fails at step 2.
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
        # The tracer makes the rope buffer a persistent key of every stage;
        # without this, all stages would offer the same "rope" key to DCP.
        restore_non_persistent_buffers(module, model)
    module.to_empty(device=device)  # allocate the stage, then fill it
    init_weights(module, seed)
    module.get_buffer("rope").copy_(rope_table(model_args))
    group = mesh.get_group("pp") if mesh is not None else None
    if args.split == "trace":
        return pipe.build_stage(index, device, group)
    if mesh is not None:
        module = data_parallel(module, args, mesh)
    return pippy.PipelineStage(module, index, num_stages, device, group=group)


def build_stages(args, layout: Layout, device, *, seed: int) -> list:
    """This rank's stages, in order, each replicated or sharded across dp."""
    n = layout.num_stages
    return [
        build_stage(args, s, n, device, seed=seed, mesh=layout.mesh)
        for s in layout.stages
    ]


def load_text(path: str | None) -> torch.Tensor:
    """Text as bytes, (num_bytes,) uint8: --data, or the stdlib's own .py files."""
    if path:
        data = Path(path).read_bytes()
    else:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        data = b"".join(f.read_bytes() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class BatchSampler:
    """Random windows of the text. Every rank draws the same batches (the first
    stage needs the inputs, the last the targets), so its state is a replica."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if len(data) <= seq_len + 1:
            raise ValueError(f"the text has {len(data)} bytes, too few for --seq-len")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (batch_size, seq_len) int64."""
        high = len(self.data) - self.seq_len - 1
        starts = torch.randint(high, (self.batch_size,), generator=self.generator)
        windows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts])
        windows = windows.long()
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"rng_state": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.generator.set_state(state_dict["rng_state"])


def build_state(args, stages: list, data: torch.Tensor) -> checkpoint.StageState:
    """AdamW, warmup + cosine LR schedule and data sampler, with the stages' modules."""
    modules = [stage.submod for stage in stages]  # StageState looks inside DDP
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    sampler = BatchSampler(data, args.batch_size, args.seq_len, args.seed)
    extra = {"data": sampler}
    return checkpoint.StageState(modules, optimizer, scheduler, extra=extra)


def log(message: str) -> None:
    """Prints a line in one write, so that lines of concurrent ranks never mix."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


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


def report(layout: Layout, verb: str, size: tuple, where: str, start: float) -> None:
    (tensors, nbytes), seconds = size, time.perf_counter() - start
    log(
        f"{layout.label}: {verb} {tensors} tensors, {nbytes / 1e6:.1f} MB {where} "
        f"in {seconds:.2f} s"
    )


def save(state: checkpoint.StageState, args, layout: Layout, saver) -> None:
    start = time.perf_counter()
    if saver is not None:  # --async-save: returns once the state is copied
        saver.save(state)
        size = state_dict_size(state.state_dict())  # FSDP2: this rank's shards
        return report(layout, "staged", size, f"for step-{state.step}", start)
    # DCP takes equal keys on two ranks for replicas and keeps one: a collision
    # would lose a stage without an error, and diverged dp replicas would be
    # mixed key by key. So take_state checks before anything is written: keys
    # disjoint across the pipeline dim, replicas equal across the dp dim.
    state_dict, step = take_state(state, mesh=layout.mesh)
    # One checkpoint_id for all ranks: each writes its own file into the same
    # folder and rank 0 writes .metadata, which maps every key to its file.
    # DCP stores no checksums: pippy's writer is DCP's, plus a manifest.json
    # with a CRC-32C of every item, which loading verifies.
    with publish_step(args.checkpoint_dir, step, keep_last=args.keep_last) as ckpt:
        writer = ManifestWriter(ckpt, step=step)
        dcp.save(state_dict, storage_writer=writer)
    # What this rank wrote: DCP writes each replicated item once, spread over
    # the replicas, so with DDP a rank writes a share of its stages.
    report(layout, "saved", writer.written, f"to step-{step}", start)


def load(state, path: Path, layout: Layout, *, model_only=False, note="") -> None:
    """Fills the stage's state from `path`; with model_only, the weights alone."""
    start = time.perf_counter()
    # DCP loads in place, into tensors that must already exist: state_dict()
    # returns this stage's tensors (and creates AdamW's empty moments), so each
    # rank reads just the keys its stage owns.
    if model_only:  # a fine-tuning start: optimizer, schedule and step stay new
        state_dict = {"model": get_model_state_dict(state.module)}
    else:
        state_dict = state.state_dict()
    # A checkpoint is partly pickle: pippy's reader and planner refuse pickled
    # code (PIPPY_TRUST_CHECKPOINT=1 lifts that), and keys that no rank reads.
    reader, planner = open_step(path, must_read=("model." if model_only else "",))
    with explain_failures(f"loading {path}"):
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    # Applying it runs on each rank alone; if one refuses (its param groups do
    # not match the checkpoint's), all stop with its error instead of the
    # others failing later in a collective.
    if model_only:
        with fail_together(f"loading {path}"):
            set_model_state_dict(state.module, state_dict["model"])
    else:
        apply_state(state, state_dict, path=path)
    size = state_dict_size(state_dict)
    report(layout, "loaded", size, f"from {path}{note}", start)


def train(args, state, stages, schedule, device, layout, saver, stop) -> None:
    """Trains up to --steps (or --stop-after, or a SIGTERM), saving as it goes."""
    rank, dp_group = dist.get_rank(), layout.mesh.get_group("dp")
    last = min(args.steps, args.stop_after or args.steps)
    if state.step >= last and rank == 0:
        log(f"already at step {state.step} of {args.steps}: nothing to train")
    while state.step < last:
        start, lr = time.time(), state.lr_scheduler.get_last_lr()[0]
        loss = train_step(state, stages, schedule, device, dp_group)
        if loss is not None and dist.get_rank(dp_group) == 0:  # last stage, replica 0
            secs = time.time() - start
            log(f"step {state.step:3d} | loss {loss:.4f} | lr {lr:.2e} | {secs:.2f} s")
        due = state.step % args.save_every == 0 or state.step == args.steps
        if due:
            save(state, args, layout, saver)
        elif saver is not None:
            saver.poll()  # publishes a background save as soon as it is on disk
        if stop.requested():  # preempted: this step is saved before we go
            if saver is not None:
                saver.wait()
            if not due:
                save(state, args, layout, None)
            if rank == 0:
                step = state.step
                log(f"stopping after step {step}: SIGTERM received, step-{step} saved")
            return
    if state.step < args.steps and rank == 0:
        log(f"stopping after step {state.step} (--stop-after), as if interrupted")


def verify(args, state, path: Path, layout: Layout, device) -> bool:
    """Loads `path` into freshly initialised stages and compares every tensor
    (with FSDP2, every rank its shards)."""
    fresh_stages = build_stages(args, layout, device, seed=args.seed + 1)
    fresh = build_state(args, fresh_stages, state.extra["data"].data)
    note = " into a fresh stage" if len(fresh_stages) == 1 else " into fresh stages"
    load(fresh, path, layout, note=note)
    # With FSDP2, each rank compares its own shards.
    differ = checkpoint.diff_state_dicts(state.state_dict(), fresh.state_dict())
    if differ:
        log(f"{layout.label}: {len(differ)} entries differ: {differ[:5]}")
    failed = torch.tensor([len(differ)], device=device)
    dist.all_reduce(failed)
    if dist.get_rank() == 0 and not failed.item():
        log(
            f"verified: {path} loaded into fresh stages on all "
            f"{dist.get_world_size()} ranks, model and optimizer bitwise equal"
        )
    return not failed.item()


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
    return dist.get_rank(), device


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--checkpoint-dir", default="checkpoints", help="one step-<N> folder per save")
    add("--steps", type=int, default=20, help="steps in all, resumed ones included")
    add("--save-every", type=int, default=10, help="save every N steps and at the last")
    add("--stop-after", type=int, help="stop after this step, as if interrupted")
    add("--split", choices=["manual", "trace"], default="manual", help="stage building")
    add("--schedule", choices=list(SCHEDULES), default="gpipe", help="schedule")
    add("--stages-per-rank", type=int, default=1, help="> 1: a looped --schedule")
    add("--dp", type=int, default=1, help="data-parallel degree; pp = ranks / dp")
    add("--fsdp", action="store_true", help="with --dp: FSDP2 shards, not DDP")
    add("--microbatches", type=int, default=4, help="per replica; >= stages for 1f1b")
    add("--batch-size", type=int, default=8, help="sequences per step, all replicas")
    add("--seq-len", type=int, default=128, help="bytes per sequence")
    add("--n-layers", type=int, default=8, help="decoder blocks; >= ranks")
    add("--dim", type=int, default=128, help="model width")
    add("--lr", type=float, default=1e-3, help="peak learning rate")
    add("--seed", type=int, default=0, help="seed of the weights and data order")
    add("--keep-last", type=int, help="keep only the newest K >= 1 complete steps")
    add("--async-save", action="store_true", help="save in the background")
    add("--init-from", help="a step folder whose weights start a new run")
    add("--data", help="a text file to train on (default: the stdlib's .py files)")
    args = p.parse_args(argv)
    counts = (args.steps, args.save_every, args.microbatches, args.dp)
    optional = [n for n in (args.stop_after, args.keep_last) if n is not None]
    if min(*counts, *optional, args.stages_per_rank) < 1:
        p.error(
            "--steps, --save-every, --microbatches, --dp, --stages-per-rank, "
            "--stop-after, --keep-last: >= 1"
        )
    world_size = int(os.environ.get("WORLD_SIZE", args.dp))
    if world_size % args.dp or args.fsdp and args.dp == 1:
        p.error(f"--dp must divide the {world_size} ranks; --fsdp needs --dp 2 or more")
    if args.batch_size % (args.dp * args.microbatches) or args.dim % ModelArgs.n_heads:
        p.error(
            "--dp x --microbatches must divide --batch-size; --dim, a multiple of 4"
        )
    if args.stages_per_rank > 1 and args.schedule not in LOOPED:
        p.error(f"--stages-per-rank > 1 needs --schedule {'|'.join(LOOPED)}")
    if args.split == "trace" and (args.dp > 1 or args.stages_per_rank > 1):
        p.error("--split trace builds one stage per rank, without --dp")
    return args


def main() -> None:
    args = parse_args()
    # set up distributed: gloo on CPU, nccl on GPU. A rank whose torchrun
    # died stops at once; a SIGTERM ends training with a save
    rank, device = setup_distributed()
    checkpoint.stop_with_launcher()
    stop = checkpoint.StopSignal(device=device)
    owner = checkpoint.FolderOwner(args.checkpoint_dir)
    try:
        # lay the ranks out on a (dp, pp) mesh; build and split the model, the
        # pipeline schedule, and the optimizer, LR schedule and data sampler: the
        # state to checkpoint. A failure on one rank stops them all, instead of
        # the others waiting in a collective
        with fail_together("setting up", keep_own_error=True):
            layout = build_layout(args, device)
            stages = build_stages(args, layout, device, seed=args.seed)
            runs = stages if args.schedule in LOOPED else stages[0]
            schedule = SCHEDULES[args.schedule](
                runs, args.microbatches, loss_fn=loss_fn
            )
            state = build_state(args, stages, load_text(args.data))
        # own the checkpoint folder: one job writes it, a second is refused;
        # this also fails now, not at the first save, if it is not writable
        owner.acquire()
        # resume if a checkpoint exists (its optimizer and LR schedule win over --lr)
        latest = checkpoint.find_latest_step(args.checkpoint_dir)
        if latest is not None:
            ignored = (
                " (--init-from applies to new runs only)" if args.init_from else ""
            )
            if rank == 0:
                log(f"resuming from {latest}{ignored}")
            load(state, latest, layout)
        elif args.init_from:
            if rank == 0:
                log(f"starting from the weights of {args.init_from}")
            load(state, Path(args.init_from), layout, model_only=True)
        # train, saving every --save-every steps and at the last; with
        # --async-save, in the background, one save at a time
        saver = None
        if args.async_save:
            saver = checkpoint.AsyncSaver(
                args.checkpoint_dir, keep_last=args.keep_last, mesh=layout.mesh
            )
        train(args, state, stages, schedule, device, layout, saver, stop)
        if saver is not None:
            saver.close()  # waits for the last save, then publishes it
        # verify: load the final checkpoint into fresh stages, compare bit for bit
        final = step_dir(args.checkpoint_dir, state.step)
        saved = is_complete(final)
        ok = not saved or verify(args, state, final, layout, device)
    except (checkpoint.CheckpointError, ValueError, OSError) as e:  # not a traceback
        hint = ""  # pippy names no flag of ours: say which one to change
        if type(e) is checkpoint.CheckpointDirError:
            hint = "; pass a writable --checkpoint-dir"
        log(f"[rank {rank}] error: {e}{hint}")
        ok = False
    finally:
        owner.release()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
