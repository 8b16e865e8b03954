"""The model of pippy_dcp.py: a small byte-level GPT, as a pipeline splits it.

What matters for checkpointing: the decoder blocks live in an ``nn.ModuleDict``
keyed by the global layer index, so a stage that keeps layers 4 and 5 still
names them ``layers.4`` and ``layers.5``; the parts a stage lacks are ``None``;
the RoPE table is a non-persistent buffer (not in the ``state_dict``); and
``init_weights`` gives every parameter a value that depends on its FQN alone.
"""

import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    n_layers: int = 8
    dim: int = 128
    n_heads: int = 4
    max_seq_len: int = 128
    vocab_size: int = 256  # bytes


def rope_table(args: ModelArgs) -> torch.Tensor:
    """Rotary embedding cos and sin: (2, max_seq_len, head_dim // 2)."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(args.max_seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    cos, sin = rope[0, : x.shape[2]], rope[1, : x.shape[2]]  # x: (b, heads, t, hd)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.attn_norm = nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(args.dim)
        hidden = 4 * args.dim
        self.mlp = nn.Sequential(
            nn.Linear(args.dim, hidden), nn.GELU(), nn.Linear(hidden, args.dim)
        )

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            apply_rope(q, rope), apply_rope(k, rope), v, is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by the global layer index: a stage that keeps layers 4 and 5
        # still calls them "layers.4" and "layers.5", the un-split model's FQNs.
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from the config, so not part of the state_dict.
        self.register_buffer("rope", rope_table(args), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # (b, t) bytes on the first stage, (b, t, dim) activations on the others
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h  # (b, t, vocab)


def init_weights(module: nn.Module, seed: int) -> None:
    """Initialises every parameter from (seed, its FQN) alone, so that a stage
    holds the same initial values whatever the split, and none of the un-split
    model's other parameters need to exist."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim == 1:  # norm weights 1, biases 0
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                g = torch.Generator().manual_seed(
                    seed << 32 | zlib.crc32(name.encode())
                )
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
