"""The data of pippy_dcp.py: random windows of real text, as bytes.

The sampler's random state is part of the checkpoint (``StageState`` extra
state), so a resumed run draws the very batches the uninterrupted one would.
"""

import sysconfig
from pathlib import Path

import torch


def load_text(path: str | None) -> torch.Tensor:
    """Text as bytes, (num_bytes,) uint8: --data, or the stdlib's own .py files."""
    files = (
        [Path(path)]
        if path
        else sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    )
    return torch.frombuffer(
        bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8
    )


class BatchSampler:
    """Random windows of the text. Every rank draws the same batches (the first
    stage needs the inputs, the last the targets), so its state is a replica."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if len(data) <= seq_len + 1:
            raise ValueError(f"the text has {len(data)} bytes, too few for --seq-len")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (batch_size, seq_len) int64."""
        high = len(self.data) - self.seq_len - 1
        starts = torch.randint(high, (self.batch_size,), generator=self.generator)
        windows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts])
        return windows[:, :-1].long(), windows[:, 1:].long()

    def state_dict(self) -> dict:
        return {"rng_state": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.generator.set_state(state_dict["rng_state"])
