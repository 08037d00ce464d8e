"""Our own forward pass for Qwen2 / Qwen3 / Llama and their mixture-of-experts siblings
(Qwen2-MoE, Qwen3-MoE, Mixtral: ``moe_block.py``) over a paged KV cache.

Weights are plain tensors loaded by their transformers names (from a live
state dict or a safetensors checkpoint); q/k/v and gate/up are fused into one
matrix each, so a layer is four matmuls. The step's tokens of all sequences are
packed into one flat (T, hidden) batch with no padding for every matmul; only
attention pads, to the step's longest query and context. The KV pool is one
tensor per K and V of shape (layers, kv_heads, slots, head_dim), slot =
block * block_size + offset; attention writes the new K/V at the sequences'
slots and gathers each sequence's context through its block table into a
reused buffer, then computes grouped-query attention without repeating K/V. Plain torch: CPU here,
CUDA unchanged.

Mixture-of-experts models also record routing: next to the KV pool lies a routing pool of shape
(slots, MoE layers, k), int16, and every forward writes the experts each MoE layer chose for a
token at that token's KV slot. Routing thus lives and dies with the KV: a prompt prefix served
from the prefix cache brings its tokens' routing in its blocks, a fork's copied block copies it,
and a recomputed token (after a preemption or a weight update) overwrites it. ``read_routing``
gathers a sequence's routing through its block table before its blocks are freed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE
from hybridrl.rollout.model_spec import ModelSpec, default_inv_freq
from hybridrl.rollout.moe_block import MoEBlock
from hybridrl.rollout.sequence import Sequence
from hybridrl.rollout.step_inputs import StepInputs, StepPreparation


class ModelRunner(StepPreparation):
    def __init__(
        self,
        config,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        hf_model=None,
        keep_gathered: bool | None = None,
    ):
        self.config = config
        self.spec = s = ModelSpec.from_config(config)
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        kw = dict(device=self.device, dtype=dtype)
        H, D, KV, FF = s.hidden_size, s.head_dim, s.num_kv_heads, s.intermediate_size
        self.q_size, self.kv_size = s.num_heads * D, KV * D
        qkv = self.q_size + 2 * self.kv_size
        self.layers = []
        for li in range(s.num_layers):
            sparse = s.is_sparse(li)
            self.layers.append(
                dict(
                    ln1=torch.ones(H, **kw),
                    ln2=torch.ones(H, **kw),
                    wqkv=torch.zeros(qkv, H, **kw),
                    bqkv=torch.zeros(qkv, **kw) if s.attn_bias else None,
                    qn=torch.ones(D, **kw) if s.qk_norm else None,
                    kn=torch.ones(D, **kw) if s.qk_norm else None,
                    wo=torch.zeros(H, self.q_size, **kw),
                    bo=torch.zeros(H, **kw) if s.o_bias else None,
                    wgu=None if sparse else torch.zeros(2 * FF, H, **kw),
                    bgu=torch.zeros(2 * FF, **kw) if s.mlp_bias and not sparse else None,
                    wd=None if sparse else torch.zeros(H, FF, **kw),
                    bd=torch.zeros(H, **kw) if s.mlp_bias and not sparse else None,
                    moe=MoEBlock(s.moe, H, **kw) if sparse else None,
                )
            )
        self.embed = torch.zeros(s.vocab_size, H, **kw)
        self.lm_head = self.embed if s.tie_word_embeddings else torch.zeros(s.vocab_size, H, **kw)
        self.norm = torch.ones(H, **kw)
        self._targets = self._name_map()
        # accepted by load_weights, never required of a sync: the routers' balancing bias
        self._optional = {
            n: t
            for i, L in enumerate(self.layers)
            if L["moe"] is not None
            for n, t in L["moe"].optional_names(f"model.layers.{i}.mlp.").items()
        }
        self.routing_pool: torch.Tensor | None = None  # (slots, MoE layers, k) expert ids
        self.records_routing = s.moe is not None
        rot = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
        if rot is not None:
            inv_freq, scaling = (
                rot.inv_freq.detach().float().cpu(),
                float(getattr(rot, "attention_scaling", 1.0)),
            )
        else:
            inv_freq, scaling = default_inv_freq(config, D)
        # + room for speculative lookahead
        self._build_rope(inv_freq, scaling, s.max_positions + 64)
        self.k_cache = self.v_cache = None
        self.num_blocks = 0
        self._kbuf = self._vbuf = None
        # Keep each layer's gathered context between decode steps over the same batch and only
        # append the new token: on a CPU the per-step gather costs about as much as a small model's
        # matmuls. Off on CUDA.
        self.keep_gathered = self.device.type == "cpu" if keep_gathered is None else keep_gathered
        self._layer_bufs: list | None = None
        self._last_batch: tuple | None = None  # (blocks per row, {seq_id: row}) of the kept buffers
        if hf_model is not None:
            self.load_weights(hf_model.state_dict().items())

    # --- weights ----------------------------------------------------------------
    def _name_map(self) -> dict[str, torch.Tensor]:
        s, m = self.spec, {}
        q, kv, ff = self.q_size, self.kv_size, s.intermediate_size
        m["model.embed_tokens.weight"] = self.embed
        m["lm_head.weight"] = self.lm_head
        m["model.norm.weight"] = self.norm
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            m[p + "input_layernorm.weight"] = L["ln1"]
            m[p + "post_attention_layernorm.weight"] = L["ln2"]
            for name, t in (("weight", L["wqkv"]), ("bias", L["bqkv"])):
                if t is not None:
                    m[p + f"self_attn.q_proj.{name}"] = t[:q]
                    m[p + f"self_attn.k_proj.{name}"] = t[q : q + kv]
                    m[p + f"self_attn.v_proj.{name}"] = t[q + kv :]
            m[p + "self_attn.o_proj.weight"] = L["wo"]
            if L["bo"] is not None:
                m[p + "self_attn.o_proj.bias"] = L["bo"]
            if s.qk_norm:
                m[p + "self_attn.q_norm.weight"] = L["qn"]
                m[p + "self_attn.k_norm.weight"] = L["kn"]
            if L["moe"] is not None:
                m.update(L["moe"].name_map(p + "mlp."))
                continue
            for name, t in (("weight", L["wgu"]), ("bias", L["bgu"])):
                if t is not None:
                    m[p + f"mlp.gate_proj.{name}"] = t[:ff]
                    m[p + f"mlp.up_proj.{name}"] = t[ff:]
            m[p + "mlp.down_proj.weight"] = L["wd"]
            if L["bd"] is not None:
                m[p + "mlp.down_proj.bias"] = L["bd"]
        return m

    def optional_weight_names(self) -> set[str]:
        """Names a weight sync may carry besides :meth:`named_weights` (the routers' bias)."""
        return set(self._optional)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The live weights by transformers name (views into the fused tensors; a tied head is the
        embedding)."""
        return dict(self._targets)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors (transformers names) into the live weights in place; the number loaded."""
        count = 0
        for name, tensor in named_tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target = self._targets.get(name)
            if target is None and name in self._optional:
                target = self._optional[name]
                self._moe_of(name).has_bias = True  # selection now adds the bias
            if target is None:
                raise KeyError(f"native rollout: no weight named {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
            target.copy_(tensor)
            count += 1
        return count

    def _moe_of(self, name: str) -> MoEBlock:
        return self.layers[int(name.split(".")[2])]["moe"]

    def load_safetensors(self, path: str) -> int:
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path!r}")
        return sum(self.load_weights(load_file(str(f)).items()) for f in files)

    def _build_rope(self, inv_freq: torch.Tensor, scaling: float, max_pos: int) -> None:
        self._rope_args = (inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        self.cos_table = (emb.cos() * scaling).to(self.device, self.dtype)
        # sin_table holds (-sin, sin) over the halves: the sign of rotate_half
        half = inv_freq.shape[0]
        self.sin_table = (
            emb.sin() * scaling * torch.cat([-torch.ones(half), torch.ones(half)])
        ).to(self.device, self.dtype)

    # --- KV pool ------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        s = self.spec
        routing = self.block_size * self._routing_width() * torch.iinfo(ROUTING_DTYPE).bits // 8
        return routing + (
            2
            * s.num_layers
            * s.num_kv_heads
            * s.head_dim
            * self.block_size
            * torch.finfo(self.dtype).bits
            // 8
        )

    def allocate_kv(self, num_blocks: int) -> None:
        s = self.spec
        shape = (s.num_layers, s.num_kv_heads, num_blocks * self.block_size, s.head_dim)
        # zeros: masked slots stay finite
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.num_blocks = num_blocks
        if s.moe is not None:
            self.routing_pool = torch.full(
                (num_blocks * self.block_size, s.num_moe_layers, s.moe.top_k),
                NOT_ROUTED,
                device=self.device,
                dtype=ROUTING_DTYPE,
            )

    def _routing_width(self) -> int:
        """Expert ids stored per token slot (0 for a dense model)."""
        s = self.spec
        return s.num_moe_layers * s.moe.top_k if s.moe is not None else 0

    def read_routing(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """(num_tokens, MoE layers, k) int16 on the CPU: the routing recorded at the first
        ``num_tokens`` positions of a sequence with ``block_table``."""
        bs = self.block_size
        pos = torch.arange(num_tokens)
        slots = torch.tensor(block_table, dtype=torch.long)[pos // bs] * bs + pos % bs
        return self.routing_pool.index_select(0, slots.to(self.device)).cpu()

    def free_kv(self) -> None:
        self.k_cache = self.v_cache = self._kbuf = self._vbuf = self._layer_bufs = (
            self._last_batch
        ) = self.routing_pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.block_size
        off = torch.arange(bs)
        src = (
            (torch.tensor([p[0] for p in pairs]).unsqueeze(1) * bs + off).flatten().to(self.device)
        )
        dst = (
            (torch.tensor([p[1] for p in pairs]).unsqueeze(1) * bs + off).flatten().to(self.device)
        )
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))
        if self.routing_pool is not None:
            self.routing_pool.index_copy_(0, dst, self.routing_pool.index_select(0, src))
        self._last_batch = None

    # --- forward ------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.spec.rms_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)
        return w * xf.to(x.dtype)

    def _gather_buf(self, name: str, numel: int) -> torch.Tensor:
        buf = getattr(self, name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(int(numel * 1.25) + 1, device=self.device, dtype=self.dtype)
            setattr(self, name, buf)
        return buf[:numel]

    def _gather_targets(
        self, li: int, numel: int, persistent: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where layer ``li`` gathers its K/V context: its own kept buffers, or the shared scratch
        buffers."""
        if not persistent:
            return self._gather_buf("_kbuf", numel), self._gather_buf("_vbuf", numel)
        if self._layer_bufs is None:
            self._layer_bufs = [None] * self.spec.num_layers
        if self._layer_bufs[li] is None or self._layer_bufs[li][0].numel() < numel:
            size = int(numel * 1.25) + 1
            self._layer_bufs[li] = (
                torch.empty(size, device=self.device, dtype=self.dtype),
                torch.empty(size, device=self.device, dtype=self.dtype),
            )
        kb, vb = self._layer_bufs[li]
        return kb[:numel], vb[:numel]

    def _attention(
        self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: StepInputs
    ) -> torch.Tensor:
        s = self.spec
        KV, D, G = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        kc, vc = self.k_cache[li], self.v_cache[li]  # (KV, slots, D)
        kc.index_copy_(1, x.slots, k.transpose(0, 1))
        vc.index_copy_(1, x.slots, v.transpose(0, 1))
        B, qmax, kmax = x.batch, x.qmax, x.kmax
        R = x.num_rows if x.pos is not None else B
        n, nb, bsd = KV * R * kmax * D, B * kmax // self.block_size, self.block_size * D
        kbuf, vbuf = self._gather_targets(li, n, x.pos is not None and self.keep_gathered)
        if x.reuse:  # decode over the kept batch: its gathered context only lacks the new token
            rows = (torch.arange(B, device=k.device) if x.rows is None else x.rows) * kmax + x.pos
            K = (
                kbuf.view(KV, R * kmax, D)
                .index_copy_(1, rows, k.transpose(0, 1))
                .view(KV, R, kmax, D)
            )
            V = (
                vbuf.view(KV, R * kmax, D)
                .index_copy_(1, rows, v.transpose(0, 1))
                .view(KV, R, kmax, D)
            )
        else:
            kb, vb = kc.view(KV, -1, bsd), vc.view(KV, -1, bsd)  # (KV, blocks, block_size * D)
            K = torch.index_select(kb, 1, x.kv_blocks, out=kbuf.view(KV, nb, bsd)).view(
                KV, B, kmax, D
            )
            V = torch.index_select(vb, 1, x.kv_blocks, out=vbuf.view(KV, nb, bsd)).view(
                KV, B, kmax, D
            )
        if x.q_pad_index is None:  # decode: one query per sequence
            Q = q.view(B, KV, G, D).transpose(0, 1)
            if x.rows is not None:  # scatter into the kept rows
                Q = torch.zeros(KV, R, G, D, device=q.device, dtype=q.dtype).index_copy_(
                    1, x.rows, Q
                )
        else:
            Q = (
                q[x.q_pad_index]
                .view(B, qmax, KV, G, D)
                .permute(2, 0, 3, 1, 4)
                .reshape(KV, B, G * qmax, D)
            )
        if x.q_pad_index is None:  # decode: the row's mask serves all its heads, one fused kernel
            out = F.scaled_dot_product_attention(Q, K, V, attn_mask=x.bias.view(1, -1, 1, kmax))
        else:
            scores = torch.matmul(Q, K.transpose(-1, -2)).mul_(1.0 / math.sqrt(D))
            scores.view(KV, B, G, qmax, kmax).add_(x.bias.view(1, B, 1, qmax, kmax))
            probs = torch.softmax(scores, -1, dtype=torch.float32).to(self.dtype)
            out = torch.matmul(probs, V)  # (KV, B, G*qmax, D)
        if x.q_pad_index is None:
            if x.rows is not None:
                out = out.index_select(1, x.rows)
            return out.transpose(0, 1).reshape(B, KV * G * D)
        out = out.view(KV, B, G, qmax, D).permute(1, 3, 0, 2, 4).reshape(B * qmax, KV * G * D)
        return out[x.out_index]

    @torch.inference_mode()
    def forward(self, x: StepInputs, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) at ``logits_index`` (default: each sequence's last new token)."""
        s = self.spec
        T = x.input_ids.shape[0]
        H, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        h = F.embedding(x.input_ids, self.embed)
        routed = []  # each MoE layer's (T, k) expert ids
        for li, L in enumerate(self.layers):
            qkv = F.linear(self._rms(h, L["ln1"]), L["wqkv"], L["bqkv"])
            qk = qkv[:, : (H + KV) * D].view(T, H + KV, D)
            v = qkv[:, (H + KV) * D :].view(T, KV, D)
            if s.qk_norm:
                qk = torch.cat([self._rms(qk[:, :H], L["qn"]), self._rms(qk[:, H:], L["kn"])], 1)
            # RoPE: x * cos + rotate_half(x) * sin, where
            # rotate_half(x) = (-x2, x1) = flip of the halves times (-1, 1)
            qk = torch.addcmul(
                qk * x.cos, qk.view(T, H + KV, 2, D // 2).flip(2).view(T, H + KV, D), x.sin
            )
            h = self._add_linear(
                h, self._attention(li, qk[:, :H], qk[:, H:], v, x), L["wo"], L["bo"]
            )
            if L["moe"] is not None:
                out, ids = L["moe"](self._rms(h, L["ln2"]))
                h = h.add_(out)
                routed.append(ids)
                continue
            g, u = F.linear(self._rms(h, L["ln2"]), L["wgu"], L["bgu"]).chunk(2, -1)
            h = self._add_linear(h, F.silu(g).mul_(u), L["wd"], L["bd"])
        if routed:  # at the tokens' KV slots, next to their K/V
            self.routing_pool.index_copy_(0, x.slots, torch.stack(routed, 1).to(ROUTING_DTYPE))
        h = h[x.last_index if logits_index is None else logits_index]
        return F.linear(self._rms(h, self.norm), self.lm_head).float()

    @staticmethod
    def _add_linear(
        h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
    ) -> torch.Tensor:
        """The residual update h + a @ w^T (+ b), the addition fused into the matmul."""
        out = torch.addmm(h, a, w.t())
        return out if b is None else out.add_(b)

    def execute(
        self, seqs: list[Sequence], num_tokens: list[int], all_logits: bool = False
    ) -> torch.Tensor:
        x = self.prepare(seqs, num_tokens)
        idx = torch.arange(x.input_ids.shape[0], device=self.device) if all_logits else None
        return self.forward(x, idx)
