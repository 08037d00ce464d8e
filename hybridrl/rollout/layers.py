"""Building blocks of the native engine's decoder (``decoder.py``): frozen parameters that know
which transformers weights they hold, linear layers (plain or packed), RMSNorm, rotary embedding,
the attention block and the dense MLP.

A packed parameter holds several transformers weights side by side along its output rows: the
attention's ``qkv_proj`` holds ``q_proj``, ``k_proj`` and ``v_proj``, the MLP's ``gate_up_proj``
holds ``gate_proj`` and ``up_proj``, so a layer runs one matmul where transformers runs three (or
two). Each such parameter carries its ``shards`` (transformers module name -> (first row, rows)),
and :func:`hf_view` gives the slice a transformers weight occupies: loading copies into that view,
and ``named_weights`` hands out the views themselves, so a weight sync, a LoRA merge or a test that
writes through them changes what the next forward computes. A parameter stored transposed (the
experts' matrices, ``moe_block.py``) says so with ``hf_transposed``. A parameter or buffer with its
own ``weight_loader`` (the routers' balancing bias) loads through it.

Parameters never require gradients: the engine only runs forwards, and in-place updates through
the views must not trip autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.rollout.paged_attention import paged_attention


class EngineModule(nn.Module):
    """Base of the engine's modules. The engine registers no hooks on its model, so calling a module
    goes straight to ``forward`` without ``nn.Module.__call__``'s hook bookkeeping: with
    :func:`mirror_attributes`, that keeps a tiny model's decode step as fast as the plain-tensor
    forward it replaced (the module overhead measured 5 to 10 % of the step)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward  # module(x) is module.forward(x), not one frame more


def mirror_attributes(model: nn.Module) -> None:
    """Put every module's parameters and submodules into its instance ``__dict__`` as well, where
    attribute access finds them without ``nn.Module.__getattr__`` (Python code run on every
    access). The mirror is safe for a model that is updated in place, as the engine's is:
    assigning a new parameter or module through ``nn.Module.__setattr__`` removes the mirrored
    entry, so the attribute falls back to the registered one."""
    for m in model.modules():
        m.__dict__.update({n: p for n, p in m._parameters.items() if p is not None})
        m.__dict__.update({n: c for n, c in m._modules.items() if c is not None})


def frozen(*shape: int, fill: float, device, dtype) -> nn.Parameter:
    """A parameter of ``shape`` filled with ``fill`` (weights start at zero, norms at one until
    loaded), outside autograd."""
    return nn.Parameter(torch.full(shape, fill, device=device, dtype=dtype), requires_grad=False)


def set_shards(param: torch.Tensor | None, sizes: dict[str, int]) -> None:
    """Record which transformers module's weight lies in which rows of ``param`` (in order)."""
    if param is None:
        return
    shards, start = {}, 0
    for name, size in sizes.items():
        shards[name] = (start, size)
        start += size
    param.shards = shards


def hf_view(param: torch.Tensor, shard: str | None = None) -> torch.Tensor:
    """The view of ``param`` that one transformers weight names: the whole (or transposed)
    parameter, or the rows of ``shard`` in a packed one."""
    t = param.transpose(-1, -2) if getattr(param, "hf_transposed", False) else param
    if shard is None:
        return t
    start, size = param.shards[shard]
    return t.narrow(0, start, size)


def load_into(param: torch.Tensor, tensor: torch.Tensor, shard: str | None, name: str) -> None:
    """Copy ``tensor`` (the transformers weight ``name``) into its place in ``param``, cast to the
    parameter's dtype, through the parameter's own loader when it has one."""
    loader: Callable | None = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard, name)
        return
    target = hf_view(param, shard)
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
    target.copy_(tensor)


class RMSNorm(EngineModule):
    def __init__(self, size: int, eps: float, *, device, dtype):
        super().__init__()
        self.weight = frozen(size, fill=1.0, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # half precision: normalise in fp32, scale after rounding back, as transformers does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(EngineModule):
    """``x @ W^T (+ b)``; ``shards`` (transformers module name -> output rows, in order) packs
    several transformers projections into this one."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device,
        dtype,
        shards: dict[str, int] | None = None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.weight = frozen(out_features, in_features, fill=0.0, **kw)
        self.bias = frozen(out_features, fill=0.0, **kw) if bias else None
        if shards:
            set_shards(self.weight, shards)
            set_shards(self.bias, shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W^T (+ b)``, the addition fused into the matmul."""
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


class Embedding(EngineModule):
    def __init__(self, vocab: int, hidden: int, *, device, dtype):
        super().__init__()
        self.weight = frozen(vocab, hidden, fill=0.0, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def rope_tables(
    inv_freq: torch.Tensor, scaling: float, max_pos: int, *, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_pos, head_dim) cos and signed sin tables for :func:`apply_rotary`: the sin table holds
    (-sin, sin) over the two halves, the sign of rotate_half."""
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    half = inv_freq.shape[0]
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return (emb.cos() * scaling).to(device, dtype), (emb.sin() * scaling * sign).to(device, dtype)


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (T, heads, D): x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1) is
    the flip of the halves times the sign folded into ``sin``."""
    T, n, D = qk.shape
    return torch.addcmul(qk * cos, qk.view(T, n, 2, D // 2).flip(2).view(T, n, D), sin)


class Attention(EngineModule):
    """One layer's self-attention: the packed q/k/v projection, q/k RMSNorm where the family has
    it, rotary, the paged-KV attention of ``paged_attention.py`` and the output projection added
    to the residual."""

    def __init__(self, spec, layer_index: int, *, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        H, D = spec.hidden_size, spec.head_dim
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        q, kv = spec.num_heads * D, spec.num_kv_heads * D
        shards = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        self.qkv_proj = Linear(H, q + 2 * kv, bias=spec.attn_bias, shards=shards, **kw)
        self.o_proj = Linear(q, H, bias=spec.o_bias, **kw)
        self.q_norm = RMSNorm(D, spec.rms_eps, **kw) if spec.qk_norm else None
        self.k_norm = RMSNorm(D, spec.rms_eps, **kw) if spec.qk_norm else None

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, x, pool) -> torch.Tensor:
        """``residual`` + attention over ``normed`` (T, hidden) for step inputs ``x``, reading and
        writing this layer's KV in ``pool`` (the runner)."""
        T, H, KV, D = normed.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(normed)
        qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
        v = qkv[:, (H + KV) * D :].view(T, KV, D)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :H]), self.k_norm(qk[:, H:])], 1)
        qk = apply_rotary(qk, x.cos, x.sin)
        out = paged_attention(pool, self.layer_index, qk[:, :H], qk[:, H:], v, x)
        return self.o_proj.add_to(residual, out)


class MLP(EngineModule):
    """SiLU-gated MLP with gate and up packed into one projection."""

    def __init__(self, hidden: int, inter: int, *, bias: bool, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        shards = {"gate_proj": inter, "up_proj": inter}
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias, shards=shards, **kw)
        self.down_proj = Linear(inter, hidden, bias=bias, **kw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, added to ``residual`` inside the down projection when given."""
        g, u = self.gate_up_proj(x).chunk(2, -1)
        act = F.silu(g).mul_(u)
        return self.down_proj(act) if residual is None else self.down_proj.add_to(residual, act)
