"""A rank that stalls in a save or a load, on 3 ranks (threads over real gloo, test/ranks.py).

Rank 1 is put to sleep (test/stall_checks.py): mid-write, mid-read, or before
the save starts. The others log, every PIPPY_WAIT_LOG_SECONDS (1 s here),
which rank is not there and how far it is (stall_checks.py sets it); with a timeout, every rank ends
with the same CheckpointTimeout naming rank 1, long before gloo's own timeout
(30 minutes) and before rank 1 wakes, and nothing is published.
"""

import json
from datetime import timedelta

import pytest
import stall_checks
from ranks import run_checks

from pippy import checkpoint
from pippy.checkpoint import collectives

import helpers

ALL = "store,save_logs,save_timeout,start_timeout,load_logs,load_timeout,example"
FIX = "find what holds them (a slow disk, a hung process), or raise the timeout"
SKIPPED = (  # a rank not started at all
    "find what holds them (a slow disk, a hung process, code that skips the call "
    "on them), or raise the timeout"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every check's result, by check and rank, from one run of 3 ranks."""
    out = tmp_path_factory.mktemp("stall")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PIPPY_WAIT_LOG_SECONDS", stall_checks.LOG_SECONDS)
        out = run_checks(3, {"stall_checks": ALL.split(",")}, out, timeout=120)
    out = out["stall_checks"]
    found = {}
    for name in ALL.split(","):
        found[name] = [
            json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(3)
        ]
    return out, found


def logged(ranks):
    """The lines logged, by the one rank that logs: one of those waiting."""
    logging = [r for r, result in enumerate(ranks) if result["lines"]]
    assert len(logging) == 1 and logging[0] != 1
    return ranks[logging[0]]["lines"]


def test_the_store_is_untouched_while_nobody_is_late_and_the_callers_group_always(
    results,
):
    _, found = results
    for rank in found["store"]:
        assert rank == {
            "is_store": True,
            "seen": ["0", "1", "2"],
            "store_ops": 0,  # nobody late: no store traffic at all
            "timeout_back": True,
            # NCCL's watchdog would stop the process: pippy's collectives, and
            # DCP's in save_stage, run on a gloo group of pippy's own
            "caller_untouched": True,
            "set_on_ours_only": True,
            "collectives_on_ours": True,
        }


def test_a_rank_slow_to_write_is_logged_every_interval_with_its_progress(results):
    _, found = results
    lines = logged(found["save_logs"])
    late = (
        "saving step-1: rank 1 not at write after {} s (rank 1: wrote 3 of 5 "
        "items, 0.5 of 1.0 MB); ranks 0, 2 waiting"
    )
    assert [text for _, text in lines] == [late.format(1), late.format(2)]
    # Within the interval of 1 s, and again one interval later.
    assert 1.0 <= lines[0][0] < 1.9 and 2.0 <= lines[1][0] < 2.9
    # The save goes on.
    assert all(r["steps"] == [1] for r in found["save_logs"])


def test_a_rank_slow_to_read_is_logged_with_its_progress(results):
    out, found = results
    lines = logged(found["load_logs"])
    path = out / "ckpt" / "step-1"
    late = (
        f"loading {path}: rank 1 not at read after {{}} s (rank 1: read 2 of 5 "
        "items, 0.5 of 1.1 MB); ranks 0, 2 waiting"
    )
    assert [text for _, text in lines] == [late.format(1), late.format(2)]
    assert 1.0 <= lines[0][0] < 1.9
    assert all(r["loaded"] for r in found["load_logs"])


def test_a_save_times_out_on_every_rank_naming_the_stalled_one(results):
    _, found = results
    error = [
        "CheckpointTimeout",
        "saving step-2 timed out: rank 1 did not arrive at write within 1 s "
        "(rank 1: wrote 3 of 5 items, 0.5 of 1.0 MB). The step is not "
        f"published; {FIX}",
    ]
    for rank in found["save_timeout"]:
        assert rank["error"] == error
        assert rank["folder"] == ["step-1"]  # no step-2, no staging folder left
        assert rank["step1_untouched"]
    # The others stop at the deadline (the first rank there keeps it: the
    # others may have come a little later), plus at most 1 s for DCP's
    # collective that follows, before rank 1 even wakes (3.5 s in); rank 1
    # raises too.
    for rank in (0, 2):
        assert 0.9 <= found["save_timeout"][rank]["seconds"] < 3.3
    assert found["save_timeout"][1]["seconds"] >= 3.5


def test_a_rank_late_to_start_a_save_is_named_and_raises_too(results):
    _, found = results
    error = [
        "CheckpointTimeout",
        "saving step-3 timed out: rank 1 did not arrive at start within 1 s "
        f"(rank 1: not started). The step is not published; {SKIPPED}",
    ]
    for rank in found["start_timeout"]:
        assert rank["error"] == error
        assert rank["steps"] == [1]  # no step-3
    for rank in (0, 2):
        assert 0.9 <= found["start_timeout"][rank]["seconds"] < 2.0


def test_a_load_times_out_on_every_rank_naming_the_stalled_one(results):
    out, found = results
    error = [
        "CheckpointTimeout",
        f"loading {out / 'ckpt' / 'step-1'} timed out: rank 1 did not arrive at "
        "read within 1 s (rank 1: read 2 of 5 items, 0.5 of 1.1 MB). The stage "
        f"is not loaded; {FIX}",
    ]
    for rank in found["load_timeout"]:
        assert rank["error"] == error
    for rank in (0, 2):
        assert 0.9 <= found["load_timeout"][rank]["seconds"] < 3.3
    assert found["load_timeout"][1]["seconds"] >= 3.5


def test_the_examples_flag_bounds_its_save(results):
    _, found = results
    for rank in found["example"]:
        assert rank["save"]["error"] == [
            "CheckpointTimeout",
            "saving step-1 timed out: rank 1 did not arrive at start within 1 s "
            f"(rank 1: not started). The step is not published; {SKIPPED}",
        ]
        assert rank["steps"] == [0]
    for rank in (0, 2):
        assert found["example"][rank]["save"]["seconds"] < 2.0


BAD_TIMEOUTS = [0, -1, float("nan"), "30", True, timedelta(0), float("inf"), 10**20]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_a_timeout_that_is_not_a_positive_number_is_refused(bad):
    """Also one past what a process group's timeout holds (OverflowError there)."""
    with pytest.raises(ValueError) as e:
        checkpoint.save_stage(helpers.linear_state(), "unused", step=1, timeout=bad)
    assert str(e.value) == (
        "timeout must be a positive number of seconds or a timedelta, of at most "
        f"365 days, not {bad!r}; None waits without a deadline"
    )


def test_timeouts_in_seconds_or_as_a_timedelta():
    assert collectives.seconds(None) is None
    assert collectives.seconds(timedelta(minutes=2)) == 120.0
    assert collectives.seconds(2) == 2.0


@pytest.mark.parametrize("text", ["0", "soon", "-3"])
def test_a_bad_log_interval_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(collectives.LOG_ENV, text)
    with pytest.raises(ValueError) as e:
        collectives.log_every()
    assert str(e.value) == (
        f"PIPPY_WAIT_LOG_SECONDS={text!r}: set it to a positive number of seconds"
    )


def test_the_log_interval_defaults_to_30_seconds(monkeypatch):
    monkeypatch.delenv(collectives.LOG_ENV, raising=False)
    assert collectives.log_every() == 30.0
    monkeypatch.setenv(collectives.LOG_ENV, "2.5")
    assert collectives.log_every() == 2.5
