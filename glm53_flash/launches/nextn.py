"""The `nextn` launch: the MTP block (research/model.md §4.6) that drafts the token after next from the
trunk's final hidden row, as the sparse launch's kernel built with NEXTN (launches/sparse_layer.py)
followed by the tail launch for the draft logits.

  x = eh_proj([enorm(embed(t_next)) | hnorm(h)])     stage eh_proj (GEMV tiles in K slices; at width 1 each task
                                                     norms its own slice, else an eh_in stage a row first)
  y = x + DSA(input_layernorm(x))                    the sparse launch's DSA mixer (at width 1 its qkv_a tasks norm
                                                     their own K slice of x, else an ln_row 0 task a row), o_proj + x
  z = y + MoE(post_attention_layernorm(y))           ln_row 1, the KDA / sparse launches' MoE, down + y
  n = shared_head.norm(z)                            ln_row 2 -> n (the recycled hidden row of chained drafts)
  logits = lm_head(shared_head.norm(z))              TailLaunch on z as 4 equal streams with the
                                                     shared_head norm (mean of 4 equal rows = the row)
Single stream, no mHC. The block's own DSA caches (the reference's DecodeCaches DSA index n_dsa,
lagging the trunk by one token: positions are MTP positions) have the sparse launch's layouts and the
same all-or-nothing argument (launches/sparse.py docstring). Why the logits are a second launch: the
tail launch already streams lm_head at its measured speed with its argmax across CTAs and ranks;
folding it in would make this kernel carry the tail's register-heavy GEMV too.

Wait sites (schedule order; TP > 1 adds xo after o and xd before z; without the folds (norm_folds: widths > 1)
ein comes first and a_in after x): x, ya, qr, q, hs0..hs3,
idx, ql, att, o, hp2, a, rl, h, xe, z (`nextn.<region>`); the tail launch's own (`tail.*`) follow.

Host API:
  L = NextnLaunch(cfg, source, tp_rank=0, tp_size=1, width=1, device=None, grid=None, max_len=4096)
  logits, tokens, n = L.run(hidden [rows, H] fp32, next_tokens [rows], latent, pool_keys, tail_rows,
                            positions [rows], slots=None, *, inject_fault=None)
  logits: this rank's vocabulary shard [rows, V / tp] fp32; tokens: the greedy draft (global ids).
  inject_fault names a site of either launch (`nextn.*` or `tail.*`).
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ..weights import LM_HEAD, PREFIX
from .base import interpreting
from .layer_host import rank_tensors
from .sparse import SparseLaunch

# The norm folds (s21B, H100, TP8 bf16): each eh_proj task norms its own K slice of the input, each qkv_a task its own
# K slice of input_layernorm(x), instead of a norm task a row that they wait on. 1 row: nextn -5.0 us; 8 rows: +19.5
# (a folding task norms the rows one after another, the norm tasks ran a row each in parallel). The same bits.
FOLD_MAX_WIDTH = 1


def norm_folds(width: int) -> tuple[bool, bool]:
    """(eh fold, ain fold) of a NextN launch of this width: folded up to FOLD_MAX_WIDTH rows; GLM53_EH_FOLD /
    GLM53_AIN_FOLD = 1 or 0 force one (A/B runs)."""
    out = []
    for name in ("GLM53_EH_FOLD", "GLM53_AIN_FOLD"):
        v = os.environ.get(name, "")
        if v not in ("", "0", "1"):
            raise ValueError(f"{name}={v!r} must be 0, 1 or unset (by width)")
        out.append(width <= FOLD_MAX_WIDTH if v == "" else v == "1")
    return out[0], out[1]


class NextnLaunch(SparseLaunch):
    """The MTP block of one TP rank (see the module docstring)."""

    kind = "nextn"
    NEXTN = True

    def __init__(self, cfg, source, layer: int | None = None, *, logits: bool = True, tail_options: dict | None = None,
                 **kw):
        if not cfg.num_nextn_predict_layers:
            raise ValueError("nextn: this config has no MTP block (num_nextn_predict_layers=0)")
        layer = cfg.num_hidden_layers if layer is None else layer
        if layer != cfg.num_hidden_layers:
            raise ValueError(f"nextn: layer={layer}: the MTP block is layer {cfg.num_hidden_layers}")
        w = kw.get("width", 1)
        self.eh_fold, self.ain_fold = norm_folds(w if isinstance(w, int) else 1)   # a bad width: refused below
        super().__init__(cfg, source, layer, **kw)
        self.X_out = torch.full((self.width, self.H), float("nan"), device=self.device)
        self.n_out = torch.full((self.width, self.H), float("nan"), device=self.device)
        self.tokens = torch.zeros(self.width, dtype=torch.int32, device=self.device)
        self.tail_launch = self._build_tail(source, kw.get("scales"), tail_options or {}) if logits else None

    def _build_tail(self, source, scales, options):
        from .tail import TailLaunch
        w, sc = rank_tensors(self.cfg, source, [LM_HEAD], self.tp_rank, self.tp_size, scales)
        options = dict(options)
        options.setdefault("grid", self.grid if interpreting() else None)
        return TailLaunch(self.cfg, w[LM_HEAD], self.shn, sc.get(LM_HEAD), tp_rank=self.tp_rank,
                          tp_size=self.tp_size, width=self.width, device=self.device, **options)

    # ------------------------------------------------------------------ weights
    def _pre_names(self, p: str) -> list[str]:
        return [p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")] + \
            [PREFIX + "embed_tokens.weight"]

    def _load_hc(self, g, p) -> None:
        bf = torch.bfloat16
        self.ln1, self.ln2 = g(p + "input_layernorm.weight", bf), g(p + "post_attention_layernorm.weight", bf)
        z32 = torch.zeros(1, dtype=torch.float32, device=self.device)           # no mHC: never read
        self.fn1 = self.base1 = self.scale1 = self.fn2 = self.base2 = self.scale2 = z32
        self.enorm, self.hnorm = g(p + "enorm.weight", bf), g(p + "hnorm.weight", bf)
        self.shn = g(p + "shared_head.norm.weight", bf)
        self.W_eh = g(p + "eh_proj.weight", bf)
        self.embed_w = g(PREFIX + "embed_tokens.weight", bf)

    # ------------------------------------------------------------------ plan
    @classmethod
    def site_names(cls, tp_size: int = 1, down_groups: int = 1, oproj_split: int = 1, width: int = 1,
                   **_) -> list[str]:
        eh_fold, ain_fold = norm_folds(width)
        s = ([] if eh_fold else ["ein"]) + ["x"] + ([] if ain_fold else ["a_in"])
        s += ["ya", "qr", "q", "hs0", "hs1", "hs2", "hs3", "idx", "ql", "att", "o"]
        s += (["xo"] if tp_size > 1 or oproj_split > 1 else []) + ["hp2", "a", "rl", "hg", "sel", "xe", "h"]
        s += (["dp"] if down_groups > 1 else []) + (["xd"] if tp_size > 1 else [])
        return [f"{cls.kind}.{n}" for n in s + ["z"]]

    def _graph_pre(self, g) -> None:
        W, H = self.width, self.H
        self.block_c, self.gate_bh, self.npart1, self.npart2 = 32, min(512, H), 1, 1
        if not self.eh_fold:             # the normed input a task a row, which the tiles wait on
            g.stage("eh_in")
            for r in range(W):
                g.add("eh_in", (r, r), writes=("ein",), nbytes=2 * H * 2)
            self.n_box["ein"] = W
        g.stage("eh_proj")
        self._mat_stage(g, "eh", [(0, H, 2 * H * 2)], () if self.eh_fold else ("ein",), "x", self.ks_eh)
        if not self.ain_fold:            # input_layernorm a task a row, which qkv_a waits on
            g.stage("ln_in")
            for r in range(W):
                g.add("ln_row", (r, 0, r), reads=("x",), writes=("a_in",), nbytes=H * 4)
            self.n_box["a_in"] = W

    def _graph_gate_ffn(self, g) -> None:
        g.stage("ln_ffn")
        for r in range(self.width):
            g.add("ln_row", (r, 1, r), reads=("hp2",), writes=("a",), nbytes=self.H * 4)
        self.n_box["a"] = self.width

    def _graph_post(self, g) -> None:
        # the tasks that finish z publish box z (their a2 = producer index): the rank sums at TP > 1; at TP 1
        # the down tiles, or the group joins when the down tiles are split into KG groups (kda.py)
        fam = "post2" if self.tp_size > 1 else "down_join" if self.kg > 1 else "moe_down"
        k = 0
        for i, t in enumerate(g.tasks):
            if t.family == fam:
                g.tasks[i] = dataclasses.replace(t, args=t.args[:2] + (k,) + t.args[3:], writes=t.writes + ("z",))
                k += 1
        self.n_box["z"] = k
        g.stage("ln_out")
        for r in range(self.width):
            g.add("ln_row", (r, 2, r), reads=("z",), nbytes=self.H * 4)

    def _nextn_args(self) -> tuple:
        return (self.tokens, self.embed_w, self.X, self.W_eh, self.enorm, self.hnorm, self.shn, self.n_out)

    # ------------------------------------------------------------------ run
    def set_input(self, hidden, next_tokens, latent, pool_keys, tail_rows, positions, slots=None) -> None:
        rows = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
        if not 1 <= rows <= self.width:
            raise ValueError(f"nextn: {rows} rows; this launch is built for 1..{self.width}")
        self._check("hidden", hidden, (rows, self.H))
        tok = torch.as_tensor(next_tokens).reshape(-1)
        if tok.shape[0] != rows or bool((tok < 0).any()) or bool((tok >= self.cfg.vocab_size).any()):
            raise ValueError(f"nextn: next_tokens {tok.tolist()} must be {rows} ids in [0, {self.cfg.vocab_size})")
        # the sparse launch's checks of the caches, positions and slots (X: any [rows, 4, H] stand-in)
        super().set_input(hidden.new_empty(rows, 4, self.H), latent, pool_keys, tail_rows, positions, slots)
        self.tokens[:rows] = tok.to(self.tokens)
        self.X = hidden

    def run(self, hidden, next_tokens, latent, pool_keys, tail_rows, positions, slots=None, *,
            inject_fault: str | None = None, peer: dict | None = None):
        """One checked MTP step (+ the tail launch for the draft logits) -> (logits, tokens, n); logits and
        tokens are None when built with logits=False. Raises HandoffTimeout naming the site."""
        f_main = self.fault_id(inject_fault) if inject_fault and not inject_fault.startswith("tail.") else -1
        self.set_input(hidden, next_tokens, latent, pool_keys, tail_rows, positions, slots)
        if self.loopback:
            self.set_peers(peer)
        self.enqueue(f_main)
        self.check()
        n = self.n_out[: self.rows].clone()
        if self.tail_launch is None:
            return None, None, n
        z = self.X_out[: self.rows].unsqueeze(1).expand(self.rows, 4, self.H).contiguous()
        f_tail = inject_fault if inject_fault and inject_fault.startswith("tail.") else None
        logits, tokens = self.tail_launch.run(z, inject_fault=f_tail)
        return logits, tokens, n
