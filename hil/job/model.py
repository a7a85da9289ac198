"""The training job's model and data: a character-level transformer whose MLPs split over a
tensor-parallel group, the text it learns (shipped in `hil/job/data/`), its optimizer, and a
rank's training state as tensors a peer can copy (hil.job.worker moves them).

Everything here is plain torch on one process: the collectives the model calls go through a
`TPLink` that the rank points at its current generation's group.
"""
from __future__ import annotations

import hashlib
import math
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = pathlib.Path(__file__).with_name("data") / "devils-dictionary.txt"


# --- data -----------------------------------------------------------------------------------
class CharText:
    """The text as character ids; batches drawn from (seed, step, data-parallel index) alone,
    so any process computes the batch any rank would have at any step."""

    def __init__(self, text: str, block: int, seed: int):
        if len(text) < 2 * block + 2:
            raise ValueError(f"the text has {len(text)} characters: too short for blocks of "
                             f"{block}")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block = block
        self.seed = seed

    @classmethod
    def shipped(cls, block: int, seed: int) -> CharText:
        return cls(TEXT.read_text(encoding="ascii"), block, seed)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, step: int, dp_index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + dp_index)
        starts = torch.randint(0, len(self.ids) - self.block - 1, (size,), generator=g)
        offsets = torch.arange(self.block + 1)
        rows = self.ids[starts[:, None] + offsets[None, :]]
        return rows[:, :-1], rows[:, 1:]


# --- the model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    block: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4
    tp: int = 1                      # tensor-parallel ways of every MLP

    def __post_init__(self) -> None:
        if self.width % self.heads or (4 * self.width) % self.tp:
            raise ValueError(f"width {self.width} must divide into {self.heads} heads and its "
                             f"MLP ({4 * self.width}) into {self.tp} tensor-parallel parts")


class TPLink:
    """The tensor-parallel all-reduce the model calls; the rank points it at the current
    generation's TP group (an abortable collective)."""

    def __init__(self) -> None:
        self.allreduce: Callable[[torch.Tensor], None] | None = None

    def __call__(self, t: torch.Tensor) -> None:
        if self.allreduce is None:
            raise RuntimeError("tensor-parallel all-reduce used outside a generation")
        self.allreduce(t)


class _ToTP(torch.autograd.Function):
    """Into a tensor-parallel region: identity forward, gradients summed over the TP group."""

    @staticmethod
    def forward(ctx, x, link):
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.link(grad)
        return grad, None


class _FromTP(torch.autograd.Function):
    """Out of a tensor-parallel region: partial outputs summed over the TP group."""

    @staticmethod
    def forward(ctx, x, link):
        out = x.contiguous().clone()
        link(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """fc1 split by columns and fc2 by rows over the TP group; one all-reduce forward (the
    partial outputs) and one backward (the input's gradient)."""

    def __init__(self, cfg: ModelConfig, link: TPLink):
        super().__init__()
        hidden = 4 * cfg.width // cfg.tp
        self.tp, self.link = cfg.tp, link
        self.fc1 = nn.Linear(cfg.width, hidden)
        self.fc2 = nn.Linear(hidden, cfg.width, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.width))

    def forward(self, x):
        if self.tp > 1:
            x = _ToTP.apply(x, self.link)
        y = self.fc2(F.gelu(self.fc1(x)))
        if self.tp > 1:
            y = _FromTP.apply(y, self.link)
        return y + self.bias


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, link: TPLink):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg, link)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, link: TPLink | None = None):
        super().__init__()
        self.cfg = cfg
        self.link = link or TPLink()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.block, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, self.link) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build_model(cfg: ModelConfig, tp_index: int, seed: int) -> CharTransformer:
    """The model of TP shard `tp_index`: the full model drawn from `seed`, its MLPs sliced,
    so every process of a shard starts from the same weights."""
    torch.manual_seed(seed)
    full = CharTransformer(ModelConfig(cfg.vocab, cfg.block, cfg.width, cfg.layers, cfg.heads))
    if cfg.tp == 1:
        return full
    shard = CharTransformer(cfg)
    h = 4 * cfg.width // cfg.tp
    lo, hi = tp_index * h, (tp_index + 1) * h
    src = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in shard.named_parameters():
            w: torch.Tensor = src[name]
            if name.endswith("mlp.fc1.weight") or name.endswith("mlp.fc1.bias"):
                w = w[lo:hi]
            elif name.endswith("mlp.fc2.weight"):
                w = w[:, lo:hi]
            p.copy_(w)
    return shard


class Adam:
    """Adam (Kingma and Ba, 2015) written out over plain tensors. torch.optim's first use
    imports torch._dynamo, seconds of every process's start on a busy CPU; and a rank's whole
    optimizer state is then three lists of tensors and a step count that a peer copies."""

    def __init__(self, params: list[nn.Parameter], lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.t = torch.zeros(1, device=self.params[0].device)   # steps taken: travels with
                                                                # the state

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        t = float(self.t)
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            g = p.grad
            if g is None:           # the loss did not reach it: left as it is (as torch.optim)
                continue
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.exp_avg, *self.exp_avg_sq, self.t]


def new_optimizer(model: nn.Module, lr: float) -> Adam:
    return Adam(list(model.parameters()), lr)


def state_tensors(model: nn.Module, opt: Adam) -> list[torch.Tensor]:
    """Everything a rank's training state is: weights, then Adam's moments and step count."""
    return [p.data for p in model.parameters()] + opt.tensors()


def gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient from the last backward pass (every parameter of the model
    takes part in the loss: one without is named in a RuntimeError)."""
    out = []
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(f"parameter {i} (shape {tuple(p.shape)}) has no gradient: the "
                               "loss does not reach it")
        out.append(p.grad)
    return out


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    o = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[o:o + n].view_as(t))
            o += n
    if o != flat.numel():
        raise ValueError(f"state of {flat.numel()} values received for {o} expected")


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes: equal digests are bit-equal states."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_weights(path: pathlib.Path, model: nn.Module, step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "model": model.state_dict()}, tmp)
    os.replace(tmp, path)


def load_weights(path: str | os.PathLike) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def max_abs_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest absolute difference between two saved models' weights (inf if they differ in
    shape or names)."""
    ma, mb = a["model"], b["model"]
    if ma.keys() != mb.keys() or any(ma[k].shape != mb[k].shape for k in ma):
        return math.inf
    return max(float((ma[k] - mb[k]).abs().max()) for k in ma)
