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
    # The packed optimizer layout: fewer DCP items than the flattened one.
    sync = next(s for s in result["summary"] if s["method"] == "pippy_sync")
    assert sync["items_per_rank"] < sync["flat_items_per_rank"] / 3
    # The parts of the sync save's time: each measured, none more than the whole.
    parts = ("pippy_s", "dcp_plan_s", "dcp_write_s", "dcp_finish_s")
    for row in result["rows"]:
        if row["method"] in ("pippy_sync", "pippy_sync_repeat"):
            assert all(0 < row[p] < row["wall_s"] for p in parts), row
            assert sum(row[p] for p in parts) <= row["wall_s"] * 1.01, row
