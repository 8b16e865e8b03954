"""The checkpointers users would pick instead, on the bench's stage, and the
check that an async save holds the values of its call.

A :class:`Peer` is one checkpointer set up on a stage: its save, what waits for
it, what it documents before the saved tensors may change in place, and its
load. ``dcp_async_save`` needs torch alone; ``tt_*`` (torchtitan 0.3.0's
``CheckpointManager``) and ``tc_*`` (torch_checkpointing 0.1.1's) are timed
only when their package imports (bench/README.md, "Against other
checkpointers", says how to install them).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from harness import (
    STEP,
    Ctx,
    Method,
    all_ranks,
    barrier,
    build_state,
    drop_page_cache,
    fsync_path,
    log,
)
from torch.distributed.checkpoint import FileSystemWriter

from pippy import checkpoint
from pippy.checkpoint.offline import diff_state_dicts
from pippy.checkpoint.steps import step_dir

Stage = checkpoint.StageState
Opener = Callable[[Stage], Callable[[], Any]]


@dataclass
class Peer:
    """One checkpointer on one stage, its files at ``path``.

    ``save`` saves ``state`` and returns what ``finish`` waits for (a sync
    save, not ``is_async``, returns once done); ``guard`` is what the
    checkpointer documents before the saved tensors change in place;
    ``open(fresh)`` prepares ``fresh`` (a new stage) and returns its timed
    load of ``path``.
    """

    state: Stage
    path: Path
    save: Callable[[], Any]
    open: Opener
    finish: Callable[[Any], Any] = lambda _: None
    guard: Callable[[], Any] = contextlib.nullcontext
    close: Callable[[], None] | None = None
    is_async: bool = False


def save_method(ctx: Ctx, name: str, peer: Peer) -> Method:
    """A peer's save: *blocked* until ``save`` returns, *wall* until it is done."""

    def run() -> dict:
        start = time.perf_counter()
        pending = peer.save()
        blocked = time.perf_counter() - start
        peer.finish(pending)
        return {"blocked_s": blocked} if peer.is_async else {}

    return Method(run=run, cleanup=ctx.remover(name), close=peer.close)


def load_method(ctx: Ctx, name: str, peer: Peer, cold: bool) -> Method:
    """A peer's load into a new stage; the save, the stage and what the load
    needs are made outside the timed region, as a resumed run has them."""
    holder: dict[str, Callable[[], Any]] = {}

    def prepare() -> None:
        peer.finish(peer.save())
        holder["load"] = peer.open(
            build_state(ctx.case, ctx.rank, ctx.world, seed=1, stepped=False)
        )
        barrier()
        if cold and ctx.rank == 0:
            drop_page_cache(ctx.work / name)

    def cleanup() -> None:
        holder.clear()
        ctx.remover(name)()

    def run() -> None:
        holder["load"]()

    return Method(run=run, prepare=prepare, cleanup=cleanup, close=peer.close)


def plain(state: Stage) -> dict[str, Any]:
    """The module's and optimizers' own state_dicts (param group options as
    dicts: torchtitan's load reorders their keys, which pippy's packing keeps)."""
    optim = {f"optim{i}": o.state_dict() for i, o in enumerate(state.optimizers)}
    return {"model": state.module.state_dict(), **optim}


def saved_tensors(state: Stage) -> list[torch.Tensor]:
    """The live tensors a stage's save holds: the module's and the optimizers'."""
    model = list(state.module.state_dict().values())
    optim = [
        v
        for o in state.optimizers
        for per_param in o.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    ]
    return [t for t in model + optim if t.dtype != torch.bool]


@torch.no_grad()
def check(ctx: Ctx, name: str, peer: Peer, guarded: bool = True) -> bool:
    """Whether a save holds the values of its call, bitwise, on every rank.

    Saves once and, as soon as the save returned (after ``peer.guard`` if
    ``guarded``), adds 1 to every saved tensor in place; then waits for the
    save, loads it into a new stage with the peer's own load and compares it
    with a copy taken at the call. The state is restored and the files
    removed. For a sync save this is the bitwise check of its load.
    """
    at_call = copy.deepcopy(plain(peer.state))
    live = saved_tensors(peer.state)
    kept = [t.clone() for t in live]
    pending = peer.save()
    with peer.guard() if guarded else contextlib.nullcontext():
        for t in live:
            t.add_(1)
    peer.finish(pending)
    barrier()
    fresh = build_state(ctx.case, ctx.rank, ctx.world, seed=1, stepped=False)
    peer.open(fresh)()
    differ = diff_state_dicts(plain(fresh), at_call)
    for t, value in zip(live, kept, strict=True):
        t.copy_(value)
    ctx.remover(name)()
    if differ and ctx.rank == 0:
        log.info(
            "%s: %d keys differ from the call, e.g. %s", name, len(differ), differ[:3]
        )
    return all(all_ranks(not differ))


# --------------------------------------------------------------------------
# pippy's async save and torch.save per stage
# --------------------------------------------------------------------------


def pippy_async(ctx: Ctx, name: str) -> Peer:
    """The example's async save: ``AsyncSaver.save(state)``, one saver kept
    (and its stager's buffers) on the async group; ``wait()`` publishes."""
    saver = checkpoint.AsyncSaver(ctx.work / name, process_group=ctx.async_group)
    peer_path = step_dir(ctx.work / name, STEP)

    @contextlib.contextmanager
    def staged() -> Iterator[None]:
        saver.wait_for_staging()  # what its docs ask before an in-place change
        yield

    return Peer(
        state=ctx.state,
        path=peer_path,
        save=lambda: saver.save(ctx.state),
        finish=lambda _: saver.wait(),
        guard=staged,
        open=lambda fresh: lambda: checkpoint.load_stage(fresh, peer_path),
        close=saver.close,
        is_async=True,
    )


def torch_stage(ctx: Ctx, name: str) -> Peer:
    """Each rank ``torch.save``s its module's and AdamW's state_dicts, fsynced;
    its load: ``torch.load`` and both ``load_state_dict``."""
    path = ctx.work / name / f"stage-{ctx.rank}.pt"

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        module, optimizer = ctx.state.module, ctx.state.optimizer
        torch.save(
            {"model": module.state_dict(), "optim": optimizer.state_dict()}, path
        )
        fsync_path(path)

    def open_(fresh: Stage) -> Callable[[], None]:
        def load() -> None:
            saved = torch.load(path, weights_only=True)
            fresh.module.load_state_dict(saved["model"])
            fresh.optimizer.load_state_dict(saved["optim"])

        return load

    return Peer(state=ctx.state, path=path, save=save, open=open_)


def dcp_async(ctx: Ctx, name: str) -> Peer:
    """Plain ``dcp.async_save`` with DCP's own ``FileSystemWriter`` (which stages,
    copying the state, before it returns) on the async group."""
    path = ctx.work / name / f"step-{STEP}"

    def save() -> Any:
        writer = FileSystemWriter(path)
        return dcp.async_save(
            ctx.state.state_dict(), storage_writer=writer, process_group=ctx.async_group
        )

    def open_(fresh: Stage) -> Callable[[], None]:
        def load() -> None:
            state_dict = fresh.state_dict()
            dcp.load(state_dict, checkpoint_id=path)
            fresh.load_state_dict(state_dict)

        return load

    return Peer(
        state=ctx.state,
        path=path,
        save=save,
        finish=lambda f: f.result(),
        open=open_,
        is_async=True,
    )


# --------------------------------------------------------------------------
# torchtitan 0.3.0 and torch_checkpointing 0.1.1
# --------------------------------------------------------------------------


def tt_optimizers(module: torch.nn.Module, state: dict | None = None) -> tuple:
    """torchtitan's own AdamW container (the bench's options) and LR schedulers.

    ``state``: the bench's AdamW state, shared (the same tensors are saved).
    """
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )

    options = {"lr": 1e-3, "weight_decay": 0.1}
    group = ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs=options
    )
    config = OptimizersContainer.Config(param_groups=[group], implementation="for-loop")
    optimizers = OptimizersContainer(config, model_parts=[module])
    if state is not None:
        optimizers.optimizers[0].state = state
    return optimizers, LRSchedulersContainer(optimizers, lambda _: 1.0)


def tt_manager(
    module: torch.nn.Module, optimizers: Any, schedulers: Any, folder: Path, mode: str
) -> Any:
    """torchtitan's ``CheckpointManager`` of one stage saving into ``folder``."""
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(
        enable=True,
        folder=folder.name,
        interval=1,
        keep_latest_k=0,  # the bench deletes each step itself
        initial_load_model_only=False,
        async_mode=mode,
    )
    return CheckpointManager(
        config,
        dataloader=None,
        model_parts=[module],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
        base_folder=str(folder.parent),
    )


def torchtitan(ctx: Ctx, name: str, mode: str) -> Peer:
    """torchtitan's ``CheckpointManager`` (``async_mode``: ``disabled``, ``async``)
    on the stage and its AdamW state; loads through a new manager."""
    optimizers, schedulers = tt_optimizers(ctx.state.module, ctx.state.optimizer.state)
    state = checkpoint.StageState(ctx.state.module, optimizers.optimizers[0], step=STEP)
    manager = tt_manager(state.module, optimizers, schedulers, ctx.work / name, mode)

    def open_(fresh: Stage) -> Callable[[], Any]:
        optim, sched = tt_optimizers(fresh.module)
        fresh.optimizer = optim.optimizers[0]
        reader = tt_manager(fresh.module, optim, sched, ctx.work / name, "disabled")
        return lambda: reader.load(step=STEP)

    return Peer(
        state=state,
        path=ctx.work / name / f"step-{STEP}",
        save=lambda: manager.save(STEP),
        finish=lambda _: manager.maybe_wait_for_saving(),
        open=open_,
        close=manager.close,
        is_async=mode != "disabled",
    )


def torch_checkpointing(ctx: Ctx, name: str, is_async: bool) -> Peer:
    """torch_checkpointing's ``CheckpointManager`` (its sync or async saver,
    buffered I/O) saving ``{"model", "optim", "step"}``; its load fills a new
    stage's tensors in place, then AdamW's ``load_state_dict``."""
    import torch_checkpointing as tc
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    # Its writer process, spawned, imports this bench: 30 s (the default) to
    # start is too short on a loaded machine (the tests share two cores).
    process = CheckpointProcessConfig(subprocess_init_timeout_secs=600)
    saver = (
        tc.AsyncCheckpointSaverConfig(process_config=process)
        if is_async
        else tc.SyncCheckpointSaverConfig()
    )
    manager = tc.CheckpointManager(
        tc.CheckpointManager.Config(
            save=saver, storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
        )
    )
    path = ctx.work / name / f"step-{STEP}"

    def payload(state: Stage) -> dict[str, Any]:
        model, optim = state.module.state_dict(), state.optimizer.state_dict()
        return {"model": model, "optim": optim, "step": STEP}

    def open_(fresh: Stage) -> Callable[[], None]:
        def load() -> None:
            into = {"model": fresh.module.state_dict(), "optim": None, "step": None}
            loaded = manager.load(str(path), into=into)  # None: read as saved
            fresh.optimizer.load_state_dict(loaded["optim"])

        return load

    return Peer(
        state=ctx.state,
        path=path,
        save=lambda: manager.save(str(path), payload(ctx.state)),
        finish=lambda f: f and f.result(),
        guard=manager.lock,  # its docs: wrap in-place updates in manager.lock()
        open=open_,
        close=manager.close,
        is_async=is_async,
    )


def importable(module: str) -> bool:
    """Whether ``module`` imports; one log line (rank 0) if not."""
    try:
        importlib.import_module(module)
        return True
    except Exception as e:  # noqa: BLE001 (any failure to import skips the peer)
        if os.environ.get("RANK", "0") == "0":
            log.info("skipping %s's methods: %s (see bench/README.md)", module, e)
        return False


def peers(ctx: Ctx) -> dict[str, Peer]:
    """Every peer whose package imports, by method name (``*_load``: a load)."""
    found = {
        "pippy_async_tuned": pippy_async(ctx, "pippy_async_tuned"),
        "dcp_async_save": dcp_async(ctx, "dcp_async_save"),
        "torch_save_stage": torch_stage(ctx, "torch_save_stage"),
        "load_torch_stage": torch_stage(ctx, "load_torch_stage"),
    }
    if importable("torchtitan.components.checkpoint"):
        found["tt_sync"] = torchtitan(ctx, "tt_sync", "disabled")
        found["tt_async"] = torchtitan(ctx, "tt_async", "async")
        found["tt_load"] = torchtitan(ctx, "tt_load", "disabled")
    if importable("torch_checkpointing"):
        found["tc_sync"] = torch_checkpointing(ctx, "tc_sync", is_async=False)
        found["tc_async"] = torch_checkpointing(ctx, "tc_async", is_async=True)
        found["tc_load"] = torch_checkpointing(ctx, "tc_load", is_async=False)
    return found
