"""The benchmark runs end to end on a tiny model, loads included.

Its figures are not judged here (speed is the benchmark's business, never a
timed test's): this checks that it runs every method on real ranks, that each
checkpoint it loads matched the saved state bitwise (the benchmark raises
otherwise), and that it reports every target.
"""

import json
import os
import subprocess
import sys

from helpers import ROOT

SAVE_METHODS = {
    "pippy_sync",
    "pippy_sync_cached",
    "pippy_sync_crc32",
    "pippy_sync_crcwrite",
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
    "pippy_sync_repeat",
    "dcp_save",
}


def test_the_benchmark_runs_every_method_and_reports_every_target(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "bench/bench_checkpoint.py",
        *("--sizes-mb", "2", "--stages", "2", "--keys-x", "2", "--repeats", "1"),
        *("--out-dir", out, "--work-dir", tmp_path / "work", "--timeout", "300"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        list(map(str, cmd)),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    ran = {(s["phase"], s["case"], s["method"]) for s in result["summary"]}
    for case in ("2MB", "2MB-x2keys"):
        assert {m for p, c, m in ran if (p, c) == ("save", case)} == SAVE_METHODS
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
        "load_same / load_same_unverified",
        "load_same_unverified / load_same_dcp",
        "load_same / load_torch_stage",
    } <= targets
    assert (out / "results.png").stat().st_size > 10_000
    text = (out / "results.md").read_text()
    assert "## Targets" in text and "## Where a sync save's time goes" in text
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
        if row["method"] in ("pippy_sync", "pippy_sync_repeat"):
            assert all(0 < row[p] < row["wall_s"] for p in parts), row
            assert sum(row[p] for p in parts) <= row["wall_s"] * 1.01, row


def test_the_gpu_check_runs_dry_on_the_cpu():
    """bench/gpu_check.sh --dry: the GPU check's three rows, on gloo and the CPU."""
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = dict(
        tuple(cell.strip() for cell in line.split("|"))
        for line in proc.stdout.splitlines()
        if line.count("|") == 1
    )
    assert rows["example, 2 ranks (gloo, CPU)"].startswith("ok, verified bitwise")
    assert rows["stop at 2, resume to 4"] == "resumed; last step bitwise"
    assert rows["async blocking / bare copy"].endswith("x")


def test_the_overlap_benchmark_runs_every_mode(tmp_path):
    """bench/overlap.py on a tiny stage: its one row, every mode's ratio."""
    cmd = [sys.executable, "bench/overlap.py", "--out-dir", str(tmp_path)]
    cmd += ["--mb-per-rank", "1", "--compute", "0.05", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / "results.json").read_text())
    assert {k.split("/")[1] for k in run["results"]} == {
        "none",
        "sync",
        "async",
        "async+plan",
        "copy",
    }
    row = (tmp_path / "results.md").read_text().splitlines()[-1]
    assert row.startswith("| 0.05 |") and row.count("x") == 6
