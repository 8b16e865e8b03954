"""Checks that run on real ranks; launched by the tests with torchrun.

    torchrun --nproc-per-node N test/dist_checks.py CHECK[,CHECK...] OUT_DIR

Each rank writes what it found to OUT_DIR/<check>-rank<R>.json and the test
asserts on it, so a failure shows the values, not just an exit code. Several
checks share one launch of ranks: starting ranks is the slow part here.
"""

import copy
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint import (
    checks,
    offline,  # noqa: E402
)
from pippy.checkpoint.checks import named_leaves, state_dict_size
from pippy.checkpoint.collectives import fail_together
from pippy.checkpoint.steps import list_steps, step_dir
from pippy.checkpoint.storage import LocalStorage

import parallel  # noqa: E402
import pippy_dcp  # noqa: E402
from gpt import GPT, ModelArgs, rope_table  # noqa: E402
from helpers import TINY_FLAGS, CountedOps, poison_metadata, run_checks  # noqa: E402
from hf_checks import check_hf  # noqa: E402

TINY = [*TINY_FLAGS, "--batch-size", "8"]
DEVICE = torch.device("cpu")


def build(args, rank, world_size, seed):
    stage = pippy_dcp.build_stage(args, rank, world_size, DEVICE, seed=seed)
    state = pippy_dcp.build_state(args, [stage], pippy_dcp.load_text(None))
    return stage, state


def collision(state_dict):
    try:
        checks.check_keys(state_dict)
    except checkpoint.KeyCollisionError as e:
        return str(e)
    return None


class PerRank:
    """A Stateful whose value differs per rank, e.g. a stage's RNG."""

    def __init__(self, rank):
        self.value = torch.tensor([rank])

    def state_dict(self):
        return {"state": self.value}

    def load_state_dict(self, state_dict):
        self.value = state_dict["state"]


def check_keys(out: Path, rank: int, world_size: int) -> dict:
    """Each rank's keys for both split methods, and the collision check's verdicts."""
    result, built = {}, {}
    for split in ("manual", "trace"):
        args = pippy_dcp.parse_args([*TINY, "--split", split])
        _, built[split] = build(args, rank, world_size, seed=0)
        sd = built[split].state_dict()
        checks.check_keys(sd)  # must not raise on a correct split
        result[split] = {
            "model": sorted(sd["model"]),
            "optim": sorted(k for k, _ in named_leaves(sd["optim"])),
        }
    # Per-rank state under a shared key: DCP would keep one rank's copy.
    args = pippy_dcp.parse_args(TINY)
    _, state = build(args, rank, world_size, seed=0)
    state.extra["rng"] = PerRank(rank)
    try:
        checks.check_keys(state.state_dict())
        result["per_rank_error"] = None
    except checkpoint.KeyCollisionError as e:
        result["per_rank_error"] = str(e)
    # An LR scheduler over another number of param groups on each stage.
    try:
        checks.check_keys({"lr_scheduler": {"base_lrs": [1e-3] * (rank + 1)}})
        result["scheduler_error"] = None
    except checkpoint.KeyCollisionError as e:
        result["scheduler_error"] = str(e)
    # The first and last stages alone draw batches: which ranks agree, not
    # the fewer of them, is what the error shows.
    ends = torch.tensor([rank in (0, world_size - 1)])
    try:
        checks.check_keys({"data": {"drawn": ends}})
        result["ends_error"] = None
    except checkpoint.KeyCollisionError as e:
        result["ends_error"] = str(e)
    # An entry DCP cannot pickle: its repr (an address) differs between ranks.
    try:
        checks.check_keys({"cfg": {"fn": lambda x: x}})
        result["lambda_error"] = None
    except TypeError as e:
        result["lambda_error"] = str(e)
    # Tracing without restore_non_persistent_buffers: "rope" on every stage
    # (the traced stage above, its keys taken: one trace less).
    state = built["trace"]
    state.module.register_buffer("rope", state.module.get_buffer("rope"))
    result["traced_buffer_error"] = collision(state.state_dict())
    # A tied output head, traced: a copy named output.weight on two stages.
    with torch.device("meta"):
        tied = GPT(ModelArgs(4, 32, max_seq_len=32))
    tied.output.weight = tied.tok_embeddings.weight
    pipe = pippy_dcp.split_traced(tied, world_size, (2, 32))
    stage_module = pipe.get_stage_module(rank)
    result["traced_tie_error"] = collision({"model": stage_module.state_dict()})
    # A stage built from layers[i] without the global index: every stage has
    # "layers.0". The check must refuse it on every rank.
    args = pippy_dcp.parse_args(TINY)
    _, state = build(args, rank, world_size, seed=0)
    layers = state.module.layers
    renumbered = {str(i): layer for i, layer in enumerate(layers.values())}
    state.module.layers = torch.nn.ModuleDict(renumbered)
    try:
        checks.check_keys(state.state_dict())
        result["renumbered_error"] = None
    except checkpoint.KeyCollisionError as e:
        result["renumbered_error"] = str(e)
    return result


def train_steps(state, stage, schedule, n):
    return [parallel.train_step(state, [stage], schedule, DEVICE) for _ in range(n)]


def check_train(out: Path, rank: int, world_size: int) -> dict:
    """Round trip and exact resume, for both schedules.

    Run A trains 3 steps, saves, trains 3 more. Run B builds fresh stages from
    another seed, loads the step-3 checkpoint and trains 3 steps. B must equal A
    bit for bit: at the load (model, optimizer, scheduler, data state) and after.
    """
    result = {}
    for schedule_name in ("gpipe", "1f1b"):
        args = pippy_dcp.parse_args([*TINY, "--schedule", schedule_name])
        args.microbatches = 4
        cls = parallel.SCHEDULES[schedule_name]
        stage, state = build(args, rank, world_size, seed=0)
        schedule = cls(stage, n_microbatches=4, loss_fn=parallel.loss_fn)
        train_steps(state, stage, schedule, 3)
        saved = copy.deepcopy(state.state_dict())
        folder = out / schedule_name
        checkpoint.save_stage(state, folder)
        losses_a = train_steps(state, stage, schedule, 3)

        stage_b, state_b = build(args, rank, world_size, seed=1)
        schedule_b = cls(stage_b, n_microbatches=4, loss_fn=parallel.loss_fn)
        before = offline.diff_state_dicts(state_b.state_dict(), saved)
        checkpoint.load_stage(state_b, checkpoint.find_latest_step(folder))
        after_load = offline.diff_state_dicts(state_b.state_dict(), saved)
        losses_b = train_steps(state_b, stage_b, schedule_b, 3)
        final = offline.diff_state_dicts(state_b.state_dict(), state.state_dict())
        result[schedule_name] = {
            "differ_before_load": before,
            "differ_after_load": after_load,
            "losses_a": losses_a,
            "losses_b": losses_b,
            "differ_final": final,
            "tensors": state_dict_size(saved)[0],
        }
    return result


def check_logits(out: Path, rank: int, world_size: int) -> dict:
    """Trains 2 steps, saves, and keeps what the un-split model must reproduce:
    each stage's tensors and the pipeline's logits on one batch."""
    args = pippy_dcp.parse_args([*TINY, "--microbatches", "4"])
    stage, state = build(args, rank, world_size, seed=0)
    schedule = parallel.SCHEDULES["gpipe"](stage, 4, loss_fn=parallel.loss_fn)
    train_steps(state, stage, schedule, 2)
    checkpoint.save_stage(state, out / "ckpt")
    torch.save(state.state_dict(), out / f"stage-{rank}.pt")
    inputs, targets = state.extra["data"].next_batch()
    logits = schedule.eval(*([inputs] if stage.is_first else []), target=targets)
    if stage.is_last:
        torch.save({"inputs": inputs, "logits": logits}, out / "logits.pt")
    return {"step": state.step}


def check_fsdp(out: Path, rank: int, world_size: int) -> dict:
    """The pipeline checkpoint in out/ckpt, loaded into the un-split model
    sharded with FSDP2 (model and AdamW state), then 2 more training steps."""
    from torch.distributed.fsdp import fully_shard

    args = pippy_dcp.parse_args(TINY)
    with torch.device("meta"):
        model = GPT(ModelArgs(4, 32, max_seq_len=32))
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=DEVICE)  # uninitialised: everything comes from the load
    model.rope.copy_(rope_table(ModelArgs(4, 32, max_seq_len=32)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    path = checkpoint.find_latest_step(out / "ckpt")
    step = offline.load_model(path, model, optimizer)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    torch.save(full, out / f"fsdp-model-{rank}.pt")
    moments = {
        k: v["exp_avg"].full_tensor()
        for k, v in optimizer.state_dict()["state"].items()
    }
    # Data parallel: each rank takes its share of the pipeline's batch.
    sampler = pippy_dcp.BatchSampler(pippy_dcp.load_text(None), 8, 32, seed=5)
    losses = []
    for _ in range(2):
        inputs, targets = sampler.next_batch()
        share = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        loss = parallel.loss_fn(model(inputs[share]), targets[share])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {"step": step, "losses": losses, "moments": len(moments)}


def check_memory(out: Path, rank: int, world_size: int) -> dict:
    """Peak memory of building one stage of a model of ~200 MB, against the
    whole model's size: a rank must not allocate the layers it does not own."""
    import resource

    argv = ["--n-layers", "16", "--dim", "512", "--seq-len", "32"]
    args = pippy_dcp.parse_args(argv)

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes

    with torch.device("meta"):
        full = GPT(ModelArgs(16, 512, max_seq_len=32))
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    before = peak()
    stage = pippy_dcp.build_stage(args, rank, world_size, DEVICE, seed=0)
    stage_peak = peak() - before
    stage_bytes = sum(p.numel() * p.element_size() for p in stage.submod.parameters())
    names = sorted(
        {
            int(n.split(".")[1])
            for n, _ in stage.submod.named_parameters()
            if n.startswith("layers.")
        }
    )
    # Control: materialising the whole model does raise the peak by its size.
    before = peak()
    whole = GPT(ModelArgs(16, 512, max_seq_len=32))
    whole_peak = peak() - before
    del whole
    return {
        "full_bytes": full_bytes,
        "stage_bytes": stage_bytes,
        "stage_peak": stage_peak,
        "whole_peak": whole_peak,
        "layers": names,
    }


class NoPickle:
    """A value that compares equal on every rank and copies, and pickles once
    (for the checks before a save), then no more (in the writer)."""

    def __init__(self):
        self.pickled = False

    def __repr__(self):
        return "NoPickle()"

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if not self.pickled:
            self.pickled = True
            return NoPickle, ()
        raise TypeError("cannot pickle a NoPickle")


class Unpicklable:
    """Extra state whose value cannot be written: the background save fails."""

    def state_dict(self):
        return {"callback": NoPickle()}

    def load_state_dict(self, state_dict):
        pass


def changed_at_once(out: Path, rank: int) -> dict:
    """Every saved tensor changed in place as soon as save() returns: by
    optimizer.step() (the saver's hook makes it wait for the copy; the LR
    and a buffer replaced before it), then by p.add_() after
    wait_for_staging(); plain dcp.load reads each step back. A state_dict
    hook slow outside the main thread holds the background back; a save
    before the first step (no AdamW state yet) does not hang."""
    import torch.distributed.checkpoint as dcp

    def build_state(seed: int) -> checkpoint.StageState:
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(512, 512) for _ in range(8)]  # 25 MB with AdamW
        module = torch.nn.ModuleDict({f"stage{rank}": torch.nn.Sequential(*layers)})
        module[f"stage{rank}"].register_buffer("seen", torch.zeros(4))
        return checkpoint.StageState(module, torch.optim.AdamW(module.parameters()))

    def slow(*_, **__):  # the background takes the state after the changes below
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)

    state = build_state(rank)
    state.module.register_state_dict_pre_hook(slow)
    saver = checkpoint.AsyncSaver(out / "at_once")
    saver.save(state)  # step 0
    saver.wait()
    at_call, unchanged = {}, {}
    for step in (1, 2):
        for p in state.module.parameters():
            p.grad = torch.randn_like(p)
        state.optimizer.step()
        state.step = step
        at_call[step] = copy.deepcopy(state.state_dict())
        live = [v for _, v in named_leaves(state.state_dict()) if torch.is_tensor(v)]
        saver.save(state)
        if step == 1:
            own = state.module[f"stage{rank}"]
            own.seen = own.seen + 1
            state.optimizer.param_groups[0]["lr"] *= 2
            state.optimizer.step()  # waits for the copy (the saver's step hook)
        else:
            saver.wait_for_staging()
            with torch.no_grad():  # the last tensor first: where the copy ends
                for t in reversed(live):
                    t.add_(1)
        now = state.state_dict()
        diff = set(offline.diff_state_dicts(now, at_call[step]))
        leaves = named_leaves(now)
        unchanged[step] = [
            k for k, v in leaves if isinstance(v, torch.Tensor) and k not in diff
        ]
        saver.wait()
    saver.close()
    differ = {}
    for step in (1, 2):
        loaded = build_state(rank + 10).state_dict()
        dcp.load(loaded, checkpoint_id=step_dir(out / "at_once", step))
        differ[step] = offline.diff_state_dicts(loaded, at_call[step])
    return {"at_once_unchanged": unchanged, "at_once_differ": differ}


def check_async(out: Path, rank: int, world_size: int) -> dict:
    """--async-save: values of the moment of the call, one save in flight,
    failures reported by wait(), nothing published on failure; the copy
    overlaps the next step (changed_at_once)."""
    args = pippy_dcp.parse_args(TINY)
    stage, state = build(args, rank, world_size, seed=0)
    schedule = parallel.SCHEDULES["gpipe"](stage, 4, loss_fn=parallel.loss_fn)
    saver = checkpoint.AsyncSaver(out / "ckpt", keep_last=2)
    train_steps(state, stage, schedule, 2)
    snapshots = {}
    for _ in range(3):  # saves at steps 2, 4, 6; training goes on meanwhile
        snapshots[state.step] = copy.deepcopy(state.state_dict())
        saver.save(state)
        train_steps(state, stage, schedule, 2)
    saver.wait()
    steps = sorted(list_steps(LocalStorage(), out / "ckpt"))
    differ = {}
    for step in steps:
        fresh_stage, fresh = build(args, rank, world_size, seed=1)
        checkpoint.load_stage(fresh, step_dir(out / "ckpt", step))
        differ[step] = offline.diff_state_dicts(fresh.state_dict(), snapshots[step])
    # A save that fails in the background is reported by wait(), not lost.
    state.extra["bad"] = Unpicklable()
    error, raised_in = None, None
    try:
        raised_in = "save"
        saver.save(state.state_dict(), state.step)
        raised_in = "wait"
        saver.wait()
        raised_in = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    saver.close()
    after = sorted(list_steps(LocalStorage(), out / "ckpt"))
    return {
        "steps": steps,
        "differ": differ,
        "error": error,
        "raised_in": raised_in,
        "after": after,
        **changed_at_once(out, rank),
    }


def check_refusal(out: Path, rank: int, world_size: int) -> dict:
    """A load that one rank refuses (its param groups) stops every rank with
    that rank's error, instead of the others training on into a dead peer."""

    def build_state(split_groups: bool) -> checkpoint.StageState:
        torch.manual_seed(rank)
        heads = torch.nn.ModuleDict(
            {"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)}
        )
        module = torch.nn.ModuleDict({f"stage{rank}": heads})  # FQNs per rank
        groups = [{"params": heads.parameters(), "lr": 0.1}]
        if split_groups:
            groups = [
                {"params": heads["a"].parameters(), "lr": 0.1},
                {"params": heads["b"].parameters(), "lr": 0.2},
            ]
        state = checkpoint.StageState(module, torch.optim.AdamW(groups))
        sum(h(torch.randn(2, 4)).sum() for h in heads.values()).backward()
        state.optimizer.step()
        return state

    saved = build_state(split_groups=rank == 1)  # rank 1's stage: two groups
    saved.step = 1
    path = checkpoint.save_stage(saved, out / "refusal")
    loaded = build_state(split_groups=False)  # rebuilt with one group everywhere
    error = None
    try:  # rank 1 refuses inside dcp.load; DCP's last gather tells rank 0
        checkpoint.load_stage(loaded, path)
    except checkpoint.CheckpointError as e:
        error = str(e)
    dist.barrier()  # every rank got here: none trains on into a dead peer
    # Under a group of rank 1 alone: the error names the global rank, and a
    # rank outside the group may not enter (it would lose its error).
    only_1 = dist.new_group([1])
    in_group = None
    try:
        with fail_together("in a group", process_group=only_1):
            raise RuntimeError("from the group")
    except (checkpoint.CheckpointError, ValueError) as e:
        in_group = f"{type(e).__name__}: {e}"
    # A rank's error that pickles but does not unpickle (an __init__ with more
    # arguments than it passes on) reaches the others as its line, not as a
    # TypeError inside DCP's gather that leaves rank 1 waiting.
    unportable = None
    state = {"model": {f"w{rank}": torch.ones(2)}, "note": _Note(fail=rank == 1)}
    try:
        checkpoint.save_stage(state, out / "unportable", step=1, timeout=60)
    except checkpoint.CheckpointError as e:
        unportable = f"{type(e).__name__}: {e}"
    # The same on a load, of a plain state_dict and of a StageState: a Stateful
    # failing on rank 1 stops both ranks; a plain one's entries are loaded.
    plain = {**state, "note": _Note(fail=False), "count": 3}
    noted = checkpoint.save_stage(plain, out / "notes", step=1)
    module = torch.nn.ModuleDict({f"stage{rank}": torch.nn.Linear(2, 2)})
    staged = checkpoint.StageState(module, extra={"note": _Note(fail=False)})
    staged.step = 1
    staged_step = checkpoint.save_stage(staged, out / "staged")
    failing = {"note": _Note(fail=rank == 1)}
    loads = [
        ({**state, **failing, "count": 0}, noted),
        (checkpoint.StageState(module, extra=failing), staged_step),
    ]
    unloaded = []
    for target, step in loads:
        try:
            checkpoint.load_stage(target, step, timeout=60)
        except checkpoint.CheckpointError as e:
            unloaded.append(f"{type(e).__name__}: {e}")
    plain = {**state, "note": _Note(fail=False, text="?"), "count": 0}
    checkpoint.load_stage(plain, noted)
    loaded = [plain["note"].text, plain["count"]]
    # Its Stateful's load_state_dict failing on rank 1 stops both ranks too.
    refused = {**state, "note": _Note(fail=False, fail_load=rank == 1), "count": 0}
    applied = None
    try:
        checkpoint.load_stage(refused, noted, timeout=60)
    except checkpoint.CheckpointError as e:
        applied = f"{type(e).__name__}: {e}"
    # A crafted .metadata, checked by rank 0, unpickled by rank 1 from its bytes:
    # refused on every rank, its payload never run; trusted, loaded on every rank.
    poisoned, marker = checkpoint.save_stage(staged, out / "poisoned"), out / "pwned"
    if rank == 0:
        poison_metadata(poisoned, marker)
    dist.barrier()
    crafted = []
    for trusted in (False, True):
        try:
            checkpoint.load_stage(copy.deepcopy(staged), poisoned, trusted=trusted)
            crafted.append(["loaded", marker.exists()])
        except checkpoint.CheckpointError as e:
            crafted.append([type(e).__name__, marker.exists()])
        dist.barrier()
    # Step counters that drifted apart (5 on rank 0, 6 on rank 1): refused in
    # DCP's planning, on both ranks, before anything is written.
    drift = None
    try:
        checkpoint.save_stage({f"w{rank}": torch.ones(2)}, out / "drift", step=5 + rank)
    except checkpoint.CheckpointError as e:
        drift = f"{type(e).__name__}: {e}"
    dist.barrier()
    # A folder per rank (one name for a shared folder and one for the other):
    # refused on both ranks in DCP's planning, before any folder is made.
    apart = None
    try:
        checkpoint.save_stage({f"w{rank}": torch.ones(2)}, out / f"apart{rank}", step=1)
    except checkpoint.CheckpointDirError as e:
        apart = f"{type(e).__name__}: {e}"
    dist.barrier()
    # The same folder, named through a link on rank 1: one step, saved.
    if rank == 0:
        (out / "linked").symlink_to(out / "real", target_is_directory=True)
    dist.barrier()
    folder = out / ("real" if rank == 0 else "linked")
    linked = checkpoint.save_stage({f"w{rank}": torch.ones(2)}, folder, step=1)
    # Ranks that load different steps: refused on both, not taken for damage.
    steps = [checkpoint.save_stage(staged, out / "two") for staged.step in (1, 2)]
    mixed = None
    try:
        checkpoint.load_stage(copy.deepcopy(staged), steps[rank], timeout=60)
    except (checkpoint.CheckpointError, ValueError) as e:  # rank 1: its own
        mixed = f"{type(e).__name__}: {e}"
    dist.barrier()
    return {
        "mixed": mixed,
        "drift": drift,
        "drift_folder": sorted(p.name for p in (out / "drift").glob("*")),
        "apart": apart,
        "linked": [str(linked), sorted(os.listdir(out / "real"))],
        "apart_folders": sorted(p.name for p in out.glob("apart*")),
        "error": error,
        "path": str(path),
        "in_group": in_group,
        "unportable": unportable,
        "unloaded": unloaded,
        "loaded": loaded,
        "unloaded_from": [str(step) for _, step in loads],
        "crafted": crafted,
        "applied": applied,
    }


class _Unportable(Exception):
    """An error that pickles, but whose unpickling calls __init__ with too few."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")


class _Note:
    """A Stateful whose state_dict (or load_state_dict) fails if told to."""

    def __init__(self, fail: bool, text: str = "hello", fail_load: bool = False):
        self.fail, self.text, self.fail_load = fail, text, fail_load

    def state_dict(self) -> dict:
        if self.fail:
            raise _Unportable(7, "the note is gone")
        return {"text": self.text}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.fail_load:
            raise _Unportable(8, "the note cannot be read")
        self.text = state_dict["text"]


def check_twins(out: Path, rank: int, world_size: int) -> dict:
    """A step whose rank files have the same size (each rank: one 8x8 tensor),
    and an async save published by poll() as soon as it is on disk."""
    torch.manual_seed(rank)
    state = {"model": {f"w{rank}": torch.randn(8, 8)}}  # nothing shared
    checkpoint.save_stage(state, out / "twins", step=1)
    saver = checkpoint.AsyncSaver(out / "poll", keep_last=1)
    saver.save({"model": {f"w{rank}": torch.randn(8, 8)}, "step": 1}, 1)
    saver.save({"model": {f"w{rank}": torch.randn(8, 8)}, "step": 2}, 2)
    polls, published = 0, None
    while published is None and polls < 200:  # what a training loop does
        polls += 1
        time.sleep(0.02)
        published = saver.poll()
    listed = sorted(list_steps(LocalStorage(), out / "poll"))
    saver.close()
    return {"published": str(published), "polls": polls, "listed": listed}


def check_one_fails(out: Path, rank: int, world_size: int) -> dict:
    """A setup that fails on the last rank only (its data file is missing):
    every rank stops, the failing one with its own error, the others naming it."""
    try:
        with fail_together("setting up", keep_own_error=True):
            path = out / "missing.txt" if rank == world_size - 1 else None
            pippy_dcp.load_text(str(path) if path else None)
        return {"error": None}
    except (checkpoint.CheckpointError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def check_ops(out: Path, rank: int, world_size: int) -> dict:
    """The collectives and store operations of a save and a load of one stage,
    pippy's and plain DCP's, on the same state (counted on each rank)."""
    import torch.distributed.checkpoint as dcp

    args = pippy_dcp.parse_args(TINY)
    _, state = build(args, rank, world_size, seed=0)
    ops = {}
    with CountedOps() as ops["dcp.save"]:
        dcp.save(state.state_dict(), checkpoint_id=out / "ops-plain")
    with CountedOps() as ops["save_stage"]:
        step = checkpoint.save_stage(state, out / "ops")
    with CountedOps() as ops["dcp.load"]:
        dcp.load(state.state_dict(), checkpoint_id=out / "ops-plain")
    with CountedOps() as ops["load_stage"]:
        checkpoint.load_stage(state, step)
    return {name: dict(counted.counts) for name, counted in ops.items()}


CHECKS = {
    "ops": check_ops,
    "one_fails": check_one_fails,
    "twins": check_twins,
    "async": check_async,
    "refusal": check_refusal,
    "keys": check_keys,
    "train": check_train,
    "logits": check_logits,
    "fsdp": check_fsdp,
    "memory": check_memory,
    "hf": check_hf,
}

if __name__ == "__main__":
    run_checks(CHECKS)
