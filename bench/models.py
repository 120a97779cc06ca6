"""The models the training workloads run: a small GPT-style decoder and LoRA adapters for it.

Everything is generated locally: weights are randomly initialised and the training data are random token
ids, so nothing is downloaded. Training time is never measured; these only produce realistic states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    d_model: int = 512
    n_layers: int = 14
    n_heads: int = 8
    vocab: int = 8192
    ctx: int = 64

    def n_params(self) -> int:
        d = self.d_model
        block = 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d + 4 * d
        return self.vocab * d + self.ctx * d + self.n_layers * block + 2 * d + self.vocab * d


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of :class:`GPT`'s parameters without building it (meta-device init is slow)."""
    d, v = cfg.d_model, cfg.vocab
    shapes: dict[str, tuple[int, ...]] = {"tok.weight": (v, d), "pos.weight": (cfg.ctx, d)}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes.update({
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "qkv.weight": (3 * d, d), p + "qkv.bias": (3 * d,),
            p + "proj.weight": (d, d), p + "proj.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
            p + "fc1.weight": (4 * d, d), p + "fc1.bias": (4 * d,),
            p + "fc2.weight": (d, 4 * d), p + "fc2.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "head.weight": (v, d)})
    return shapes


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.ctx, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B @ A`` (B starts at zero, as in LoRA)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def add_lora(model: GPT, rank: int) -> None:
    """Freeze every parameter of ``model`` and put LoRA adapters on each block's four Linear layers."""
    model.requires_grad_(False)
    for blk in model.blocks:
        for name in ("qkv", "proj", "fc1", "fc2"):
            setattr(blk, name, LoRALinear(getattr(blk, name), rank))


def train_step(model: GPT, opt: torch.optim.Optimizer, gen: torch.Generator, batch: int) -> float:
    """One real optimizer step of next-token prediction on random token ids; returns the loss."""
    cfg = model.cfg
    x = torch.randint(0, cfg.vocab, (batch, cfg.ctx + 1), generator=gen)
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())
