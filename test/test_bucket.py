"""Checkpoints in a bucket: the example against a real S3 server (SeaweedFS).

The server runs on 127.0.0.1 for this module; s3fs reaches it through the
standard AWS settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), as it would
reach a real bucket. A step there is written in place and committed by its
manifest.json, written last in one PUT; the owner record is a conditional
write held with a lease.
"""

import json
import time

import pytest

from pippy import checkpoint
from pippy.cli import main

import helpers
from helpers import EXAMPLE, TINY_FLAGS, loss_lines, torchrun

FLAGS = [*TINY_FLAGS, "--save-every", "2", "--keep-last", "2"]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    yield from helpers.s3_bucket(tmp_path_factory)


def example(run, *flags, ok=True):
    return torchrun(2, EXAMPLE, *FLAGS, *flags, "--checkpoint-dir", run, expect_ok=ok)


def test_the_example_trains_saves_and_resumes_in_a_bucket(bucket, tmp_path, capsys):
    fs, root = bucket
    run = f"{root}/resume"
    example(run, "--steps", "6", "--stop-after", "4")  # as if interrupted at 4
    assert sorted(fs.ls(run[5:], detail=False)) == [
        f"{run[5:]}/step-2",
        f"{run[5:]}/step-4",
    ]
    second = example(run, "--steps", "6")
    assert f"resuming from {run}/step-4" in second.stdout
    assert f"verified: {run}/step-6 loaded into fresh stages" in second.stdout
    assert "[rank 0] removed step-2 (keeping the newest 2)" in second.stdout
    straight = example(tmp_path / "local", "--steps", "6")
    assert loss_lines(second.stdout) == loss_lines(straight.stdout)[4:]
    ours = checkpoint.read_checkpoint(f"{run}/step-6")
    assert (
        checkpoint.diff_state_dicts(
            ours, checkpoint.read_checkpoint(tmp_path / "local" / "step-6")
        )
        == []
    )
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
    assert checkpoint.diff_state_dicts(checkpoint.read_checkpoint(back), ours) == []
    # load_model: the un-split model from the bucket, in this process
    model = helpers.tiny_gpt()
    checkpoint.load_model(f"{run}/step-6", model)
    weights = {k[len("model.") :]: v for k, v in ours.items() if k.startswith("model.")}
    assert checkpoint.diff_state_dicts(model.state_dict(), weights) == []
    # --init-from a step in the bucket: a new run starts from its weights
    started = example(tmp_path / "init", "--steps", "2", "--init-from", f"{run}/step-6")
    assert f"starting from the weights of {run}/step-6" in started.stdout


def test_a_step_without_its_commit_record_is_never_taken(bucket):
    fs, root = bucket
    run = f"{root}/uncommitted"
    example(run, "--steps", "4")
    # A save killed before its last PUT: the data and .metadata are there,
    # its manifest.json (the commit record) is not.
    fs.rm(f"{run[5:]}/step-4/manifest.json")
    assert checkpoint.find_latest_step(run) == f"{run}/step-2"
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


def test_a_damaged_object_is_refused_and_nothing_is_lost(bucket):
    fs, root = bucket
    run = f"{root}/damaged"
    example(run, "--steps", "2")
    path = f"{run[5:]}/step-2/__1_0.distcp"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    before = {p: fs.cat_file(p) for p in fs.find(run[5:])}
    refused = example(run, "--steps", "4", ok=False)
    assert "is damaged: its bytes do not match their checksum" in refused.stdout
    assert {p: fs.cat_file(p) for p in fs.find(run[5:])} == before
