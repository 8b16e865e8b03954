"""How long a background save stalls another Python thread (the GIL).

On a GPU the training thread launches kernels while ``AsyncSaver`` writes in
the background; any call that holds the GIL for long stalls it. A thread
here sleeps 1 ms at a time and records its longest wait while an async save
writes one ``--mb`` MB tensor, with pippy's checksums in chunks
(``manifest.CRC_CHUNK``) and, for comparison, in one call per write (as
before). One process, no process group.

    python bench/gil_stall.py --mb 512 --out-dir bench/results-gil
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pippy import checkpoint  # noqa: E402
from pippy.checkpoint import manifest  # noqa: E402


def longest_stall(mb: int, folder: Path, repeats: int) -> float:
    """The longest wait (ms) of a 1 ms sleeper during ``repeats`` saves."""
    state = {"model": {"w": torch.randn(mb * (1 << 20) // 4)}, "step": 0}
    saver = checkpoint.AsyncSaver(folder, keep_last=1)
    worst, done = 0.0, threading.Event()

    def tick() -> None:  # one sleep at least, then until the save is done
        nonlocal worst
        while True:
            start = time.perf_counter()
            time.sleep(0.001)
            worst = max(worst, time.perf_counter() - start)
            if done.is_set():
                return

    try:
        for step in range(1, repeats + 1):
            state["step"] = step
            worst, done = 0.0, threading.Event()
            ticker = threading.Thread(target=tick)
            ticker.start()
            saver.save(state, step)
            saver.wait()
            done.set()
            ticker.join()
    finally:
        saver.close()
    return worst * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        rows["chunked"] = longest_stall(args.mb, Path(work) / "a", args.repeats)
        with mock.patch.object(manifest, "CRC_CHUNK", 1 << 62):  # one call a write
            rows["one_call"] = longest_stall(args.mb, Path(work) / "b", args.repeats)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    table = (
        f"| tensor MB | longest stall, CRC in {manifest.CRC_CHUNK >> 20} MiB chunks "
        "| in one call per write |\n| --- | --- | --- |\n"
        f"| {args.mb} | {rows['chunked']:.1f} ms | {rows['one_call']:.1f} ms |\n"
    )
    (args.out_dir / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
