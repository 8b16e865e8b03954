"""Writes a golden checkpoint with the torch of the interpreter that runs it.

    python -m venv /tmp/t && /tmp/t/bin/pip install torch==X numpy google-crc32c safetensors
    /tmp/t/bin/python test/golden/make_golden.py

It launches 2 ranks (torchrun, gloo, CPU) that build the stages of a tiny GPT
with ``pippy.build_stage_module``, train 2 steps with AdamW and an LR schedule,
and ``save_stage`` step-2 into ``test/golden/torch-<X.Y>/step-2`` (about 100 KB),
then writes ``digests.json`` beside it: the SHA-256 of every tensor's bytes,
its dtype and shape, and the repr of every other value, read back with the
same torch. The suite (test/test_golden.py) loads each golden step with the
pinned torch and compares. A new torch release adds its own in one command.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def digest(value) -> object:
    """What a value must be, compared across torch versions."""
    import torch

    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().view(-1).view(torch.uint8).numpy()
        return {
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "sha256": hashlib.sha256(data.tobytes()).hexdigest(),
        }
    return repr(value)


def save_on_ranks(out: Path) -> None:
    """On each rank: build, train and save the stage."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples" / "checkpoint"))
    import pippy
    from pippy import checkpoint

    from gpt import GPT, ModelArgs, init_weights

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = pippy.build_stage_module(
        lambda: GPT(ModelArgs(n_layers=2, dim=16, max_seq_len=8)),
        rank,
        world_size,
        device="cpu",
        layers="layers",
        first=["tok_embeddings"],
        last=["norm", "output"],
    )
    init_weights(module, seed=0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    state = checkpoint.StageState(module, optimizer, scheduler)
    stage = pippy.PipelineStage(module, rank, world_size, torch.device("cpu"))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    schedule = pippy.ScheduleGPipe(stage, 2, loss_fn=loss_fn)
    tokens = torch.randint(256, (4, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        inputs = [tokens[:, :-1].contiguous()] if stage.is_first else []
        targets = {"target": tokens[:, 1:].contiguous()} if stage.is_last else {}
        schedule.step(*inputs, **targets)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state.step += 1
    checkpoint.save_stage(state, out)
    dist.destroy_process_group()


def main() -> None:
    import torch

    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    out = HERE / f"torch-{version}"
    if "RANK" in os.environ:  # a rank of the launch below
        return save_on_ranks(out)
    if out.exists():
        sys.exit(f"{out} exists; delete it to write it again")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += ["--nproc-per-node=2", __file__]
    subprocess.run(launch, check=True, env=env, timeout=300)
    sys.path.insert(0, str(ROOT))
    from pippy.checkpoint import offline

    values = offline.read_checkpoint(out / "step-2")
    digests = {key: digest(value) for key, value in sorted(values.items())}
    (out / "digests.json").write_text(
        json.dumps({"torch": torch.__version__, "items": digests}, indent=1) + "\n"
    )
    print(f"wrote {out}: {len(digests)} items")


if __name__ == "__main__":
    main()
