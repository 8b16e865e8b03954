"""Every Python snippet of README.md and the walkthrough runs as written.

Snippets of a page run in order in one folder (later ones read the
checkpoints earlier ones wrote), from the repository root's view of imports;
one whose first line is ``# torchrun --nproc-per-node N ...`` runs on N ranks
(a pool's, started as torchrun starts them: rank_pool.py).
"""

import contextlib
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pippy.checkpoint import offline
from pippy.cli import parser

from helpers import ROOT, example, launch

PAGES = ["README.md", "examples/checkpoint/README.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_BASH = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)
_TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+)")
#: README's "Run the example": its command, then the output it shows.
_EXAMPLE_RUN = re.compile(
    r"^## Run the example\n\n```bash\n(.*?)\n```\n.*?^```\n(.*?)^```", re.S | re.M
)
#: The Python whose standard library (the text the example trains on) gave
#: the losses README.md shows; another one's gives other losses.
SAMPLE_PYTHON = "3.11.7"


def snippets(page):
    return _BLOCK.findall((ROOT / page).read_text())


def test_the_pages_have_snippets():
    assert len(snippets("examples/checkpoint/README.md")) >= 4
    assert snippets("README.md")


def run_snippet(code, folder, name="snippet.py"):
    """Runs a snippet in `folder` as the page says: python, or on N ranks as
    torchrun starts them (a pool of rank processes, helpers.example)."""
    script = folder / name
    script.write_text(code)
    offline_hub = {"HF_HUB_OFFLINE": "1"}
    match = _TORCHRUN.match(code)
    if match:
        return example(
            int(match.group(1)),
            script=str(script),
            cwd=folder,
            env=offline_hub,
            expect_ok=False,
            timeout=180,
        )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **offline_hub}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_ci_reads_the_readmes_setup_and_test_commands():
    """.ci/run's own `block` function finds both commands in README.md."""
    ci = (ROOT / ".ci" / "run").read_text()
    block = re.search(r"^block\(\) \{.*?^\}$", ci, re.S | re.M).group(0)
    found = {}
    for name in ("setup", "test"):
        cmd = ["bash", "-c", f"{block}\nblock {name}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        found[name] = done.stdout
    assert 'pip install -e ".[dev]" -c constraints.txt\n' in found["setup"]
    assert found["setup"].startswith("python3 -m venv .venv")
    assert found["test"] == "pytest -n 2 --dist loadgroup\n"


def test_the_pages_command_lines_of_python_m_pippy_parse():
    """Every `python -m pippy` line in the pages' bash blocks, flags included."""
    lines = [
        line
        for page in [*PAGES, "RELEASING.md"]
        for block in _BASH.findall((ROOT / page).read_text())
        for line in block.splitlines()
        if line.startswith("python -m pippy ")
    ]
    assert len(lines) >= 6
    for line in lines:
        parser().parse_args(shlex.split(line, comments=True)[3:])  # exits 2 if not


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """A page's snippets, run in order in a folder of their own, each once for
    the module and none after one that fails: ran(page, i) -> (folder,
    [process]) of its snippets up to the i-th (all if i is None)."""
    done = {}

    def run(page, i=None):
        codes = snippets(page)
        if page not in done:
            done[page] = tmp_path_factory.mktemp("snippets"), []
        folder, procs = done[page]
        last = len(codes) - 1 if i is None else i
        while len(procs) <= last and (not procs or procs[-1].returncode == 0):
            n = len(procs)
            procs.append(run_snippet(codes[n], folder, f"snippet_{n}.py"))
        return folder, procs

    return run


#: (page, i): each snippet of each page, a test of its own.
SNIPPETS = [(page, i) for page in PAGES for i in range(len(snippets(page)))]


@pytest.mark.launches
@pytest.mark.parametrize(("page", "i"), SNIPPETS, ids=[f"{p}-{i}" for p, i in SNIPPETS])
def test_snippets_run_as_written(ran, page, i):
    _, procs = ran(page, i)
    assert len(procs) > i, f"{page} snippet {len(procs) - 1} failed before it"
    assert procs[i].returncode == 0, (
        f"{page} snippet {i}:\n{snippets(page)[i]}\n{procs[i].stderr[-3000:]}"
    )


@pytest.mark.launches
def test_the_readme_training_script_resumes_bit_for_bit(ran, tmp_path):
    """README's "Your own training script": stopped after step 3 (its step-6
    taken away), it resumes there and ends as the uninterrupted run did."""
    [(i, code)] = [
        (i, c)
        for i, c in enumerate(snippets("README.md"))
        if c.startswith("# torchrun --nproc-per-node 2 train.py")
    ]
    # Its first run, from nothing: the one test_snippets_run_as_written ran.
    ran_in, procs = ran("README.md", i)
    first = procs[i]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resumed" not in first.stdout
    folder = tmp_path / "my-checkpoints"
    shutil.copytree(ran_in / "my-checkpoints", folder)
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-6"]
    (folder / "step-6").rename(tmp_path / "uninterrupted-step-6")

    second = run_snippet(code, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    for rank in (0, 1):
        line = f"[rank {rank}] resumed from my-checkpoints/step-3 at step 3"
        assert line in second.stdout

    def losses(run):
        return [x for x in run.stdout.splitlines() if x.startswith("step ")]

    assert len(losses(first)) == 6 and losses(second) == losses(first)[3:]
    resumed = offline.read_checkpoint(folder / "step-6")
    whole = offline.read_checkpoint(tmp_path / "uninterrupted-step-6")
    assert resumed.keys() == whole.keys() and resumed["step"] == 6
    assert offline.diff_state_dicts(resumed, whole) == []


@pytest.mark.launches
def test_the_readme_shows_what_the_example_prints(tmp_path):
    """README's sample output is a real run's of the command above it: every
    line it shows, timings aside (and losses, on another Python)."""
    command, sample = _EXAMPLE_RUN.search((ROOT / "README.md").read_text()).groups()
    torchrun, flag, nproc, script, *args = shlex.split(command)
    assert (torchrun, flag, script) == (
        "torchrun",
        "--nproc-per-node",
        "examples/checkpoint/pippy_dcp.py",
    )
    # the ranks as torchrun starts them, on a pool (the launcher prints nothing)
    run = example(int(nproc), *args, cwd=tmp_path)  # checkpoints/, as in the README
    assert run.returncode == 0, run.stderr[-3000:]

    def same(line):
        line = re.sub(r" \d+\.\d\d s$", " <seconds> s", line)
        if platform.python_version() != SAMPLE_PYTHON:
            line = re.sub(r"\| loss \d+\.\d{4} \|", "| loss <x> |", line)
        return line

    shown = [same(line) for line in sample.splitlines() if line != "..."]
    printed = {same(line) for line in run.stdout.splitlines()}
    assert len(shown) == 8 and [x for x in shown if x not in printed] == []
    assert f"python {SAMPLE_PYTHON}" in (ROOT / "README.md").read_text().lower()


@pytest.mark.launches
def test_the_readme_training_script_stops_saving_once_its_launcher_is_killed(tmp_path):
    """README's "Your own training script" under torchrun, its launcher killed
    with -9: the workers it leaves behind (which would train on and publish
    steps beside a restarted job) refuse their next save, on every rank, and end."""
    [code] = [
        c
        for c in snippets("README.md")
        if c.startswith("# torchrun --nproc-per-node 2 train.py")
    ]
    constants = 'CHECKPOINT_DIR, STEPS, SAVE_EVERY = "my-checkpoints", 6, 3'
    assert constants in code
    folder = tmp_path / "my-checkpoints"
    script = tmp_path / "train.py"
    script.write_text(
        code.replace(
            constants, f'CHECKPOINT_DIR, STEPS, SAVE_EVERY = "{folder}", 10**9, 3'
        )
    )
    launcher = launch(
        2,
        script,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={"PYTHONPATH": str(ROOT)},  # as run from the repository's root
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not (folder / "step-3").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(
                lines
            )
            time.sleep(0.01)
        tasks = Path(f"/proc/{launcher.pid}/task").iterdir()
        workers = [int(p) for t in tasks for p in (t / "children").read_text().split()]
        assert len(workers) == 2
        launcher.kill()  # the launcher alone: torchrun's workers outlive it
        launcher.wait(timeout=30)
        at_kill = {p.name for p in folder.iterdir() if p.name.startswith("step-")}
        reader.join(timeout=60)  # the workers hold its pipe until they end
        assert not reader.is_alive(), "the orphaned workers trained on"
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = "".join(lines)
    refusal = "this worker's launcher (pid"
    assert [line.count(refusal) for line in out.splitlines() if refusal in line]
    assert "DistNetworkError" not in out, out  # the refusal is each rank's last word
    after = {p.name for p in folder.iterdir() if p.name.startswith("step-")}
    assert len(after - at_kill) <= 1  # at most the save under way at the kill
