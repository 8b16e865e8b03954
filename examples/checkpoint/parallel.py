"""The parallel harness of pippy_dcp.py: processes, the (dp, pp) mesh, a train step.

Nothing here is about checkpoints: it is what any pipeline-parallel training
script on torch.distributed.pipelining needs, kept out of pippy_dcp.py so that
its checkpoint code reads first.
"""

import atexit
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import pippy

SCHEDULES = {"gpipe": pippy.ScheduleGPipe, "1f1b": pippy.Schedule1F1B}
LOOPED = {  # all of a rank's stages; stage s runs on pipeline rank s % pp
    "interleaved-1f1b": pippy.ScheduleInterleaved1F1B,
    "looped-bfs": pippy.ScheduleLoopedBFS,
    "zero-bubble": pippy.ScheduleInterleavedZeroBubble,
}
SCHEDULES.update(LOOPED)


def build_schedule(args, stages: list):
    """--schedule over this rank's stages (a looped schedule takes all of them)."""
    runs = stages if args.schedule in LOOPED else stages[0]
    return SCHEDULES[args.schedule](runs, args.microbatches, loss_fn=loss_fn)


def setup_distributed() -> tuple[int, torch.device]:
    """init_process_group: nccl on GPU (one per local rank), gloo on CPU.
    Returns (rank, device); exits with the torchrun line if not under torchrun."""
    if "RANK" not in os.environ:
        sys.exit(f"launch with torchrun: torchrun --nproc-per-node 4 {sys.argv[0]}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # Free what reference cycles keep alive (modules, their groups) while Python
    # still runs: a group freed in interpreter finalization can abort the
    # process, "terminate called without an active exception", as gloo's
    # threads reach for the GIL then (pytorch/pytorch#179291)
    atexit.register(gc.collect)
    # pippy logs what it does beyond a save (steps removed by --keep-last, a
    # background save published): rank 0 shows it.
    form = f"[rank {dist.get_rank()}] %(message)s"
    logging.basicConfig(format=form, level=logging.WARNING, stream=sys.stdout)
    if dist.get_rank() == 0:
        logging.getLogger("pippy").setLevel(logging.INFO)
    return dist.get_rank(), device


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


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross entropy; logits (batch, seq, vocab), targets (batch, seq)."""
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


def log(message: str) -> None:
    """Prints a line in one write, so that lines of concurrent ranks never mix."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def report(layout: Layout, what: str, nbytes: int, where: str, start: float) -> None:
    """One per-rank I/O line: '[rank 1] stage 1: saved ..., 4.8 MB ... in 0.20 s'."""
    seconds = time.perf_counter() - start
    log(f"{layout.label}: {what}, {nbytes / 1e6:.1f} MB {where} in {seconds:.2f} s")
