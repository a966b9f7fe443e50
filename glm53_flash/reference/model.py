"""The fp32 reference model of GLM-5.3-Flash: prefill, decode step, per-layer pieces and the MTP block.

This is the spec every launch is checked against: mathematically HF transformers' `glm5_next` text
model (research/model.md §4) with all of HF's intermediate bf16 casts removed, plus the NextN/MTP
block HF lacks (§4.6, SGLang's pairing: row i = (h_i, t_{i+1}) at MTP position i, nothing masked).

Weights are read by HF checkpoint name from any Mapping (bf16/fp32 values, FP8 already dequantised)
and cast to fp32 on first use; routed experts are fetched by name only when a token is routed to
them (and cached only when a layer's experts are small), so a 288-expert layer is never built.

Every public entry validates all of its inputs before it touches a cache: a bad call raises
ValueError naming the argument and value and leaves the caches exactly as they were.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config import GlmConfig
from ..weights import LM_HEAD, PREFIX, weight_specs
from . import ops
from .caches import DecodeCaches
from .dsa import dsa_decode, dsa_prefill, write_prompt
from .kda import kda_decode, kda_prefill

Tensor = torch.Tensor

_BIG = 256 << 20          # fp32 bytes above which a tensor is kept in its own dtype and cast in chunks
_EXPERT_CACHE = 64 << 20  # cache a layer's routed experts in fp32 when all of them fit in this


@dataclass
class PrefillOut:
    logits: Tensor   # [T, V] fp32
    hidden: Tensor   # [T, H] fp32: final post-norm rows (the lm_head input, what the MTP block consumes)


@dataclass
class StepOut:
    logits: Tensor   # [w, V] fp32
    hidden: Tensor   # [w, H] fp32


class ReferenceModel:
    """GLM-5.3-Flash in fp32. `weights`: HF names as in `weight_specs(cfg)`; `chunk`: KDA prefill chunk."""

    def __init__(self, cfg: GlmConfig, weights: Mapping[str, Tensor], device="cpu", chunk: int = 32):
        self.cfg, self.weights, self.device, self.chunk = cfg, weights, torch.device(device), chunk
        self.specs = weight_specs(cfg)
        have = set(iter(weights))                 # names only: a lazy mapping builds nothing here
        missing = [n for n in self.specs if n not in have]
        if missing:
            raise ValueError(f"weights: {len(missing)} tensors missing, e.g. {missing[:3]}")
        self._f32: dict[str, Tensor] = {}
        self._native: dict[str, Tensor] = {}
        self._kda_idx = {li: i for i, li in enumerate(cfg.kda_layers)}
        self._dsa_idx = {li: i for i, li in enumerate(cfg.dsa_layers)}
        ffn_bytes = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
        self.cache_experts = cfg.n_routed_experts * ffn_bytes <= _EXPERT_CACHE

    # ------------------------------------------------------------------ weights
    def _fetch(self, name: str) -> Tensor:
        t = self.weights[name]
        spec = self.specs[name]
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"weights[{name!r}]: shape {tuple(t.shape)}, expected {spec.shape}")
        return t.to(self.device)

    def get(self, name: str) -> Tensor:
        """fp32 copy of a weight, cached (the embedding and lm_head go through `_embed_rows` /
        `_linear_big` instead, which never make a whole fp32 copy)."""
        t = self._f32.get(name)
        if t is None:
            t = self._fetch(name).float()
            self._f32[name] = t
        return t

    def drop_cached_weights(self) -> None:
        """Forget the fp32 copies made so far (e.g. between layers of a real-shape run on CPU)."""
        self._f32.clear()
        self._native.clear()

    def _native_big(self, name: str) -> Tensor:
        t = self._native.get(name)
        if t is None:
            t = self._native[name] = self._fetch(name)
        return t

    def _linear_big(self, x: Tensor, name: str, rows: int = 16384) -> Tensor:
        """x @ W^T for a huge W (lm_head), cast to fp32 a block of rows at a time."""
        if torch.Size(self.specs[name].shape).numel() * 4 <= _BIG:
            return x @ self.get(name).t()
        W = self._native_big(name)
        return torch.cat([x @ W[r:r + rows].float().t() for r in range(0, W.shape[0], rows)], dim=-1)

    def _expert_fn(self, p: str):
        def expert(e: int):
            names = [f"{p}mlp.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")]
            if self.cache_experts:
                return tuple(self.get(n) for n in names)
            return tuple(self._fetch(n).float() for n in names)
        return expert

    @staticmethod
    def _lp(li: int) -> str:
        return f"{PREFIX}layers.{li}."

    # ------------------------------------------------------------------ validation
    def _check_ids(self, name: str, t, n: int | None = None, hi: int | None = None) -> Tensor:
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int64, torch.int32):
            desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 1-D integer (int64/int32) tensor, got {desc}")
        if n is not None and t.shape[0] != n:
            raise ValueError(f"{name}: {t.shape[0]} entries, expected {n}")
        if t.shape[0] == 0:
            raise ValueError(f"{name}: empty")
        if hi is not None:
            bad = (t < 0) | (t >= hi)
            if bad.any():
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}[{i}]={int(t[i])}: outside [0, {hi})")
        return t.long().cpu()

    def _check_caches(self, caches) -> DecodeCaches:
        if not isinstance(caches, DecodeCaches):
            raise ValueError(f"caches: expected DecodeCaches, got {type(caches).__name__}")
        ref = DecodeCaches.allocate(self.cfg, 1, 1, device="meta")
        for name, t in caches.tensors().items():
            want = getattr(ref, name).shape[1:]
            got = t.shape[1:]
            if name in ("latent", "pool_keys"):      # max_len-dependent dim
                want, got = want[:1] + want[2:], got[:1] + got[2:]
            if got != want:
                raise ValueError(f"caches.{name}: shape {tuple(t.shape)} does not fit this config")
        return caches

    def _check_slots(self, caches: DecodeCaches, slots, w: int) -> Tensor:
        if slots is None:
            if w > caches.num_slots:
                raise ValueError(f"slots: {w} rows but only {caches.num_slots} slots")
            return torch.arange(w)
        slots = self._check_ids("slots", slots, w, caches.num_slots)
        if len(set(slots.tolist())) != w:
            raise ValueError(f"slots={slots.tolist()}: duplicate slots in one step")
        return slots

    def _check_positions(self, caches: DecodeCaches, positions, slots: Tensor, lengths: Tensor) -> Tensor:
        positions = self._check_ids("positions", positions, slots.shape[0])
        for i, (p, s) in enumerate(zip(positions.tolist(), slots.tolist())):
            if p != int(lengths[s]):
                raise ValueError(f"positions[{i}]={p}: slot {s} holds {int(lengths[s])} tokens "
                                 f"(the position must equal the slot's length)")
            if p >= caches.max_len:
                raise ValueError(f"positions[{i}]={p}: >= max_len={caches.max_len}")
        return positions

    def _check_rows(self, name: str, x, shape: tuple) -> Tensor:
        if not isinstance(x, Tensor) or not x.is_floating_point() or tuple(x.shape) != shape:
            desc = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a float tensor of shape {shape}, got {desc}")
        return x.to(self.device, torch.float32)

    def _check_empty(self, caches: DecodeCaches, slot, T: int, lengths: Tensor, what: str,
                     arg: str = "tokens") -> int:
        if not isinstance(slot, int) or not 0 <= slot < caches.num_slots:
            raise ValueError(f"slot={slot!r}: outside [0, {caches.num_slots})")
        if int(lengths[slot]) != 0:
            raise ValueError(f"slot={slot}: holds {int(lengths[slot])} {what} already; {what} prefill needs "
                             f"an empty slot (caches.reset(slot))")
        if T > caches.max_len:
            raise ValueError(f"{arg}: {T} rows > max_len={caches.max_len}")
        return slot

    # ------------------------------------------------------------------ pieces
    def new_caches(self, num_slots: int, max_len: int) -> DecodeCaches:
        return DecodeCaches.allocate(self.cfg, num_slots, max_len, device=self.device)

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [w] -> 4 identical streams X [w, 4, H]."""
        tokens = self._check_ids("tokens", tokens, hi=self.cfg.vocab_size)
        return ops.hc_expand(self._embed_rows(tokens), self.cfg.hc_mult)

    def _embed_rows(self, tokens: Tensor) -> Tensor:
        return self._native_big(PREFIX + "embed_tokens.weight")[tokens.to(self.device)].float()

    def hidden(self, X: Tensor) -> Tensor:
        """Streams [w, 4, H] -> final post-norm rows [w, H]."""
        return ops.tail_hidden(X, self.get(PREFIX + "norm.weight"), self.cfg.rms_norm_eps)

    def tail(self, X: Tensor) -> Tensor:
        """Streams [w, 4, H] -> logits [w, V] (ops.tail_logits, lm_head cast in blocks)."""
        w = X.shape[0] if isinstance(X, Tensor) and X.dim() == 3 else 0
        X = self._check_rows("X", X, (w, self.cfg.hc_mult, self.cfg.hidden_size))
        return self._linear_big(self.hidden(X), LM_HEAD)

    def _ffn(self, li: int, a: Tensor) -> Tensor:
        """FFN of layer li (li = num_hidden_layers: the MTP block, MoE) on normed rows a [rows, H]."""
        p, cfg = self._lp(li), self.cfg
        if li < cfg.num_hidden_layers and cfg.mlp_layer_types[li] == "dense":
            return ops.mlp(a, self.get(p + "mlp.gate_proj.weight"), self.get(p + "mlp.up_proj.weight"),
                           self.get(p + "mlp.down_proj.weight"), cfg.swiglu_limit)
        sh = tuple(self.get(f"{p}mlp.shared_experts.{n}_proj.weight") for n in ("gate", "up", "down"))
        return ops.moe(a, self.get(p + "mlp.gate.weight"), self.get(p + "mlp.gate.e_score_correction_bias"),
                       self._expert_fn(p), sh, cfg)

    def _layer(self, li: int, X: Tensor, mixer) -> Tensor:
        """One trunk layer on streams X [rows, 4, H]; `mixer(a)` runs attention on normed rows a."""
        p, cfg = self._lp(li), self.cfg
        x_in, post, comb = ops.hc_pre(X, self.get(p + "hc_attn_fn"), self.get(p + "hc_attn_base"),
                                      self.get(p + "hc_attn_scale"), cfg)
        y = mixer(ops.rms_norm(x_in, self.get(p + "input_layernorm.weight"), cfg.rms_norm_eps))
        X = ops.hc_post(X, y, post, comb)
        x_in, post, comb = ops.hc_pre(X, self.get(p + "hc_ffn_fn"), self.get(p + "hc_ffn_base"),
                                      self.get(p + "hc_ffn_scale"), cfg)
        y = self._ffn(li, ops.rms_norm(x_in, self.get(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps))
        return ops.hc_post(X, y, post, comb)

    def _layer_decode(self, caches: DecodeCaches, li: int, X: Tensor, positions: Tensor, slots: Tensor,
                      trace: dict | None = None) -> Tensor:
        cfg, p = self.cfg, self._lp(li) + "self_attn."
        if cfg.layer_types[li] == "kda":
            k = self._kda_idx[li]

            def mixer(a):
                y, S, win = kda_decode(self.get, p, cfg, a, caches.kda_state[slots, k], caches.conv_window[slots, k])
                caches.kda_state[slots, k] = S
                caches.conv_window[slots, k] = win
                return y
        else:
            mixer = self._dsa_decode_mixer(caches, self._dsa_idx[li], p, positions, slots, trace, li)
        return self._layer(li, X, mixer)

    def _dsa_decode_mixer(self, caches, d: int, p: str, positions, slots, trace, key):
        def mixer(a):
            s = slots.tolist()        # per-row views: dsa_decode writes the slot's caches in place
            lat = [caches.latent[i, d] for i in s]
            pk = [caches.pool_keys[i, d] for i in s]
            tail = [caches.tail_rows[i, d] for i in s]
            sel = [] if trace is not None else None
            y = dsa_decode(self.get, p, self.cfg, a, positions.tolist(), lat, pk, tail, sel)
            if trace is not None:
                trace[key] = sel
            return y
        return mixer

    def layer_step(self, caches: DecodeCaches, layer_idx: int, X: Tensor, positions: Tensor,
                   slots: Tensor | None = None, trace: dict | None = None) -> Tensor:
        """Trunk layer `layer_idx` for one token per row: X [w, 4, H] -> X'. Writes the layer's caches at
        `positions` (which must equal the slots' lengths) but does not advance the lengths: after the
        last layer call `caches.lengths[slots] += 1` (decode_step does). `trace` receives the DSA
        selections ({layer_idx: [tokens per row]})."""
        caches = self._check_caches(caches)
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.cfg.num_hidden_layers:
            raise ValueError(f"layer_idx={layer_idx!r}: outside [0, {self.cfg.num_hidden_layers})")
        w = X.shape[0] if isinstance(X, Tensor) and X.dim() == 3 else 0
        X = self._check_rows("X", X, (w, self.cfg.hc_mult, self.cfg.hidden_size))
        slots = self._check_slots(caches, slots, w)
        positions = self._check_positions(caches, positions, slots, caches.lengths)
        return self._layer_decode(caches, layer_idx, X, positions, slots, trace)

    def layer_prefill(self, layer_idx: int, X: Tensor, caches: DecodeCaches | None = None, slot: int = 0,
                      trace: dict | None = None) -> Tensor:
        """Trunk layer `layer_idx` over a whole prompt X [T, 4, H] -> X' (chunked KDA / masked attention).
        With caches, stores the layer's state for `slot` (lengths untouched: prefill sets them).
        `trace` receives {layer_idx: {"mask", "scores"}} for a DSA layer (see dsa.dsa_prefill)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.cfg.num_hidden_layers:
            raise ValueError(f"layer_idx={layer_idx!r}: outside [0, {self.cfg.num_hidden_layers})")
        T = X.shape[0] if isinstance(X, Tensor) and X.dim() == 3 else 0
        X = self._check_rows("X", X, (T, self.cfg.hc_mult, self.cfg.hidden_size))
        if T == 0:
            raise ValueError("X: empty prompt")
        if caches is not None:
            caches = self._check_caches(caches)
            slot = self._check_empty(caches, slot, T, caches.lengths, "tokens", "X")
        return self._layer_prefill(layer_idx, X, caches, slot, trace)

    def _layer_prefill(self, layer_idx: int, X: Tensor, caches, slot: int, trace) -> Tensor:
        cfg, p = self.cfg, self._lp(layer_idx) + "self_attn."
        if cfg.layer_types[layer_idx] == "kda":
            def mixer(a):
                y, S, win = kda_prefill(self.get, p, cfg, a, self.chunk)
                if caches is not None:
                    k = self._kda_idx[layer_idx]
                    caches.kda_state[slot, k], caches.conv_window[slot, k] = S, win
                return y
        else:
            mixer = self._dsa_prefill_mixer(p, caches, slot, self._dsa_idx[layer_idx], trace, layer_idx)
        return self._layer(layer_idx, X, mixer)

    def _dsa_prefill_mixer(self, p: str, caches, slot: int, d: int, trace=None, key=None):
        def mixer(a):
            sub = None if trace is None else trace.setdefault(key, {})
            y, r = dsa_prefill(self.get, p, self.cfg, a, sub)
            if caches is not None:
                write_prompt(self.cfg, r, self.get(p + "indexer.index_kpool_compress_ape"),
                             caches.latent[slot, d], caches.pool_keys[slot, d], caches.tail_rows[slot, d])
            return y
        return mixer

    # ------------------------------------------------------------------ trunk
    def prefill(self, tokens: Tensor, caches: DecodeCaches | None = None, slot: int = 0,
                trace: dict | None = None) -> PrefillOut:
        """Whole prompt at once. With caches, slot `slot` (which must be empty) is left ready for decode
        at position T. `trace` receives each DSA layer's selection mask and pool scores."""
        tokens = self._check_ids("tokens", tokens, hi=self.cfg.vocab_size)
        if caches is not None:
            caches = self._check_caches(caches)
            slot = self._check_empty(caches, slot, tokens.shape[0], caches.lengths, "tokens")
        X = ops.hc_expand(self._embed_rows(tokens), self.cfg.hc_mult)
        for li in range(self.cfg.num_hidden_layers):
            X = self._layer_prefill(li, X, caches, slot, trace)
        if caches is not None:
            caches.lengths[slot] = tokens.shape[0]
        h = self.hidden(X)
        return PrefillOut(self._linear_big(h, LM_HEAD), h)

    def decode_step(self, caches: DecodeCaches, tokens: Tensor, positions: Tensor, slots: Tensor | None = None,
                    trace: dict | None = None) -> StepOut:
        """One token for each of w rows, row i in slot slots[i] (default i) at positions[i] (= its length)."""
        h = self.hidden(self.decode_trunk(caches, tokens, positions, slots, trace))
        return StepOut(self._linear_big(h, LM_HEAD), h)

    def decode_trunk(self, caches: DecodeCaches, tokens: Tensor, positions: Tensor, slots: Tensor | None = None,
                     trace: dict | None = None) -> Tensor:
        """decode_step without the tail: embed + every layer, lengths advanced; returns the final mHC
        streams X [w, 4, H] (feed them to `tail` or to a tail launch)."""
        caches = self._check_caches(caches)
        tokens = self._check_ids("tokens", tokens, hi=self.cfg.vocab_size)
        slots = self._check_slots(caches, slots, tokens.shape[0])
        positions = self._check_positions(caches, positions, slots, caches.lengths)
        X = ops.hc_expand(self._embed_rows(tokens), self.cfg.hc_mult)
        for li in range(self.cfg.num_hidden_layers):
            X = self._layer_decode(caches, li, X, positions, slots, trace)
        caches.lengths[slots] += 1
        return X

    # ------------------------------------------------------------------ MTP block (research/model.md §4.6)
    def _mtp(self, hidden: Tensor, next_tokens: Tensor, mixer) -> tuple[Tensor, Tensor]:
        """x = eh_proj([enorm(embed(t_next)) | hnorm(h)]); y = x + DSA(ln x); z = y + MoE(ln y);
        n = shared_head.norm(z); logits = lm_head(n). Returns (logits, n)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        p = self._lp(cfg.num_hidden_layers)
        e = ops.rms_norm(self._embed_rows(next_tokens), self.get(p + "enorm.weight"), eps)
        h = ops.rms_norm(hidden, self.get(p + "hnorm.weight"), eps)
        x = torch.cat([e, h], dim=-1) @ self.get(p + "eh_proj.weight").t()      # embedding first
        y = x + mixer(ops.rms_norm(x, self.get(p + "input_layernorm.weight"), eps))
        z = y + self._ffn(cfg.num_hidden_layers,
                          ops.rms_norm(y, self.get(p + "post_attention_layernorm.weight"), eps))
        n = ops.rms_norm(z, self.get(p + "shared_head.norm.weight"), eps)
        return self._linear_big(n, LM_HEAD), n

    def _check_mtp(self):
        if not self.cfg.num_nextn_predict_layers:
            raise ValueError("num_nextn_predict_layers=0: this config has no MTP block")

    def nextn_prefill(self, hidden: Tensor, next_tokens: Tensor, caches: DecodeCaches | None = None,
                      slot: int = 0, trace: dict | None = None) -> PrefillOut:
        """MTP block over rows i = 0..T-1 = (hidden[i] = h_i, next_tokens[i] = t_{i+1}) at MTP positions
        0..T-1. Returns draft logits [T, V] (for t_{i+2}) and the block's post-norm rows."""
        self._check_mtp()
        next_tokens = self._check_ids("next_tokens", next_tokens, hi=self.cfg.vocab_size)
        T = next_tokens.shape[0]
        hidden = self._check_rows("hidden", hidden, (T, self.cfg.hidden_size))
        if caches is not None:
            caches = self._check_caches(caches)
            slot = self._check_empty(caches, slot, T, caches.mtp_lengths, "MTP rows", "next_tokens")
        p = self._lp(self.cfg.num_hidden_layers) + "self_attn."
        logits, n = self._mtp(hidden, next_tokens, self._dsa_prefill_mixer(p, caches, slot, len(self.cfg.dsa_layers),
                                                                            trace, "mtp"))
        if caches is not None:
            caches.mtp_lengths[slot] = T
        return PrefillOut(logits, n)

    def nextn_step(self, caches: DecodeCaches, hidden: Tensor, next_tokens: Tensor, positions: Tensor,
                   slots: Tensor | None = None, trace: dict | None = None) -> StepOut:
        """One MTP row per slot: (h_i, t_{i+1}) at MTP position i (= the slot's MTP length)."""
        self._check_mtp()
        caches = self._check_caches(caches)
        next_tokens = self._check_ids("next_tokens", next_tokens, hi=self.cfg.vocab_size)
        w = next_tokens.shape[0]
        hidden = self._check_rows("hidden", hidden, (w, self.cfg.hidden_size))
        slots = self._check_slots(caches, slots, w)
        positions = self._check_positions(caches, positions, slots, caches.mtp_lengths)
        p = self._lp(self.cfg.num_hidden_layers) + "self_attn."
        mixer = self._dsa_decode_mixer(caches, len(self.cfg.dsa_layers), p, positions, slots, trace, "mtp")
        logits, n = self._mtp(hidden, next_tokens, mixer)
        caches.mtp_lengths[slots] += 1
        return StepOut(logits, n)
