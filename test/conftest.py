"""pytest setup: the example's folder on sys.path (`import gpt`, `import pippy_dcp`),
and the launches of ranks that tests of several modules share.

Starting ranks is what the suite spends most of its time on (every process
imports torch), so a launch whose output several modules read runs once per
session: the checks of test/*_checks.py on 2 and on 4 ranks, the
example's uninterrupted and stopped 4-rank runs, and a tiny 2-rank run. A
module run alone starts them as well, on first use.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))

from helpers import (  # noqa: E402
    EXAMPLE,
    FOUR_RANK_FLAGS,
    TINY_RUN_FLAGS,
    start_s3_server,
    torchrun,
    torchrun_together,
)

SHARED_CHECKS = Path(__file__).with_name("shared_checks.py")

#: The checks of test/*_checks.py that run on 2 ranks, by script, in one
#: launch (shared_checks.py): dist_checks.py's for test_stages (keys, train, ops),
#: test_failures (async, refusal), test_edges (twins, one_fails) and test_hf
#: (hf, where transformers is installed); seam_checks.py's for test_seam,
#: layout_checks.py's for test_parallel, test_cost.py's own (save),
#: fsdp_checks.py's for test_topology, and stop_checks.py's for test_preemption
#: (stop: the last, since it leaves a SIGUSR1 handler behind). Each script's
#: checks write into a folder of its own.
TWO_RANK_CHECKS = {
    "dist_checks": ["keys", "train", "async", "refusal", "twins", "one_fails", "ops"],
    "seam_checks": ["same", "async_checks", "async_staging"],
    "layout_checks": ["parts"],
    "test_cost": ["save"],
    "fsdp_checks": ["fsdp"],
}
if importlib.util.find_spec("transformers") is not None:
    TWO_RANK_CHECKS["dist_checks"].append("hf")
TWO_RANK_CHECKS["stop_checks"] = ["stop"]
#: ... and on 4 ranks: dist_checks.py's for test_stages (keys, train) and
#: test_topology (logits, memory), the operation counts (ops), layout_checks.py's for test_parallel.
#: memory runs first: it measures the peak RSS of building a stage against
#: the process's high-water mark, which a check before it could raise.
FOUR_RANK_CHECKS = {
    "dist_checks": ["memory", "keys", "train", "logits", "ops"],
    "layout_checks": ["mesh", "hsdp"],
}


def launch_checks(tmp_path_factory, nproc, checks, given=None):
    """One launch of `nproc` ranks running `checks`; {script: its folder}.
    `given`: {script: {name: a folder copied there first}}."""
    out = tmp_path_factory.mktemp(f"checks-{nproc}")
    for script, folders in (given or {}).items():
        for name, folder in folders.items():
            shutil.copytree(folder, out / script / name)
    names = [f"{script}.{check}" for script, names in checks.items() for check in names]
    torchrun(nproc, SHARED_CHECKS, ",".join(names), out, timeout=400)
    return {script: out / script for script in checks}


@pytest.fixture(scope="session")
def two_rank_checks(tmp_path_factory, four_rank_checks):
    """{script: the folder of its checks in TWO_RANK_CHECKS}: <check>-rank<R>.json
    and what the checks saved. Launched after FOUR_RANK_CHECKS: fsdp_checks.py
    loads the pipeline checkpoint their logits check saved."""
    pipeline = {"ckpt": four_rank_checks["dist_checks"] / "ckpt"}
    return launch_checks(
        tmp_path_factory, 2, TWO_RANK_CHECKS, given={"fsdp_checks": pipeline}
    )


@pytest.fixture(scope="session")
def four_rank_checks(tmp_path_factory):
    """{script: the folder of its checks in FOUR_RANK_CHECKS}, as above; the
    logits check's folder holds ckpt/step-2, stage-<R>.pt and logits.pt."""
    return launch_checks(tmp_path_factory, 4, FOUR_RANK_CHECKS)


@pytest.fixture(scope="session")
def four_rank_runs(tmp_path_factory):
    """The example on 4 ranks with FOUR_RANK_FLAGS, uninterrupted and stopped
    after step 3 (--stop-after 3), two independent launches at once:
    {"run": (folder, stdout), "stopped": (folder, stdout)}."""
    folders = {
        n: tmp_path_factory.mktemp(f"four-ranks-{n}") for n in ("run", "stopped")
    }
    run, stopped = torchrun_together(
        (4, EXAMPLE, *FOUR_RANK_FLAGS, "--checkpoint-dir", folders["run"]),
        (4, EXAMPLE, *FOUR_RANK_FLAGS, "--checkpoint-dir", folders["stopped"])
        + ("--stop-after", 3),
    )
    return {
        "run": (folders["run"], run.stdout),
        "stopped": (folders["stopped"], stopped.stdout),
    }


@pytest.fixture(scope="session")
def four_rank_run(four_rank_runs):
    """The uninterrupted one: (folder holding step-3 and step-6, stdout).
    Read it; copy it to change it."""
    return four_rank_runs["run"]


@pytest.fixture(scope="session")
def four_rank_stopped(four_rank_runs):
    """The one stopped after step 3: (folder holding step-3, stdout). Tests
    resume from a copy of the folder."""
    return four_rank_runs["stopped"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The example on 2 ranks with TINY_RUN_FLAGS, uninterrupted: (folder
    holding step-3 and step-6, stdout). test_bucket's, test_edges' and
    test_example's reference; test_convert, test_edges, test_failures and
    test_safety start from a copy of its steps. Read it; copy it to change it."""
    folder = tmp_path_factory.mktemp("tiny-run")
    run = torchrun(2, EXAMPLE, *TINY_RUN_FLAGS, "--checkpoint-dir", folder)
    return folder, run.stdout


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3 server (SeaweedFS) for the session's bucket tests, started
    once: its URL. Each module makes its own bucket or folder on it."""
    proc, endpoint = start_s3_server(tmp_path_factory.mktemp("s3"))
    try:
        yield endpoint
    finally:
        proc.kill()  # weed takes ~25 s to stop on SIGTERM; nothing here to keep
        proc.wait(timeout=30)
