"""Checkpoints in a bucket: the example against a real S3 server (SeaweedFS).

The server runs on 127.0.0.1 for this module; s3fs reaches it through the
standard AWS settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), as it would
reach a real bucket. A step there is written in place and committed by its
manifest.json, written last in one PUT; the owner record is a conditional
write held with a lease.
"""

import json
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.owner import OWNER_FILE
from pippy.cli import main

import helpers
from helpers import (
    EXAMPLE,
    TINY_FLAGS,
    TINY_RUN_FLAGS,
    linear_state,
    loss_lines,
    torchrun,
)

FLAGS = [*TINY_FLAGS, "--save-every", "2", "--keep-last", "2"]


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    yield from helpers.s3_bucket(s3_endpoint)


def example(run, *flags, ok=True, launcher=False):
    """The example on 2 ranks in the bucket: on a pool of rank processes, or
    (`launcher`) under torchrun, end to end."""
    if launcher:
        args = (2, EXAMPLE, *FLAGS, *flags, "--checkpoint-dir", run)
        return torchrun(*args, expect_ok=ok)
    return helpers.example(2, *FLAGS, *flags, "--checkpoint-dir", run, expect_ok=ok)


@pytest.fixture(scope="module")
def resumed(bucket):
    """The example in the bucket, stopped at step 4 (a pool's ranks), then
    resumed to step 6 under torchrun, end to end: (the run's URL, the
    resumed run's process)."""
    fs, root = bucket
    run = f"{root}/resume"
    example(run, "--steps", "6", "--stop-after", "4")  # stopped at 4
    assert sorted(fs.ls(run[5:], detail=False)) == [
        f"{run[5:]}/step-2",
        f"{run[5:]}/step-4",
    ]
    return run, example(run, "--steps", "6", launcher=True)


def test_the_example_trains_saves_and_resumes_in_a_bucket(resumed, tiny_run):
    run, second = resumed
    assert f"resuming from {run}/step-4" in second.stdout
    assert f"verified: {run}/step-6 loaded into fresh stages" in second.stdout
    assert "[rank 0] removed step-2 (keeping the newest 2)" in second.stdout
    # The same 6 steps on a local disk (saved at 3 and 6; what is saved and
    # kept changes no arithmetic): a run shared with other modules.
    local, straight = tiny_run
    assert TINY_RUN_FLAGS == [*TINY_FLAGS, "--steps", "6", "--save-every", "3"]
    assert loss_lines(second.stdout) == loss_lines(straight)[4:]
    ours = offline.read_checkpoint(f"{run}/step-6")
    assert (
        offline.diff_state_dicts(ours, offline.read_checkpoint(local / "step-6")) == []
    )


def test_a_step_in_the_bucket_is_read_exported_converted_and_started_from(
    bucket, resumed, tmp_path, capsys
):
    _, root = bucket
    run, _ = resumed
    ours = offline.read_checkpoint(f"{run}/step-6")
    # --init-from a step in the bucket: a new run starts from its weights. It
    # reads step-6 only, so it runs while this process reads the bucket below.
    with ThreadPoolExecutor(max_workers=1) as pool:
        init_from = ("--steps", "2", "--init-from", f"{run}/step-6")
        started = pool.submit(example, tmp_path / "init", *init_from)
        check_the_command_line_and_load_model(root, run, ours, tmp_path, capsys)
        started = started.result()
    assert f"starting from the weights of {run}/step-6" in started.stdout


def check_the_command_line_and_load_model(root, run, ours, tmp_path, capsys):
    """What the command line and load_model do with the step in the bucket."""
    # The command line reads the bucket, and exports from it.
    assert main(["inspect", run, "--verify"]) == 0
    assert f"verified: {run}/step-6: " in capsys.readouterr().out
    out = tmp_path / "gpt.safetensors"
    assert main(["export", run, "--out", str(out)]) == 0
    assert out.stat().st_size > 100_000
    # convert, bucket to bucket, there and back: every item as it was
    titan, back = f"{root}/titan/step-6", f"{root}/back/step-6"
    assert main(["convert", f"{run}/step-6", "--to", "torchtitan", "--out", titan]) == 0
    assert main(["convert", titan, "--to", "pippy", "--out", back]) == 0
    assert offline.diff_state_dicts(offline.read_checkpoint(back), ours) == []
    # load_model: the un-split model from the bucket, in this process
    model = helpers.tiny_gpt()
    offline.load_model(f"{run}/step-6", model)
    weights = {k[len("model.") :]: v for k, v in ours.items() if k.startswith("model.")}
    assert offline.diff_state_dicts(model.state_dict(), weights) == []


@pytest.fixture(scope="module")
def four_steps(bucket):
    """A run of 4 steps in the bucket, saved at 2 and 4: the tests below each
    start from a copy of its objects (one launch for them all)."""
    fs, root = bucket
    run = f"{root}/four-steps"
    example(run, "--steps", "4")
    fs.invalidate_cache()
    steps = sorted({p.split("/")[2] for p in fs.find(run[5:])})
    assert steps == ["step-2", "step-4"]  # the owner record is released
    return run


def copy_run(fs, source, run):
    """Every object of `source` copied under `run`, byte for byte."""
    fs.invalidate_cache()
    for path in fs.find(source[5:]):
        fs.pipe_file(run[5:] + path[len(source) - 5 :], fs.cat_file(path))


def test_a_step_without_its_commit_record_is_never_taken(bucket, four_steps):
    fs, root = bucket
    run = f"{root}/uncommitted"
    copy_run(fs, four_steps, run)  # the run saved step-2 and step-4
    # A save killed before its last PUT: the data and .metadata are there,
    # its manifest.json (the commit record) is not.
    fs.rm(f"{run[5:]}/step-4/manifest.json")
    assert checkpoint.find_latest_step(run) == f"{run}/step-2"
    for read in (offline.read_checkpoint, checkpoint.open_step):  # asked by name
        with pytest.raises(
            checkpoint.CheckpointNotFoundError,
            match="has no manifest.json, a step's commit record on an object store: "
            "a save that did not finish",
        ):
            read(f"{run}/step-4")
    again = example(run, "--steps", "4")
    assert f"resuming from {run}/step-2" in again.stdout
    assert f"removed {run}/step-4: a save of it never committed" in again.stdout
    assert f"verified: {run}/step-4" in again.stdout


def test_one_job_per_bucket_folder_and_an_expired_lease_is_taken_over(bucket):
    fs, root = bucket
    run = f"{root}/owned"
    record = {"host": "node7", "pid": 4242, "since": "then", "token": "abc"}
    fs.pipe_file(
        f"{run[5:]}/.owner.json",
        json.dumps(
            {**record, "expires": time.time() + 600, "lease_seconds": 60}
        ).encode(),
    )
    refused = example(run, "--steps", "2", ok=False)
    for rank in (0, 1):
        assert (
            f"[rank {rank}] error: {run} is in use by another job (host 'node7', pid 4242"
            in refused.stdout
        )
    assert "step   1 |" not in refused.stdout
    fs.pipe_file(
        f"{run[5:]}/.owner.json",
        json.dumps(
            {**record, "expires": time.time() - 1, "lease_seconds": 60}
        ).encode(),
    )
    taken = example(run, "--steps", "2")
    assert f"taking over {run} from a job whose lease expired at " in taken.stdout
    assert f"verified: {run}/step-2" in taken.stdout
    assert not fs.exists(f"{run[5:]}/.owner.json")  # released at the end


def two_steps(root, name):
    """A run of this process alone in the bucket, saved at steps 1 and 2."""
    run, state = f"{root}/{name}", linear_state()
    for step in (1, 2):
        state.step = step
        checkpoint.save_stage(state, run)
    return run, state


def test_urls_that_would_touch_other_objects_are_refused(bucket, capsys):
    fs, root = bucket
    run, state = two_steps(root, "run-a")
    fs.invalidate_cache()
    before = {p: fs.cat_file(p) for p in fs.find(root[5:])}
    # fsspec reads * ? [ as wildcards: run-? would take run-a's objects
    for url in (f"{root}/run-?", f"{root}/run-*", f"{root}/run-[ab]"):
        with pytest.raises(checkpoint.CheckpointDirError, match="reads as a wildcard"):
            checkpoint.save_stage(state, url)
    # a step folder is no run's folder, on a bucket as on a disk
    with pytest.raises(checkpoint.CheckpointDirError, match="lies in the step folder"):
        checkpoint.job.FolderOwner(f"{run}/step-2").acquire()
    with pytest.raises(checkpoint.CheckpointDirError, match="lies in the step folder"):
        checkpoint.save_stage(state, f"{run}/step-2/inner")
    # a bucket that does not exist (a typo) is not created
    with pytest.raises(checkpoint.CheckpointDirError, match="no bucket 'pippy-typo'"):
        checkpoint.save_stage(state, "s3://pippy-typo/run")
    fs.invalidate_cache()
    assert not fs.exists("pippy-typo")
    assert {p: fs.cat_file(p) for p in fs.find(root[5:])} == before
    # export writes a file under a prefix that holds nothing yet
    out = f"{root}/exports/model.safetensors"
    assert main(["export", f"{run}/step-2", "--out", out]) == 0
    assert fs.exists(out[5:])


def test_a_damaged_step_in_a_bucket_is_moved_aside_whole_and_passed_over(bucket):
    fs, root = bucket
    run, _ = two_steps(root, "skip-damaged")
    path = f"{run[5:]}/step-2/__0_0.distcp"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    damaged = {p[len(run) - 5 :]: fs.cat_file(p) for p in fs.find(f"{run[5:]}/step-2")}
    assert checkpoint.find_latest_step(run, verified=True) == f"{run}/step-1"
    fs.invalidate_cache()
    aside, kept = (p.rsplit("/", 1)[1] for p in fs.ls(run[5:], detail=False))
    assert aside.startswith(".step-2.damaged-") and kept == "step-1"
    moved = fs.find(f"{run[5:]}/{aside}")  # every object, byte for byte
    assert {
        p[len(run) - 5 :].replace(aside, "step-2"): fs.cat_file(p) for p in moved
    } == (damaged)
    assert checkpoint.find_latest_step(run, verified=True) == f"{run}/step-1"


def test_a_lease_of_a_process_gone_from_this_host_or_a_dead_claim_is_taken_over(
    bucket, caplog
):
    """torchrun restarting a job whose rank 0 was killed (its lease still runs),
    and a job that died while taking over an expired lease (its claim left)."""
    fs, root = bucket
    run = f"{root}/restarted"
    dead = subprocess.Popen(["true"])  # a process, ended
    dead.wait()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    here = {"host": socket.gethostname(), "boot": boot, "pid": dead.pid}
    record = {**here, "start": 1.0, "since": "then", "token": "abc"}
    lease = {"expires": time.time() + 600, "lease_seconds": 60}
    fs.pipe_file(f"{run[5:]}/{OWNER_FILE}", json.dumps({**record, **lease}).encode())
    with caplog.at_level("WARNING", logger="pippy.checkpoint.owner"):
        with checkpoint.job.FolderOwner(run):
            pass
    assert "from a job whose process ran on this host and is gone" in caplog.text
    # A pid of another PID namespace (another container on this host): cannot tell.
    contained = {**record, **lease, "pidns": "pid:[1]"}
    fs.pipe_file(f"{run[5:]}/{OWNER_FILE}", json.dumps(contained).encode())
    with pytest.raises(checkpoint.CheckpointDirInUseError, match="in use by another"):
        checkpoint.job.FolderOwner(run).acquire()
    # An expired lease, and a claim on it by a job that died meanwhile.
    other = {**record, "host": "node7", "pid": 4242}
    expired = {"expires": time.time() - 1, "lease_seconds": 60}
    fs.pipe_file(f"{run[5:]}/{OWNER_FILE}", json.dumps({**other, **expired}).encode())
    claim = f"{run[5:]}/{OWNER_FILE}.takeover-abc"
    fs.pipe_file(claim, json.dumps({**other, **expired, "token": "def"}).encode())
    with checkpoint.job.FolderOwner(run):
        pass
    # A claim whose lease still runs: refused, naming it.
    fs.pipe_file(f"{run[5:]}/{OWNER_FILE}", json.dumps({**other, **expired}).encode())
    fs.pipe_file(claim, json.dumps({**other, **lease, "token": "def"}).encode())
    with pytest.raises(
        checkpoint.CheckpointDirInUseError, match="another job is taking"
    ):
        checkpoint.job.FolderOwner(run).acquire()


def test_a_damaged_object_is_refused_and_nothing_is_lost(bucket, four_steps):
    fs, root = bucket
    run = f"{root}/damaged"
    copy_run(fs, four_steps, run)  # the run saved step-2 and step-4
    path = f"{run[5:]}/step-4/__1_0.distcp"  # of the newest step
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    before = {p: fs.cat_file(p) for p in fs.find(run[5:])}
    refused = example(run, "--steps", "6", ok=False)
    assert "is damaged: its bytes do not match their checksum" in refused.stdout
    assert {p: fs.cat_file(p) for p in fs.find(run[5:])} == before


def test_a_large_tensor_is_read_from_the_bucket_into_its_storage_and_checked(bucket):
    # A tensor item of 1 MiB or more is read by torch.load through s3fs's file,
    # straight into a new tensor, and checked before it is copied in.
    import torch

    fs, root = bucket
    torch.manual_seed(0)
    big = checkpoint.StageState(torch.nn.Linear(1024, 512, bias=False), step=1)
    step = checkpoint.save_stage(big, f"{root}/large")
    fresh = checkpoint.StageState(torch.nn.Linear(1024, 512, bias=False))
    checkpoint.load_stage(fresh, step)
    assert torch.equal(fresh.module.weight, big.module.weight)
    path = f"{step[5:]}/__0_0.distcp"
    data = bytearray(fs.cat_file(path))
    at = bytes(data).index(big.module.weight.detach().numpy().tobytes())
    data[at + 1000] ^= 0x01
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    with pytest.raises(checkpoint.CheckpointError, match="'model.weight' .* damaged"):
        checkpoint.load_stage(fresh, step)
