"""Save and load against a local S3 server (SeaweedFS), next to the local disk.

    python bench/bucket.py --mb 50 --repeats 3

One process (no process group: one rank's share of a checkpoint) saves a
StageState of about --mb MB (a Linear stack with AdamW state) with
``save_stage`` and loads it with ``load_stage``, into a local folder and into
a bucket of a ``weed server`` it starts on 127.0.0.1, interleaved, --repeats
times each; and times writing one file of that size to the bucket in one PUT
(``pipe_file``) against s3fs's multipart upload at two block sizes, which is
how DCP's data files go up. Prints one Markdown table of medians and ratios.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "checkpoint"))
from pippy import checkpoint  # noqa: E402

from helpers import s3_env, start_s3_server  # noqa: E402


def state_of(mb: float) -> checkpoint.StageState:
    """A stack of Linear layers with AdamW state: about ``mb`` MB in all."""
    width = 512
    layers = max(1, round(mb * 1e6 / (3 * 4 * width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return checkpoint.StageState(model, optimizer, step=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50, help="state size, MB")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pippy-bucket-"))
    (work / "s3").mkdir()
    proc, endpoint = start_s3_server(work / "s3")
    os.environ.update(s3_env(endpoint))
    import s3fs

    fs = s3fs.S3FileSystem()
    for _ in range(50):
        try:
            fs.mkdir("bench")
            break
        except OSError:
            time.sleep(0.2)
    state = state_of(args.mb)
    sd = state.module.state_dict()
    nbytes = 3 * sum(t.numel() * t.element_size() for t in sd.values())
    blob = os.urandom(nbytes)
    times: dict[str, list[float]] = {}

    def record(name: str, fn) -> None:
        start = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - start)

    def multipart(path: str, block: int) -> None:
        with fs.open(path, "wb", block_size=block) as f:
            f.write(blob)

    try:
        for r in range(args.repeats):
            for where, root in (
                ("local disk", work / f"local-{r}"),
                ("bucket", f"s3://bench/run-{r}"),
            ):
                record(
                    f"save_stage, {where}",
                    lambda root=root: checkpoint.save_stage(state, root),
                )
                step = checkpoint.find_latest_step(root)
                record(
                    f"load_stage, {where}",
                    lambda step=step: checkpoint.load_stage(state, step),
                )
            record(
                "one file, one PUT", lambda r=r: fs.pipe_file(f"bench/blob-{r}", blob)
            )
            for block in (5 * 2**20, 50 * 2**20):
                name = f"one file, multipart, {block >> 20} MiB parts"
                record(name, lambda r=r, b=block: multipart(f"bench/mp-{r}-{b}", b))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    print(f"{nbytes / 1e6:.0f} MB of state, median of {args.repeats} (seconds;")
    print("ratios to the first row of each kind)\n")
    print("| what | s | ratio |\n| --- | ---: | ---: |")
    base: dict[str, float] = {}
    for name, values in times.items():
        kind = name.split(",")[0]
        median = statistics.median(values)
        base.setdefault(kind, median)
        print(f"| {name} | {median:.3f} | {median / base[kind]:.2f}x |")


if __name__ == "__main__":
    main()
