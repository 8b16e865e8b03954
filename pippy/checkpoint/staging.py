"""Staging for background saves: a copy of the state in buffers kept between saves.

A background save must hold the values of the moment it was called while
training changes the tensors in place, so it first copies them (stages
them). DCP's ``DefaultStager`` keeps its CPU copies between saves too, but
goes through a generic deep copy that costs, per tensor, a new tensor, a
storage lookup and a check of the tensor's attributes: more than a bare copy
of the same bytes (``bench/README.md`` measures both).
:class:`KeptBufferStager` copies each tensor of the state_dict into a buffer
kept under its path, with ``Tensor.copy_``: what a bare copy costs. Built
with ``in_background=True``, it makes the copy of the state's structure at
the call and copies the bytes in a thread of its own (on a GPU, on a side
stream, into pinned buffers), so that the copy overlaps the training step
that follows (what ``AsyncSaver`` does with it, taking the model's and
optimizers' state_dicts in that thread too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["KeptBufferStager"]

_ATOMIC = (int, float, bool, str, type(None))  # values deepcopy returns as they are


class KeptBufferStager:
    """Copies a state_dict's tensors into CPU buffers kept from one save to the next.

    It follows DCP's ``AsyncStager`` protocol (``stage``,
    ``should_synchronize_after_execute``, ``synchronize_staging``,
    ``close``), so :class:`~pippy.checkpoint.AsyncSaver` and
    ``dcp.async_save`` take it. Each tensor is copied into the buffer kept
    under its path in the state_dict (``("model", "layers.0.w")``), made anew
    where its shape, strides, dtype or ``requires_grad`` changed; a DTensor
    is staged as its local shard, wrapped again with the same mesh and
    placements (no collective); anything else is deep-copied. The copy is
    complete when :meth:`stage` returns, or, ``in_background``, when the
    ``Future`` it returns is done: everything but the tensors' bytes is
    copied at the call, the bytes in a thread of the stager's own, after
    the work queued on the caller's CUDA stream (one side stream of the
    stager's own; the sources are kept alive until the copy is done).

    Args:
        pin_memory: Allocate the buffers in pinned memory and copy from an
            accelerator without blocking each copy (one synchronization at
            the end). Default: whether CUDA is available.
        in_background: Copy the tensors' bytes in the background:
            :meth:`stage` returns a ``Future`` of the copy, and nothing may
            change the tensors in place until it is done.

    Note:
        The buffers hold a second copy of the state for as long as the
        stager lives (until :meth:`close`): budget the state's size again per
        rank. Two paths that share one tensor are copied twice.
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
    ) -> dict[str, Any] | Future[dict[str, Any]]:
        """A copy of ``state_dict`` whose tensors live in the kept CPU buffers.

        Args:
            state_dict: A nested state_dict (dicts, lists and tuples of
                tensors, DTensors and other values).
            later: ``in_background`` only: takes more of the state_dict in the
                stager's thread, before the copy (its entries come first);
                what it reads must not change until the copy is done.

        Returns:
            The copy, of the same structure, or (``in_background``) a
            ``Future`` of it; its tensors are valid until the next
            :meth:`stage` or :meth:`close`.
        """
        if self._staging is not None:  # the buffers are free again (its error told)
            wait([self._staging])
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._copy(state_dict, (), pairs)
        if not self.in_background:
            if later is not None:
                raise ValueError("only a stager in_background takes state later")
            self._fill(pairs, None)
            return staged
        ready = None
        on_gpu = later is not None and torch.cuda.is_initialized()
        if on_gpu or any(src.is_cuda for _, src in pairs):
            if self._stream is None:  # made on the caller's thread, as DCP's
                self._stream = torch.cuda.Stream()
            ready = torch.cuda.current_stream().record_event()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pippy-staging")
        self._staging = self._executor.submit(self._fill, pairs, ready, staged, later)
        return self._staging

    def _fill(
        self, pairs: list, ready: Any, staged: Any = None, later: Any = None
    ) -> Any:
        """Copies each (buffer, source) pair, ``later``'s too; after ``ready``."""
        if later is not None:
            with torch.no_grad():
                staged = {**self._copy(later(), (), pairs), **staged}
        side = self._stream if ready is not None else None
        on_side = torch.cuda.stream(side) if side is not None else nullcontext()
        with torch.no_grad(), on_side:
            if side is not None:
                side.wait_event(ready)  # the sources hold the values of the call
            for buffer, source in pairs:
                buffer.copy_(source, non_blocking=self.pin_memory)
        if side is not None:
            side.synchronize()
        elif self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies are done
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
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=self.pin_memory)
            kept = (layout, buffer.requires_grad_(tensor.requires_grad))
            self._buffers[path] = kept
        pairs.append((kept[1], tensor))
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
