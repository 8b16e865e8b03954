"""Ranks as threads of the test's own process, over real gloo.

Starting a rank process costs about 2 s of CPU (importing torch); a thread
costs nothing. Each thread joins a gloo process group of its own over one
in-memory store, in a world of its own (torch's thread-local world, as
PyTorch's own distributed tests use), so collectives, point-to-point sends,
timeouts and asynchronous work are gloo's, as under torchrun. What the
threads share is the process: signal handlers, the RSS high-water mark and
module-level state, so tests of those launch real processes (helpers.torchrun).

A thread a rank starts (a background save, a stall watch) joins that rank's
world, as in a process every thread sees the process group.
"""

import threading
import traceback
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group
from torch.distributed.checkpoint import _version
from torch.distributed.pipelining._IR import Pipe
from torch.testing._internal.distributed import multi_threaded_pg

_install_lock = threading.Lock()
_installed = False


def _install() -> None:
    """Makes the c10d world (and group names) per thread, once per process,
    and lets a thread started by a rank see its rank's world."""
    global _installed
    with _install_lock:
        if _installed:
            return
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        multi_threaded_pg._install_threaded_pg()
        local = multi_threaded_pg.ThreadLocalWorld._world
        start = threading.Thread.start

        def start_in_world(self):
            world = getattr(local, "world", None)
            if world is not None and world.default_pg is not None:
                run = self.run

                def run_in_world():
                    local.world = world
                    for group, name in list(world.pg_names.items()):
                        _register_process_group(name, group)
                    run()

                self.run = run_in_world
            start(self)

        threading.Thread.start = start_in_world
        # torch.export (a traced split) keeps global state: one rank at a time.
        trace, lock = Pipe._trace_with_export, threading.Lock()

        def trace_alone(*args, **kwargs):
            with lock:
                return trace(*args, **kwargs)

        Pipe._trace_with_export = staticmethod(trace_alone)
        # DCP's load planner sets the module-level _derived_version to "2_3"
        # for a moment when a rank's keys are a subset of the step's (every
        # pipeline stage): another rank flattening then would keep its non-tensor
        # sections whole. In a process of its own, no other rank sees it.
        _version.__class__ = _PerThreadVersion
        _installed = True


class _PerThreadVersion(types.ModuleType):
    """DCP's ``_version`` module, its ``_derived_version`` one per thread."""

    _local = threading.local()

    @property
    def _derived_version(self):
        return getattr(self._local, "value", None)

    @_derived_version.setter
    def _derived_version(self, value):
        self._local.value = value


def run_ranks(nproc, fn, *args, timeout=120):
    """Runs ``fn(rank, nproc, *args)`` on `nproc` ranks, each a thread in a
    gloo process group of `nproc`; the results, by rank.

    A rank that raises fails the test with its traceback (each failing rank's,
    once); its group is destroyed, so ranks waiting on it fail instead of
    hanging. `timeout` (s) bounds each collective and the whole run.
    """
    _install()
    store = dist.HashStore()
    results, errors = [None] * nproc, [None] * nproc

    def rank_main(rank):
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=nproc,
            timeout=timedelta(seconds=timeout),
        )
        try:
            results[rank] = fn(rank, nproc, *args)
        except BaseException as e:  # noqa: B036 (CheckpointException is one)
            errors[rank] = "".join(traceback.format_exception(e))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True)
        for r in range(nproc)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if hung or failed:
        text = "".join(f"--- rank {r}\n{e}" for r, e in failed.items())
        pytest.fail(
            f"ranks {hung} did not finish in {timeout} s\n{text}" if hung else text
        )
    return results


def run_checks(nproc, checks, out, timeout=300):
    """The checks of test/*_checks.py on `nproc` ranks as threads, as
    shared_checks.py runs them under torchrun: `checks` is {script: [check,
    ...]}, run in order; each writes OUT/<script>/<check>-rank<R>.json and
    whatever it saves there. Returns {script: its folder}."""
    import importlib
    import json

    def rank_main(rank, world_size):
        for script, names in checks.items():
            folder = out / script
            folder.mkdir(parents=True, exist_ok=True)
            for name in names:
                check = importlib.import_module(script).CHECKS[name]
                result = check(folder, rank, world_size)
                (folder / f"{name}-rank{rank}.json").write_text(json.dumps(result))

    run_ranks(nproc, rank_main, timeout=timeout)
    return {script: out / script for script in checks}
