"""The benchmark runs end to end on a tiny model, loads included.

Its figures are not judged here (speed is the benchmark's business, never a
timed test's): this checks that it runs every method on real ranks, that each
checkpoint it loads matched the saved state bitwise (the benchmark raises
otherwise), and that it reports every target.
"""

import importlib
import json

import bench_runs
import pytest

SAVE_METHODS = {
    "pippy_sync",
    "pippy_sync_flat",
    "pippy_sync_crc32",
    "pippy_sync_threads2",
    "pippy_async_tuned",
    "torch_save_stage",
    "gather_rank0",
    "raw_write",
    "copy_fresh",
    "copy_reuse",
    "load_same",
    "load_same_dcp",
    "load_same_unverified",
    "load_torch_stage",
    "pippy_sync_nomanifest",
    "dcp_save",
    "dcp_async_save",
}
# The optional peers, timed when their package imports (as the bench decides).
OPTIONAL = {
    "torchtitan.components.checkpoint": {"tt_sync", "tt_async", "tt_load"},
    "torch_checkpointing": {"tc_sync", "tc_async", "tc_load"},
}


def installed_peers():
    """The optional peers' methods whose package imports here."""
    found = set()
    for module, methods in OPTIONAL.items():
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 (the bench skips it alike)
            continue
        found |= methods
    return found


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The benchmark's commands (bench_runs.py), started at once; each test
    waits for its own, the quickest first (no test then waits 30 s)."""
    commands = bench_runs.start(tmp_path_factory)
    try:
        yield commands
    finally:
        bench_runs.kill()


@pytest.mark.launches
def test_the_coordinator_benchmark_times_both_planners(started):
    """bench/coordinator.py: a row per number of ranks, save and load."""
    folder, command = started["coordinator"]
    command.finish()
    rows = json.loads((folder / "out" / "results.json").read_text())
    assert [row["ranks"] for row in rows] == [16, 64]
    for row in rows:
        for name in ("save_dcp", "save_pippy", "load_dcp", "load_pippy"):
            seconds, peak = row[name]
            assert seconds > 0 and peak >= 0
    table = (folder / "out" / "results.md").read_text()
    assert table.count("x |") == 2 * 4


@pytest.mark.launches
def test_the_replica_check_benchmark_times_saves_with_and_without_it(started):
    """bench/replica_check.py: a dp 2 save with the replicas' fingerprints
    compared and without, and their ratio."""
    folder, command = started["replica"]
    command.finish()
    result = json.loads((folder / "out" / "results.json").read_text())
    assert result["checked_s"] > 0 and result["unchecked_s"] > 0
    assert result["ratio"] == result["checked_s"] / result["unchecked_s"]
    assert [len(result["times"][k]) for k in ("checked", "unchecked")] == [1, 1]
    assert (folder / "out" / "results.md").read_text().count("x |") == 1


@pytest.mark.launches
def test_the_gil_benchmark_times_a_ticking_thread_during_a_background_save(started):
    """bench/gil_stall.py: the longest stall, checksums chunked and not."""
    folder, command = started["gil"]
    command.finish()
    stalls = json.loads((folder / "out" / "results.json").read_text())
    assert set(stalls) == {"chunked", "one_call"}
    assert all(ms >= 1.0 for ms in stalls.values())  # at least the 1 ms sleep


@pytest.mark.launches
def test_the_overlap_benchmark_runs_every_mode(started):
    """bench/overlap.py on a tiny stage: its one row, every mode's ratio."""
    folder, command = started["overlap"]
    command.finish()
    out = folder / "out"
    run = json.loads((out / "results.json").read_text())
    assert {k.split("/")[1] for k in run["results"]} == {
        "none",
        "sync",
        "async",
        "async_unchecked",  # the version counters' check left out: its cost
        "copy",
    }
    text = (out / "results.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 0.05 |"))
    assert row.count("x") == 6
    assert run["twin_differs"] == {}  # every async step bitwise the twin's
    assert "against a sync twin (the stage stepped again, nothing saved): all" in text


@pytest.mark.launches
def test_the_gpu_check_runs_dry_on_the_cpu(started):
    """bench/gpu_check.sh --dry: the GPU check's three rows, on gloo and the CPU."""
    _, command = started["gpu"]
    stdout = command.finish()
    rows = dict(
        tuple(cell.strip() for cell in line.split("|"))
        for line in stdout.splitlines()
        if line.count("|") == 1
    )
    assert rows["example, 2 ranks (gloo, CPU)"].startswith("ok, verified bitwise")
    assert rows["stop at 2, resume to 4"] == "resumed; last step bitwise"
    assert rows["async blocking / bare copy"].endswith("x")
    assert rows["longest stall of a 1 ms ticking thread"].endswith(
        " ms, during the background write"
    )
    assert rows["kept host buffers / stage"].startswith("1.00x")  # exact sizes
    assert rows["device syncs in save() and its staging"] == "n/a (no accelerator)"


@pytest.mark.launches
def test_the_benchmark_runs_every_method_and_reports_every_target(started):
    folder, command = started["bench"]
    command.finish()
    out = folder / "out"
    result = json.loads((out / "results.json").read_text())
    ran = {(s["phase"], s["case"], s["method"]) for s in result["summary"]}
    expected = SAVE_METHODS | installed_peers()
    for case in ("2MB", "2MB-x2keys"):
        assert {m for p, c, m in ran if (p, c) == ("save", case)} == expected
    # pippy's and DCP's async saves hold the values of their call.
    held = {s["method"]: s["held_at_call"] for s in result["summary"]}
    assert held["pippy_async_tuned"] is True and held["dcp_async_save"] is True
    assert {m for p, _, m in ran if p == "reshard"} == {"load_same", "load_reshard"}
    assert {m for p, _, m in ran if p == "unsplit"} == {
        "load_unsplit",
        "torch_load_full",
    }
    targets = {t["target"] for t in result["targets"]}
    assert {
        "pippy_sync / torch_save_stage",
        "pippy_async_tuned blocked / copy_fresh",
        "load_reshard / load_same",
        "pippy_sync s/byte more keys / base",
        "pippy_sync / pippy_sync_nomanifest",
        "pippy_sync / dcp_save",
        "pippy_sync / pippy_sync_flat",
        "load_same / load_same_dcp",
        "load_same / load_same_unverified",
        "load_same_unverified / load_same_dcp",
        "load_same / load_torch_stage",
    } <= targets
    assert (out / "results.png").stat().st_size > 10_000
    assert (out / "peers.png").stat().st_size > 10_000
    text = (out / "results.md").read_text()
    assert "## Targets" in text and "## Where a sync save's time goes" in text
    peers = text.split("## Against other checkpointers")[1].split("##")[0]
    assert all(f"| {m} |" in peers for m in expected & {"dcp_async_save", "tt_load"})
    assert (
        "## Fixed cost per save: pippy and a repeat save against plain dcp.save" in text
    )
    # Per item at equal bytes, for pippy and plain DCP: both measured.
    per_item = text.split("## Per item, at equal bytes")[1].split("##")[0]
    assert "| 2 | 2MB -> 2MB-x2keys | pippy_sync |" in per_item
    assert "| 2 | 2MB -> 2MB-x2keys | dcp_save |" in per_item
    # The packed optimizer layout: fewer DCP items than the flattened one.
    sync = next(s for s in result["summary"] if s["method"] == "pippy_sync")
    assert sync["items_per_rank"] < sync["flat_items_per_rank"] / 3
    # The parts of the sync save's time: each measured, none more than the whole.
    parts = ("pippy_s", "dcp_plan_s", "dcp_write_s", "dcp_finish_s")
    for row in result["rows"]:
        if row["method"] == "pippy_sync":
            assert all(0 < row[p] < row["wall_s"] for p in parts), row
            assert sum(row[p] for p in parts) <= row["wall_s"] * 1.01, row
