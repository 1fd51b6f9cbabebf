"""A small GPT-style language model in plain PyTorch (no hpshard in it): token and position
embeddings, pre-norm blocks of causal self-attention and an MLP, a final layer norm and an
output layer tied to the token embedding. The main job (train_gpt.py), the adapter's
tests and the torch peer benchmark (hpshard-bench torch) all train this one model.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 96
    context: int = 64
    width: int = 128
    heads: int = 4
    layers: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        if c.width % c.heads:
            raise ValueError(f"width {c.width} is not a multiple of heads {c.heads}")
        self.heads = c.heads
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        # Added to the scores: 0 where a position may attend, -inf after it. (A float, not a
        # bool mask: DDP broadcasts buffers over gloo, which has no bool.)
        mask = torch.full((c.context, c.context), float("-inf")).triu(1)
        self.register_buffer("mask", mask.view(1, 1, c.context, c.context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).split(w, dim=2)
        q = q.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(w // self.heads))
        att = (att + self.mask[:, :, :t, :t]).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, w)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(),
                                 nn.Linear(4 * c.width, c.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.width)
        self.wpe = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter under two names
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting ``targets`` (the next characters)."""
        t = tokens.shape[1]
        positions = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def parameter_count(model: nn.Module) -> int:
    """Parameters, tied ones once."""
    return sum(p.numel() for p in model.parameters())
