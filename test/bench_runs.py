"""The benchmark's commands that test_bench.py checks, started in the background.

Their figures are not judged, only that each runs and reports what it
should. They start with the first test of the worker that runs test_bench.py
(conftest.py), at the lowest CPU priority (nice 19), so that they take only
the CPU time the tests leave idle (waits for a lease to expire, a killed
rank's restart, I/O) and slow no test down; whatever is left of them runs
after the other tests, with both cores to themselves. The deadlines allow for
a whole suite's run before that.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT

_running = {}  # name: (folder, Command), once started


class Command:
    """A command started in the background, its output into files."""

    def __init__(self, folder, cmd, timeout):
        self.deadline = time.monotonic() + timeout
        self.stdout, self.stderr = folder / "stdout.txt", folder / "stderr.txt"
        # gpu_check.sh runs `python`: this interpreter, in a venv or not
        path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                list(map(str, cmd)),
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own group: cleaned up by its id
                preexec_fn=_lowest_priority,
            )

    def finish(self):
        """Waits for it (until its deadline); its exit status and stdout."""
        self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        stdout, stderr = self.stdout.read_text(), self.stderr.read_text()
        assert self.proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        return stdout

    def kill(self):
        """Ends it and what it started, if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _lowest_priority():
    """In the child: nice 19, for it and its session's autogroup (Linux
    weighs the sessions' autogroups against each other, so a process's own
    niceness alone would not yield to the tests' processes)."""
    os.nice(19)
    with contextlib.suppress(OSError):  # no autogroups here
        Path("/proc/self/autogroup").write_text("19")


def start(tmp_path_factory):
    """{name: (folder, Command)} of the commands, started if not yet."""
    if _running:
        return dict(_running)
    names = ("bench", "gpu", "overlap", "coordinator", "gil", "replica")
    folders = {n: tmp_path_factory.mktemp(n) for n in names}
    bench = folders["bench"]
    commands = {
        "bench": (
            [
                sys.executable,
                "bench/bench_checkpoint.py",
                *("--sizes-mb", "2", "--stages", "2", "--keys-x", "2"),
                *("--n-layers", "4"),  # half the default 8: fewer items, same bytes
                *("--repeats", "1", "--out-dir", bench / "out"),
                *("--work-dir", bench / "work", "--timeout", "900"),
            ],
            900,
        ),
        "gpu": (["bash", "bench/gpu_check.sh", "--dry"], 900),
        "overlap": (
            [
                sys.executable,
                "bench/overlap.py",
                *("--out-dir", folders["overlap"] / "out", "--mb-per-rank", "1"),
                *("--compute", "0.05", "--steps", "2"),
            ],
            900,
        ),
        "gil": (
            [
                sys.executable,
                "bench/gil_stall.py",
                *("--mb", "16", "--repeats", "1", "--out-dir", folders["gil"] / "out"),
            ],
            900,
        ),
        "replica": (
            [
                sys.executable,
                "bench/replica_check.py",
                *(
                    "--mb",
                    "8",
                    "--repeats",
                    "1",
                    "--out-dir",
                    folders["replica"] / "out",
                ),
            ],
            900,
        ),
        "coordinator": (
            [
                sys.executable,
                "bench/coordinator.py",
                *("--ranks", "16", "64", "--stages", "4", "--keys", "20"),
                *("--repeats", "1", "--out-dir", folders["coordinator"] / "out"),
            ],
            900,
        ),
    }
    for name, (cmd, timeout) in commands.items():
        _running[name] = (folders[name], Command(folders[name], cmd, timeout))
    return dict(_running)


def kill():
    """Ends the commands that still run, and forgets them."""
    for _, command in _running.values():
        command.kill()
    _running.clear()
