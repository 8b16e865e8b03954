"""pytest setup: the example's folder on sys.path (`import gpt`, `import pippy_dcp`),
the runs of ranks that tests of several modules share, and the ``launches``
mark.

Ranks are threads of the test process (test/ranks.py) unless the process is
what a test is about: the launcher, signals, process death, a process's
memory. Starting a process costs about 2 s of CPU (importing torch), so a
run whose output several modules read runs once per session: the checks of
test/*_checks.py on 2 and on 4 ranks (threads), the example's uninterrupted
and stopped 4-rank runs and a tiny 2-rank run. The example runs on a pool of
rank processes kept across tests (rank_pool.py) unless the launcher or the
process is what a test is about (torchrun). A module run alone starts them as
well, on first use.

A test that starts a Python process (torchrun, ``python -m pippy``, a
snippet) is marked ``launches``, or uses a fixture that does (LAUNCHING);
``pytest -m "not launches"`` runs the rest, the developer's inner loop, and
a test that starts one unmarked fails, saying so.
"""

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))

import bench_runs  # noqa: E402
import rank_pool  # noqa: E402
from ranks import run_checks  # noqa: E402

from helpers import (  # noqa: E402
    FOUR_RANK_FLAGS,
    TINY_RUN_FLAGS,
    example,
    start_s3_server,
    torchrun,
)

SHARED_CHECKS = Path(__file__).with_name("shared_checks.py")

#: The checks of test/*_checks.py that run on 2 ranks, by script, as threads
#: of this process (test/ranks.py): dist_checks.py's for test_stages (keys,
#: train), test_failures (async, refusal), test_edges (twins, one_fails),
#: test_cost (ops) and test_hf (hf, where transformers is installed);
#: seam_checks.py's for test_seam, layout_checks.py's for test_parallel,
#: test_cost.py's own (save). Each script's checks write into a folder of its
#: own.
TWO_RANK_CHECKS = {
    "dist_checks": ["keys", "train", "async", "refusal", "twins", "one_fails", "ops"],
    "seam_checks": ["same", "async_checks", "async_staging"],
    "layout_checks": ["parts"],
    "test_cost": ["save"],
}
if importlib.util.find_spec("transformers") is not None:
    TWO_RANK_CHECKS["dist_checks"].append("hf")
#: ... and on 4 ranks: dist_checks.py's for test_stages (keys, train),
#: test_topology (logits) and test_cost (ops), layout_checks.py's for
#: test_parallel.
FOUR_RANK_CHECKS = {
    "dist_checks": ["keys", "train", "logits", "ops"],
    "layout_checks": ["mesh", "hsdp"],
}


def run_checks_in(tmp_path_factory, nproc, checks, given=None):
    """`checks` on `nproc` ranks as threads of this process (ranks.run_checks),
    in a new folder holding `given` ({script: {name: a folder to copy
    there}}); {script: its folder}."""
    out = tmp_path_factory.mktemp(f"checks-{nproc}")
    for script, folders in (given or {}).items():
        for name, folder in folders.items():
            shutil.copytree(folder, out / script / name)
    return run_checks(nproc, checks, out)


@pytest.fixture(scope="session")
def two_rank_checks(tmp_path_factory):
    """{script: the folder of its checks in TWO_RANK_CHECKS}:
    <check>-rank<R>.json and what the checks saved."""
    return run_checks_in(tmp_path_factory, 2, TWO_RANK_CHECKS)


@pytest.fixture(scope="session")
def four_rank_checks(tmp_path_factory):
    """{script: the folder of its checks in FOUR_RANK_CHECKS}, as above; the
    logits check's folder holds ckpt/step-2, stage-<R>.pt and logits.pt."""
    return run_checks_in(tmp_path_factory, 4, FOUR_RANK_CHECKS)


@pytest.fixture(scope="session")
def fsdp_checks(tmp_path_factory, four_rank_checks):
    """The folder of fsdp_checks.py's check on 2 ranks (test_topology), which
    loads the pipeline checkpoint the 4-rank logits check saved."""
    pipeline = {"fsdp_checks": {"ckpt": four_rank_checks["dist_checks"] / "ckpt"}}
    checks = {"fsdp_checks": ["fsdp"]}
    return run_checks_in(tmp_path_factory, 2, checks, pipeline)["fsdp_checks"]


def launch_checks(tmp_path_factory, nproc, script, check):
    """The checks that need processes of their own, under torchrun
    (shared_checks.py): the folder of `check` of `script` on `nproc` ranks."""
    out = tmp_path_factory.mktemp(f"launch-{check}")
    torchrun(nproc, SHARED_CHECKS, f"{script}.{check}", out, timeout=400)
    return out / script


@pytest.fixture(scope="session")
def stop_launch(tmp_path_factory):
    """stop_checks.py's check on 2 ranks (test_preemption): a signal is the
    process's."""
    return launch_checks(tmp_path_factory, 2, "stop_checks", "stop")


@pytest.fixture(scope="session")
def memory_launch(tmp_path_factory):
    """dist_checks.py's memory check on 4 ranks (test_topology): it measures
    the peak RSS of building a stage, the process's high-water mark."""
    return launch_checks(tmp_path_factory, 4, "dist_checks", "memory")


@pytest.fixture(scope="session")
def four_rank_run(tmp_path_factory):
    """The example on 4 ranks with FOUR_RANK_FLAGS, uninterrupted, on a pool
    of rank processes (rank_pool.py): (folder holding step-3 and step-6,
    stdout). Read it; copy it to change it."""
    folder = tmp_path_factory.mktemp("four-ranks-run")
    run = example(4, *FOUR_RANK_FLAGS, "--checkpoint-dir", folder)
    return folder, run.stdout


@pytest.fixture(scope="session")
def four_rank_stopped(tmp_path_factory):
    """The same run stopped after step 3 (--stop-after 3): (folder holding
    step-3, stdout). Tests resume from a copy of the folder."""
    folder = tmp_path_factory.mktemp("four-ranks-stopped")
    flags = (*FOUR_RANK_FLAGS, "--checkpoint-dir", folder, "--stop-after", 3)
    return folder, example(4, *flags).stdout


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The example on 2 ranks with TINY_RUN_FLAGS, uninterrupted (a pool of
    rank processes): (folder
    holding step-3 and step-6, stdout). test_bucket's, test_edges' and
    test_example's reference; test_convert, test_edges, test_failures and
    test_safety start from a copy of its steps. Read it; copy it to change it."""
    folder = tmp_path_factory.mktemp("tiny-run")
    run = example(2, *TINY_RUN_FLAGS, "--checkpoint-dir", folder)
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


#: The fixtures that start Python processes: a test using one is marked
#: ``launches``.
LAUNCHING = {
    "four_rank_run",
    "four_rank_stopped",
    "tiny_run",
    "s3_endpoint",
    "stop_launch",
    "memory_launch",
}


#: README's test command, ``pytest -n 2 --dist loadgroup``, runs the suite on
#: two workers (pytest-xdist), one per core: the second runs these modules,
#: the first the rest. Each session fixture's users stay on one worker, so it
#: starts once (s3_endpoint and stop_launch here; the thread checks,
#: four_rank_run, four_rank_stopped and memory_launch on the first), except
#: tiny_run, which test_bucket.py's worker runs too.
SECOND_WORKER = {
    "test_one_rank_decides.py",
    "test_preemption.py",
    "test_stall.py",
    "test_hf_load.py",
    "test_read_once.py",
    "test_convert.py",
    "test_durability.py",
    "test_cli.py",
    "test_parallel_example.py",
    "test_bucket.py",
    "test_bucket_faults.py",
    "test_bench.py",
}
#: ... and of its modules, these run last, once the first worker is done
#: (pytest_runtest_protocol): jobs in a bucket whose leases expire in 2 s and
#: that are frozen and woken (under load their jobs take twice as long; the
#: module's fixtures are shared, so the whole module), then the benchmark's
#: commands.
ALONE = ["test_bucket_faults.py", "test_bench.py"]
#: ... and, before them, these tests of other modules of its worker, which
#: under load take two to three times as long as alone: a rank killed in a
#: 40 MB save and restarted; the example stopped and resumed in a bucket (the
#: module fixture that runs it, and the test that reads its step).
ALONE_TESTS = {
    "test_torchrun_restarts_after_a_rank_killed_mid_save",
    "test_the_example_trains_saves_and_resumes_in_a_bucket",
    "test_a_step_in_the_bucket_is_read_exported_converted_and_started_from",
}


def _alone(item):
    """Where `item` runs among those that wait for the other worker: -1 in
    turn; 0 ALONE_TESTS; 1, 2, ... ALONE's modules, in order."""
    if item.path.name in ALONE:
        return 1 + ALONE.index(item.path.name)
    return 0 if item.originalname in ALONE_TESTS else -1


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    """Marks ``launches`` each test that uses a LAUNCHING fixture, and each
    test with its worker's group (SECOND_WORKER); runs the modules without a
    launch first and ALONE's last."""
    for item in items:
        if LAUNCHING & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launches)
        second = item.path.name in SECOND_WORKER
        item.add_marker(pytest.mark.xdist_group("second" if second else "first"))
    launching = {i.path for i in items if i.get_closest_marker("launches")}

    def order(item):  # sorted is stable: each module's tests keep their order
        return (_alone(item), item.path in launching)

    items[:] = sorted(items, key=order)


@contextlib.contextmanager
def _no_python_processes(item):
    """Fails `item` if it starts a Python process while not marked
    ``launches``, so that ``-m "not launches"`` stays free of them."""
    if item.get_closest_marker("launches") is not None:
        yield
        return
    popen_init = subprocess.Popen.__init__

    def refuse_python(self, args, *rest, **kwargs):
        words = args.split() if isinstance(args, str) else [str(a) for a in args]
        # the program, or the one a wrapper (strace, timeout) runs
        program = next((w for w in words if Path(w).name.startswith("python")), "")
        if program:
            pytest.fail(
                f"{item.nodeid} starts a Python process ({program}): "
                "mark it @pytest.mark.launches",
                pytrace=False,
            )
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = refuse_python
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Its fixtures (of any scope) start no Python process unless marked."""
    with _no_python_processes(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Nor does the test itself."""
    with _no_python_processes(item):
        yield


def _done_marker(config, worker):
    """The file a pytest-xdist worker leaves when its tests are done."""
    return config._tmp_path_factory.getbasetemp().parent / f"{worker}.done"


def pytest_sessionfinish(session):
    """A pytest-xdist worker says it is done (see pytest_runtest_protocol)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        _done_marker(session.config, worker).touch()


def _group(item):
    """The pytest-xdist group that `item` runs in (SECOND_WORKER)."""
    return item.get_closest_marker("xdist_group").args[0]


def pytest_collection_finish(session):
    """Notes whether test_bench.py runs, and in which group; and the groups
    whose tests launch processes."""
    bench = [i for i in session.items if i.path.name == "test_bench.py"]
    _bench["group"] = _group(bench[0]) if bench else None
    launching = [i for i in session.items if i.get_closest_marker("launches")]
    _bench["launching"] = {_group(i) for i in launching}


#: The pools of rank processes (rank_pool.py) each group's worker starts with
#: its first test, if it runs any test that launches: those whose first use
#: is in a fixture (four_rank_run on the first; test_parallel_example's
#: references on the second, of 4 ranks and of 1).
WARM_POOLS = {"first": (4,), "second": (4, 1)}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The benchmark's commands (test_bench.py, bench_runs.py) start with the
    first test of the worker that runs test_bench.py, at the lowest CPU
    priority: they take what the tests leave idle; the worker's pools
    (WARM_POOLS) start with its first test. Under pytest-xdist, the first
    test that runs alone (_alone) waits, before its setup, until every other
    worker is done."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not _bench["warmed"]:
        _bench["warmed"] = True
        groups = [_group(item)] if worker else list(WARM_POOLS)
        for group in groups:
            if group in _bench["launching"]:
                rank_pool.warm(*WARM_POOLS[group])
    if _bench["group"] and not _bench["started"]:
        if worker is None or _group(item) == _bench["group"]:
            _bench["started"] = True
            bench_runs.start(item.config._tmp_path_factory)
    if worker and _alone(item) >= 0 and not _bench["waited"]:
        _bench["waited"] = True
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        others = [f"gw{i}" for i in range(count) if f"gw{i}" != worker]
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not all(
            _done_marker(item.config, w).exists() for w in others
        ):
            time.sleep(0.5)
    yield


#: test_bench.py's group, whether its commands started, whether it waited;
#: the groups that launch, whether this worker's pools were warmed.
_bench = {
    "group": None,
    "started": False,
    "waited": False,
    "launching": set(),
    "warmed": False,
}
