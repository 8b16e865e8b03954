"""The private torch names pippy relies on, each as pippy uses it.

pippy/checkpoint/steps.py lists them with the torch releases they were
checked on. Each test here fails, naming what changed, when a new torch
renames, moves or reshapes one of them; test/golden/version_matrix.py runs
this file under every torch pippy supports.
"""

import fractions
import importlib
import io
import pickle
import re
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _get_default_store
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.serialization import get_crc32_options, set_crc32_options

from pippy.checkpoint.manifest import CRC32_PER_THREAD, no_crc32
from pippy.checkpoint.reader import _METADATA_GLOBALS


class _Recorder(pickle.Unpickler):
    """Unpickles anything (our own file), recording every global it names."""

    def __init__(self, file):
        super().__init__(file)
        self.seen = set()

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_every_allow_listed_metadata_global_exists_in_this_torch():
    missing = [
        f"{module}.{name}"
        for module, name in sorted(_METADATA_GLOBALS)
        if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []


def test_this_torchs_metadata_names_only_allow_listed_globals(tmp_path):
    # A contiguous, a channels_last and a non-tensor item: what a stage saves.
    state = {
        "w": torch.randn(4, 3),
        "conv": torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
        "step": {"n": 3},
    }
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        recorder = _Recorder(f)
        recorder.load()
    dtypes = {
        ("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)
    }
    assert recorder.seen - _METADATA_GLOBALS - dtypes == set()


def test_storage_info_has_the_fields_the_manifest_reads(tmp_path):
    dcp.save({"w": torch.randn(8)}, checkpoint_id=tmp_path, no_dist=True)
    metadata = FileSystemReader(tmp_path).read_metadata()
    (info,) = metadata.storage_data.values()
    assert isinstance(info, _StorageInfo)
    assert (tmp_path / info.relative_path).stat().st_size >= info.offset + info.length


def test_filesystem_reader_and_writer_keep_their_fs_and_path_fields(tmp_path):
    # pippy's ChecksummingWriter and SafeFileSystemReader replace both fields.
    writer, reader = FileSystemWriter(tmp_path), FileSystemReader(tmp_path)
    for storage in (writer, reader):
        assert isinstance(storage.fs, FileSystem)
        assert str(storage.path) == str(tmp_path)
    assert writer.sync_files is True


def test_fsspec_filesystem_is_where_pippy_imports_it_from():
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as Fsspec

    assert callable(Fsspec.create_stream) and callable(Fsspec.init_path)


def test_get_fqns_names_a_parameter_by_its_fqn():
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"head": nn.Linear(2, 1)}))
    assert _get_fqns(model, "1.head.weight") == {"1.head.weight"}


def test_compute_local_shape_and_global_offset_gives_shape_then_offset():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        tensor = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        assert (tuple(shape), tuple(offset)) == ((4, 3), (0, 0))
    finally:
        dist.destroy_process_group()


def test_get_default_store_is_the_default_groups_store():
    """pippy.checkpoint.collectives waits on it: a key-value store shared by the group."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        default = _get_default_store()
        default.set("pippy/probe", b"1")
        assert default.get("pippy/probe") == b"1"
        assert default.check(["pippy/probe"])
    finally:
        dist.destroy_process_group()


def test_read_data_sees_the_filled_state_dict_and_its_errors_reach_dcp(tmp_path):
    """The reader's after_reads applies the planner's original_state_dict in
    read_data: filled there, top-level values too; what it raises comes back
    from DCP's gather of the reads as a CheckpointException."""
    seen = {}

    class Reader(FileSystemReader):
        def read_data(self, plan, planner):
            super().read_data(plan, planner).wait()
            seen.update(planner.original_state_dict)
            raise ValueError("refused")

    dcp.save(
        {"step": 3, "m": {"w": torch.ones(2)}}, checkpoint_id=tmp_path, no_dist=True
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(dcp.CheckpointException) as e:
            state = {"step": 0, "m": {"w": torch.zeros(2)}}
            dcp.load(state, storage_reader=Reader(tmp_path))
    finally:
        dist.destroy_process_group()
    assert seen["step"] == 3 and torch.equal(seen["m"]["w"], torch.ones(2))
    assert state["step"] == 0  # copied back only after a load that succeeds
    assert [type(error) for error, _ in e.value.failures.values()] == [ValueError]


def test_crc32_options_are_per_thread_where_pippy_says_so():
    # manifest.no_crc32 turns torch.save's CRC-32 off only where it is per thread.
    seen = []
    previous = get_crc32_options()
    set_crc32_options(False)
    try:
        other = threading.Thread(target=lambda: seen.append(get_crc32_options()))
        other.start()
        other.join()
        assert get_crc32_options() is False
        assert seen == [previous if CRC32_PER_THREAD else False]
    finally:
        set_crc32_options(previous)
    assert get_crc32_options() is previous


def test_no_crc32_leaves_other_threads_and_the_setting_alone():
    seen = []
    with no_crc32():
        assert get_crc32_options() is (not CRC32_PER_THREAD)
        other = threading.Thread(target=lambda: seen.append(get_crc32_options()))
        other.start()
        other.join()
    assert seen == [True] and get_crc32_options() is True


def test_a_weights_only_refusal_names_the_global_as_safe_load_planner_parses_it():
    data = io.BytesIO()
    torch.save({"x": fractions.Fraction(1, 3)}, data)
    data.seek(0)
    with pytest.raises(pickle.UnpicklingError) as refused:
        torch.load(data, weights_only=True)
    # SafeLoadPlanner.load_bytes names the refused global with this pattern.
    match = re.search(r"GLOBAL ([\w.]+)", str(refused.value))
    assert match is not None and match.group(1) == "fractions.Fraction"


def test_lr_scheduler_state_keeps_per_group_lists_under_these_names():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = scheduler.state_dict()
    assert isinstance(state["base_lrs"], list) and isinstance(state["_last_lr"], list)


def test_module_internals_pippy_reads():
    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("rope", torch.ones(2), persistent=False)
            self.register_buffer("kept", torch.ones(2))

    module = WithBuffers()
    module.register_state_dict_pre_hook(lambda *args: None)
    assert module._non_persistent_buffers_set == {"rope"}
    assert set(module._buffers) == {"rope", "kept"}
    assert set(module._modules) == {"lin"} and set(module.lin._parameters) == {
        "weight",
        "bias",
    }
    assert len(module._state_dict_pre_hooks) == 1 and len(module._state_dict_hooks) == 0


def test_plan_caching_is_a_planner_attribute_and_pippy_refuses_it():
    """CheckedSavePlanner reads DefaultSavePlanner._enable_plan_caching: a cached
    plan would send a save into an earlier step's staging folder."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from pippy.checkpoint import take_state

    assert DefaultSavePlanner(enable_plan_caching=True)._enable_plan_caching is True
    assert DefaultSavePlanner()._enable_plan_caching is False
    cached = DefaultSavePlanner(enable_plan_caching=True)
    with pytest.raises(ValueError, match="plan caching"):
        take_state({"w": torch.zeros(2)}, step=1, planner=cached)
