"""What makes saves cheaper must keep them readable and checked.

pippy's writer has ``torch.save`` skip its zip CRC-32 (which ``torch.load``
never checks) while it writes a step's files, in the writing thread alone.
The checkpoint must still load with plain ``dcp.load`` and DCP's own
``FileSystemReader``, bit for bit, and pippy's manifest must still catch a
flipped byte.

On 2 ranks (check_save, in the launch of checks that conftest.py shares),
each rank saves a stage of its own twice (DCP's default writer thread, and
``thread_count=2``) and records what the test checks.
"""

import io
import json
import shutil
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.serialization import get_crc32_options

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.manifest import CRC32_PER_THREAD
from pippy.checkpoint.steps import step_dir

SEEDS = {0: 10, 1: 11}


def stage_state(rank):
    """A stage's state with keys of its own and one non-tensor item."""
    g = torch.Generator().manual_seed(SEEDS[rank])
    layer = f"layers.{rank}"
    return {
        "model": {f"{layer}.w": torch.randn(64, 32, generator=g)},
        "optim": {f"{layer}.w.exp_avg": torch.randn(64, 32, generator=g)},
        "extra": {f"rank{rank}": {"lr": 0.1 * (rank + 1)}},
    }


def empty_like(state):
    """The same nesting, with fresh tensors and None for the other leaves."""
    if isinstance(state, dict):
        return {k: empty_like(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def check_save(out: Path, rank: int, world_size: int) -> dict:
    """Each rank saves steps 1 and 2 and notes the CRC-32 setting around them."""
    state = stage_state(rank)
    # Another thread of the process keeps torch.save's CRC-32 during the save.
    seen, stop = set(), threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(get_crc32_options())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        checkpoint.save_stage(state, out / "ckpt", step=1)
    finally:
        stop.set()
        watcher.join()
    checkpoint.save_stage(state, out / "ckpt", step=2, thread_count=2)
    return {"crc32_after": get_crc32_options(), "other_thread": sorted(seen)}


#: For ranks.run_checks and shared_checks.py: this module's checks by name.
CHECKS = {"save": check_save}


def item_ranges(folder):
    """``{key: (file, offset, length)}`` of every item, from ``.metadata``."""
    metadata = FileSystemReader(folder).read_metadata()
    return {
        index.fqn: (info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
    }


def item_bytes(folder, where):
    name, offset, length = where
    return (Path(folder) / name).read_bytes()[offset : offset + length]


def both_stages():
    """The union of the ranks' states: what the step holds."""
    states = [stage_state(rank) for rank in SEEDS]
    return {
        part: {k: v for s in states for k, v in s[part].items()} for part in states[0]
    }


@pytest.fixture(scope="module")
def saved(two_rank_checks):
    """The folder check_save saved into, on 2 ranks (conftest.py)."""
    return two_rank_checks["test_cost"]


def test_torch_crc32_is_off_only_while_writing(saved):
    for rank in SEEDS:
        record = json.loads((saved / f"save-rank{rank}.json").read_text())
        assert record == {"crc32_after": True, "other_thread": [True]}
    for step in (1, 2):
        folder = step_dir(saved / "ckpt", step)
        for key, where in item_ranges(folder).items():
            with zipfile.ZipFile(io.BytesIO(item_bytes(folder, where))) as archive:
                crcs = {info.filename: info.CRC for info in archive.infolist()}
            if CRC32_PER_THREAD:
                assert set(crcs.values()) == {0}, (step, key, crcs)
            else:  # torch 2.10, 2.11: the setting is the process's; kept on
                assert 0 not in crcs.values(), (step, key, crcs)


@pytest.mark.parametrize("step", [1, 2])
def test_plain_dcp_load_reads_it_bitwise(saved, step):
    folder = step_dir(saved / "ckpt", step)
    merged = both_stages()
    loaded = empty_like(merged)
    # Plain DCP, in this process (no process group: DCP reads alone).
    dcp.load(loaded, storage_reader=FileSystemReader(folder), no_dist=True)
    assert offline.diff_state_dicts(loaded, merged) == []


def test_manifest_catches_a_flipped_byte(saved, tmp_path):
    folder = tmp_path / "step-1"
    shutil.copytree(step_dir(saved / "ckpt", 1), folder)
    key = "model.layers.1.w"
    name, offset, length = item_ranges(folder)[key]
    data = bytearray((folder / name).read_bytes())
    data[offset + length // 2] ^= 0x01  # inside the tensor's 8 KB
    (folder / name).write_bytes(bytes(data))
    state = empty_like(both_stages())
    with pytest.raises(checkpoint.CheckpointError, match="damaged"):
        checkpoint.load_stage(state, folder)
    # Without the manifest nothing notices: torch.load skips the zip CRC.
    dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=True)
    saved_w = stage_state(1)["model"]["layers.1.w"]
    assert not torch.equal(state["model"]["layers.1.w"], saved_w)


def test_the_kept_buffer_stager_copies_bitwise_into_the_same_buffers():
    """AsyncSaver's stager: the values of the moment, in buffers kept between
    saves; a changed layout gets a new buffer; non-tensors are copied."""
    from pippy.checkpoint.async_saver import KeptBufferStager

    weight = torch.nn.Parameter(torch.randn(4, 6))
    state = {
        "model": {
            "w": weight,
            "wt": weight.detach().t(),
            "e": torch.ones(3, 1).expand(3, 4),
        },
        "optim": {"scalars.w": [1e-3, (0.9, 0.999)]},
        "step": 3,
    }
    stager = KeptBufferStager(pin_memory=False)
    before = weight.detach().clone()
    first = stager.stage(state)
    with torch.no_grad():
        weight.add_(1.0)  # training goes on: the staged copy keeps the old values
    assert torch.equal(first["model"]["w"], before)
    assert (
        first["model"]["w"].requires_grad and type(first["model"]["w"]) is torch.Tensor
    )
    assert first["model"]["wt"].stride() == state["model"]["wt"].stride()
    assert torch.equal(first["model"]["e"], state["model"]["e"])
    assert first["optim"] == state["optim"] and first["step"] == 3
    second = stager.stage(state)
    for key in ("w", "wt", "e"):
        assert torch.equal(second["model"][key], state["model"][key]), key
        assert second["model"][key].data_ptr() == first["model"][key].data_ptr(), key
    state["model"]["w"] = torch.randn(5, 6, dtype=torch.float64)  # a new layout
    third = stager.stage(state)
    assert torch.equal(third["model"]["w"], state["model"]["w"])
    assert third["model"]["w"].data_ptr() != first["model"]["w"].data_ptr()
    stager.close()
    # In the background: the structure at the call, the bytes in its thread.
    stager = KeptBufferStager(pin_memory=False, in_background=True)
    staging = stager.stage(state)
    state["step"] = 4  # a value that is not a tensor is copied at the call
    staged = staging.result()
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert staged["step"] == 3 and staged["optim"] == state["optim"]
    # What AsyncSaver takes later is taken in the stager's thread, first.
    staged = stager.stage({"step": 5}, later=lambda: {"model": state["model"]})
    staged = staged.result()
    assert list(staged) == ["model", "step"] and staged["step"] == 5
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    stager.close()
