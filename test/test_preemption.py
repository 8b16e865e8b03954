"""Preemption, restarts and damage on a real cluster, with real ranks under torchrun.

A signal that reaches one rank only, the launcher's deadline after a stop
signal, SIGUSR1 (Slurm's early warning), torchrun restarting every worker
after one was killed (mid-run and mid-save), and a damaged newest step in a
restart loop. Every run ends compared with an uninterrupted one: the same
losses, and the same tensors in the last step, bit for bit.
"""

import logging
import os
import re
import shutil
import signal

import pytest

from pippy import checkpoint
from pippy.checkpoint import offline
from pippy.checkpoint.job import Deadline, check_restarts, launcher_deadline
from pippy.checkpoint.steps import list_steps
from pippy.checkpoint.storage import LocalStorage

import helpers
from helpers import (
    TINY_FLAGS,
    Job,
    example,
    linear_state,
    loss_lines,
)

#: An uninterrupted run's flags: 30 steps, saved at 10, 20, 30.
STEPS = ["--steps", "30", "--save-every", "10"]
#: ~40 MB a stage: a save that takes long enough to be caught in the middle.
BIG = ["--n-layers", "4", "--dim", "512", "--seq-len", "32"]
#: Each attempt of a torchrun restart gets a store of its own (see check_restarts).
OWN_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def losses_by_step(out):
    """{step: "step N | loss X | lr Y"}; a step printed twice must agree."""
    found = {}
    for line in loss_lines(out):
        step = int(line.split()[1])
        assert found.setdefault(step, line) == line, (found[step], line)
    return found


def assert_same_tensors(folder, reference):
    mine, theirs = (
        offline.read_checkpoint(folder),
        offline.read_checkpoint(reference),
    )
    assert offline.diff_state_dicts(mine, theirs) == []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """An uninterrupted run of STEPS: its losses by step, and its folder."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    run = example(2, *TINY_FLAGS, *STEPS, "--checkpoint-dir", folder)
    losses = losses_by_step(run.stdout)
    assert sorted(losses) == list(range(1, 31))
    return losses, folder


# --------------------------------------------------------------------------
# A stop signal on one rank; SIGUSR1; the launcher's deadline
# --------------------------------------------------------------------------


@pytest.mark.launches
def test_a_sigterm_to_one_rank_stops_every_rank_at_one_saved_step(
    tmp_path, uninterrupted
):
    """One node preempted: the signal reaches rank 1 only, and every rank saves."""
    reference, ref_folder = uninterrupted
    flags = [*TINY_FLAGS, "--steps", "30", "--save-every", "1000"]
    job = Job(*flags, "--checkpoint-dir", tmp_path)
    try:
        job.wait_for(job.printed("step   5 |"))
        os.kill(job.worker(1), signal.SIGTERM)  # one worker, not torchrun
        code, out = job.finish()
    finally:
        job.kill()
    assert code == 0, out  # torchrun exits 0 only if every worker did
    [line] = [x for x in out.splitlines() if x.startswith("stopping after")]
    match = re.fullmatch(
        r"stopping after step (\d+): SIGTERM received by rank 1, "
        r"step-(\d+) saved in \d+\.\d\d s",
        line,
    )
    assert match and match[1] == match[2], line
    step = int(match[1])
    assert 5 <= step < 30
    for rank in (0, 1):
        assert f"[rank {rank}] stage {rank}: saved" in out  # every rank saved it
    assert sorted(list_steps(LocalStorage(), tmp_path)) == [step]
    assert offline.read_checkpoint(tmp_path / f"step-{step}")["step"] == step

    resumed = example(2, *flags, "--checkpoint-dir", tmp_path)
    assert f"resuming from {tmp_path / f'step-{step}'}" in resumed.stdout
    both = {**losses_by_step(out), **losses_by_step(resumed.stdout)}
    assert both == reference  # steps 1..step, then step+1..30
    assert_same_tensors(tmp_path / "step-30", ref_folder / "step-30")


@pytest.mark.launches
def test_sigusr1_stops_too_and_the_launchers_deadline_is_said_and_checked(tmp_path):
    """Slurm's early warning is SIGUSR1; torchrun's --shutdown-timeout, given
    as PET_SHUTDOWN_TIMEOUT (which wins over TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    as in torchrun), is read from the workers' environment, shown, and a save
    longer than it is warned of, once."""
    job = Job(
        *TINY_FLAGS,
        "--steps",
        "1000",
        "--save-every",
        "2",
        "--checkpoint-dir",
        tmp_path,
        env={"PET_SHUTDOWN_TIMEOUT": "0", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"},
    )
    try:
        job.wait_for(job.printed("step   5 |"))
        os.kill(job.worker(0), signal.SIGUSR1)
        code, out = job.finish()
    finally:
        job.kill()
    assert code == 0, out
    deadline = "SIGTERM, SIGUSR1: a last save, then exit; "
    assert f"{deadline}PET_SHUTDOWN_TIMEOUT gives it 0 s\n" in out
    warnings = re.findall(r"a save took \d+\.\d s, longer than the 0 s", out)
    assert len(warnings) == 1, out  # once, though it saved every 2 steps
    assert re.search(r": SIGUSR1 received by rank 0, step-(\d+) saved in ", out)


def test_stop_signal_names_the_ranks_and_the_deadline_comes_from_torchrun(
    monkeypatch, caplog
):
    """In one process: what the job learns, without torchrun and with its env."""
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        stop = checkpoint.job.StopSignal((signal.SIGUSR1,))
        assert not stop.requested() and stop.reason == ""
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() and stop.reason == "SIGUSR1 received by rank 0"
    finally:
        signal.signal(signal.SIGUSR1, previous)
    stop._received_by = dict.fromkeys([0, 1, 2, 3, 6], signal.SIGTERM)
    stop._received_by[5] = signal.SIGUSR1
    assert stop.reason == (
        "SIGTERM received by ranks 0-3, 6, SIGUSR1 received by rank 5"
    )

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launcher_deadline() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    default = launcher_deadline()
    assert default == Deadline(30.0, "torchrun's default")
    assert not default.explicit
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert launcher_deadline() == Deadline(120.0, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "60")  # torchrun's flag, as a variable
    assert launcher_deadline() == Deadline(60.0, "PET_SHUTDOWN_TIMEOUT")
    assert launcher_deadline(90) == Deadline(90.0, "the caller")  # any launcher's
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert launcher_deadline(90) == Deadline(90.0, "the caller")

    stop.deadline = Deadline(1.0, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    with caplog.at_level(logging.WARNING, logger="pippy.checkpoint.job"):
        for seconds in (0.5, 2.0, 3.0):
            stop.check_save_time(seconds)
    assert len(caplog.records) == 1 and "a save took 2.0 s" in caplog.text

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="pippy.checkpoint.job"):
        assert check_restarts()
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    caplog.clear()
    previous = signal.getsignal(signal.SIGUSR1)
    try:  # a job that saves on a stop signal is told at once, by StopSignal
        with caplog.at_level(logging.WARNING, logger="pippy.checkpoint.job"):
            checkpoint.job.StopSignal((signal.SIGUSR1,))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert not check_restarts()


# --------------------------------------------------------------------------
# Restarts by the launcher
# --------------------------------------------------------------------------


#: The run a rank is killed in, while it saves step 4.
KILLED_MID_SAVE = [*BIG, "--steps", "4", "--save-every", "2"]


@pytest.fixture
def big_reference(tmp_path):
    """KILLED_MID_SAVE uninterrupted (a pool's ranks): its process; its steps
    in tmp_path/alone."""
    return example(2, *KILLED_MID_SAVE, "--checkpoint-dir", tmp_path / "alone")


@pytest.mark.launches
def test_torchrun_restarts_after_a_rank_killed_mid_save(tmp_path, big_reference):
    """--max-restarts 1: rank 0, the coordinator, is killed while step 4 is
    written. The new workers take the folder over from the dead job (its owner
    record stays behind), remove its staging folder, resume from step-2 and
    end bitwise equal to an uninterrupted run."""
    job = Job(
        *KILLED_MID_SAVE,
        "--checkpoint-dir",
        tmp_path / "restarted",
        torchrun_flags=["--max-restarts=1"],
        env=OWN_STORE,
    )
    try:
        staging = tmp_path / "restarted"
        job.wait_for(lambda: any(staging.glob(".step-4.partial-*")), timeout=180)
        os.kill(job.worker(0), signal.SIGKILL)
        code, out = job.finish(timeout=240)
    finally:
        job.kill()
    assert code == 0, out
    assert (
        f"[rank 0] taking over {tmp_path / 'restarted'} from a job that is gone" in out
    )
    assert "hang (pytorch/pytorch#135712)" not in out  # its own store: no warning
    assert re.search(r"removed \.step-4\.partial-\w+, left by that job", out), out
    assert f"resuming from {tmp_path / 'restarted' / 'step-2'}" in out
    assert sorted(p.name for p in (tmp_path / "restarted").iterdir()) == [
        "step-2",
        "step-4",
    ]
    assert losses_by_step(out) == losses_by_step(big_reference.stdout)
    assert_same_tensors(
        tmp_path / "restarted" / "step-4", tmp_path / "alone" / "step-4"
    )
    assert "verified:" in out


# --------------------------------------------------------------------------
# A damaged newest step in a restart loop
# --------------------------------------------------------------------------


@pytest.mark.launches
def test_a_damaged_newest_step_is_refused_and_with_skip_damaged_gone_past(
    tmp_path, uninterrupted
):
    reference, ref_folder = uninterrupted
    folder = tmp_path / "run"
    shutil.copytree(ref_folder, folder)
    data = folder / "step-30" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])  # a copy cut short
    flags = [*TINY_FLAGS, *STEPS, "--checkpoint-dir", folder]

    refused = example(2, *flags, expect_ok=False)
    assert refused.returncode != 0
    for rank in (0, 1):  # the default: every restart would fail alike
        assert (
            f"[rank {rank}] error: '{folder / 'step-30'}' is damaged" in refused.stdout
        )
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-20", "step-30"]

    run = example(2, *flags, "--skip-damaged")
    assert re.search(  # rank 0, which decided, says what it skipped, and why
        r"\[rank 0\] skipped step-30: moved aside to \.step-30\.damaged-\d+: "
        r"'.*step-30' is damaged: __1_0\.distcp has 1000 bytes",
        run.stdout,
    ), run.stdout
    assert f"resuming from {folder / 'step-20'}" in run.stdout
    assert losses_by_step(run.stdout) == {s: reference[s] for s in range(21, 31)}
    assert_same_tensors(folder / "step-30", ref_folder / "step-30")
    [aside] = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert aside.startswith(".step-30.damaged-")


def test_verified_latest_step_skips_damage_only_and_names_why(tmp_path, caplog):
    """In one process: damage is gone past (moved aside, logged); a step that
    no rank could trust, or that cannot be verified, still stops the job."""
    for step in (1, 2, 3):
        state = linear_state()
        state.step = step
        checkpoint.save_stage(state, tmp_path)
    data = tmp_path / "step-3" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    assert checkpoint.find_latest_step(tmp_path) == tmp_path / "step-3"  # default
    with caplog.at_level(logging.WARNING, logger="pippy.checkpoint.steps"):
        found = checkpoint.find_latest_step(tmp_path, verified=True)
    assert found == tmp_path / "step-2"
    assert re.search(
        r"skipped step-3: moved aside to \.step-3\.damaged-\d+: .* is damaged",
        caplog.text,
    )
    assert sorted(list_steps(LocalStorage(), tmp_path)) == [1, 2]

    helpers.poison_metadata(tmp_path / "step-2", tmp_path / "marker")
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="refused to load"):
        # not damage: never skipped for it
        checkpoint.find_latest_step(tmp_path, verified=True)
    assert (
        sorted(list_steps(LocalStorage(), tmp_path)) == [1, 2]
        and not (tmp_path / "marker").exists()
    )

    (tmp_path / "step-2" / "manifest.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="has no manifest.json"):
        checkpoint.find_latest_step(tmp_path, verified=True)
    shutil.rmtree(tmp_path / "step-2")
    data = tmp_path / "step-1" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match="no step of .* verifies"):
        checkpoint.find_latest_step(tmp_path, verified=True)
    assert sorted(list_steps(LocalStorage(), tmp_path)) == [
        1
    ]  # nothing moved when none verifies


# --------------------------------------------------------------------------
# Agreeing on a stop holds up no step
# --------------------------------------------------------------------------


def test_ranks_agree_on_a_stop_without_waiting_for_each_other_each_step(
    stop_launch,
):
    """Each call reads the agreement the previous call started: no rank waits
    for the others in the call that starts it (the old per-step all_reduce
    deadlocked here), and every rank stops at the same call (stop_checks.py,
    launched by conftest.py)."""
    out = stop_launch
    for rank in (0, 1):
        assert (out / f"rank-{rank}").read_text() == (
            "[False, False, True, True] SIGUSR1 received by rank 1"
        )
