"""StopSignal.requested() on 2 ranks (run by test_preemption.py with torchrun).

Rank 1 makes each call only once rank 0 has returned from the same call, so
a call that waited for the other rank would never return; rank 1 receives
SIGUSR1 before its second call. Each rank writes its answers and the reason.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from pippy import checkpoint


def main(out: str) -> None:
    """On 2 ranks (run as a script): rank 0's calls return while rank 1 has not
    made its own yet, and both learn of rank 1's signal at the same call."""
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), Path(out)
    stop = checkpoint.job.StopSignal((signal.SIGUSR1,))
    answers = []
    for call in range(4):
        if rank == 1:  # waits until rank 0 has returned from this very call
            deadline = time.monotonic() + 60
            while not (out / f"returned-{call}").exists():
                assert time.monotonic() < deadline, f"rank 0 blocked in call {call}"
                time.sleep(0.01)
            if call == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
        answers.append(stop.requested())
        if rank == 0:
            (out / f"returned-{call}").touch()
    (out / f"rank-{rank}").write_text(f"{answers} {stop.reason}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
