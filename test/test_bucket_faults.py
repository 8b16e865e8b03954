"""Faults in a bucket: a job killed mid-save, a stop signal, a stalled owner.

Real jobs (the example on 2 ranks under torchrun) write a real S3 server
(SeaweedFS on 127.0.0.1, reached by s3fs through the standard AWS settings);
the test watches the bucket with s3fs and acts on the jobs with signals:
SIGKILL mid-save, SIGTERM with background saves, SIGSTOP for longer than the
lease. What was saved is read back with plain DCP (FsspecReader) in another
process and compared bit for bit with an uninterrupted run's steps.
"""

import json
import os
import re
import signal
import socket
import time

import pytest

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.owner import LEASE_ENV
from pippy.checkpoint.steps import is_complete
from pippy.checkpoint.storage import storage_for

import helpers
from helpers import Job, PlainReader, loss_lines

#: Stages of 2 layers and 1 (~19 and ~10 MB): rank 1 is done writing well
#: before rank 0, and a save can be caught between the two. Steps stay quick.
MEDIUM = ["--n-layers", "3", "--dim", "256", "--seq-len", "32"]
#: Every run here trains these 8 steps (the LR schedule depends on --steps).
STEPS = ["--steps", "8"]


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    yield from helpers.s3_bucket(s3_endpoint)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on a local disk, saved at every step: its losses
    by step, and the folder of each step."""
    folder = tmp_path_factory.mktemp("reference")
    run = helpers.example(
        2, *MEDIUM, *STEPS, "--save-every", "1", "--checkpoint-dir", folder
    )
    losses = by_step(run.stdout)
    assert sorted(losses) == list(range(1, 9))
    return losses, lambda n: folder / f"step-{n}"


def by_step(out):
    """{step: "step N | loss X | lr Y"}; a step printed twice must agree."""
    found = {}
    for line in loss_lines(out):
        n = int(line.split()[1])
        assert found.setdefault(n, line) == line, (found[n], line)
    return found


def objects(fs, key):
    """Every object under a folder of the bucket: {path: bytes}."""
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in fs.find(key)}


def listed(fs, pattern):
    """The bucket's objects matching a glob, listed afresh (s3fs caches lists)."""
    fs.invalidate_cache()
    return fs.glob(pattern)


def committed(fs, key, step):
    """Whether step-<step>'s commit record (its manifest) is in the bucket."""
    fs.invalidate_cache()
    return fs.exists(f"{key}/step-{step}/manifest.json")


@pytest.fixture(scope="module")
def plain(bucket, tmp_path_factory):
    """The other process that reads steps with plain DCP, for the module."""
    reader = PlainReader(tmp_path_factory.mktemp("plain"))
    yield reader
    reader.close()


def assert_same(pairs, plain):
    """Each (step, reference step), read by plain DCP in another process, agree
    bit for bit."""
    read = plain.read([s for pair in pairs for s in pair])
    for (step, _), got, expected in zip(pairs, read[::2], read[1::2], strict=True):
        assert offline.diff_state_dicts(got, expected) == [], step


def wait_for_lease_to_expire(fs, key):
    """Sleeps until the owner record's lease is over (a killed job's stays)."""
    record = json.loads(fs.cat_file(f"{key}/.owner.json"))
    time.sleep(max(0.0, record["expires"] - time.time() + 0.5))


def catch_mid_save(job, fs, key, steps):
    """Freezes the job (SIGSTOP) as soon as a data object of one of `steps`
    is in the bucket; returns that step, whose commit record is not there.
    Requests already sent land first; a save that committed before the
    freeze is let go, and the next one tried."""
    for step in steps:
        job.wait_for(lambda s=step: listed(fs, f"{key}/step-{s}/__*_0.distcp"), 120)
        job.signal(signal.SIGSTOP)
        assert job.proc.poll() is None, job.out
        time.sleep(0.5)  # what was on the wire reaches the server
        if not committed(fs, key, step):
            return step
        job.signal(signal.SIGCONT)
    pytest.fail(f"every save of {steps} committed before it could be caught")


def keep_last_2(complete, saves):
    """The steps --keep-last 2 removes as `saves` are published after the
    `complete` ones, by publication: what retention over committed steps does."""
    removed = []
    for step in saves:
        complete = [*complete, step]
        if len(complete) > 2:
            removed.append(complete[:-2])
            complete = complete[-2:]
    return removed


def test_a_job_killed_mid_save_in_a_bucket_resumes_from_the_last_good_step(
    bucket, reference, plain
):
    """SIGKILL of the whole job while step N is written: N is never taken,
    loaded or counted by --keep-last; N-1 reads back bitwise with plain DCP;
    the restart takes the dead job's lease over at once (its processes are
    gone from this host) and ends bitwise equal."""
    fs, root = bucket
    losses, saved = reference
    run, key = f"{root}/killed", "pippy-test/killed"
    flags = [*MEDIUM, *STEPS, "--checkpoint-dir", run, "--keep-last", "2"]
    job = Job(*flags, "--save-every", "1", env={LEASE_ENV: "2"})
    try:
        step = catch_mid_save(job, fs, key, steps=(3, 4, 6, 7))
        job.signal(signal.SIGKILL)  # frozen: killed as seen
    finally:
        job.kill()
    first, good = job.out, step - 1
    names = {p.rsplit("/", 1)[1] for p in fs.ls(f"{key}/step-{step}", refresh=True)}
    assert "manifest.json" not in names and any(n.endswith(".distcp") for n in names)
    assert not is_complete(storage_for(run), f"{run}/step-{step}")
    assert checkpoint.find_latest_step(run) == f"{run}/step-{good}"
    with pytest.raises(checkpoint.CheckpointNotFoundError):
        offline.read_checkpoint(f"{run}/step-{step}")
    assert_same([(f"{run}/step-{good}", saved(good))], plain)
    assert all(by_step(first)[n] == losses[n] for n in by_step(first))
    before = [n for n in range(1, 9) if committed(fs, key, n)]
    assert before == [good - 1, good]

    # The restart saves at 5 (if after N-1) and 8, keeping 2: were step N
    # counted, one more good step would go at each save. On this host, it
    # sees the dead job's processes gone: it need not wait for their lease.
    again = helpers.example(2, *flags, "--save-every", "5")
    assert (
        f"[rank 0] taking over {run} from a job whose process ran on this host "
        "and is gone" in again.stdout
    )
    assert f"resuming from {run}/step-{good}" in again.stdout
    removed = re.findall(
        r"\[rank 0\] removed (step-.*) \(keeping the newest 2\)", again.stdout
    )
    saves = [n for n in (5, 8) if n > good]
    expected = keep_last_2(before, saves)
    assert removed == [", ".join(f"step-{n}" for n in r) for r in expected]
    assert f"verified: {run}/step-8 loaded into fresh stages" in again.stdout
    assert by_step(again.stdout) == {n: losses[n] for n in range(step, 9)}
    assert_same([(f"{run}/step-8", saved(8))], plain)
    # Nothing looks complete that is not: the dead save is still uncommitted,
    # and without a .metadata plain DCP cannot take it for a step either.
    kept = [*before, *saves][-2:]
    folders = {p.split("/")[2] for p in objects(fs, key)}  # objects, not prefixes
    assert folders == {f"step-{n}" for n in [*kept, step]}
    assert not fs.exists(f"{key}/step-{step}/.metadata")
    assert checkpoint.find_latest_step(run) == f"{run}/step-8"


def test_async_saves_and_a_sigterm_end_with_loadable_steps_in_a_bucket(
    bucket, reference, plain
):
    """--async-save publishes step-3 from the background (its commit record
    written last); a SIGTERM to torchrun at step 4 waits for any save in
    flight, then saves the step it stopped at: both read back bitwise."""
    fs, root = bucket
    losses, saved = reference
    run, key = f"{root}/async", "pippy-test/async"
    job = Job(
        *MEDIUM, *STEPS, "--save-every", "3", "--async-save", "--checkpoint-dir", run
    )
    try:
        job.wait_for(job.printed("step   4 |"))
        os.kill(job.proc.pid, signal.SIGTERM)  # a scheduler's preemption
        _, out = job.finish()  # torchrun itself exits 1 on a SIGTERM
    finally:
        job.kill()
    [line] = [x for x in out.splitlines() if x.startswith("stopping after")]
    match = re.fullmatch(
        r"stopping after step (\d): SIGTERM received by ranks 0, 1, "
        r"step-(\d) saved in \d+\.\d\d s",
        line,
    )
    assert match and match[1] == match[2], line
    stop = int(match[1])  # 4 or 5: not due, so saved at once (sync); a slow
    assert 4 <= stop < 8, line  # torchrun may pass it on at 6 (async, waited for)
    assert "[rank 0] published step-3, saved in the background in " in out
    assert f"not verifying {run}/step-{stop}: stopped by a signal" in out
    steps = sorted({n for n in (3, 6) if n <= stop} | {stop})
    assert [n for n in range(1, 9) if committed(fs, key, n)] == steps
    assert by_step(out) == {n: losses[n] for n in range(1, stop + 1)}
    assert_same([(f"{run}/step-{n}", saved(n)) for n in steps], plain)


def test_a_stalled_owner_that_lost_its_lease_writes_nothing_more(
    bucket, reference, plain
):
    """Job A (a 2 s lease) is frozen with SIGSTOP; job B takes the folder
    over, saves step-3 and is frozen in turn; A wakes, and its next save is
    refused on every rank, naming B. B's objects stay as they were, and B
    trains on to a step bitwise equal to an uninterrupted run's."""
    fs, root = bucket
    losses, saved = reference
    run, key = f"{root}/stalled", "pippy-test/stalled"
    # Were A not stopped, its save of step-4 would delete B's step-3.
    a_flags = ["--save-every", "2", "--keep-last", "1", "--checkpoint-dir", run]
    a = Job(*MEDIUM, *STEPS, *a_flags, env={LEASE_ENV: "2"})
    b = None
    try:
        saved_2 = [f"[rank {r}] stage {r}: saved " for r in (0, 1)]
        a.wait_for(lambda: all(x in a.out and "to step-2 in" in a.out for x in saved_2))
        a.signal(signal.SIGSTOP)  # a paused VM, a stopped process, mid-training
        wait_for_lease_to_expire(fs, key)
        b = Job(*MEDIUM, *STEPS, "--save-every", "3", "--checkpoint-dir", run)
        b.wait_for(lambda: committed(fs, key, 3))
        b_pid = b.worker(0)
        b.signal(signal.SIGSTOP)  # B holds the folder, frozen
        before = objects(fs, key)
        a.signal(signal.SIGCONT)
        code, out = a.finish()
        assert objects(fs, key) == before  # nothing of B's touched by A
        b.signal(signal.SIGCONT)
        b_code, b_out = b.finish()
    finally:
        a.kill()
        if b is not None:
            b.kill()
    assert code == 1, out
    for rank in (0, 1):
        [error] = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] error")]
        assert re.fullmatch(
            rf"\[rank {rank}\] error: this job lost {run}: another job took it "
            rf"over \(host '[^']+', pid {b_pid}, started [^)]+\) after this job's "
            r"lease expired at \S+ \(not renewed for 2 s: this job stalled\), so "
            r"this job writes nothing more there\. Stop this job; the other job's "
            r"steps are untouched: resume from them once it has ended "
            r"\(--checkpoint-dir\)",
            error,
        ), error
    assert "to step-4" not in out  # A saved step-2 only
    assert out.count("this job lost") == 2  # once per rank, nothing logged twice
    assert b_code == 0, b_out
    assert f"taking over {run} from a job whose lease expired at" in b_out
    assert f"resuming from {run}/step-2" in b_out
    assert f"verified: {run}/step-8 loaded into fresh stages" in b_out
    assert by_step(b_out) == {n: losses[n] for n in range(3, 9)}
    assert_same([(f"{run}/step-8", saved(8))], plain)
    assert [committed(fs, key, n) for n in range(1, 9)] == [
        n in (2, 3, 6, 8) for n in range(1, 9)
    ]
    assert not fs.exists(f"{key}/.owner.json")  # B released it; A did not touch


def test_a_stalled_owner_commits_no_background_save_after_losing_its_lease(
    bucket, tmp_path, caplog
):
    """Job A (--async-save, a 2 s lease) is frozen while a background save
    is being written; this process takes the folder over and saves a step;
    A wakes, writes out what it had in flight, and its commit is refused:
    that step never becomes complete, and nothing of the new owner's moves."""
    fs, root = bucket
    run, key = f"{root}/stalled-async", "pippy-test/stalled-async"
    a_flags = ["--save-every", "2", "--async-save", "--checkpoint-dir", run]
    a = Job(*MEDIUM, *STEPS, *a_flags, env={LEASE_ENV: "2"})
    try:
        step = catch_mid_save(a, fs, key, steps=(4, 6))
        wait_for_lease_to_expire(fs, key)
        with checkpoint.job.FolderOwner(run) as owner:  # another job: takes it over
            state = helpers.linear_state()
            state.step = 100
            checkpoint.save_stage(state, run, owner=owner)
            before = objects(fs, key)
            a.signal(signal.SIGCONT)
            code, out = a.finish()
            after = objects(fs, key)
    finally:
        a.kill()
    assert f"taking over {run} from a job whose lease expired at" in caplog.text
    assert code == 1, out
    for rank in (0, 1):
        [error] = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] error")]
        assert error.startswith(
            f"[rank {rank}] error: this job lost {run}: another job took it over "
            f"(host '{socket.gethostname()}', pid {os.getpid()}, started "
        ), error
    # What A had on the wire, or sent after the lease check it passed before
    # the freeze, may land (a PUT cannot be fenced): data and .metadata, in its
    # own uncommitted folder only; its commit record is checked for again and
    # refused. The rest is as the new owner left it.
    landed = {p for p in after.keys() - before.keys()}
    assert {p.rsplit("/", 1)[0] for p in landed} <= {f"{key}/step-{step}"}
    assert all(p.endswith((".distcp", "/.metadata")) for p in landed), landed
    assert {p: v for p, v in after.items() if p in before} == before
    assert not committed(fs, key, step)
    assert checkpoint.find_latest_step(run) == f"{run}/step-100"


def test_each_write_of_a_job_that_lost_its_lease_is_refused(bucket):
    """In one process, each guard alone: the record is replaced by another
    job's (what a takeover leaves) before a save, during one (as its data is
    written, and once its .metadata is), and between its commit and its
    retention. Each is
    refused with the same line naming that job; its steps stay."""
    import torch.distributed.checkpoint as dcp

    from pippy.checkpoint.save import publish_step, take_state

    fs, root = bucket
    run, key = f"{root}/guards", "pippy-test/guards"
    theirs = {"host": "node9", "pid": 99, "since": "then", "token": "theirs"}
    theirs = json.dumps({**theirs, "expires": time.time() + 600}).encode()
    named = "another job took it over (host 'node9', pid 99, started then)"
    state = helpers.linear_state()

    def take_over():  # the other job's record replaces ours
        fs.pipe_file(f"{key}/.owner.json", theirs)

    def save(step, *, during=None, metadata=None, committed=None, keep_last=None):
        state.step = step
        state_dict, _, planner = take_state(state)
        with publish_step(run, step, keep_last=keep_last, owner=owner) as writer:
            if during is not None:  # once staged in DCP's planning, as data is written
                write = writer.write_data
                writer.write_data = lambda *args: (during(), write(*args))[1]
            if metadata is not None:  # once .metadata is written, before the commit
                check = writer.before_commit
                writer.before_commit = lambda: (metadata(), check())[1]
            if committed is not None:  # once the commit record is written
                publish = writer.publish  # then retention, inside dcp.save
                writer.publish = lambda: (committed(), publish())
            dcp.save(state_dict, storage_writer=writer, planner=planner)

    # Before a save: refused before anything is written.
    with checkpoint.job.FolderOwner(run, lease_seconds=600) as owner:
        save(1)
        take_over()
        with pytest.raises(checkpoint.CheckpointDirInUseError) as e:
            save(2)
        assert re.fullmatch(
            rf"this job lost {run}: {re.escape(named)}, though this job's lease "
            r"ran until \S+, so this job writes nothing more there\. Stop this "
            r"job; the other job's steps are untouched: resume from them once it "
            r"has ended",
            str(e.value),
        ), str(e.value)
    assert not fs.exists(f"{key}/step-2")
    # During a save: its data is written, its commit record is not.
    fs.rm(key, recursive=True)
    with checkpoint.job.FolderOwner(run, lease_seconds=600) as owner:
        with pytest.raises(checkpoint.CheckpointDirInUseError, match=re.escape(named)):
            save(3, during=take_over)
    assert fs.exists(f"{key}/step-3/__0_0.distcp")  # not removed: a store's
    assert not fs.exists(f"{key}/step-3/.metadata")  # step is written in place
    assert not fs.exists(f"{key}/step-3/manifest.json")
    # After .metadata (the lease checked at the start of the commit): its
    # commit record is not written.
    fs.rm(key, recursive=True)
    with checkpoint.job.FolderOwner(run, lease_seconds=600) as owner:
        with pytest.raises(checkpoint.CheckpointDirInUseError, match=re.escape(named)):
            save(6, metadata=take_over)
    assert fs.exists(f"{key}/step-6/.metadata")
    assert not fs.exists(f"{key}/step-6/manifest.json")
    # After its commit: retention (--keep-last 1) deletes nothing.
    fs.rm(key, recursive=True)
    with checkpoint.job.FolderOwner(run, lease_seconds=600) as owner:
        save(4)
        with pytest.raises(checkpoint.CheckpointDirInUseError, match=re.escape(named)):
            save(5, committed=take_over, keep_last=1)
    assert committed(fs, key, 4) and committed(fs, key, 5)
    assert fs.cat_file(f"{key}/.owner.json") == theirs  # left to its owner


def test_a_lease_that_is_no_number_of_seconds_is_refused_in_one_line(
    bucket, monkeypatch
):
    """PIPPY_LEASE_SECONDS (what the tests above shorten) is read once, at
    FolderOwner's acquire; a bad value is one line naming it, nothing written."""
    fs, root = bucket
    run = f"{root}/bad-lease"
    for text in ("soon", "0", "-5", "nan", "inf", "1e300"):
        monkeypatch.setenv(LEASE_ENV, text)
        with pytest.raises(ValueError) as e:
            checkpoint.job.FolderOwner(run).acquire()
        assert str(e.value) == (
            f"PIPPY_LEASE_SECONDS={text!r} is not a lease: give a number of "
            "seconds above 0 and at most 365 days, or leave it unset for the "
            "default of 60"
        )
    monkeypatch.delenv(LEASE_ENV)
    with pytest.raises(ValueError, match="^lease_seconds=0 is not a lease"):
        checkpoint.job.FolderOwner(run, lease_seconds=0).acquire()
    assert not fs.exists("pippy-test/bad-lease")
