"""Building one pipeline stage of a model, keeping the un-split model's FQNs.

A stage's ``state_dict`` keys must be exactly the un-split model's keys for
what it owns (``model.layers.5.mlp.up_proj.weight``, never a renumbered
``layers.0``), so that the stages' checkpoints together form the whole model
and DCP can load them into any split. :func:`split_model` cuts a model that
keeps its blocks in an ``nn.ModuleList`` (Hugging Face, most models) or an
``nn.ModuleDict`` keyed by layer index (torchtitan) down to one stage:

* the layers the stage does not own go: deleted from a ``ModuleDict``, and
  replaced by a :class:`PassThrough` in a ``ModuleList``, whose indices
  must stay (deleting ``layers[0]`` would rename ``layers.1`` to ``layers.0``);
* modules only the first stage keeps (embeddings) and only the last keeps
  (final norm, output head) become :class:`PassThrough` elsewhere.

:func:`build_stage_module` builds the model with its parameters on the
``meta`` device (no memory) and its buffers computed on the CPU
(:func:`meta_init`), splits it, and allocates the stage alone
(:func:`materialize`). A ``to_empty`` alone would leave non-persistent buffers
(a RoPE ``inv_freq``) uninitialised: they are in no checkpoint, so a resumed
run would differ without an error; :func:`materialize` keeps their computed
values and refuses any it cannot recompute.

A stage built another way (a split of one's own, or ``pippy.pipeline``'s
tracer) has two checks of its own: :func:`check_untied` refuses a model with
tied weights before it is split, and :func:`restore_non_persistent_buffers`
takes back out of a traced stage's ``state_dict`` the buffers the model kept
out of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pippy.checkpoint.checks import tied_groups

__all__ = [
    "PassThrough",
    "StageBuildError",
    "build_stage_module",
    "causal_lm_forward",
    "check_untied",
    "layer_range",
    "materialize",
    "meta_init",
    "restore_non_persistent_buffers",
    "split_model",
]

logger = logging.getLogger(__name__)


class TiedParametersError(ValueError):
    """The model shares a parameter under several FQNs (tied weights)."""


def check_untied(model: nn.Module) -> None:
    """Refuses a model with tied weights before it is split into stages.

    A tied parameter (an output head tied to the embedding) ends up on two stages
    after a split, each training its own copy; pippy does not keep them in sync.

    Args:
        model: The un-split (for example meta) model.

    Raises:
        TiedParametersError: Naming each pair of FQNs that share a parameter.
    """
    ties = [f"{n!r} is {g[0]!r}" for g in tied_groups(model) for n in g[1:]]
    if ties:
        raise TiedParametersError(
            f"tied weights: {', '.join(ties)}. Split into pipeline stages, each "
            "stage would train its own copy and the checkpoint would keep one. "
            "pippy does not synchronise tied weights across stages: untie them "
            "(give each module its own nn.Parameter) before splitting."
        )


def restore_non_persistent_buffers(
    stage_module: nn.Module, model: nn.Module
) -> list[str]:
    """Makes the model's non-persistent buffers non-persistent in a traced stage.

    ``torch.distributed.pipelining.pipeline`` registers every buffer as persistent
    on each stage that uses it, so a RoPE table would be the same key on every
    stage. This re-registers them as non-persistent, in place.

    Args:
        stage_module: The stage's module (``pipe.build_stage(...).submod``).
        model: The un-split model that was traced.

    Returns:
        The FQNs of the buffers re-registered.
    """
    stage_buffers = dict(stage_module.named_buffers())
    restored = []
    for owner_name, owner in model.named_modules():
        for name in owner._non_persistent_buffers_set:
            fqn = f"{owner_name}.{name}" if owner_name else name
            if fqn in stage_buffers:
                stage_owner = stage_module.get_submodule(fqn.rpartition(".")[0])
                stage_owner.register_buffer(name, stage_buffers[fqn], persistent=False)
                restored.append(fqn)
    logger.debug("re-registered non-persistent buffers %s", restored)
    return restored


class StageBuildError(ValueError):
    """A stage cannot be built as asked; the message says why and what to do."""


class PassThrough(nn.Module):
    """Stands in for a module another stage owns: returns its first input.

    It has no parameters or buffers, so it adds no key to the stage's
    ``state_dict``, and it accepts (and ignores) any further arguments, as
    a decoder layer's attention mask or position embeddings.
    """

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Returns ``x`` unchanged."""
        return x


def layer_range(stage_index: int, num_stages: int, n_layers: int) -> range:
    """The contiguous layers of one stage; stage sizes differ by at most one.

    Args:
        stage_index: The stage, from 0.
        num_stages: How many stages the model is split into.
        n_layers: How many layers the model has.

    Returns:
        The global indices of the stage's layers; earlier stages get the extra
        layer when ``n_layers`` does not divide evenly.

    Raises:
        StageBuildError: ``num_stages`` is not between 1 and ``n_layers``, or
            ``stage_index`` is not a stage.
    """
    if not 1 <= num_stages <= n_layers:
        raise StageBuildError(
            f"cannot split {n_layers} layers into {num_stages} stages: "
            f"use between 1 and {n_layers} stages"
        )
    if not 0 <= stage_index < num_stages:
        raise StageBuildError(f"stage {stage_index} is not one of {num_stages}")
    per_stage, rest = divmod(n_layers, num_stages)
    start = stage_index * per_stage + min(stage_index, rest)
    return range(start, start + per_stage + (stage_index < rest))


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    """Sets the submodule at ``fqn`` to ``new``."""
    parent, _, name = fqn.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    if not hasattr(owner, name):
        raise StageBuildError(f"the model has no module {fqn!r} to leave out")
    setattr(owner, name, new)


def split_model(
    model: nn.Module,
    stage_index: int,
    num_stages: int,
    *,
    layers: str,
    first: Iterable[str] = (),
    last: Iterable[str] = (),
    owned: range | None = None,
    forward: Callable[..., Any] | None = None,
) -> nn.Module:
    """Cuts ``model``, in place, down to one pipeline stage that keeps its FQNs.

    Works on a real model and on one built on the ``meta`` device.

    Args:
        model: The un-split model (for example built under :func:`meta_init`).
        stage_index: This stage, from 0.
        num_stages: The number of stages.
        layers: The FQN of the layer container, an ``nn.ModuleList`` or an
            ``nn.ModuleDict`` keyed by the global layer index (``"model.layers"``
            for a Hugging Face Llama, ``"transformer.h"`` for GPT-2).
        first: FQNs of modules only the first stage keeps (embeddings).
        last: FQNs of modules only the last stage keeps (norm, output head).
        owned: The global indices of the layers this stage keeps; by default
            :func:`layer_range`.
        forward: If given, becomes the stage's forward as
            ``forward(model, *args)``, for models whose own forward cannot
            take the previous stage's activations (see
            :func:`causal_lm_forward`).

    Returns:
        ``model``, cut down: its ``state_dict`` keys are a subset of the
        un-split model's.

    Raises:
        StageBuildError: ``layers`` is not a ``ModuleList`` or ``ModuleDict``,
            a ``ModuleDict`` key is not a layer index, a module in ``first`` or
            ``last`` does not exist, or the stages do not fit the layers.
        TiedParametersError: A parameter the model ties under two FQNs (an
            output head sharing the embedding's weight) would be kept under
            one of them on this stage and under the other elsewhere: the two
            would train as separate copies.
    """
    container = model.get_submodule(layers)
    if not isinstance(container, nn.ModuleList | nn.ModuleDict):
        raise StageBuildError(
            f"{layers!r} is a {type(container).__name__}, not an nn.ModuleList "
            "or nn.ModuleDict of layers: hold the layers in one, or split by "
            "tracing (pippy.pipeline with pippy.SplitPoint)"
        )
    keys = list(range(len(container))) if isinstance(container, nn.ModuleList) else []
    if isinstance(container, nn.ModuleDict):
        if not all(k.isdigit() for k in container):
            raise StageBuildError(
                f"the keys of {layers!r} must be global layer indices, not "
                f"{list(container)[:3]}"
            )
        keys = [int(k) for k in container]
    if owned is None:
        owned = layer_range(stage_index, num_stages, len(keys))
    dropped = [f"{layers}.{index}" for index in keys if index not in owned]
    dropped += list(first) * (stage_index > 0)
    dropped += list(last) * (stage_index < num_stages - 1)
    _check_ties(model, stage_index, num_stages, dropped)
    for index in keys:
        if index in owned:
            continue
        if isinstance(container, nn.ModuleList):
            container[index] = PassThrough()  # keeps the indices of the others
        else:
            del container[str(index)]
    for fqn in () if stage_index == 0 else first:
        _replace(model, fqn, PassThrough())
    for fqn in () if stage_index == num_stages - 1 else last:
        _replace(model, fqn, PassThrough())
    if forward is not None:
        model.forward = forward.__get__(model)  # type: ignore[method-assign]
    return model


def _check_ties(
    model: nn.Module, stage_index: int, num_stages: int, dropped: list[str]
) -> None:
    """Refuses a tied parameter that this stage would keep under some FQNs only."""

    def kept(fqn: str) -> bool:
        return not any(fqn == d or fqn.startswith(f"{d}.") for d in dropped)

    for group in tied_groups(model):
        here = [fqn for fqn in group if kept(fqn)]
        if here and len(here) < len(group):
            other = next(fqn for fqn in group if not kept(fqn))
            raise TiedParametersError(
                f"{other!r} is tied to {here[0]!r}, but stage {stage_index} of "
                f"{num_stages} keeps only {here[0]!r}: split, the two would train "
                "as separate copies. Untie them (Hugging Face: "
                "tie_word_embeddings=False), or keep both on one stage"
            )


def causal_lm_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A stage forward for Hugging Face causal LMs that take ``inputs_embeds``.

    The first stage gets token ids (an integer tensor) and calls the model's
    own forward with ``input_ids``; later stages get the previous stage's
    activations and pass them as ``inputs_embeds``. Every stage returns
    ``.logits``, which on stages without the output head (a
    :class:`PassThrough`) are the hidden states the next stage takes.
    Fits Llama, Mistral, Qwen2 and other models that add nothing to
    ``inputs_embeds``; GPT-2 adds position embeddings to them, so it needs a
    forward of its own.

    Args:
        model: The stage's module, a ``...ForCausalLM`` cut by
            :func:`split_model`.
        x: Token ids on the first stage, activations on the others.

    Returns:
        Logits on the last stage, hidden states on the others.
    """
    name = "inputs_embeds" if x.is_floating_point() else "input_ids"
    return type(model).forward(model, **{name: x}, use_cache=False).logits


@contextmanager
def meta_init() -> Iterator[None]:
    """Builds modules with parameters on ``meta`` and buffers computed on the CPU.

    Parameters take no memory (each is created on the CPU uninitialised and
    moved to ``meta`` at once), while buffers (RoPE tables, masks) keep the
    values the model's constructor computes, so that :func:`materialize` can
    keep them. Buffers are small next to the weights.

    Note:
        A model built under ``with torch.device("meta")`` instead has its
        buffers on ``meta`` too; :func:`materialize` refuses it if any is
        non-persistent, since no checkpoint holds those.
    """
    global _meta_users
    with _meta_lock:
        if not _meta_users:
            nn.Module.register_parameter = _register_on_meta  # type: ignore[method-assign,assignment]
        _meta_users += 1
    _meta_thread.active = getattr(_meta_thread, "active", 0) + 1
    try:
        yield
    finally:
        _meta_thread.active -= 1
        with _meta_lock:
            _meta_users -= 1
            if not _meta_users:
                nn.Module.register_parameter = _register  # type: ignore[method-assign]


#: meta_init's state: nn.Module.register_parameter is patched while any thread
#: is inside it (_meta_users counts them), and acts in those threads alone
#: (ranks may be threads of one process).
_register = nn.Module.register_parameter
_meta_lock = threading.Lock()
_meta_users = 0
_meta_thread = threading.local()


def _register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """Registers as nn.Module.register_parameter; on ``meta`` in meta_init.

    The parameter moves to ``meta`` in a thread inside :func:`meta_init`.
    """
    _register(module, name, param)
    if (
        getattr(_meta_thread, "active", 0)
        and param is not None
        and param.device.type != "meta"
    ):
        kept = module._parameters[name]
        assert kept is not None
        kwargs = dict(kept.__dict__)
        kwargs["requires_grad"] = kept.requires_grad
        module._parameters[name] = type(kept)(kept.to("meta"), **kwargs)


def _non_persistent(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(fqn, buffer)`` of every non-persistent buffer."""
    for owner_name, owner in module.named_modules():
        for name in owner._non_persistent_buffers_set:
            buffer = owner._buffers.get(name)
            if buffer is not None:
                yield f"{owner_name}.{name}" if owner_name else name, buffer


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocates a stage built on ``meta`` on ``device``, keeping computed buffers.

    Parameters and persistent buffers on ``meta`` are allocated uninitialised
    (fill them with an init function or a checkpoint load); tensors already
    holding values (buffers built under :func:`meta_init`) are moved with
    their values. A parameter tied under several FQNs stays one parameter
    (``to_empty`` alone would give each name its own).

    Args:
        module: A stage built under :func:`meta_init` and cut by
            :func:`split_model`.
        device: Where the stage runs.

    Returns:
        ``module``, allocated on ``device``.

    Raises:
        StageBuildError: A non-persistent buffer is on ``meta``: no
            checkpoint holds it and ``to_empty`` would leave it uninitialised.
            The message names the buffers.
    """
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        return module.to(device)  # nothing to allocate: keep the values
    lost = [fqn for fqn, buffer in _non_persistent(module) if buffer.is_meta]
    if lost:
        raise StageBuildError(
            f"non-persistent buffer(s) {', '.join(map(repr, lost))} are on the meta "
            "device: no checkpoint holds them and allocating would leave them "
            "uninitialised. Build the model under pippy.meta_init(), which "
            "computes buffers on the CPU, or recompute them after allocating"
        )
    kept = {fqn: buf for fqn, buf in module.named_buffers() if not buf.is_meta}
    ties = tied_groups(module)
    module.to_empty(device=device)  # a new tensor for each name of a tied one
    for group in ties:  # so tie them again, as the model had them
        shared = module.get_parameter(group[0])
        for fqn in group[1:]:
            owner, _, name = fqn.rpartition(".")
            setattr(module.get_submodule(owner), name, shared)
    with torch.no_grad():
        for fqn, value in kept.items():
            module.get_buffer(fqn).copy_(value)
    logger.debug("kept the computed buffers %s", sorted(kept))
    return module


def build_stage_module(
    model_fn: Callable[[], nn.Module],
    stage_index: int,
    num_stages: int,
    *,
    device: torch.device | str,
    layers: str,
    first: Iterable[str] = (),
    last: Iterable[str] = (),
    owned: range | None = None,
    forward: Callable[..., Any] | None = None,
) -> nn.Module:
    """Builds one stage of a model, allocating memory for that stage alone.

    ``model_fn`` builds the whole model under :func:`meta_init` (parameters
    on ``meta``, buffers computed); :func:`split_model` cuts it to the stage
    and :func:`materialize` allocates it on ``device``. For example, stage 1
    of 2 of a Hugging Face Llama::

        module = pippy.build_stage_module(
            lambda: LlamaForCausalLM(config), 1, 2, device="cpu",
            layers="model.layers", first=["model.embed_tokens"],
            last=["model.norm", "lm_head"], forward=pippy.causal_lm_forward,
        )

    Args:
        model_fn: Builds the un-split model; called once, with no arguments.
        stage_index: This stage, from 0.
        num_stages: The number of stages.
        device: Where the stage runs.
        layers: As :func:`split_model`.
        first: As :func:`split_model`.
        last: As :func:`split_model`.
        owned: As :func:`split_model`.
        forward: As :func:`split_model`.

    Returns:
        The stage's module, parameters allocated but uninitialised: load a
        checkpoint into it or initialise it.

    Raises:
        StageBuildError: As :func:`split_model` and :func:`materialize`.
    """
    with meta_init():
        model = model_fn()
    split_model(
        model,
        stage_index,
        num_stages,
        layers=layers,
        first=first,
        last=last,
        owned=owned,
        forward=forward,
    )
    return materialize(model, device)
