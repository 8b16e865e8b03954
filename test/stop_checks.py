"""StopSignal.requested() on 2 ranks (in the launch of checks that conftest.py
shares, last: it leaves its SIGUSR1 handler in place).

Rank 1 makes each call only once rank 0 has returned from the same call, so
a call that waited for the other rank would never return; rank 1 receives
SIGUSR1 before its second call. Each rank writes its answers and the reason.
"""

import os
import signal
import time
from pathlib import Path

from pippy import checkpoint


def check_stop(out: Path, rank: int, world_size: int) -> dict:
    """Rank 0's calls return while rank 1 has not made its own yet, and both
    learn of rank 1's signal at the same call."""
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
    return {}


#: For ranks.run_checks and shared_checks.py: this module's checks by name.
CHECKS = {"stop": check_stop}
