"""The storage seam, and the one save and load sequence every writer uses.

URLs stay URLs (never a local folder), saves to storage without an atomic
rename are refused in one line, reads go through fsspec; AsyncSaver checks what
save_stage checks and works with a stager that copies in the background; the
command line picks the newest step as a resume does; the example's save and
load write and read what save_stage and load_stage do.
"""

import importlib.util
import shutil

import fsspec
import google_crc32c
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.manifest import read_manifest
from pippy.checkpoint.steps import wait_for_deletions
from pippy.checkpoint.storage import (
    FsspecStorage,
    LocalStorage,
    check_publishable,
    storage_for,
)
from pippy.cli import main

from helpers import linear_state, plain_read, rank_results


@pytest.fixture
def memory_run(tmp_path):
    """A real step saved locally, copied into fsspec's memory file system."""
    state = linear_state()
    state.step = 1
    checkpoint.save_stage(state, tmp_path / "run")
    fs = fsspec.filesystem("memory")
    url = f"memory://{tmp_path.name}/run"
    fs.put(str(tmp_path / "run"), url, recursive=True)
    yield url, tmp_path / "run", state
    fs.rm(url, recursive=True)


def test_a_lease_is_refused_where_the_store_tags_no_object(tmp_path, monkeypatch):
    """A store that writes conditionally but gives the owner record no ETag:
    a renewal would be a plain PUT, which is no lease. Refused, nothing left."""
    url = f"memory://{tmp_path.name}/run"
    monkeypatch.setattr(FsspecStorage, "conditional", property(lambda self: True))
    with pytest.raises(checkpoint.CheckpointDirError, match="no ETag to renew it by"):
        checkpoint.job.FolderOwner(url).acquire()
    assert fsspec.filesystem("memory").find(url) == []


@pytest.mark.parametrize("url", ["memory://run", "file:///tmp/pippy-url-run"])
def test_a_url_is_never_a_local_folder_and_a_save_there_commits_by_record(
    tmp_path, monkeypatch, url
):
    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem(url.split("://")[0])
    state = linear_state()
    try:
        # no FolderOwner: these stores have no conditional write to hold a lease
        with pytest.raises(checkpoint.CheckpointDirError, match="no conditional"):
            checkpoint.job.FolderOwner(url).acquire()
        for step in (1, 2):
            state.step = step
            checkpoint.save_stage(state, url, keep_last=1)
        wait_for_deletions()  # retention's, in the background (an owner waits)
        latest = checkpoint.find_latest_step(url)
        assert latest == f"{url}/step-2" and isinstance(latest, str)
        assert sorted(fs.ls(url, detail=False)) == [fs._strip_protocol(latest)]
        # The checksums, taken as the bytes were written, are the bytes'.
        manifest = read_manifest(storage_for(latest), latest)
        for (name, offset, length), (_, crc) in manifest.items.items():
            data = fs.cat_file(fs._strip_protocol(f"{latest}/{name}"))
            assert google_crc32c.value(data[offset : offset + length]) == crc
        fresh = linear_state()
        fresh.module.weight.data.zero_()
        checkpoint.load_stage(fresh, latest)
        assert offline.diff_state_dicts(fresh.state_dict(), state.state_dict()) == []
        # A folder only a rename publishes whole is refused, in one line.
        with pytest.raises(checkpoint.CheckpointDirError) as e:
            offline.export_hf(latest, f"{url}/hf", config={})
        assert str(e.value) == (
            f"cannot write a folder to {url + '/hf'!r}: publishing it whole needs "
            "an atomic rename, which this storage lacks (a reader could see half "
            "of it). Write it to a local or mounted folder"
        )
    finally:
        fs.rm(url, recursive=True)
    assert list(tmp_path.iterdir()) == []  # no ./memory:/run, no ./file:/...


def test_a_step_in_a_url_is_found_read_and_loaded_through_fsspec(memory_run):
    url, local, state = memory_run
    latest = checkpoint.find_latest_step(url)
    assert latest == f"{url}/step-1" and isinstance(latest, str)
    ours = offline.read_checkpoint(latest)
    assert ours.keys() == plain_read(local / "step-1").keys()
    for key, value in plain_read(local / "step-1").items():
        assert torch.equal(ours[key], value) if torch.is_tensor(value) else True
    # Plain DCP reads the URL the same.
    items = offline.read_checkpoint(latest, prefix="model.")
    plain = {f"model.{k}": torch.empty_like(v) for k, v in items.items()}
    torch.distributed.checkpoint.load(
        plain, storage_reader=FsspecReader(latest), no_dist=True
    )
    assert all(torch.equal(plain[f"model.{k}"], v) for k, v in items.items())
    model = torch.nn.Linear(4, 4)
    assert offline.load_model(latest, model) == 1
    assert torch.equal(model.weight, state.module.weight)


@pytest.mark.parametrize("where", ["folder", "url"])
def test_a_save_and_a_load_resolve_their_location_once(tmp_path, monkeypatch, where):
    """The checkpoint folder becomes its storage once per call, which travels down:
    a save (with pruning), a search for the newest step (verified or not) and a
    load each make one storage object."""
    made = []
    for kind in (LocalStorage, FsspecStorage):
        original = kind.__init__

        def counted(self, *args, _original=original, **kwargs):
            made.append(type(self).__name__)
            _original(self, *args, **kwargs)

        monkeypatch.setattr(kind, "__init__", counted)
    root = tmp_path / "run" if where == "folder" else f"memory://{tmp_path.name}"
    expected = ["LocalStorage" if where == "folder" else "FsspecStorage"]
    state, second = linear_state(), linear_state()
    state.step, second.step = 1, 2
    calls = {
        "save": lambda: checkpoint.save_stage(state, root),
        "save and prune": lambda: checkpoint.save_stage(second, root, keep_last=1),
        "find": lambda: checkpoint.find_latest_step(root),
        "find verified": lambda: checkpoint.find_latest_step(root, verified=True),
    }
    for name, call in calls.items():
        made.clear()
        latest = call()
        assert made == expected, name
    made.clear()
    checkpoint.load_stage(state, latest)
    assert made == expected and latest == storage_for(root).join(root, "step-2")
    if where == "url":
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_the_command_line_reads_a_url(memory_run, capsys):
    url, _, _ = memory_run
    assert main(["inspect", url, "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"verified: {url}/step-1: " in out


def test_a_missing_storage_client_names_the_extra():
    missing = [
        (protocol, extra)
        for protocol, module, extra in (("s3", "s3fs", "s3"), ("gs", "gcsfs", "gcs"))
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        pytest.skip("s3fs and gcsfs are both installed")
    protocol, extra = missing[0]
    url = f"{protocol}://bucket/run"
    with pytest.raises(checkpoint.CheckpointDirError) as e:
        checkpoint.find_latest_step(url)
    assert str(e.value) == (
        f"{url!r} needs the fsspec client of {protocol}://: pip install "
        f"'pippy[{extra}]'"
    )


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_the_storages_create_exclusively_write_whole_and_publish(tmp_path, kind):
    root = str(tmp_path) if kind == "local" else f"memory://{tmp_path.name}"
    storage = storage_for(root)
    assert isinstance(storage, LocalStorage if kind == "local" else FsspecStorage)
    folder = storage.join(root, "run")
    storage.makedirs(folder)
    record = storage.join(folder, ".owner.json")
    assert storage.create_exclusive(record, b"first")
    assert not storage.create_exclusive(record, b"second")
    assert storage.read_bytes(record) == b"first"
    target = storage.join(folder, "data")
    with pytest.raises(RuntimeError), storage.open_atomic(target) as f:
        f.write(b"half")
        raise RuntimeError("killed mid-write")
    assert not storage.exists(target)  # nothing, not half a file
    storage.write_atomic(target, b"whole")
    assert storage.size(target) == 5
    storage.makedirs(storage.join(folder, ".partial"))
    storage.write_atomic(storage.join(folder, ".partial", "x"), b"1")
    storage.publish(storage.join(folder, ".partial"), storage.join(folder, "step-1"))
    assert storage.listdir(folder) == [".owner.json", "data", "step-1"]
    storage.remove(storage.join(folder, "step-1"))
    assert storage.listdir(folder) == [".owner.json", "data"]
    assert check_publishable(root) if kind == "local" else True
    if kind == "local":
        assert isinstance(folder, type(tmp_path))  # local paths stay Path
    else:
        assert folder == f"memory://{tmp_path.name}/run"
        fsspec.filesystem("memory").rm(root, recursive=True)


def test_the_command_line_picks_the_newest_step_a_resume_would(tmp_path, capsys):
    state = linear_state()
    for step in (1, 2):
        state.step = step
        checkpoint.save_stage(state, tmp_path / "run")
    # step-3 is a copy of step-2: its manifest says step 2, so no load takes it.
    shutil.copytree(tmp_path / "run" / "step-2", tmp_path / "run" / "step-3")
    assert checkpoint.find_latest_step(tmp_path / "run") == tmp_path / "run" / "step-2"
    assert main(["inspect", str(tmp_path / "run")]) == 0
    assert f"{tmp_path / 'run' / 'step-2'}: " in capsys.readouterr().out
    out = tmp_path / "weights.pt"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert f"{tmp_path / 'run' / 'step-2'} -> {out}" in capsys.readouterr().out


def test_convert_writes_through_the_save_sequence(tmp_path):
    state = linear_state()
    state.step = 4
    checkpoint.save_stage(state, tmp_path / "run")
    out = tmp_path / "titan" / "step-4"
    (tmp_path / "titan").mkdir()
    offline.convert_layout(tmp_path / "run" / "step-4", out, to="torchtitan")
    assert (
        read_manifest(LocalStorage(), out).step == 4
    )  # its manifest, and loads verify it
    assert sorted(p.name for p in (tmp_path / "titan").iterdir()) == ["step-4"]
    assert offline.verify_step(out) == len(read_manifest(LocalStorage(), out).items)


@pytest.fixture(scope="module")
def seam_ranks(two_rank_checks):
    """The checks below (seam_checks.py's same, async_checks, async_staging)
    ran in one launch of 2 ranks with other modules' checks (conftest.py:
    starting ranks is slow); their folder."""
    return two_rank_checks["seam_checks"]


def test_the_examples_save_and_save_stage_write_the_same_step(seam_ranks):
    example = seam_ranks / "example" / "step-2"
    library = seam_ranks / "library" / "step-2"
    ours, theirs = (
        read_manifest(LocalStorage(), example),
        read_manifest(LocalStorage(), library),
    )
    assert ours.items == theirs.items  # same keys, files, offsets, bytes (CRC-32C)
    assert ours.files == theirs.files
    reader = FileSystemReader(example)
    assert set(reader.read_metadata().state_dict_metadata) == set(
        FileSystemReader(library).read_metadata().state_dict_metadata
    )
    for r in rank_results(seam_ranks, "same"):
        assert r["example_vs_library"] == []  # the two loads agree bitwise
        assert r["loaded_vs_saved"] == []
        assert r["steps"] == [2, 2]


def test_the_async_saver_checks_step_and_keys_as_save_stage(seam_ranks):
    for r in rank_results(seam_ranks, "async_checks"):
        assert r["wrong_step"] == (
            "ValueError: the state holds step 1; it cannot be step-5"
        )
        assert r["steps_after_wrong_step"] == []
    rank0, rank1 = rank_results(seam_ranks, "async_checks")
    wrong = "the state holds step 1; it cannot be step-5"
    assert rank1["one_wrong"] == f"ValueError: {wrong}"
    assert rank1["polled"] == []  # said once, by save()
    assert rank0["one_wrong"] is None  # its own state was right
    assert rank0["polled"] == [  # rank 0 saved its own step, 1
        "CheckpointError: saving step-1 in the background failed on 1 rank(s):\n"
        f"  rank 1: ValueError: {wrong}"
    ]
    for r in (rank0, rank1):
        assert r["collision"].startswith("KeyCollisionError: ")
        assert "'per_rank.value'" in r["collision"]
        assert r["steps_after_collision"] == []
        assert r["steps"] == [1]


def test_the_async_saver_with_a_background_stager(seam_ranks):
    for r in rank_results(seam_ranks, "async_staging"):
        assert r["steps"] == [1, 2]
        assert r["differ"] == {"1": [], "2": []}  # the moment of each call


def test_no_module_but_the_seam_touches_files():
    """Every open, rename, link and delete of pippy lives in its storage module."""
    import re

    from helpers import ROOT

    touching = re.compile(
        r"\bopen\(|os\.(rename|replace|link|unlink|remove|fsync|mkdir|makedirs|"
        r"listdir|scandir|chmod)\b|shutil\.|\.(iterdir|glob|rglob|mkdir|unlink|"
        r"write_text|write_bytes|read_text|stat|is_file|rename|touch)\("
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "pippy").rglob("*.py"))
        if path != ROOT / "pippy" / "checkpoint" / "storage.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if touching.search(line) and not line.lstrip().startswith("#")
    ]
    # This host's /proc (an owner's liveness) and the CLI's stdout are not a
    # checkpoint's files.
    allowed = ('open(f"/proc/', "os.open(os.devnull")
    assert [f for f in found if not any(a in f for a in allowed)] == []
