"""The `sparse` launch: one DSA layer (sparse NoPE MLA + kpool indexer, then the MoE FFN, each inside
mHC) of one TP rank as one persistent launch. Kernel and stage list: launches/sparse_layer.py; the
mHC / o_proj / MoE host pieces (weights, graph stages, exchange mailboxes) are the KDA layer
launch's (layer_host.py, kda.py), reused by subclassing `KdaLaunch`.

Cache layouts (per DSA layer; `S` request slots; the reference's DecodeCaches fields sliced at the
layer, `caches.latent[:, d]` etc., can be passed as they are: any slot stride, rows contiguous):
  latent     [S, max_len, C]      C = kv_lora_rank; row t = RMSNorm'd kv_a latent of token t
                                  (bf16: 1 KiB / token at the real C = 512, the GPU layout; or fp32)
  pool_keys  [S, ceil(max_len / KP), D] fp32 or bf16   pooled index key of every complete pool p
                                  (tokens [KP p, KP p + KP)), written by the step whose token completes
                                  it (bf16 on the GPU: the scoring task then runs bf16 MMAs, 168 instead
                                  of 247 registers at real shapes, and reads half the bytes)
  tail_rows  [S, KP, 2 D] fp32    ring of raw index rows: [LayerNorm'd key | kpool gate logits] of
                                  token t at row t % KP, kept until its pool completes
`to_latent_dtype` / `from_latent` convert the reference's fp32 latent to and from the bf16 one.

All-or-nothing (DESIGN.md §6) with in-place cache writes. A step at position pos of a slot writes
exactly three places: latent row pos, ring row pos % KP, and (when (pos + 1) % KP == 0) pool key
pos // KP. None of them is part of the slot's state before the step: row pos and pool pos // KP lie at
or past the slot's length, and ring row pos % KP held token pos - KP, whose pool completed at or
before pos - 1 (already pooled; nothing reads that raw row again). The state a step reads (latent
rows < pos, the pool keys of the pools complete before pos, the ring rows of the open pool's earlier
tokens) is never written. So a launch that faults after some of these writes leaves the slot's state
as it was, and any later step at the same position (a retry, or another token in its place, e.g. a
rejected draft) recomputes the three places from that untouched state; a retry with the same input
rewrites the same bits. Within a step, the only reads of words written in the same step go through
hand-offs: the attention reads latent row pos, and the scoring pool key pos // KP, after box waits
downstream of the norm task that wrote them. Tests: faulted launches leave latent[:pos],
pool_keys[:pos // KP] and the open pool's ring rows bitwise unchanged, and the retry equals the clean
launch bit for bit (caches included).

Wait sites (schedule order; TP > 1 adds xo after o and xd last): hp1, a_in, ya, qr, q, hs0, hs1, hs2,
hs3, idx, ql, att, o, hp2, a, rl, h, xe (`sparse.<region>`, launches/sparse_layer.py has the stages).

Host API:
  L = SparseLaunch(cfg, source, layer, tp_rank=0, tp_size=1, width=1, device=None, grid=None,
                   max_len=4096)
  X' = L.run(X [rows, 4, H] fp32, latent, pool_keys, tail_rows, positions [rows], slots=None,
             *, inject_fault=None, peer=None)
  L.selection(rows) -> token indices [rows, index_width] int32 of the latest launch (-1 padded)
Attention split: `choose_attention_split(index_width, heads of this rank, grid, SM count)`, fixed
at build from width-independent inputs, so a row's bits do not depend on the batch (DESIGN.md §7).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton

from layout import Planner

from ..kernels.indexer import topk_passes
from ..kernels.mla import AttentionSplit, att_chunk, choose_attention_split, join_chunk
from ..schedule import TaskGraph
from .kda import KdaLaunch
from .base import check_rank_width, interpreting
from .ffn_tasks import ROUTER_BLOCK_E
from .layer_host import ROWS_PAD, _ranges, rank_tensors
from .sparse_layer import BOXES, CACHE_ALIGN_ELEMS, FAMILIES, META, META_WORDS, ROWS_REGIONS, sparse_layer_kernel

T_MAX_LIMIT = 16        # selection tasks per row (kernels/indexer.py: registers measured at T_MAX 16)


class SparseLaunch(KdaLaunch):
    """One DSA layer + MoE of one TP rank (see the module docstring for the API and cache layouts).

    Options: latent_dtype of the caller's latent cache is taken from the tensor given to run; split
    (an AttentionSplit) overrides the chooser; block_p: pools per scoring MMA tile (64: 3 tiles in flight;
    16 left the score task at ~9 us for 144 pools on the H200); sel_chunk (pools per selection task, a
    multiple of block_p) defaults to the smallest giving <= 16 tasks; bits: radix digit width (8 only: 4
    passes, the register-light choice of kernels/indexer.py); num_stages: the layer GEMVs' cp.async depth, 5 as
    kda's (4 x 16 KB in flight a CTA; 72 KB of shared memory, still two CTAs an SM; 3 until 2026-12-06: H100,
    TP8 pos 8191, side by side, sparse 1 row -1.3 to -2.4 us in three pairs, 8 rows -2.0, nextn -5.3)."""

    default_ctas_per_sm = 2     # 255 registers and 72 KB of shared memory let two CTAs share an SM: H200, TP8 1 row
                                # bf16, side by side: pos 8191 208.4 -> 187.7 us, 65535 240.1 -> 221.0, nextn 307 -> 295
                                # (split-K stages of > 132 units, the expert slots, in one wave)

    META_LAYOUT = (BOXES, ROWS_REGIONS, META, META_WORDS)        # layer_host.py _meta
    late_coef1 = True           # coef1 in the dsa_norm stage (a task per row), not beside the gate: qkv_a
                                # has a task on every CTA, and the coef CTA's waited for the Sinkhorn

    kind = "sparse"
    eh_fold = ain_fold = False  # NextN's input norms folded into their GEMV tasks (nextn.py norm_folds)

    def __init__(self, cfg, source, layer: int, *, tp_rank: int = 0, tp_size: int = 1, width: int = 1, device=None,
                 grid: int | None = None, scales: Mapping | None = None, max_len: int = 4096, timeout_s: float = 1.0,
                 xchg=None, block_n: int = 64, block_k: int = 128, num_stages: int = 5, num_warps: int = 4,
                 act_dtype: str = "bfloat16", split: AttentionSplit | None = None, sel_chunk: int | None = None,
                 block_p: int = 64, bits: int = 8, sm_count: int | None = None, **tag_kw):
        from .base import Launch
        Launch.__init__(self, grid=grid, device=device, timeout_s=timeout_s, **tag_kw)
        k = self.kind
        check_rank_width(k, cfg, tp_rank, tp_size, width)
        if not isinstance(layer, int) or not 0 <= layer <= cfg.num_hidden_layers:
            raise ValueError(f"{k}: layer={layer!r} outside [0, {cfg.num_hidden_layers})")
        if layer < cfg.num_hidden_layers and cfg.layers[layer].launch != k:
            p = cfg.layers[layer]
            raise ValueError(f"{k}: layer {layer} is a {p.launch!r} launch (mixer {p.mixer}, ffn {p.ffn})")
        if act_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"{k}: act_dtype={act_dtype!r} must be 'bfloat16' or 'float32'")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"{k}: max_len={max_len!r} must be a positive integer")
        self.act_dtype = act_dtype
        self.cfg, self.layer, self.tp_rank, self.tp_size, self.width = cfg, layer, tp_rank, tp_size, width
        self.num_warps, self.block_n, self.block_k, self.num_stages = num_warps, block_n, block_k, num_stages
        self.H = H = cfg.hidden_size
        self.QL, self.C = cfg.q_lora_rank, cfg.kv_lora_rank
        self.DI, self.NI, self.KP = cfg.index_head_dim, cfg.index_n_heads, cfg.index_kpool
        self.NA = self.QL + self.C + 2 * self.DI + self.NI
        self.NHA = cfg.num_attention_heads // tp_size
        self.DN, self.DV = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.NQ = self.NHA * self.DN + self.NI * self.DI
        self.TOPK, self.WIDTH = cfg.index_topk_pools, cfg.index_width
        self.max_len = max_len
        self.pmax = -(-max_len // self.KP)
        if bits != 8:
            raise ValueError(f"{k}: bits={bits!r}: the kernel's boxes hs0..hs3 are built for 8-bit digits (4 passes)")
        self.block_p, self.bits = block_p, bits
        chunk = sel_chunk or -(-(-(-self.pmax // T_MAX_LIMIT)) // block_p) * block_p
        if chunk % block_p:
            raise ValueError(f"{k}: sel_chunk={chunk} must be a multiple of block_p={block_p}")
        self.sel_chunk = chunk
        self.n_sel = -(-self.pmax // chunk)
        self.t_max = triton.next_power_of_2(self.n_sel)
        sm = sm_count or (self.grid if interpreting() else None)
        if sm is None:
            from ..schedule import device_sm_count
            sm = device_sm_count(self.device)
        self.split = split or choose_attention_split(self.WIDTH, self.NHA, self.grid, sm)
        sp = self.split
        if self.NHA % sp.heads_per_task or sp.tokens_per_task != sp.block_t or sp.tokens_per_task * sp.n_splits < self.WIDTH:
            raise ValueError(f"{k}: attention split {sp} does not fit {self.NHA} heads / {self.WIDTH} indices")
        self._load_weights_recorded(source, scales)
        self._setup_xchg(xchg)
        self.X_out = torch.full((width, 4, H), float("nan"), device=self.device)
        self.positions = torch.zeros(width, dtype=torch.int32, device=self.device)
        self.slots = torch.zeros(width, dtype=torch.int32, device=self.device)
        self.X = self.latent = self.pool_keys = self.tail = None
        self.rows = 0
        self._setup()
        self.meta = self._meta().to(self.device)

    # ------------------------------------------------------------------ weights
    def _names(self) -> list[str]:
        p = f"{self.prefix()}"
        a, ix = p + "self_attn.", p + "self_attn.indexer."
        names = self._pre_names(p) + [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [a + n for n in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                                  "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
                                  "o_proj.weight")]
        names += [ix + n for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
                                   "index_kpool_compress_gate", "index_kpool_compress_ape")]
        return names + self._ffn_names(p)

    def _pre_names(self, p: str) -> list[str]:
        return [p + f"hc_{s}_{n}" for s in ("attn", "ffn") for n in ("fn", "base", "scale")]

    def prefix(self) -> str:
        from ..weights import PREFIX
        return f"{PREFIX}layers.{self.layer}."

    def _load_weights(self, source, scales) -> None:
        w, sc = rank_tensors(self.cfg, source, self._names(), self.tp_rank, self.tp_size, scales)
        dev, bf, f32 = self.device, torch.bfloat16, torch.float32
        p = self.prefix()
        a, ix = p + "self_attn.", p + "self_attn.indexer."

        def g(n, dtype):
            return w[n].to(dev).to(dtype).contiguous()
        self._load_hc(g, p)
        self.W_qa, self.S_qa = self._mat(w, sc, a + "q_a_proj.weight")
        self.W_kva, self.S_kva = self._mat(w, sc, a + "kv_a_proj_with_mqa.weight")
        self.W_qb, self.S_qb = self._mat(w, sc, a + "q_b_proj.weight")
        self.kv_b, self.S_kvb = self._mat(w, sc, a + "kv_b_proj.weight")
        self.W_o, self.S_o = self._mat(w, sc, a + "o_proj.weight")
        self.qa_ln, self.kva_ln = g(a + "q_a_layernorm.weight", bf), g(a + "kv_a_layernorm.weight", bf)
        self.W_ix = torch.cat([g(ix + "wk.weight", bf), g(ix + "index_kpool_compress_gate", bf),
                               g(ix + "weights_proj.weight", bf)]).contiguous()
        self.W_iqb = g(ix + "wq_b.weight", bf)
        self.kn_w, self.kn_b = g(ix + "k_norm.weight", f32), g(ix + "k_norm.bias", f32)
        self.ape = g(ix + "index_kpool_compress_ape", f32)
        for n, t in (("q_a", self.W_qa), ("kv_a", self.W_kva), ("q_b", self.W_qb), ("o_proj", self.W_o)):
            if t.dtype == torch.float8_e4m3fn and 128 % self.block_n:
                raise ValueError(f"{self.kind}: FP8 {n} needs block_n dividing 128, got {self.block_n}")
        self._load_ffn(w, sc, p)

    def _load_hc(self, g, p) -> None:
        f32, bf = torch.float32, torch.bfloat16
        self.fn1, self.base1, self.scale1 = (g(p + f"hc_attn_{n}", f32) for n in ("fn", "base", "scale"))
        self.fn2, self.base2, self.scale2 = (g(p + f"hc_ffn_{n}", f32) for n in ("fn", "base", "scale"))
        self.ln1, self.ln2 = g(p + "input_layernorm.weight", bf), g(p + "post_attention_layernorm.weight", bf)

    # ------------------------------------------------------------------ plan
    @classmethod
    def site_names(cls, tp_size: int = 1, down_groups: int = 1, oproj_split: int = 1, **_) -> list[str]:
        s = ["hp1", "a_in", "ya", "qr", "q", "hs0", "hs1", "hs2", "hs3", "idx", "ql", "att", "o"]
        s += (["xo"] if tp_size > 1 or oproj_split > 1 else []) + ["cf1", "hp2", "a", "rl", "hg", "sel", "xe", "h"]
        s += (["dp"] if down_groups > 1 else []) + ["cf2"] + (["xd"] if tp_size > 1 else [])
        return [f"{cls.kind}.{n}" for n in s]

    def _mat_stage(self, g, fam, mats, reads, box, k_split: int = 1) -> None:
        """GEMV tiles of several matrices (mat id, N, row bytes) into one output, times k_split K slices (each
        slice its own partial plane, joined by the consumer in plane order): tile ranges of each matrix in
        proportion to its tiles, about one task per CTA in all; args (mat, t0, n tiles, producer, K slice)."""
        G, BN = self.grid, self.block_n
        tiles = [-(-N // BN) for _, N, _ in mats]
        per = [min(t, -(-G * t // (sum(tiles) * k_split))) for t in tiles]
        slot = 0
        for ks in range(k_split):
            for (mid, N, rb), t, n_tasks in zip(mats, tiles, per):
                for (t0, n) in _ranges(t, n_tasks):
                    rows_n = min((t0 + n) * BN, N) - t0 * BN
                    g.add(fam, (mid, t0, n, slot, ks), reads=reads, writes=(box,), nbytes=rows_n * rb // k_split)
                    slot += 1
        self.n_box[box] = slot

    def build_graph(self) -> TaskGraph:
        g = TaskGraph(self.kind, FAMILIES)
        self.n_box = {}
        # qkv_a's K slices (one tile row of q_a | kv_a | the indexer's rows is 4096 x 2 B at TP 1 and TP 8: 37
        # tiles of full K used 37 CTAs for 19 MB); from the shape only, so every grid and width joins the
        # same planes (the same bits)
        n_a = self.QL + self.C + 2 * self.DI + self.NI
        self.ks_a = self.k_split_for(n_a, self.H, self.W_qa.element_size())
        # NextN's eh_proj (H x 2H bf16, 67 MB, every rank's whole bank) in K slices likewise: 64 tiles of full K
        # streamed 1 MB a CTA on 64 CTAs; ln_row 0 joins the planes in order. GLM53_EH_SPLIT=N pins it (A/B runs;
        # 1: the unsplit stage before the twentieth session)
        pin = int(os.environ.get("GLM53_EH_SPLIT", "0"))
        self.ks_eh = (pin or self.k_split_for(self.H, 2 * self.H, 2)) if self.NEXTN else 1
        if (2 * self.H) % (self.ks_eh * 128):
            raise ValueError(f"{self.kind}: GLM53_EH_SPLIT={self.ks_eh} must split eh_proj's {2 * self.H} columns "
                             f"into multiples of 128")
        if self.H % self.block_n:
            raise ValueError(f"{self.kind}: hidden size {self.H} must be a multiple of block_n={self.block_n}")
        self._graph_pre(g)
        self._graph_mixer(g)
        self._graph_oproj(g, self.NHA * self.DV * self.W_o.element_size())
        self._graph_gate_ffn(g)
        self._ffn_graph(g, 1 if self.fp8 else 2)
        self._graph_post(g)
        return g

    def _graph_mixer(self, g) -> None:
        """The DSA mixer: a_in -> o (this rank's heads' attention outputs, bf16)."""
        H, W, BN = self.H, self.width, self.block_n
        wb = lambda t: t.element_size()                                            # noqa: E731
        g.stage("qkv_a")
        self._mat_stage(g, "mat_a", [(0, self.QL, H * wb(self.W_qa)), (1, self.C, H * wb(self.W_kva)),
                                     (2, 2 * self.DI + self.NI, H * 2)], ("x" if self.ain_fold else "a_in",), "ya",
                       self.ks_a)
        g.stage("dsa_norm")
        for r in range(W):
            g.add("dsa_norm", (r, r), reads=("ya",), writes=("qr",), nbytes=self.ks_a * self.NA * 4)
        self.n_box["qr"] = W
        if not self.NEXTN:                         # the mixer's Sinkhorn: needed only by o_sum's hc_post
            self._coef_tasks(g, "1", "hp1", "cf1")
        g.stage("q_b")
        self._mat_stage(g, "mat_q", [(0, self.NHA * self.DN, self.QL * wb(self.W_qb)),
                                     (1, self.NI * self.DI, self.QL * 2)], ("qr",), "q")
        g.stage("absorb_score")
        self.abs_c = min(64, self.C)
        slot = 0
        for h in range(self.NHA):
            for c in range(self.C // self.abs_c):
                g.add("absorb", (h, c, slot), reads=("q",), writes=("ql",), nbytes=self.DN * self.abs_c * 2)
                slot += 1
        self.n_box["ql"] = slot
        self._row_tasks(g, "score", ("q",), "hs0", self.sel_chunk * self.DI * 4)
        for j in range(1, topk_passes(self.bits)):
            g.stage(f"hist{j}")
            slot = 0
            for r in range(W):
                for t in range(self.n_sel):
                    g.add("hist", (r, t, j, slot), reads=(f"hs{j - 1}",), writes=(f"hs{j}",), nbytes=self.sel_chunk * 4)
                    slot += 1
            self.n_box[f"hs{j}"] = slot
        g.stage("select")
        self._row_tasks(g, "select", (f"hs{topk_passes(self.bits) - 1}",), "idx", self.sel_chunk * 4)
        g.stage("attend")
        sp, slot = self.split, 0
        for r in range(W):
            for hg in range(self.NHA // sp.heads_per_task):
                for s in range(sp.n_splits):
                    g.add("attend", (r, hg, s, slot), reads=("idx", "ql"), writes=("att",),
                          nbytes=sp.tokens_per_task * self.C * 2 * 2)
                    slot += 1
        self.n_box["att"] = slot
        g.stage("join")
        self.out_n = min(BN, self.DV)
        slot = 0
        for h in range(self.NHA):
            for nt in range(-(-self.DV // self.out_n)):
                g.add("join", (h, nt, slot), reads=("att",), writes=("o",), nbytes=self.out_n * self.C * 2)
                slot += 1
        self.n_box["o"] = slot

    def _graph_post(self, g) -> None:
        """After the FFN (nothing here: down / down_sum write X_out)."""

    def _row_tasks(self, g, fam, reads, box, nbytes) -> None:
        slot = 0
        for r in range(self.width):
            for t in range(self.n_sel):
                g.add(fam, (r, t, slot), reads=reads, writes=(box,), nbytes=nbytes)
                slot += 1
        self.n_box[box] = slot

    def plan_scratch(self, pl: Planner) -> None:
        W, H, f32, i32, bf = self.width, self.H, "float32", "int32", self.act_dtype
        sp, NH, C = self.split, self.NHA, self.C
        self._plan_hc_rows(pl)
        pl.rows("a_in_rows", (W, H), bf)
        pl.rows("a_rows", (W, H), bf)
        pl.rows("ya", (self.ks_a, W, self.NA), f32)
        pl.rows("qr_rows", (W, self.QL), bf)
        pl.rows("yq", (W, self.NQ), f32)
        pl.rows("qlat", (W, NH, C), f32)
        pl.rows("scores", (W, self.pmax), f32)
        pl.rows("hist", (W, topk_passes(self.bits), self.t_max, 1 << self.bits), i32)
        pl.rows("jstate", (W, topk_passes(self.bits), self.t_max + 2), i32)
        pl.rows("idx_rows", (W, self.WIDTH), i32)
        pl.rows("pm", (W, NH, sp.n_splits), f32)
        pl.rows("pl", (W, NH, sp.n_splits), f32)
        pl.rows("pacc", (W, NH, sp.n_splits, C), f32)
        pl.rows("ctx", (self.grid, ROWS_PAD, C), f32)
        pl.rows("o_rows", (W, NH * self.DV), bf)
        self._plan_ffn_rows(pl)
        nx = self.NEXTN
        # NextN's normed eh_proj input: a slot a CTA (width rows of the widest K slice its eh (eh_fold) and qkv_a
        # (ain_fold) tasks norm into it; the kernel's SLOT_K), else the whole rows
        slot_k = max(2 * H // self.ks_eh, H // self.ks_a)
        fold = self.eh_fold or self.ain_fold
        pl.rows("ein_rows", ((self.grid * W, slot_k) if fold else (W, 2 * H)) if nx else (1,), bf)
        pl.rows("x0", ((1 + self.ks_eh) * W, H) if nx else (1,), f32)      # x, then eh_proj's K-slice planes
        self._plan_boxes(pl)

    def kernel(self):
        return sparse_layer_kernel

    def _nextn_args(self) -> tuple:
        """tokens, embed_w, hidden, W_eh, enorm, hnorm, shared_head norm, n_out: placeholders here."""
        return (self.positions, self.ln1, self.ln1, self.ln1, self.ln1, self.ln1, self.ln1, self.ln1)

    def kernel_args(self, stage_lo, stage_hi, bump, fault_site):
        if self.X is None:
            raise RuntimeError(f"{self.kind}: no input; call run() or set_input() first")
        cfg, sp = self.cfg, self.split
        lat, pk, tail = self.latent, self.pool_keys, self.tail
        args = (self.table, self.starts, self.meta, self.scratch, self.xo, self.xd, self.peer_o, self.peer_d,
                self.X, self.X_out, self.positions, self.slots, lat, pk, tail, *self._nextn_args(),
                self.fn1, self.base1, self.scale1, self.ln1, self.fn2, self.base2, self.scale2, self.ln2,
                self.W_qa, self.S_qa, self.W_kva, self.S_kva, self.W_ix, self.qa_ln, self.kva_ln, self.kn_w, self.kn_b,
                self.ape, self.W_qb, self.S_qb, self.W_iqb, self.kv_b, self.S_kvb, self.W_o, self.S_o,
                self.W_g, self.S_g, self.W_u, self.S_u, self.W_d, self.S_d, self.W_r, self.bias_r,
                self.w_gu, self.s_gu, self.w_de, self.s_de,
                self.rows, self.width, self.tp_rank, self.tp_size, float(cfg.rms_norm_eps), float(cfg.hc_eps),
                float(cfg.swiglu_limit), float(cfg.routed_scaling_factor), float(cfg.qk_head_dim ** -0.5),
                lat.stride(0), pk.stride(0), tail.stride(0), self.pmax, self.sel_chunk, sp.n_splits,
                sp.tokens_per_task, stage_lo, stage_hi, bump, self.tag_stride, self.tag_offset, fault_site,
                self._timeout_ns, self.trace_args()[0])
        out_pf = min(self.C, 128)
        const = dict(H=self.H, QL=self.QL, C=self.C, DI=self.DI, NI=self.NI, NA=self.NA, NH=self.NHA, DN=self.DN,
                     DV=self.DV, NQ=self.NQ, KP=self.KP, TOPK=self.TOPK, WIDTH=self.WIDTH, I=self.I,
                     BLOCK_N=self.block_n, BLOCK_K=self.block_k, PF_K=128, NUM_STAGES=self.num_stages,
                     BLOCK_C=self.block_c, GATE_BH=self.gate_bh, ITERS=cfg.hc_sinkhorn_iters, ROWS_PAD=ROWS_PAD,
                     ACT_F32=self.act_dtype == "float32", ABS_C=self.abs_c, ABS_CK=min(self.DN, 64),
                     HB=sp.heads_per_task, BLOCK_T=sp.block_t, ATT_CK=att_chunk(sp.block_t, self.C), OUT_N=self.out_n,
                     OUT_PF=out_pf, BLOCK_P=self.block_p, T_MAX=self.t_max, BITS=self.bits,
                     SEL_BLOCK=min(64 if interpreting() else 1024, triton.next_power_of_2(self.sel_chunk)), NORM_BLOCK=triton.next_power_of_2(self.H),
                     E=self.E, KE=self.KE, I_E=self.I_E, E_PAD=triton.next_power_of_2(self.E),
                     K_PAD=triton.next_power_of_2(self.KE), RENORM=bool(cfg.norm_topk_prob), BLOCK_E=ROUTER_BLOCK_E, RCK=self.router_ck,
                     NEXTN=self.NEXTN, TRACE=self.trace_args()[1], KS_GU=self.ks_gu, KS_E=self.ks_e, KG=self.kg, KS_O=self.ks_o,
                     **dict(zip(("NS_PAD", "SB"), join_chunk(sp.n_splits, self.C))), KS_A=self.ks_a, KS_EH=self.ks_eh,
                     EH_FOLD=self.eh_fold, AIN_FOLD=self.ain_fold,
                     Q_PAD=triton.next_power_of_2(self.QL), C_PAD=triton.next_power_of_2(self.C),
                     NI_PAD=triton.next_power_of_2(self.NI))
        return args, const

    # ------------------------------------------------------------------ run
    def set_input(self, X, latent, pool_keys, tail_rows, positions, slots=None) -> None:
        """Validate and hold this step's inputs; the caches are written in place by the launch."""
        rows = X.shape[0] if isinstance(X, torch.Tensor) and X.dim() == 3 else 0
        if not 1 <= rows <= self.width:
            raise ValueError(f"{self.kind}: {rows} rows; this launch is built for 1..{self.width}")
        self._check("X", X, (rows, 4, self.H))
        S = latent.shape[0] if isinstance(latent, torch.Tensor) and latent.dim() == 3 else 0
        if not S or latent.shape[2] != self.C or latent.stride(2) != 1 or latent.stride(1) != self.C:
            raise ValueError(f"{self.kind}: latent must be [slots, max_len, {self.C}] with contiguous rows")
        if latent.dtype not in (torch.float32, torch.bfloat16) or latent.shape[1] > self.max_len:
            raise ValueError(f"{self.kind}: latent {latent.dtype} with max_len {latent.shape[1]}: need fp32/bf16, "
                             f"max_len <= {self.max_len} (the build's)")
        npool = -(-latent.shape[1] // self.KP)
        for name, t, shape, dts in (("pool_keys", pool_keys, (S, npool, self.DI), (torch.float32, torch.bfloat16)),
                                    ("tail_rows", tail_rows, (S, self.KP, 2 * self.DI), (torch.float32,))):
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype not in dts
                    or t.stride(2) != 1 or t.stride(1) != shape[2]):
                raise ValueError(f"{self.kind}: {name} must be {'/'.join(str(d)[6:] for d in dts)} {list(shape)} "
                                 f"with contiguous rows")
        for name, t in (("latent", latent), ("pool_keys", pool_keys), ("tail_rows", tail_rows)):
            if t.stride(0) % CACHE_ALIGN_ELEMS or t.data_ptr() % 16:
                raise ValueError(f"{self.kind}: {name}'s slot stride {t.stride(0)} must be a multiple of {CACHE_ALIGN_ELEMS} "
                                 f"elements and its data 16-byte aligned (the kernel's vector loads assume it)")
        for t in (latent, pool_keys, tail_rows):
            if t.device != self.device and not (t.device.type == self.device.type == "cuda"):
                raise ValueError(f"{self.kind}: caches on {t.device}, the launch on {self.device}")
        pos = torch.as_tensor(positions).reshape(-1).to(torch.int64).cpu()
        sl = torch.arange(rows) if slots is None else torch.as_tensor(slots).reshape(-1).to(torch.int64).cpu()
        if pos.shape[0] != rows or sl.shape[0] != rows:
            raise ValueError(f"{self.kind}: positions / slots need {rows} entries")
        if bool((pos < 0).any()) or bool((pos >= latent.shape[1]).any()):
            raise ValueError(f"{self.kind}: positions {pos.tolist()} outside [0, {latent.shape[1]})")
        if bool((sl < 0).any()) or bool((sl >= S).any()) or len(set(sl.tolist())) != rows:
            raise ValueError(f"{self.kind}: slots {sl.tolist()} must be distinct, in [0, {S})")
        self.positions[:rows] = pos.to(self.positions)
        self.slots[:rows] = sl.to(self.slots)
        self.X, self.latent, self.pool_keys, self.tail, self.rows = X, latent, pool_keys, tail_rows, rows

    def enqueue(self, fault_site: int = -1, stagewise: bool | None = None) -> None:
        """Launch.enqueue; stage by stage (CPU), once a stage has recorded a timeout the stages up to the
        last are skipped: they would only see the abort word and do nothing. The last one still runs,
        since its CTAs advance the epoch (a repeated tag would let stale box words pass)."""
        spans = self.spans(stagewise)
        if len(spans) == 1:
            return super().enqueue(fault_site, stagewise)
        for i, (lo, hi) in enumerate(spans):
            last = i == len(spans) - 1
            if last or i == 0 or not self.record().failed:      # before stage 0 the record is the last launch's
                self.enqueue_span(lo, hi, last, fault_site)

    def set_step(self, X, latent, pool_keys, tail_rows, positions, slots=None) -> None:
        self.set_input(X, latent, pool_keys, tail_rows, positions, slots)

    def commit(self) -> None:
        """Nothing to copy: the caches are written in place (see the module docstring)."""

    def run(self, X, latent, pool_keys, tail_rows, positions, slots=None, *, inject_fault: str | None = None,
            peer: dict | None = None):
        """One checked launch -> X' [rows, 4, H] fp32 (a fresh tensor). Raises HandoffTimeout on a fault
        (the slots' caches then hold their old state; see the module docstring)."""
        fault = self.fault_id(inject_fault)
        self.set_input(X, latent, pool_keys, tail_rows, positions, slots)
        if self.loopback:
            self.set_peers(peer)
        self.enqueue(fault)
        self.check()
        return self.X_out[: self.rows].clone()

    def selection(self, rows: int | None = None) -> torch.Tensor:
        """Token indices [rows, index_width] int32 the latest launch attended to (-1 padded)."""
        return self.layout.view(self.scratch, "idx_rows")[: rows or self.rows].clone()


def layer_caches(caches, d: int, latent_dtype=torch.float32, pool_dtype=torch.float32):
    """(latent, pool_keys, tail_rows) of DSA cache index d from a reference DecodeCaches: views (written
    in place by the launch) for fp32, else converted copies (bf16: the GPU layout)."""
    lat, pk = caches.latent[:, d], caches.pool_keys[:, d]
    if latent_dtype != torch.float32:
        lat = lat.to(latent_dtype).contiguous()
    if pool_dtype != torch.float32:
        pk = pk.to(pool_dtype).contiguous()
    return lat, pk, caches.tail_rows[:, d]


def to_latent_dtype(latent: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The reference's fp32 latent [S, max_len, C] in the kernel's cache dtype (round to nearest)."""
    return latent.to(dtype).contiguous()


def from_latent(latent: torch.Tensor) -> torch.Tensor:
    """A kernel latent cache back in the reference's fp32 layout."""
    return latent.float()
