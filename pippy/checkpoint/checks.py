"""Checks of a stage's state_dict: before a split, across ranks, after a load.

DCP takes equal keys on different ranks for replicas: its global planning
(``dedup_save_plans``) writes each once, without comparing values. That is
silently wrong for two stages offering one key, replicas that diverged and
per-rank state under a shared key, which :func:`check_keys` refuses.
:func:`diff_state_dicts` compares bit for bit.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pippy.checkpoint.collectives import global_rank, pippy_group
from pippy.checkpoint.errors import (
    DivergedReplicasError,
    KeyCollisionError,
    NestedStateError,
    name_ranks,
)
from pippy.checkpoint.manifest import crc32c

_OWNED = ("model", "optim")  # the sections whose every key one stage owns


def leaf_places(
    state_dict: Mapping[str, Any], prefix: str = ""
) -> Iterator[tuple[str, Any, Any]]:
    """Yields ``(dotted key, dict, key in it)`` of each leaf of a nested state_dict."""
    for key, value in state_dict.items():
        if isinstance(value, Mapping):
            yield from leaf_places(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", state_dict, key


def named_leaves(state_dict: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Yields ``(dotted key, leaf)`` of a nested state_dict, as DCP names them."""
    return ((name, parent[key]) for name, parent, key in leaf_places(state_dict))


def local(value: Any) -> Any:
    """A DTensor's shard on this rank (FSDP2); any other value as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def state_dict_size(state_dict: Mapping[str, Any]) -> tuple[int, int]:
    """``(tensors, bytes)`` of a nested state_dict on this rank (local shards)."""
    tensors = [
        local(v) for _, v in named_leaves(state_dict) if isinstance(v, torch.Tensor)
    ]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that equal NaNs compare equal and -0.0 != 0.0."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def fingerprint(value: Any) -> str:
    """A text that differs when a leaf does: repr, or a tensor's (local) CRC-32C.

    A ShardedTensor's is its local shards', in order.
    """
    if isinstance(value, ShardedTensor):
        return "|".join(fingerprint(s.tensor) for s in value.local_shards())
    if not isinstance(value, torch.Tensor):
        return repr(value)
    shard = local(value)
    crc = crc32c(_raw_bytes(shard).cpu().numpy())
    return f"{shard.dtype}{tuple(shard.shape)}:{crc:08x}"


#: 8-byte words a device hash takes at once (its temporaries: a few x 128 MB).
_HASH_WORDS = 16 << 20
_HASH_ODD = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd int64: the golden ratio's


def fingerprints(state_dict: Mapping[str, Any]) -> dict[str, str]:
    """A short text per leaf of a (nested) state_dict that differs when it does.

    Compare two with ``==`` to tell whether two states are equal bit for bit
    without holding both (a model's before it is freed, and after a load).

    Args:
        state_dict: As from ``StageState.state_dict()``.

    Returns:
        ``{dotted key (as DCP names it): text}``: a tensor's dtype, shape and
        CRC-32C (a DTensor's, of this rank's shard), another value's ``repr``.
    """
    return {key: fingerprint(value) for key, value in named_leaves(state_dict)}


def device_hash(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 hash of a tensor's bytes, computed on its device (no sync).

    Its 8-byte words (zero-padded), each times a distinct odd weight, summed
    modulo 2**64: an integer sum does not depend on the reduction's order, so
    equal bytes hash equal on every rank, and any changed word changes it.
    """
    raw = _raw_bytes(tensor)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int64)
    total = words.new_zeros(())
    for start in range(0, words.numel(), _HASH_WORDS):  # bounded temporaries
        chunk = words[start : start + _HASH_WORDS]
        index = torch.arange(start, start + chunk.numel(), device=chunk.device)
        total += (chunk * ((index * 2 + 1) * _HASH_ODD)).sum()
    return total


def digests(values: Mapping[str, Any]) -> dict[str, str]:
    """:func:`fingerprint` of each value; tensors off the CPU by :func:`device_hash`.

    Their hashes come to the host in one copy per device, not one sync each.
    """
    found: dict[str, str] = {}
    on_device: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    for key, value in values.items():
        shard = local(value) if isinstance(value, torch.Tensor) else None
        if shard is not None and shard.device.type not in ("cpu", "meta"):
            on_device.setdefault(shard.device, []).append((key, shard))
        else:
            found[key] = fingerprint(value)
    for items in on_device.values():
        hashes = torch.stack([device_hash(t) for _, t in items]).tolist()
        for (key, shard), value in zip(items, hashes, strict=True):
            found[key] = (
                f"{shard.dtype}{tuple(shard.shape)}:h{value & (2**64 - 1):016x}"
            )
    return found


def _storable(key: str, value: Any) -> str:
    """``fingerprint(value)``; TypeError naming ``key`` if DCP cannot pickle it."""
    if not isinstance(value, torch.Tensor):
        try:
            pickle.dumps(value)
        except Exception as e:  # PicklingError, AttributeError, TypeError
            raise TypeError(
                f"{key!r} cannot be saved: DCP pickles an entry that is not a "
                f"tensor, and this {type(value).__name__} cannot be pickled ({e}). "
                "Save plain values (numbers, strings, lists, dicts) or tensors"
            ) from None
    return fingerprint(value)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The FQNs of each parameter reachable under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def diff_state_dicts(
    actual: Mapping[str, Any], expected: Mapping[str, Any]
) -> list[str]:
    """Lists the keys whose values differ between two (nested) state_dicts.

    Tensors must match in dtype, shape and every bit (a NaN equals the same
    NaN; ``0.0`` and ``-0.0`` differ); DTensors (FSDP2) compare this rank's
    shards, with no collective; other values compare with ``==``.

    Args:
        actual: A state_dict, as from ``StageState.state_dict()``.
        expected: The state_dict to compare with.

    Returns:
        Sorted dotted keys (as DCP names them) that differ or are in only one
        of the two; empty if they are equal.
    """
    a, b = dict(named_leaves(actual)), dict(named_leaves(expected))
    differ = set(a.keys() ^ b.keys())
    for key in a.keys() & b.keys():
        x, y = local(a[key]), local(b[key])
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = (
                x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(_raw_bytes(x), _raw_bytes(y))
            )
        else:  # a tensor equals no other value
            same = not any(isinstance(v, torch.Tensor) for v in (x, y)) and x == y
        if not same:
            differ.add(key)
    return sorted(differ)


def _with_ranks(items: Mapping[str, Any]) -> str:
    """The first ten keys with their ranks, for an error message."""
    text = ", ".join(f"{k!r} (ranks {r})" for k, r in sorted(items.items())[:10])
    return text + (" ..." if len(items) > 10 else "")


def _chunk(value: Any) -> tuple[Any, ...] | None:
    """Where the chunks DCP writes of a DTensor or ShardedTensor start; else None."""
    if isinstance(value, DTensor):
        return tuple(
            compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )[1]
        )
    if isinstance(value, ShardedTensor):
        return tuple(tuple(s.metadata.shard_offsets) for s in value.local_shards())
    return None


def _replica(value: Any) -> bool:
    """Whether a DTensor's own placements replicate it over several ranks."""
    return isinstance(value, DTensor) and any(
        isinstance(p, Replicate) and value.device_mesh.size(dim) > 1
        for dim, p in enumerate(value.placements)
    )


def _replicated(value: Any, dp_dims: tuple[str, ...]) -> bool:
    """Whether a leaf is the same on every data-parallel replica of its stage."""
    if not isinstance(value, DTensor):
        return True
    names = value.device_mesh.mesh_dim_names or ()
    sharded_on_all = all(p.is_shard() for p in value.placements)
    return not (sharded_on_all and set(dp_dims) <= set(names))


def _parameter_of(key: str) -> str | None:
    """The FQN of the parameter an ``optim.state.`` or ``optim.scalars.`` key names."""
    section, _, rest = key.partition(".")
    kind, _, name = rest.partition(".")
    if section != "optim":
        return None
    return name.rsplit(".", 1)[0] if kind == "state" else name


def _by_fqn(section: str, value: Any) -> bool:
    """Whether a section is an ``optimizer`` keyed by FQNs (``get_state_dict``'s)."""
    if section != "optimizer" or not isinstance(value, Mapping):
        return False
    state, groups = value.get("state"), value.get("param_groups")
    return (
        isinstance(state, Mapping)
        and isinstance(groups, list)
        and all(isinstance(k, str) for k in state)
        and all(isinstance(p, str) for g in groups for p in g.get("params", []))
    )


def _holds_state(value: Any) -> bool:
    """Whether a mapping holds a model or optim section or an optimizer's state_dict."""
    if not isinstance(value, Mapping):
        return False
    if any(k in _OWNED for k in value) or {"state", "param_groups"} <= value.keys():
        return True
    return any(_holds_state(v) for v in value.values())


def _ranks_by(
    offers: Mapping[int, Mapping[str, Any]],
    pairs: Callable[[Mapping[str, Any]], Iterable[tuple[Any, Any]]],
) -> dict[Any, dict[Any, list[int]]]:
    """``{key: {value: ranks}}`` over the ``(key, value)`` pairs of every offer."""
    found: dict[Any, dict[Any, list[int]]] = {}
    for rank, offer in offers.items():
        for key, value in pairs(offer):
            found.setdefault(key, {}).setdefault(value, []).append(rank)
    return found


def _all(by_value: Mapping[Any, list[int]]) -> list[int]:
    """The ranks that gave any of the values, sorted."""
    return sorted(r for ranks in by_value.values() for r in ranks)


def check_keys(
    state_dict: Mapping[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
) -> None:
    """Checks across ranks, before ``dcp.save``, that DCP will lose nothing.

    One all-gather of a few KB; call it on every rank of ``process_group``.
    Every rank raises the same error, naming keys and ranks.

    Args:
        state_dict: This rank's state_dict, as from ``StageState.state_dict()``.
        process_group: The ranks that save; the default group if None.
        mesh: The ranks' whole ``DeviceMesh`` (``("dp", "pp")``): ranks with
            the same ``pp`` coordinate hold the same stage(s), as replicas or
            FSDP2 shards; needed where plain tensors are replicated (DDP).
            None: every rank holds its own stage(s). DTensors (and
            ShardedTensors) are judged by their own placements either way:
            different chunks of a key are shards; ranks a DTensor is
            replicated over, by its placements, hold replicas.

    Raises:
        KeyCollisionError: A key under ``model`` or ``optim`` is on two
            pipeline stages, or another entry differs between ranks (by CRC-32C).
        DivergedReplicasError: A stage's data-parallel replicas hold different
            values (by CRC-32C), or an entry (not a shard) only some have.
        NestedStateError: A section other than ``model`` and ``optim`` holds
            model or optimizer state, at any depth (``optimizer`` may hold an
            optimizer state_dict keyed by FQNs, as ``get_state_dict`` gives).
        ValueError: ``mesh`` has no ``pp`` dim, spans other ranks than
            ``process_group`` (a slice), or is passed on some ranks only.
        TypeError: An entry that is not a tensor cannot be pickled (on the
            ranks holding it, before the all-gather).

    Note:
        Known causes of collisions: layers renumbered per stage, tied weights,
        buffers tracing made persistent, replicas checked without their
        ``mesh``, and per-rank state (a stage's RNG) not under a key naming
        the stage (``rng.stage_3``).
    """
    offer = offer_keys(state_dict, process_group=process_group, mesh=mesh)
    if offer is not None:  # None without a process group
        gathered: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, offer, group=pippy_group(process_group))
        refuse_losses(gathered, process_group=process_group)


def offer_keys(
    state_dict: Mapping[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
) -> dict[str, Any] | None:
    """This rank's part of :func:`check_keys`, to gather; None without a group."""
    if not dist.is_initialized():
        return None
    world_size = dist.get_world_size(process_group)
    if mesh is not None and mesh.size() != world_size:
        raise ValueError(
            f"the mesh spans {mesh.size()} ranks and {world_size} ranks save: pass "
            "the whole mesh (for example its ('dp', 'pp') dims), not a slice of it"
        )
    dp_dims: tuple[str, ...] = ()
    stage = dist.get_rank()
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if "pp" not in names:
            raise ValueError(f"the mesh has no 'pp' dim (it has {names})")
        stage = mesh.get_local_rank("pp")
        dp_dims = tuple(n for n in names if n != "pp" and mesh.size(names.index(n)) > 1)
    owned = dict(named_leaves({s: v for s, v in state_dict.items() if s in _OWNED}))
    others = {s: v for s, v in state_dict.items() if s not in _OWNED}
    spread = {  # parameters a DTensor spreads over several ranks
        k.removeprefix("model.")
        for k, v in owned.items()
        if isinstance(v, DTensor) and v.device_mesh.size() > 1
    }
    return {
        "stage": stage,
        "meshed": mesh is not None,
        "owned": {k: _chunk(v) for k, v in owned.items()},
        # Replicas by their own placements: compared with every rank holding
        # the same chunk, whatever its stage.
        "replicas": {
            k
            for k, v in owned.items()
            if _replica(v) or (_parameter_of(k) in spread and _chunk(v) is None)
        },
        "digests": digests(
            {
                k: v
                for k, v in owned.items()
                if (dp_dims and _replicated(v, dp_dims)) or _replica(v)
            }
        ),
        "shared": {k: (_chunk(v), _storable(k, v)) for k, v in named_leaves(others)},
        "nested": [
            s for s, v in others.items() if _holds_state(v) and not _by_fqn(s, v)
        ],
    }


def refuse_losses(
    gathered: list[Any], *, process_group: dist.ProcessGroup | None = None
) -> None:
    """The rest of :func:`check_keys`: judges every rank's offer, by group rank."""
    if not dist.is_initialized():
        return
    offers = {global_rank(process_group, r): o for r, o in enumerate(gathered)}
    with_mesh = [r for r, offer in offers.items() if offer["meshed"]]
    if 0 < len(with_mesh) < len(offers):
        without = [r for r in offers if r not in with_mesh]
        raise ValueError(
            f"{name_ranks(with_mesh)} passed a mesh and {name_ranks(without)} did "
            "not: pass the same mesh on every rank"
        )
    # A section every rank nests its state under (DCP's tutorial's "app") is
    # a namespace; one some ranks use (a stage's, "stage0") names the layout.
    nesting: dict[str, list[int]] = {}
    for rank, offer in offers.items():
        for section in offer["nested"]:
            nesting.setdefault(section, []).append(rank)
    nested = {s: ranks for s, ranks in nesting.items() if len(ranks) < len(offers)}
    if nested:
        raise NestedStateError(
            f"model or optimizer state is nested under other sections: "
            f"{_with_ranks(nested)}. Its keys would "
            "name this layout, and no other layout could load them. Keep model and "
            "optimizer state under 'model' and 'optim', keyed by the un-split "
            "model's FQNs: give StageState all of a rank's stage modules and "
            "optimizers (StageState([stage0, stage2], ...)) instead of nesting "
            "their state_dicts"
        )
    if not _clean(offers):  # else no stage's key is lost and no replica differs
        _refuse_owned(offers)
    # Each chunk of a shared entry (the whole of a plain one) must agree.
    shared = _ranks_by(
        offers, lambda o: (((k, c), v) for k, (c, v) in o["shared"].items())
    )
    differing = {  # the ranks of each value: "[0, 3] vs [1, 2]"
        key: " vs ".join(map(str, sorted(by.values())))
        for (key, _), by in shared.items()
        if len(by) > 1
    }
    if differing:
        fix = (  # the scheduler's key is pippy's: it must agree
            "Give every stage the same param groups (in number and options), so "
            "that the LR scheduler's per-group lists agree"
            if all(key.startswith("lr_scheduler.") for key in differing)
            else "Keep per-rank state under a key that names the stage, or make "
            "it equal on all ranks"
        )
        raise KeyCollisionError(
            f"{len(differing)} shared checkpoint entr(ies) differ between ranks: "
            f"{_with_ranks(differing)}. DCP would keep one rank's value. {fix}."
        )


def _clean(offers: Mapping[int, Mapping[str, Any]]) -> bool:
    """Whether, quickly, no owned chunk is on two stages and no replica differs.

    Compares each stage's replicas' offers whole and the stages' chunk sets
    (fast for 1,024 ranks); False: :func:`_refuse_owned` names what is wrong.
    """
    first: dict[Any, Mapping[str, Any]] = {}  # each stage's first offer
    for offer in offers.values():
        if offer["replicas"]:
            return False
        seen = first.setdefault(offer["stage"], offer)
        if seen is not offer and (
            offer["owned"] != seen["owned"] or offer["digests"] != seen["digests"]
        ):
            return False
    held: set[Any] = set()
    for offer in first.values():
        chunks = set(offer["owned"].items())
        if not held.isdisjoint(chunks):
            return False
        held |= chunks
    return True


def _refuse_owned(offers: Mapping[int, Mapping[str, Any]]) -> None:
    """Raises for an owned chunk on two stages, or replicas that differ."""
    # A key's chunk on two stages is lost; other chunks of it are shards.
    stages = _ranks_by(
        offers,
        lambda o: (
            ((k, chunk), o["stage"])
            for k, chunk in o["owned"].items()
            if k not in o["replicas"]
        ),
    )
    collisions: dict[str, list[int]] = {}
    for (key, _), by in stages.items():
        if len(by) > 1:
            collisions[key] = sorted({*collisions.get(key, []), *_all(by)})
    if collisions:
        meshed = all(offer["meshed"] for offer in offers.values())
        raise KeyCollisionError(
            f"{len(collisions)} checkpoint key(s) are offered by more than one "
            f"pipeline stage: {_with_ranks(collisions)}. DCP would keep one copy and "
            "drop the others. Give every stage the un-split model's FQNs (keep "
            "layers in a ModuleDict keyed by the global layer index) and call "
            "restore_non_persistent_buffers() on traced stages; "
            + (
                "data-parallel replicas must differ only in the mesh's other dims."
                if meshed
                else "pass the mesh if these ranks are data-parallel replicas or "
                "FSDP2 shards."
            )
        )
    members: dict[int, set[int]] = {}  # the ranks that hold each stage
    for rank, offer in offers.items():
        members.setdefault(offer["stage"], set()).add(rank)
    replicas = _ranks_by(
        offers,
        lambda o: (
            ((k, None if k in o["replicas"] else o["stage"], o["owned"][k]), d)
            for k, d in o["digests"].items()
        ),
    )
    differ: dict[str, list[int]] = {}
    for (key, stage, chunk), by_value in replicas.items():
        # A whole tensor is on every replica of its stage; a shard, on some.
        held = members[stage] if stage is not None else set(_all(by_value))
        lacking = chunk is None and set(_all(by_value)) != held
        if len(by_value) > 1 or lacking:  # one key may have several chunks (HSDP)
            differ[key] = sorted({*differ.get(key, []), *held})
    if differ:
        raise DivergedReplicasError(
            f"the data-parallel replicas differ in {len(differ)} entr(ies) (in "
            f"value, or held by some replicas only): {_with_ranks(differ)}. DCP "
            "writes one replica's value of each key, so the checkpoint would mix "
            "them. Keep the replicas in sync "
            "(wrap each stage in DDP or FSDP2 over the data-parallel dim, and "
            "step every replica's optimizer alike; FSDP2 leaves buffers, such as "
            "BatchNorm's running statistics, to you: SyncBatchNorm, or broadcast "
            "them), then save."
        )
