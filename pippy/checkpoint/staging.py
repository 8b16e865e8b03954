"""Staging for background saves: a copy of the state in buffers kept between saves.

A background save must hold the values of the moment it was called while
training changes the tensors in place, so it first copies them (stages
them). DCP's ``DefaultStager`` keeps its CPU copies between saves too, but
goes through a generic deep copy that costs, per tensor, a new tensor, a
storage lookup and a check of the tensor's attributes: more than a bare copy
of the same bytes (``bench/README.md`` measures both).
:class:`KeptBufferStager` copies each tensor of the state_dict into a buffer
kept under its path, with ``Tensor.copy_``: what a bare copy costs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["KeptBufferStager"]


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
    complete when :meth:`stage` returns.

    Args:
        pin_memory: Allocate the buffers in pinned memory and copy from an
            accelerator without blocking each copy (one synchronization at
            the end). Default: whether CUDA is available.

    Note:
        The buffers hold a second copy of the state for as long as the
        stager lives (until :meth:`close`): budget the state's size again per
        rank. Two paths that share one tensor are copied twice.
    """

    should_synchronize_after_execute = False

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = (
            torch.cuda.is_available() if pin_memory is None else pin_memory
        )
        # Under each path: the layout the buffer was made for, and the buffer.
        self._buffers: dict[tuple[Any, ...], tuple[tuple, torch.Tensor]] = {}

    @torch.no_grad()
    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in the kept CPU buffers.

        Args:
            state_dict: A nested state_dict (dicts, lists and tuples of
                tensors, DTensors and other values).

        Returns:
            The copy, of the same structure; its tensors are valid until the
            next :meth:`stage` or :meth:`close`.
        """
        staged = self._copy(state_dict, ())
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies are done
        return staged

    def _copy(self, value: Any, path: tuple[Any, ...]) -> Any:
        """``value`` staged, its tensors in the buffers under ``path``."""
        if isinstance(value, Mapping):
            return {k: self._copy(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list | tuple) and type(value) in (list, tuple):
            return type(value)(self._copy(v, (*path, i)) for i, v in enumerate(value))
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), path)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        """``tensor`` copied into its kept buffer, made anew if its layout changed."""
        layout = (tensor.shape, tensor.stride(), tensor.dtype, tensor.requires_grad)
        kept = self._buffers.get(path)
        if kept is None or kept[0] != layout:
            # The same strides where the tensor is dense, as DCP's own stager.
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=self.pin_memory)
            kept = (layout, buffer.requires_grad_(tensor.requires_grad))
            self._buffers[path] = kept
        return kept[1].copy_(tensor, non_blocking=self.pin_memory)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is done."""

    def close(self) -> None:
        """Frees the buffers."""
        self._buffers.clear()
