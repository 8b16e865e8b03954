"""Checkpoints are not tied to one layout: other pipeline degrees, the
un-split model, FSDP2, weights-only starts, several nodes, per-stage memory."""

import json
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import pippy
from pippy.checkpoint import offline
from pippy.checkpoint.checks import named_leaves

import parallel
import pippy_dcp
from gpt import GPT, ModelArgs
from helpers import EXAMPLE, ROOT, TINY_FLAGS, example, loss_lines

FLAGS = ["--steps", "6", "--save-every", "3"]
TINY = ModelArgs(4, 32, max_seq_len=32)


@pytest.fixture(scope="module")
def uninterrupted(four_rank_run):
    """An uninterrupted 4-rank run of the example (FLAGS, the default split and
    schedule): the reference, shared with test_example (conftest.py)."""
    folder, stdout = four_rank_run
    return folder, loss_lines(stdout)


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4)])
def test_resume_on_another_number_of_stages(
    request, tmp_path, uninterrupted, before, after
):
    if before == 4:  # stopped after step 3 on 4 ranks: shared with test_example
        stopped = request.getfixturevalue("four_rank_stopped")[0]
        shutil.copytree(stopped, tmp_path, dirs_exist_ok=True)
    else:
        stop = ["--checkpoint-dir", tmp_path, "--stop-after", "3"]
        example(before, *FLAGS, *stop)
    run = example(after, *FLAGS, "--checkpoint-dir", tmp_path)
    assert f"resuming from {tmp_path / 'step-3'}" in run.stdout
    assert "verified:" in run.stdout
    reference, reference_losses = uninterrupted
    # Splitting into stages changes no arithmetic (each layer runs the same ops
    # on the same microbatches), so the resumed run matches bit for bit.
    assert loss_lines(run.stdout) == reference_losses[3:]
    resumed = offline.read_checkpoint(tmp_path / "step-6")
    assert (
        offline.diff_state_dicts(resumed, offline.read_checkpoint(reference / "step-6"))
        == []
    )


def test_init_from_takes_the_weights_and_nothing_else(tmp_path, uninterrupted):
    source = uninterrupted[0] / "step-6"
    # lr 0: one AdamW step leaves the weights as loaded, and moves the rest.
    flags = ["--steps", "1", "--lr", "0", "--init-from", source]
    run = example(2, *flags, "--checkpoint-dir", tmp_path)
    assert f"starting from the weights of {source}" in run.stdout
    new, old = (
        offline.read_checkpoint(tmp_path / "step-1"),
        offline.read_checkpoint(source),
    )
    model_keys = [k for k in old if k.startswith("model.")]
    assert model_keys and all(torch.equal(new[k], old[k]) for k in model_keys)
    assert new["step"] == 1 and old["step"] == 6
    adam_steps = {
        value
        for k, entries in new.items()
        if k.startswith("optim.scalars.")
        for name, value, *_ in entries
        if name == "state.step"
    }
    assert adam_steps == {1.0}  # a fresh optimizer, one step old
    assert new["lr_scheduler.last_epoch"] == 1


def test_init_from_a_hugging_face_folder_takes_its_weights(tmp_path, uninterrupted):
    """The weights of step-6, exported as safetensors shards with an index,
    start a new run on 2 ranks: each rank reads its stage's tensors."""
    source = uninterrupted[0] / "step-6"
    hf = tmp_path / "hf"
    offline.export_hf(source, hf, config={"model_type": "gpt"}, max_shard_size=50_000)
    assert (hf / "model.safetensors.index.json").is_file()
    flags = ["--steps", "1", "--lr", "0", "--init-from", hf]
    run = example(2, *flags, "--checkpoint-dir", tmp_path / "ckpt")
    assert f"starting from the weights of {hf}" in run.stdout
    assert re.search(r"^\[rank 1\] stage 1: loaded \d+ tensors", run.stdout, re.M)
    new, old = (
        offline.read_checkpoint(tmp_path / "ckpt" / "step-1"),
        offline.read_checkpoint(source),
    )
    model_keys = [k for k in old if k.startswith("model.")]
    assert model_keys and all(torch.equal(new[k], old[k]) for k in model_keys)
    assert new["step"] == 1 and new["lr_scheduler.last_epoch"] == 1


@pytest.fixture(scope="module")
def pipeline_outputs(four_rank_checks):
    """A 4-stage run that saved step-2, its stage tensors and its logits (the
    logits check, in a launch shared with test_stages' checks: conftest.py)."""
    return four_rank_checks["dist_checks"]


def test_checkpoint_loads_into_the_unsplit_model(pipeline_outputs):
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters())
    path = pipeline_outputs / "ckpt" / "step-2"
    assert offline.load_model(path, model, optimizer) == 2

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    stages = [
        torch.load(pipeline_outputs / f"stage-{r}.pt", weights_only=True)
        for r in range(4)
    ]
    assert sorted(k for s in stages for k in s["model"]) == sorted(model_sd)
    moments = dict(named_leaves(optim_sd))
    for stage in stages:
        own = {k: model_sd[k] for k in stage["model"]}
        assert offline.diff_state_dicts(own, stage["model"]) == []
        stage_moments = {
            k: v for k, v in named_leaves(stage["optim"]) if k.startswith("state.")
        }
        assert stage_moments
        assert (
            offline.diff_state_dicts(
                {k: moments[k] for k in stage_moments}, stage_moments
            )
            == []
        )
    saved = torch.load(pipeline_outputs / "logits.pt", weights_only=True)
    with torch.no_grad():  # the pipeline ran the same 4 microbatches
        logits = torch.cat([model(mb) for mb in saved["inputs"].chunk(4)])
    assert torch.equal(logits, saved["logits"])


def test_pipeline_checkpoint_loads_into_fsdp2_and_trains_on(
    pipeline_outputs, fsdp_checks
):
    # fsdp_checks.py's check on 2 ranks, from a copy of the pipeline's ckpt/
    # (conftest.py).
    fsdp = fsdp_checks
    ranks = [json.loads((fsdp / f"fsdp-rank{r}.json").read_text()) for r in range(2)]
    saved = offline.read_checkpoint(
        pipeline_outputs / "ckpt" / "step-2", prefix="model."
    )
    for rank in range(2):
        assert ranks[rank]["step"] == 2 and ranks[rank]["moments"] == len(saved)
        loaded = torch.load(fsdp / f"fsdp-model-{rank}.pt", weights_only=True)
        assert offline.diff_state_dicts(loaded, saved) == []
    # The same two steps in one process on the un-split model: FSDP averages
    # gradients over ranks in another order, so the losses agree to 1e-5.
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    offline.load_model(pipeline_outputs / "ckpt" / "step-2", model, optimizer)
    sampler = pippy_dcp.BatchSampler(pippy_dcp.load_text(None), 8, 32, seed=5)
    losses = []
    for _ in range(2):
        inputs, targets = sampler.next_batch()
        loss = parallel.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5)


def test_each_rank_allocates_only_its_own_stage(memory_launch):
    out = memory_launch
    for rank in range(4):  # the memory check runs alone in its launch
        r = json.loads((out / f"memory-rank{rank}.json").read_text())
        assert r["layers"] == list(pippy.layer_range(rank, 4, 16))
        assert r["stage_bytes"] < 0.3 * r["full_bytes"]
        # Peak memory while building the stage stays far below the whole
        # model, which the control (building the whole model) does reach.
        assert r["stage_peak"] < 0.5 * r["full_bytes"], r
        assert r["whole_peak"] > 0.8 * r["full_bytes"], r


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.launches
def test_two_nodes_write_one_checkpoint_then_one_node_resumes(tmp_path):
    """Two torchrun launchers on localhost stand in for two nodes of 2 ranks
    (a tiny model: what is tested is who writes and who resumes)."""
    endpoint = f"127.0.0.1:{free_port()}"
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
        "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", str(EXAMPLE),
        *TINY_FLAGS, *FLAGS, "--checkpoint-dir", str(tmp_path), "--stop-after", "3",
    ]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    nodes = [
        subprocess.Popen(
            launch,
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    stdout = "".join(out for out, _ in outputs)
    for rank in range(4):
        assert f"[rank {rank}] stage {rank}: saved" in stdout
    files = sorted(p.name for p in (tmp_path / "step-3").iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)] + [
        "manifest.json"
    ]

    run = example(4, *TINY_FLAGS, *FLAGS, "--checkpoint-dir", tmp_path)
    assert f"resuming from {tmp_path / 'step-3'}" in run.stdout
    assert "verified:" in run.stdout
