"""On a GPU by design: what a save or a load does that would stall training
there, counted on the CPU.

google_crc32c holds the GIL for a whole call, so a checksum over a large
tensor in one call stalls every other Python thread (on a GPU, the one that
launches kernels) for its length: every call takes at most CRC_CHUNK bytes.
"""

import threading
from pathlib import Path

import google_crc32c
import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from pippy import checkpoint
from pippy.checkpoint import checks, offline
from pippy.checkpoint.manifest import CRC_CHUNK, crc32c


@pytest.fixture
def crc_calls(monkeypatch):
    """The size in bytes of every google_crc32c call made meanwhile."""
    sizes = []
    for name in ("extend", "value"):
        real = getattr(google_crc32c, name)

        def recorded(*args, real=real):
            sizes.append(len(args[-1]))
            return real(*args)

        monkeypatch.setattr(google_crc32c, name, recorded)
    return sizes


def test_checksums_hold_the_gil_for_one_chunk_at_a_time(tmp_path, crc_calls):
    big = torch.randn(3 * CRC_CHUNK // 4 + 5)  # 3 chunks and a little more
    state = {"model": {"w": big}, "step": 1}
    step = checkpoint.save_stage(state, tmp_path, step=1)
    assert offline.verify_step(step) == 2
    loaded = {"model": {"w": torch.zeros_like(big)}, "step": 0}
    checkpoint.load_stage(loaded, step)  # read straight into the tensor, checked
    assert torch.equal(loaded["model"]["w"], big)
    checks.fingerprint(big)  # the replica check's
    assert max(crc_calls) <= CRC_CHUNK
    assert sum(size >= CRC_CHUNK for size in crc_calls) >= 4 * 3  # each path chunked


def test_a_chunked_checksum_is_the_checksum_of_the_whole():
    data = torch.randint(0, 256, (2 * CRC_CHUNK + 7,), dtype=torch.uint8).numpy()
    whole = google_crc32c.value(data.tobytes())
    assert crc32c(data) == whole
    assert crc32c(data[CRC_CHUNK + 3 :], crc32c(data[: CRC_CHUNK + 3])) == whole
    assert crc32c(b"") == 0


def test_the_optimizer_scalars_of_a_save_are_one_host_copy(monkeypatch):
    """Fused or capturable AdamW keeps each parameter's ``step`` on the GPU:
    taken one ``.item()`` at a time, a save would sync the device once per
    parameter. Counted here: no ``.item()``, one stack per device and dtype."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    optimizer = torch.optim.AdamW(model.parameters())  # step: a 0-dim tensor
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = checkpoint.StageState(model, optimizer, step=1)
    calls = {"item": 0, "stack": 0}
    item, stack = torch.Tensor.item, torch.stack

    def counted_item(self):
        calls["item"] += 1
        return item(self)

    def counted_stack(*args, **kwargs):
        calls["stack"] += 1
        return stack(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "item", counted_item)
    monkeypatch.setattr(torch, "stack", counted_stack)
    taken = state.state_dict()
    monkeypatch.undo()
    assert calls == {"item": 0, "stack": 1}
    steps = {
        e[1]
        for v in taken["optim"].values()
        if isinstance(v, list)
        for e in v
        if e[0] == "state.step"
    }
    assert steps == {1.0}


def test_fingerprints_tell_states_apart_without_holding_both():
    """The example's verification frees the trained stages before building the
    fresh ones (one set of stages on a GPU), comparing fingerprints."""
    state = {"model": {"w": torch.arange(6.0)}, "step": 3, "lr": [0.1]}
    same = {"model": {"w": torch.arange(6.0)}, "step": 3, "lr": [0.1]}
    assert offline.fingerprints(state) == offline.fingerprints(same)
    flipped = same["model"]["w"].view(torch.int32)
    flipped[5] ^= 1  # the lowest bit of one float
    differ = offline.fingerprints(state).items() ^ offline.fingerprints(same).items()
    assert {k for k, _ in differ} == {"model.w"}
    assert offline.fingerprints({"w": torch.zeros(2)}) != offline.fingerprints(
        {"w": torch.zeros(2, dtype=torch.float64)}
    )


def test_old_steps_are_deleted_off_the_saves_critical_path(tmp_path, monkeypatch):
    """keep_last takes an old step out of view at once (one rename); its
    files are deleted by a thread, so that no rank waits for them."""
    from pippy.checkpoint import steps
    from pippy.checkpoint.storage import LocalStorage

    state = {"model": {"w": torch.zeros(4)}, "step": 1}
    checkpoint.save_stage(state, tmp_path, step=1, keep_last=1)
    held, remove = threading.Event(), LocalStorage.remove

    def slow_remove(self, path):
        held.wait(30)  # a slow parallel file system
        remove(self, path)

    monkeypatch.setattr(LocalStorage, "remove", slow_remove)
    state["step"] = 2
    checkpoint.save_stage(state, tmp_path, step=2, keep_last=1)  # returns now
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".step-1.deleting-") and names[1:] == ["step-2"]
    held.set()
    steps.wait_for_deletions()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]


def test_what_a_deletion_left_is_logged_and_deleted_by_the_next_save(
    tmp_path, monkeypatch, caplog
):
    from pippy.checkpoint import steps
    from pippy.checkpoint.storage import LocalStorage

    state = {"model": {"w": torch.zeros(4)}, "step": 1}
    checkpoint.save_stage(state, tmp_path, step=1, keep_last=1)
    left = tmp_path / ".step-0.deleting-0123456789ab"  # a kill mid-deletion
    (left / "sub").mkdir(parents=True)
    remove = LocalStorage.remove

    def failing_remove(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(LocalStorage, "remove", failing_remove)
    state["step"] = 2
    with caplog.at_level("WARNING", logger="pippy.checkpoint.steps"):
        checkpoint.save_stage(state, tmp_path, step=2, keep_last=1)
        steps.wait_for_deletions()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all(
        "the next save with keep_last retries" in w for w in warned
    )
    monkeypatch.setattr(LocalStorage, "remove", remove)
    state["step"] = 3
    checkpoint.save_stage(state, tmp_path, step=3, keep_last=1)
    steps.wait_for_deletions()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def test_staging_buffers_are_pinned_at_their_exact_size(monkeypatch):
    """The caching host allocator (pin_memory=True) rounds each pinned block
    up to a power of two: a stage of 2**k + 1 bytes per tensor would keep
    twice that. The stager registers each buffer's own memory instead."""
    from pippy.checkpoint import async_saver

    pinned, unpinned = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(
        async_saver.pin_memory_utils,
        "pin_memory",
        lambda ptr, size: pinned.append((ptr, size)),
    )
    monkeypatch.setattr(async_saver.pin_memory_utils, "unpin_memory", unpinned.append)
    empty_like = torch.empty_like

    def no_caching_allocator(*args, **kwargs):
        assert not kwargs.get("pin_memory"), "pinned by the caching allocator"
        return empty_like(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", no_caching_allocator)
    state = {"a": torch.zeros(1025, dtype=torch.uint8), "b": torch.ones(3, 5)}
    stager = async_saver.KeptBufferStager(pin_memory=True)
    staged = stager.stage(state)
    sizes = sorted(size for _, size in pinned)
    assert sizes == [60, 1025]  # the bytes of each, no more
    assert torch.equal(staged["a"], state["a"]) and torch.equal(staged["b"], state["b"])
    ptrs = {ptr for ptr, _ in pinned}
    assert ptrs == {staged["a"].data_ptr(), staged["b"].data_ptr()}
    stager.close()
    del staged
    import gc

    gc.collect()
    assert set(unpinned) == ptrs  # unpinned once the buffers are freed


def verify_in_shares(rank, world_size, folder):
    """Two steps saved by 2 ranks; step-2 then damaged; find_latest_step
    (verified) on both."""
    for step in (1, 2):
        state = {"model": {f"w{rank}": torch.full((64,), float(step))}, "step": step}
        checkpoint.save_stage(state, folder, step=step)
    dist.barrier()
    if rank == 0:  # one byte of the last item of rank 1's file
        data = folder / "step-2" / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[-20] ^= 1
        data.write_bytes(bytes(raw))
    dist.barrier()
    return checkpoint.find_latest_step(folder, verified=True)


def test_a_verified_resume_reads_each_step_in_shares_and_passes_damage_over(
    tmp_path, monkeypatch
):
    """find_latest_step(verified=True): every rank reads its share of each
    step it checks, none all of it; a damaged step is passed over on all."""
    from pippy.checkpoint import reader

    reads, real = ([], []), reader.read_crcs

    def recorded(storage, step_folder, ranges):  # by the rank of the thread
        if dist.is_initialized():
            reads[dist.get_rank()].extend((Path(step_folder).name, *p) for p in ranges)
        return real(storage, step_folder, ranges)

    monkeypatch.setattr(reader, "read_crcs", recorded)
    assert run_ranks(2, verify_in_shares, tmp_path) == [tmp_path / "step-1"] * 2
    shares = [set(r) for r in reads]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    for step in ("step-2", "step-1"):  # all of each, between them
        placed = {(f, o, n) for s, f, o, n in shares[0] | shares[1] if s == step}
        assert len(placed) == 3  # w0; w1 and the step
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".step-2.damaged-") and names[1:] == ["step-1"]


def test_the_replica_check_hashes_device_tensors_where_they_live():
    """On a GPU the replica check hashes each replicated tensor on the device
    (checks.device_hash) and copies the hashes to the host once, instead of
    copying each tensor to the host for a CRC-32C: the hash, run here on the
    CPU, changes with any bit, any order of words, and any length."""
    torch.manual_seed(0)
    t = torch.randn(1001)  # 4004 bytes: padded to whole words
    h = checks.device_hash(t)
    assert h.dtype == torch.int64 and h.dim() == 0
    assert torch.equal(checks.device_hash(t.clone()), h)  # same bytes, same hash
    flipped = t.clone()
    flipped.view(torch.int32)[500] ^= 1 << 7
    swapped = t.clone()
    swapped[[0, 2]] = swapped[[2, 0]]
    shorter = t[:-1]
    hashes = {int(checks.device_hash(x)) for x in (t, flipped, swapped, shorter)}
    assert len(hashes) == 4
    assert checks.device_hash(torch.zeros(0)).item() == 0
    # On the CPU the check keeps the CRC-32C (no copy to make).
    assert checks.digests({"t": t}) == {"t": checks.fingerprint(t)}
