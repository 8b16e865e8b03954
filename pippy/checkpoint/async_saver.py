"""``AsyncSaver``: :func:`~pippy.checkpoint.save_stage` in the background.

One save in flight at a time: the state is copied by :class:`KeptBufferStager`,
then checked, written and published in a thread of the saver's own.
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from pippy.checkpoint.collectives import Timeout, drop_group, made_group, seconds
from pippy.checkpoint.errors import CheckpointError
from pippy.checkpoint.owner import FolderOwner, check_owner
from pippy.checkpoint.save import (
    CheckedSavePlanner,
    StepWriter,
    gc_paused,
    state_to_save,
    step_of,
)
from pippy.checkpoint.state import StageState, take_or_failure
from pippy.checkpoint.steps import check_keep_last, step_dir
from pippy.checkpoint.storage import Location

logger = logging.getLogger(__name__)
_ATOMIC = (int, float, bool, str, type(None))  # values deepcopy returns as they are
_Versions = Sequence[tuple[tuple[Any, ...], torch.Tensor, int]]  # path, tensor, version


class KeptBufferStager:
    """Copies a state_dict's tensors into CPU buffers kept from one save to the next.

    Cheaper than DCP's ``DefaultStager`` (which deep-copies each tensor): a bare
    ``Tensor.copy_`` into the buffer kept under the tensor's path, made anew when
    its shape, strides, dtype or ``requires_grad`` change. A DTensor is staged as
    its local shard, rewrapped without a collective; anything else is deep-copied.
    It follows DCP's ``AsyncStager`` protocol (``dcp.async_save`` takes it too).
    ``in_background``, the bytes are copied in the stager's thread, after the work
    queued on the caller's CUDA stream (on a side stream), and nothing may change
    the tensors in place until the returned ``Future`` is done. ``pin_memory``
    (default: whether CUDA is available) pins the buffers, each its exact size,
    so that copies from an accelerator do not block one by one. The buffers
    hold a second copy of the state until :meth:`close`; two paths sharing a
    tensor are copied twice.
    """

    should_synchronize_after_execute = False

    def __init__(
        self, *, pin_memory: bool | None = None, in_background: bool = False
    ) -> None:
        self.pin_memory = (
            torch.cuda.is_available() if pin_memory is None else pin_memory
        )
        self.in_background = in_background
        # Under each path: the layout the buffer was made for, and the buffer.
        self._buffers: dict[tuple[Any, ...], tuple[tuple, torch.Tensor]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None  # the side stream, on a GPU
        self._staging: Future | None = None  # the copy in flight

    @torch.no_grad()
    def stage(
        self,
        state_dict: Mapping[str, Any],
        *,
        later: Callable[[], Mapping[str, Any]] | None = None,
        versions: _Versions = (),
    ) -> dict[str, Any] | Future[dict[str, Any]]:
        """A copy of ``state_dict`` in the buffers, or (``in_background``) its Future.

        Its tensors are valid until the next :meth:`stage` or :meth:`close`.
        ``later`` takes more of the state_dict just before the copy
        (``in_background``: in the stager's thread); what it reads must not
        change until then. ``versions`` (path, tensor, version) are checked
        after the copy, as the copied tensors' own are.

        Raises:
            CheckpointError: A tensor was changed in place (its version counter
                moved) between the call and its copy: the copy may hold a later
                value (``in_background``: from the Future).
        """
        if self._staging is not None:  # the buffers are free again (its error told)
            wait([self._staging])
        pairs: list[tuple[tuple[Any, ...], torch.Tensor, int, torch.Tensor]] = []
        staged = self._copy(state_dict, (), pairs)
        if not self.in_background:
            return self._fill(pairs, None, staged, later, versions)
        ready = None
        on_gpu = later is not None and torch.cuda.is_initialized()
        if on_gpu or any(src.is_cuda for _, src, _, _ in pairs):
            if self._stream is None:  # made on the caller's thread, as DCP's
                self._stream = torch.cuda.Stream()
            ready = torch.cuda.current_stream().record_event()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pippy-staging")
        self._staging = self._executor.submit(
            self._fill, pairs, ready, staged, later, versions
        )
        return self._staging

    @torch.no_grad()
    def _fill(
        self, pairs: list, ready: Any, staged: Any, later: Any, versions: _Versions
    ) -> Any:
        """Copies ``pairs`` (``later``'s too) after ``ready``; checks the versions."""
        if later is not None:
            staged = {**self._copy(later(), (), pairs), **staged}
        side = self._stream if ready is not None else None
        with torch.cuda.stream(side) if side is not None else nullcontext():
            if side is not None:
                side.wait_event(ready)  # the sources hold the values of the call
            for _, source, _, buffer in pairs:
                buffer.copy_(source, non_blocking=self.pin_memory)
        if side is not None:
            side.synchronize()
        elif self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies are done
        for path, tensor, version, *_ in (*pairs, *versions):
            if tensor._version != version:
                raise CheckpointError(
                    f"{'.'.join(map(str, path))} was changed in place after save() "
                    "returned and before it was copied, so this step is not "
                    "published: call the saver's wait_for_staging() before "
                    "changing saved tensors"
                )
        return staged

    def _copy(self, value: Any, path: tuple[Any, ...], pairs: list) -> Any:
        """``value`` staged; its tensors' copies into buffers added to ``pairs``."""
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), path, pairs)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, pairs)
        if type(value) in _ATOMIC:  # most leaves of an optimizer's param groups
            return value
        if isinstance(value, dict | Mapping):
            return {k: self._copy(v, (*path, k), pairs) for k, v in value.items()}
        if type(value) in (list, tuple):
            items = [self._copy(v, (*path, i), pairs) for i, v in enumerate(value)]
            return items if type(value) is list else tuple(items)
        return copy.deepcopy(value)

    def _tensor(
        self, tensor: torch.Tensor, path: tuple[Any, ...], pairs: list
    ) -> torch.Tensor:
        """``tensor``'s kept buffer (new for a new layout); its copy to ``pairs``."""
        layout = (tensor.shape, tensor.stride(), tensor.dtype, tensor.requires_grad)
        kept = self._buffers.get(path)
        if kept is None or kept[0] != layout:
            # The same strides where the tensor is dense, as DCP's own stager.
            buffer = torch.empty_like(tensor, device="cpu")
            if self.pin_memory and torch.cuda.is_available():
                _pin_exactly(buffer)
            kept = (layout, buffer.requires_grad_(tensor.requires_grad))
            self._buffers[path] = kept
        pairs.append((path, tensor, tensor._version, kept[1]))
        return kept[1]

    def synchronize_staging(self) -> None:
        """Waits for the copy in flight, if any (``in_background``)."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def close(self) -> None:
        """Waits for the copy in flight (without raising its error), then frees all."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._staging = None
        self._buffers.clear()


class AsyncSaver:
    """Saves in the background, one save at a time, as DCP's ``async_save``.

    ``save`` blocks only while it takes the state; the step holds the values
    of the call, or is not published. Of a ``StageState``, the step, LR
    schedulers, extra state, param groups' options and buffers (BatchNorm's
    kernels update running statistics in place without moving their version
    counters) are taken at the call; the default stager
    (:class:`KeptBufferStager`) takes the model's and optimizers' state_dicts
    (a parameter replaced meanwhile is saved as it was) and copies the
    tensors into kept buffers while the next forward and backward run. All
    is taken at the call before the optimizers have state, under FSDP (it
    swaps parameters in forward), or with an optimizer's own ``state_dict``.
    ``save`` hooks the optimizers' ``step`` to wait for the copy; a tensor
    changed in place before its copy (its version counter moves: ``clamp_``,
    ``add_``; a write through ``.data`` is not seen) fails the save on every
    rank, naming it: call :meth:`wait_for_staging` before such a change. A
    plain state_dict's ``save`` returns once copied.

    The rest runs in one background thread over a gloo group of its own (async
    saves must not share a group with training collectives): the checks of
    :func:`~pippy.checkpoint.save_stage`, the staging folder, ``dcp.save`` and the
    publishing. :meth:`poll`, once per training step, reports it or raises its
    failure on every rank at the same step, without waiting; the next ``save``,
    :meth:`wait` (which a load must call first) and :meth:`close` wait for it.
    One save at a time: two in flight on one gloo group crash (torch 2.13:
    "Connection reset by peer"). Rank 0 logs each published step (INFO).

    Args:
        checkpoint_dir: The run's checkpoint folder.
        keep_last: If set, keep only this many newest complete steps.
        owner: The folder's :class:`~pippy.checkpoint.job.FolderOwner`, if
            this job holds one: each save checks that it still does.
        process_group: The group of the ranks that save (any backend); None:
            all ranks. The saver makes its own gloo group over them, at once
            on every one of them, and saves over it.
        mesh: As :func:`~pippy.checkpoint.save_stage`, for the key check.
        async_stager: How state is copied; None keeps one background
            :class:`KeptBufferStager`.
        timeout: As :func:`~pippy.checkpoint.save_stage`'s, in the background.

    Raises:
        ValueError: ``timeout`` is not a number of seconds in (0, 365 days],
            or ``owner`` holds another folder.

    Note:
        The default stager's CPU buffers (pinned on a GPU) live as long as the
        saver: budget the state's size again per rank. DCP's plan caching is not
        used: torch 2.13 compares plans without dtypes, so after a dtype change
        it writes the old dtype into ``.metadata`` and loads convert silently.
    """

    def __init__(
        self,
        checkpoint_dir: Location,
        *,
        keep_last: int | None = None,
        owner: FolderOwner | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        async_stager: AsyncStager | None = None,
        timeout: Timeout = None,
    ):
        self.checkpoint_dir, self.mesh = checkpoint_dir, mesh
        self.owner = check_owner(owner, checkpoint_dir)
        self.keep_last = check_keep_last(keep_last)
        self.timeout = seconds(timeout)
        # The saver's own gloo group over the saving ranks: its timeout is the
        # saver's to set (the caller's group is never touched).
        self.process_group = made_group(process_group)
        self._upload: Future | None = None  # the save in flight
        self._staging: Future | None = None  # its copy, until waited for
        self._told: Future | None = None  # a failed save save() raised itself
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pippy-async-save")
        self._closed = False
        # poll()'s own gloo group, made here on every rank at once: made in
        # poll(), it would wait on the store behind the background thread's
        # wait on the same client, and two ranks would wait for each other.
        self._poll_group = (
            dist.new_group(backend="gloo") if dist.is_initialized() else None
        )
        self._stager = async_stager or KeptBufferStager(in_background=True)
        self._hooks: list[RemovableHandle] = []  # on the saved optimizers' step

    @gc_paused()
    def save(
        self, state: StageState | Mapping[str, Any], step: int | None = None
    ) -> Any:
        """Waits for the previous save, then starts saving ``state``, on every rank.

        At the call, on each rank alone, the state is taken (its step checked)
        and the copy starts (see the class). Python's garbage collector is
        paused until it returns.

        Args:
            state: The stage's ``StageState``, or a nested state_dict (e.g.
                ``StageState.state_dict()``).
            step: The step it holds, published as ``step-<step>``; defaults to
                ``state.step`` for a ``StageState``.

        Returns:
            The step folder it will be published as.

        Raises:
            RuntimeError: The saver is closed.
            CheckpointDirInUseError: Its ``owner`` was released; nothing is
                taken.
            ValueError: This rank's state holds another step (the other ranks
                raise a ``CheckpointError`` naming it, by their next
                :meth:`poll`, :meth:`wait` or ``save``), or a plain state_dict
                came without a step (on every rank alike); nothing is written.
            CheckpointError, KeyCollisionError, CheckpointDirError,
                CheckpointTimeout: The previous save failed or was refused (see
                :meth:`wait`); ``CheckpointError`` also where copying a plain
                state_dict failed. What is taken in the background raises in
                :meth:`wait_for_staging` (or the hooked ``optimizer.step()``).
        """
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed: make a new one to save")
        if self.owner is not None and self.owner.released:  # alike on every rank
            self.owner.check()  # raises, naming it
        self.wait()
        started = time.perf_counter()
        group = self.process_group  # who saves, now: checked again in the background
        ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        step = step_of(state, step)
        try:
            taken = self._stage(state, step)
        except Exception as e:
            # The others learn of it in the background, by their next poll(),
            # which this rank's poll() joins; its wait() then says nothing more.
            failed = self._executor.submit(self._write, e, step, started, ranks)
            wait([failed])
            self._upload = self._told = failed
            raise
        # A stager that stages in the background gives a Future of the copy.
        self._staging = taken if isinstance(taken, Future) else None
        if self._staging is None and self._stager.should_synchronize_after_execute:
            self._stager.synchronize_staging()
        self._upload = self._executor.submit(self._write, taken, step, started, ranks)
        if self._staging is not None and isinstance(state, StageState):
            self._hooks = [
                o.register_step_pre_hook(self._staged) for o in state.optimizers
            ]
        if not self._hooks:  # nothing to hook: the copy is done before returning
            self.wait_for_staging()
        return step_dir(self.checkpoint_dir, step)

    def _stage(self, state: StageState | Mapping[str, Any], step: int) -> Any:
        """The stager's copy of ``state``, or its Future (see the class)."""
        stager = self._stager
        if not (
            isinstance(state, StageState)
            and type(state).state_dict is StageState.state_dict
            and isinstance(stager, KeptBufferStager)
            and stager.in_background
            and state.optimizers
            and all(
                type(o).state_dict is Optimizer.state_dict and o.state
                for o in state.optimizers
            )
            and not any(
                isinstance(m, FSDPModule | FullyShardedDataParallel)
                for m in state.module.modules()
            )
        ):
            taken = state_to_save(state, step)
            if isinstance(state, StageState):  # what has no version: its copy now
                taken = {
                    k: v if k in ("model", "optim") else _cloned(v)
                    for k, v in taken.items()
                }
                _put(taken["model"], _buffers_now(state.module))
            return stager.stage(taken)
        now = state_to_save({"step": state.step}, step)  # the step checked
        if state.lr_schedulers:
            now["lr_scheduler"] = state._scheduler_state()
        now.update((name, obj.state_dict()) for name, obj in state.extra.items())
        now = _cloned(now)  # extra state, as it is now: small
        # The optimizers' options and the module's tensors as they are now
        # (an LR set before the next step must not be saved), buffers copied.
        held = state.module.state_dict(keep_vars=True)
        buffers = _buffers_now(state.module)
        later = copy.copy(state)
        later.optimizer = [_options_now(o) for o in state.optimizers]
        later.lr_scheduler, later.extra = None, {}

        def take() -> dict[str, Any]:  # in the stager's thread, before the step
            taken = later.state_dict()
            now_held = state.module.state_dict(keep_vars=True)
            if list(now_held) != list(held):
                raise CheckpointError(
                    "the module's state_dict changed its keys after save() "
                    "returned: call the saver's wait_for_staging() first"
                )
            for key, tensor in held.items():  # replaced since: the one of the call
                if now_held[key] is not tensor:
                    for fqn in _get_fqns(state.module, key):
                        if fqn in taken["model"]:
                            taken["model"][fqn] = tensor.detach()
            _put(taken["model"], buffers)
            return taken  # its step is the one taken now

        return stager.stage(now, later=take, versions=_versions(state))

    def _write(self, taken: Any, step: int, started: float, ranks: int) -> Any:
        """In the background: the wait, the staging folder, the write, publishing."""
        group = self.process_group

        def copied() -> dict[str, Any]:  # what save() took, or its error
            if isinstance(taken, Exception):
                raise taken
            return taken.result() if isinstance(taken, Future) else taken

        writer = StepWriter(
            self.checkpoint_dir,
            step,
            keep_last=self.keep_last,
            ranks=ranks,
            owner=self.owner,
        )
        with writer.saving(
            f"saving step-{step} in the background", self.timeout, group
        ):
            planner = CheckedSavePlanner(mesh=self.mesh, process_group=group, step=step)
            state_dict, planner.failure = take_or_failure(copied)
            dcp.save(
                state_dict, storage_writer=writer, planner=planner, process_group=group
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            took = time.perf_counter() - started
            logger.info(
                "published step-%d, saved in the background in %.2f s", step, took
            )
        return writer.final

    def wait_for_staging(self) -> None:
        """Waits until the state of the save in flight has been copied.

        Call it before anything but the saved optimizers' ``step`` changes the
        saved tensors in place.

        Raises:
            CheckpointError: Staging, or taking the state in the background,
                failed (also if the module's state_dict keys changed since the
                call); the step is not published.
        """
        try:
            self._staged()
        finally:
            self._unhook()

    def _unhook(self) -> None:
        """Removes the step hooks (never in one: the optimizer iterates them)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _staged(self, *_: Any) -> None:
        """Waits for the copy of the save in flight (the optimizers' step hook)."""
        staging, self._staging = self._staging, None
        if staging is None:
            return
        try:
            staging.result()
        except BaseException:
            assert self._upload is not None
            wait([self._upload])  # it stops at staging on every rank (see save)
            self._told = self._upload
            raise

    def wait(self) -> Any:
        """Waits for the save in flight, which publishes it.

        Returns:
            The published step folder, or None if no save was in flight.

        Raises:
            KeyCollisionError: As :func:`~pippy.checkpoint.save.take_state`
                (also ``DivergedReplicasError`` and ``NestedStateError``), on
                every rank; nothing is written.
            CheckpointError: The background save failed, on some rank; the
                step is not published and earlier steps are untouched.
            CheckpointDirError: As :func:`~pippy.checkpoint.save.publish_step`
                (the step exists, the folder cannot be written), on every rank.
            CheckpointTimeout: Some rank did not start saving within the
                timeout; nothing is written.
        """
        self.wait_for_staging()
        upload, self._upload = self._upload, None
        if upload is None or upload is self._told:  # told: its failure was raised
            return None
        return upload.result()

    def poll(self) -> Any:
        """The step folder once published on every rank, else None; never waits.

        Call it on every rank once per training step: one ``all_reduce`` of one
        number, on the saver's own gloo group, so all learn of it at the same step.

        Raises:
            CheckpointError: As :meth:`wait`.
        """
        if self._upload is None:
            return None
        if self._staging is None or self._staging.done():
            self._unhook()  # optimizer.step() has nothing more to wait for
        done = torch.tensor([int(self._upload.done())])
        if self._poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        return self.wait() if done.item() else None

    def __enter__(self) -> AsyncSaver:
        """The saver, closed (:meth:`close`) when the block ends."""
        return self

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        """Closes; where the block raised, a failure of the save is logged (ERROR)."""
        if error is None:
            return self.close()
        try:
            self.close()
        except Exception as e:  # the block's error is the one to raise
            logger.error("the save in flight failed too: %s", e)

    def close(self) -> None:
        """Waits for the save in flight, then frees buffers, thread and groups.

        Raises:
            CheckpointError: As :meth:`wait` (and its other errors): the save
                in flight failed or was refused; the saver is closed anyway.
        """
        self._closed = True
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._stager.close()
            if self._poll_group is not None:
                dist.destroy_process_group(self._poll_group)
                self._poll_group = None
            if self.process_group is not None:
                drop_group(self.process_group)
                self.process_group = None


def _pin_exactly(buffer: torch.Tensor) -> None:
    """Pins ``buffer``'s exact bytes until it is freed, as DCP's stager does.

    ``pin_memory=True`` would round each block up to a power of two (the
    caching host allocator's), kept for the saver's life.
    """
    storage = buffer.untyped_storage()
    if storage.nbytes() == 0:
        return
    pin_memory_utils.pin_memory(storage.data_ptr(), storage.nbytes())
    weakref.finalize(buffer, pin_memory_utils.unpin_memory, storage.data_ptr())


def _cloned(value: Any) -> Any:
    """``value`` with each tensor in its dicts, lists and tuples cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_cloned(v) for v in value)
    return value


def _buffers_now(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each persistent buffer of ``module``, by the FQN DCP saves."""
    return {
        fqn: tensor.detach().clone()
        for key, tensor in module.state_dict(keep_vars=True).items()
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, nn.Parameter)
        for fqn in _get_fqns(module, key)
    }


def _put(model: dict[str, Any], copies: Mapping[str, torch.Tensor]) -> None:
    """Puts each copy in ``model`` in place of the entry of its FQN, if any."""
    model.update((fqn, value) for fqn, value in copies.items() if fqn in model)


def _versions(state: StageState) -> _Versions:
    """Each parameter's and optimizer state tensor's path and version counter."""
    fqn_of: dict[torch.Tensor, str] = {
        p: name for name, p in state.module.named_parameters()
    }
    found: list = [(("model", name), p, p._version) for p, name in fqn_of.items()]
    for optimizer in state.optimizers:
        for param, entries in optimizer.state.items():
            found += [
                (("optim", "state", fqn_of.get(param, "?"), key), value, value._version)
                for key, value in entries.items()
                if isinstance(value, torch.Tensor)
            ]
    return found


def _options_now(optimizer: Optimizer) -> Optimizer:
    """``optimizer`` sharing its state, with a copy of its param groups as they are."""
    frozen = object.__new__(type(optimizer))
    frozen.__dict__.update(optimizer.__dict__)
    frozen.param_groups = [
        {k: list(v) if k == "params" else copy.deepcopy(v) for k, v in group.items()}
        for group in optimizer.param_groups
    ]
    return frozen
