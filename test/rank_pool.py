"""Rank processes kept across tests, for runs of the example whose subject
is not the launcher nor the process.

Under torchrun each run starts a launcher and one process per rank, and each
imports torch (about 1.3 s of CPU for the launcher, 2.5 s for a rank, before
any work). A pool of ``nproc`` rank processes (test/rank_server.py) imports
once and forks a process for each request, which runs the example's ``main``
with the environment torchrun gives its workers and a fresh TCP store; its
output is each rank's, rank 0 first. Tests of signals, restarts, a killed launcher or rank,
the launcher's own output, or what happens at interpreter exit launch with
torchrun (helpers.torchrun).
"""

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from helpers import _ENV, ROOT, _free_ports

SERVER = Path(__file__).with_name("rank_server.py")

_lock = threading.Lock()
_idle: dict[tuple, list["Pool"]] = {}  # by nproc and env: pools running nothing
_all: list["Pool"] = []


class Pool:
    """``nproc`` rank processes, one run at a time."""

    def __init__(self, nproc, env):
        self.nproc, self.scratch = nproc, Path(tempfile.mkdtemp(prefix="rank-pool-"))
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-u", str(SERVER), str(rank), str(nproc)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(self.scratch / f"server-{rank}.log", "wb"),  # noqa: SIM115
                text=True,
                cwd=ROOT,
                env=env,
                start_new_session=True,  # killed with the runs it forked
            )
            for rank in range(nproc)
        ]

    def run(self, argv, cwd, timeout, **options):
        """The example's main with `argv` on every rank: (codes, stdout, stderr).
        `options`: the request's ``exit_check``, ``script`` and ``env``
        (rank_server.py)."""
        port = _free_ports(1)[0]
        files = [
            (self.scratch / f"out-{r}", self.scratch / f"err-{r}")
            for r in range(self.nproc)
        ]
        for proc, (out, err) in zip(self.procs, files, strict=True):
            request = {"argv": argv, "port": port, "cwd": str(cwd), **options}
            proc.stdin.write(json.dumps({**request, "out": str(out), "err": str(err)}))
            proc.stdin.write("\n")
            proc.stdin.flush()
        codes, deadline = [None] * self.nproc, time.monotonic() + timeout
        while None in codes:
            waiting = {
                p.stdout: r for r, p in enumerate(self.procs) if codes[r] is None
            }
            left = deadline - time.monotonic()
            ready, _, _ = select.select(list(waiting), [], [], max(left, 0))
            if not ready:
                self.kill()
                raise TimeoutError(f"the example did not end in {timeout} s: {argv}")
            for stream in ready:
                line = stream.readline()
                if not line:  # the server died: a crash, as a process's
                    self.kill()
                    raise RuntimeError(f"rank {waiting[stream]} of a pool died: {argv}")
                codes[waiting[stream]] = json.loads(line)["code"]
        stdout = "".join(out.read_text(errors="replace") for out, _ in files)
        stderr = "".join(err.read_text(errors="replace") for _, err in files)
        return codes, stdout, stderr

    def kill(self):
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        self.procs = []


@atexit.register
def _stop_all():
    for pool in _all:
        if pool.procs:
            pool.kill()


def _env():
    """The ranks' environment: the tests' (a bucket's settings, as they are
    now) and the project on the import path."""
    return {**_ENV, "PYTHONPATH": str(ROOT)}


def _key(nproc, env):
    """Which idle pools a run may take: those of its size and environment."""
    return nproc, tuple(sorted(env.items()))


def warm(*sizes):
    """Starts an idle pool of each of `sizes` ranks, unless one is idle
    already, for run_example to take: its servers import torch while other
    tests run, not in the setup of the first test that needs it."""
    env = _env()
    for nproc in sizes:
        key = _key(nproc, env)
        with _lock:
            if not _idle.setdefault(key, []):
                pool = Pool(nproc, env)
                _all.append(pool)
                _idle[key].append(pool)


def run_example(nproc, *args, timeout=240, expect_ok=True, cwd=ROOT, **options):
    """The example on `nproc` ranks of a pool, as helpers.torchrun runs it, in
    the folder `cwd`: a CompletedProcess whose returncode is the first
    non-zero rank's (0 if none) and whose stdout and stderr are the ranks',
    rank 0 first. `options` (rank_server.py): ``exit_check=True``, each
    rank's output ends with how many torch modules were alive at its exit;
    ``script=path``, that script runs instead, with `args` as its arguments;
    ``env={...}``, added to the ranks' environment. Runs at
    once, or in another environment (helpers._ENV: a bucket's settings), use
    pools of their own."""
    env = _env()
    key = _key(nproc, env)
    with _lock:
        idle = _idle.setdefault(key, [])
        pool = idle.pop() if idle else None
    if pool is None:
        pool = Pool(nproc, env)
        with _lock:
            _all.append(pool)
    argv = [str(a) for a in args]
    try:
        codes, stdout, stderr = pool.run(argv, cwd, timeout, **options)
    except (TimeoutError, RuntimeError) as e:
        pytest.fail(f"{e}\n--- server logs in {pool.scratch}")
    code = next((c for c in codes if c), 0)
    with _lock:  # a failed run was a process of its own: the servers are as before
        _idle[key].append(pool)
    proc = subprocess.CompletedProcess(["pool", *argv], code, stdout, stderr)
    if expect_ok and code != 0:
        pytest.fail(
            f"the example {' '.join(argv)} on a pool of {nproc} exited {code}\n"
            f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}"
        )
    return proc
