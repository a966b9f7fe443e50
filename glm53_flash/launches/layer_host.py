"""Host side of the KDA layer launches (embed / dense / kda kinds): this rank's weights, the task
graph, the scratch layout, the kernel arguments, and the all-or-nothing `run`.

`KdaLayerLaunch(cfg, source, layer, ...)`: source is a loaded `Checkpoint` (its weights are already
this rank's pieces; FP8 tensors come with their scales) or a mapping of full tensors by HF name
(RandomWeights, a dequantized checkpoint), which is sharded here with tp.py's rules; an optional
`scales` mapping makes FP8 entries of such a mapping usable. KDA tensors always run in bf16; the
dense MLP's gate / up / down run in FP8 when given FP8 (tiny shapes at TP > 1 arrive dequantized,
tp.py's rule).

State contract (DESIGN.md §6): `run(X, kda_state, conv_window)` reads the caller's state and window
(this layer's per-row slices, reference layout: state [rows, nh/tp, dv, dk] fp32, window
[rows, K-1, 3 * kda_dim / tp] fp32 with this rank's q | k | v channels) and writes the new ones into
the launch's own buffers; only after a clean launch are they copied back into the caller's tensors.
A launch that raises HandoffTimeout leaves them exactly as they were.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import triton

from layout import Planner

from .. import schedule as sched_mod
from .. import tp as tp_mod
from ..schedule import NOMINAL_GRID, TASK_COST_FLOOR, TaskGraph, choose_groups, choose_k_split
from ..weights import PREFIX, weight_specs
from .base import Launch, check_rank_width, interpreting, run_interleaved
from .ffn import BOX_BASE_H as BOX_BASE
from .ffn_tasks import ROUTER_BLOCK_E, ROUTER_MIN_CK
from .kda_layer import BOXES, FAMILIES, META, META_WORDS, ROWS_REGIONS, kda_layer_kernel
from .mixer_kda import TP_MAX

ROWS_PAD = 8
# o_proj / dense down K slices chosen from the shapes (layer_host._oproj_split, _no_moe) when on; off (unsplit unless
# pinned): measured on the H100 (twelfth session) they gave nothing at TP1, each join's hop eating the shorter stage
# (bench/RESULTS.md, docs/DECISIONS.md "The TP1 K slices, measured"). GLM53_SPLIT_BY_SHAPE=1 turns them on.
SPLIT_BY_SHAPE = os.environ.get("GLM53_SPLIT_BY_SHAPE", "0") == "1"


def oproj_split_for(tp: int, n: int, k: int, wbytes: int, block_n: int) -> int:
    """o_proj's K slices from the shape (W_o [n, k] of wbytes an element, block_n-row tiles): the
    slices are sources of the o_sum rank sum, so at most TP_MAX; TP > 1: 1 (tp x KS sources, larger mailboxes:
    not built). schedule.choose_groups, whose join hop replaces the tile owner's fused hc_post at TP 1."""
    if tp > 1 or not SPLIT_BY_SHAPE:
        return 1
    return choose_groups(-(-n // block_n), k // 128, block_n * 128 * wbytes, max_groups=TP_MAX.value)


def down_split_for(tp: int, n: int, k: int, wbytes: int, block_n: int) -> int:
    """The dense down GEMV's K slices from the shape (as oproj_split_for), joined by down_join. TP > 1: 1 (the
    model gives 3 at TP8 too, -1.7 us, against a second hop there: not measured)."""
    if tp > 1 or not SPLIT_BY_SHAPE:
        return 1
    return choose_groups(-(-n // block_n), k // 128, block_n * 128 * wbytes)


SLOT = 40
REGS_PER_SM = 65536         # sm_90: registers per SM, allocated per warp in units of 256 (8 per thread)


def maxnreg_for(ctas_per_sm: int, num_warps: int = 4) -> int:
    """The ptxas register cap of a layer launch: the most registers a thread may use while `ctas_per_sm` CTAs
    of `num_warps` warps stay resident on one SM (255 at the default 2 CTAs of 4 warps, 128 at 4). A lower cap
    buys no occupancy the grid uses and costs time: H200, 255 vs 128 on the same build, kda TP8 -4.3 us, dense
    -2.8, kda TP1 -7.5 (kda_layer.py "Registers"). GLM53_MAXNREG=N overrides it (an A/B switch, e.g. 128, the
    cap before 2026-12-01)."""
    env = os.environ.get("GLM53_MAXNREG")
    if env:
        return int(env)
    per_thread = REGS_PER_SM // (max(1, ctas_per_sm) * num_warps * 32)
    return max(24, min(255, per_thread // 8 * 8))


DEFAULT_MAXNREG = maxnreg_for(2)    # at the layer launches' default_ctas_per_sm (-1 = the grid's cap; None = ptxas's)


def default_block_v(head_dim: int) -> int:
    """Value rows per KDA task: the whole head up to 64 (the norm fuses into the task), else 32 (a
    128 x 128 fp32 state block would lift the whole kernel to ~254 registers, kernels/kda.py; the
    norm then joins in a kda_norm stage). The same on every platform, so builds agree bit for bit."""
    return head_dim if head_dim <= 64 else 32


def _ranges(n_tiles: int, n_tasks: int) -> list[tuple[int, int]]:
    """n_tiles split into n_tasks contiguous ranges (t0, count), as even as possible."""
    return [(s * n_tiles // n_tasks, (s + 1) * n_tiles // n_tasks - s * n_tiles // n_tasks) for s in range(n_tasks)]


def rank_tensors(cfg, source, names, tp_rank: int, tp_size: int, scales: Mapping | None = None):
    """(weights, scales) of this rank for `names`: dict name -> piece, dict name -> scale (FP8 kept)."""
    specs = weight_specs(cfg)
    out, sc = {}, {}
    if hasattr(source, "weights") and hasattr(source, "tp_size"):          # a loaded Checkpoint
        if (source.tp_rank, source.tp_size) != (tp_rank, tp_size):
            raise ValueError(f"checkpoint holds TP rank {source.tp_rank}/{source.tp_size}, launch asked for "
                             f"{tp_rank}/{tp_size}")
        for n in names:
            out[n] = source.weights[n]
            if n in source.scales:
                sc[n] = source.scales[n]
        return out, sc
    scales = scales or {}
    for n in names:
        t = source[n]
        if t.dtype == torch.float8_e4m3fn:
            if n not in scales:
                raise ValueError(f"{n}: FP8 tensor without a scale (pass scales=)")
            piece, s = tp_mod.shard_fp8(specs[n], t, scales[n], tp_rank, tp_size)
            out[n] = piece
            if s is not None:
                sc[n] = s
        else:
            out[n] = tp_mod.shard(specs[n], t, tp_rank, tp_size)
    return out, sc


class KdaLayerLaunch(Launch):
    """One KDA layer (mixer + FFN, both inside mHC) of one TP rank as one persistent launch.

    run(X [rows, 4, H] fp32, kda_state [rows, nh/tp, dv, dk] fp32, conv_window [rows, K-1, 3D/tp] fp32)
    -> X' [rows, 4, H] fp32 (a fresh tensor); state and window updated in place after a clean launch.
    block_v: value rows per KDA task (DV: one task per head, norm fused; smaller: a kda_norm stage).
    TP > 1: `xchg` = (xo, xd) shared by the simulated ranks (new_xchg), or None for loopback mode (the
    other ranks' partial sums come from `peer` given to run, zeros by default).
    """

    kind = "dense"
    embed = False
    # two CTAs per SM (128 registers, 4 warps: four would fit): twice the loads in flight per SM. kda TP1,
    # 1 row, bf16 on the H200: 518 us at 1 CTA per SM, 456 us at 2 (block_n 32: 660, 8 warps: 522)
    default_ctas_per_sm = 2
    # the router tiles' least width (ffn_tasks.router_rck): kda.py sets the kernel's RCK from it and rounds the K ranges
    router_ck: int = ROUTER_MIN_CK
    NEXTN = False                 # the NextN block (launches/nextn.py) has no mHC: no coef tasks or waits
    # K splits the launch would otherwise choose from the shapes (schedule.py choose_groups); tests pin them, and
    # GLM53_OPROJ_SPLIT / GLM53_DOWN_GROUPS set them for A/B timings (1: unsplit, the builds before 2026-12-06)
    oproj_split: int | None = int(os.environ.get("GLM53_OPROJ_SPLIT", "0")) or None     # o_proj K slices
    down_groups: int | None = int(os.environ.get("GLM53_DOWN_GROUPS", "0")) or None     # down K slices / groups
    META_LAYOUT = (BOXES, ROWS_REGIONS, META, META_WORDS)        # the kernel module's meta words

    def __init__(self, cfg, source, layer: int, *, tp_rank: int = 0, tp_size: int = 1, width: int = 1, device=None,
                 grid: int | None = None, scales: Mapping | None = None, block_v: int | None = None,
                 timeout_s: float = 1.0, xchg=None, block_n: int = 64, block_k: int = 128, num_stages: int = 5,
                 num_warps: int = 4, act_dtype: str = "bfloat16", maxnreg: int | None = -1, **tag_kw):
        super().__init__(grid=grid, device=device, timeout_s=timeout_s, **tag_kw)
        per_sm = self.default_ctas_per_sm
        if not interpreting():
            per_sm = -(-self.grid // sched_mod.device_sm_count(self.device))
        self.maxnreg = maxnreg_for(per_sm, num_warps) if maxnreg == -1 else maxnreg
        k = self.kind
        check_rank_width(k, cfg, tp_rank, tp_size, width)
        if not isinstance(layer, int) or not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"{k}: layer={layer!r} outside [0, {cfg.num_hidden_layers})")
        plan = cfg.layers[layer]
        if plan.launch != self.kind:
            raise ValueError(f"{k}: layer {layer} is a {plan.launch!r} launch (mixer {plan.mixer}, ffn {plan.ffn})")
        if act_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"{k}: act_dtype={act_dtype!r} must be 'bfloat16' or 'float32'")
        self.act_dtype = act_dtype
        self.cfg, self.layer, self.tp_rank, self.tp_size, self.width = cfg, layer, tp_rank, tp_size, width
        self.num_warps, self.block_n, self.block_k, self.num_stages = num_warps, block_n, block_k, num_stages
        H, d = cfg.hidden_size, cfg.linear_head_dim
        self.H, self.DK = H, d
        self.NH = cfg.linear_num_heads // tp_size
        self.D = self.NH * d
        self.R = d                                        # f_a / g_a rank
        self.KC = cfg.linear_conv_kernel_dim
        self.N_IN = 3 * self.D + self.NH + 2 * self.R
        self.BV = block_v or default_block_v(d)
        self.ks_in = self.k_split_for(self.N_IN, H, 2)        # inproj K slices (shape only: same bits on any grid)
        if d % self.BV or self.BV & (self.BV - 1) or self.BV < 16:
            raise ValueError(f"{k}: block_v={self.BV} must be a power of two >= 16 dividing {d}")
        self._load_weights_recorded(source, scales)
        self._setup_xchg(xchg)
        dev, nan = self.device, float("nan")
        self.X_out = torch.full((width, 4, H), nan, device=dev)
        self.S_out = torch.full((width, self.NH, d, d), nan, device=dev)
        self.W_out = torch.full((width, self.KC - 1, 3 * self.D), nan, device=dev)
        self.tokens = torch.zeros(width, dtype=torch.int32, device=dev)
        self.X = self.S_in = self.win_in = None
        self.rows = 0
        self._setup()
        self.meta = self._meta().to(dev)

    def _oproj_split(self) -> int:
        """K slices of o_proj (W_o loaded): the pin, or oproj_split_for's shape choice. At TP 1 the tiles of full K
        kept 64 of 264 CTAs busy (36 us for 67 MB, H100 trace), so the slices go to the xo mailbox as sources and the
        o_sum tasks add them in order (ffn.py oproj_task / post1_task): a join hop instead of the tile owner's
        hc_post."""
        steps = self.W_o.shape[1] // 128
        ks = self.oproj_split or oproj_split_for(self.tp_size, *self.W_o.shape, self.W_o.element_size(), self.block_n)
        if ks > 1 and (steps % ks or ks > TP_MAX.value or self.tp_size > 1):
            raise ValueError(f"{self.kind}: oproj_split={ks} must divide o_proj's {steps} K steps of 128, be at "
                             f"most {TP_MAX.value}, and needs tp_size 1")
        return ks

    def _setup_xchg(self, xchg) -> None:
        """The cross-rank mailboxes (xo, xd) and the loopback peers' partials (shared with sparse.py); at TP 1 with
        o_proj in K slices, xo is this rank's own mailbox [1, KS_O, width, H] for them."""
        tp, W, H = self.tp_size, self.width, self.H
        self.ks_o = self._oproj_split()
        if tp > 1 and xchg is None:
            self.loopback = True
            xchg = new_xchg(self.cfg, tp, W, self.device)
        else:
            self.loopback = False
        if xchg is not None:
            n = tp * tp * W * H
            if len(xchg) != 2 or any(x.dtype != torch.int64 or x.numel() < n for x in xchg):
                raise ValueError(f"{self.kind}: xchg must be two int64 mailboxes of >= {n} words (see new_xchg)")
        self.xo, self.xd = xchg if xchg is not None else (torch.zeros(1, dtype=torch.int64, device=self.device),) * 2
        if tp == 1 and self.ks_o > 1:
            self.xo = torch.zeros(self.ks_o * W * H, dtype=torch.int64, device=self.device)
        self.peer_o = torch.zeros(max(tp, 1), W, H, device=self.device)
        self.peer_d = torch.zeros(max(tp, 1), W, H, device=self.device)

    # ------------------------------------------------------------------ weights
    def _names(self) -> list[str]:
        p = f"{PREFIX}layers.{self.layer}."
        a = p + "self_attn."
        names = [p + f"hc_{s}_{n}" for s in ("attn", "ffn") for n in ("fn", "base", "scale")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [a + f"{n}_proj.weight" for n in ("q", "k", "v", "b", "f_a", "g_a", "f_b", "g_b", "o")]
        names += [a + f"{n}_conv1d.weight" for n in "qkv"] + [a + "A_log", a + "dt_bias", a + "o_norm.weight"]
        names += self._ffn_names(p)
        if self.embed:
            names.append(PREFIX + "embed_tokens.weight")
        return names

    def _ffn_names(self, p: str) -> list[str]:
        return [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]

    def _load_weights(self, source, scales) -> None:
        w, sc = rank_tensors(self.cfg, source, self._names(), self.tp_rank, self.tp_size, scales)
        dev, bf, f32 = self.device, torch.bfloat16, torch.float32
        p = f"{PREFIX}layers.{self.layer}."
        a = p + "self_attn."

        def g(n, dtype=None):
            t = w[n].to(dev)
            return (t.to(dtype) if dtype is not None else t).contiguous()
        self.fn1, self.base1, self.scale1 = (g(p + f"hc_attn_{n}", f32) for n in ("fn", "base", "scale"))
        self.fn2, self.base2, self.scale2 = (g(p + f"hc_ffn_{n}", f32) for n in ("fn", "base", "scale"))
        self.ln1, self.ln2 = g(p + "input_layernorm.weight", bf), g(p + "post_attention_layernorm.weight", bf)
        self.W_in = torch.cat([g(a + f"{n}_proj.weight", bf) for n in ("q", "k", "v", "b", "f_a", "g_a")]).contiguous()
        if tuple(self.W_in.shape) != (self.N_IN, self.H):
            raise ValueError(f"{self.kind}: fused inproj is {tuple(self.W_in.shape)}, expected ({self.N_IN}, {self.H})")
        self.conv_w = torch.cat([g(a + f"{n}_conv1d.weight", f32).squeeze(1) for n in "qkv"]).contiguous()
        self.A_log, self.dt_bias = g(a + "A_log", f32), g(a + "dt_bias", f32)
        self.f_b, self.g_b = g(a + "f_b_proj.weight", bf), g(a + "g_b_proj.weight", bf)
        self.onorm_w, self.W_o = g(a + "o_norm.weight", bf), g(a + "o_proj.weight", bf)
        self.embed_w = g(PREFIX + "embed_tokens.weight", bf) if self.embed else self.ln1
        self._load_ffn(w, sc, p)

    def _load_weights_recorded(self, source, scales) -> None:
        """_load_weights, noting which tensor attributes it set (`weight_names`: share_weights swaps them)."""
        before = {k: id(v) for k, v in vars(self).items()}
        self._load_weights(source, scales)
        self.weight_names = tuple(k for k, v in vars(self).items()
                                  if isinstance(v, torch.Tensor) and before.get(k) != id(v))

    def share_weights(self, other) -> None:
        """Use `other`'s weight tensors (a build of the same kind, layer, TP rank and format for another width)
        instead of this build's own copies, which are dropped: the widths of a model then hold one copy of
        its weights."""
        same = (other.kind, other.layer, other.tp_rank, other.tp_size, other.weight_names) == \
            (self.kind, self.layer, self.tp_rank, self.tp_size, self.weight_names)
        if not same:
            raise ValueError(f"{self.kind}: share_weights needs a build of the same kind, layer, rank and weights")
        for n in self.weight_names:
            a, b = getattr(self, n), getattr(other, n)
            if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
                raise ValueError(f"{self.kind}: weight {n} differs between the builds: {tuple(a.shape)} {a.dtype} "
                                 f"vs {tuple(b.shape)} {b.dtype}")
        for n in self.weight_names:                 # checked all first: a refused share changes nothing
            setattr(self, n, getattr(other, n))

    def _mat(self, w, sc, name):
        """(weight, scale) on the device: FP8 kept with its scale, anything else as bf16."""
        t = w[name].to(self.device)
        if t.dtype == torch.float8_e4m3fn:
            return t.contiguous(), sc[name].to(self.device, torch.float32).contiguous()
        t = t.to(torch.bfloat16).contiguous()
        return t, t

    def _gate_up(self, w, sc, gate: str, up: str) -> None:
        """W_g, S_g, W_u, S_u of an MLP as views into one packed bank [2I, H] (gate rows, then up rows; FP8
        scales likewise [2I/128, H/128]): the gate|up tasks stream a gate tile and its up tile as one pair
        tile (launches/ffn_tasks.py gateup_part_tile), so the up rows must sit I rows after the gate rows."""
        (wg, sg), (wu, su) = self._mat(w, sc, gate), self._mat(w, sc, up)
        if wg.dtype != wu.dtype or wg.shape != wu.shape:
            raise ValueError(f"{self.kind}: {gate} {tuple(wg.shape)} {wg.dtype} and {up} {tuple(wu.shape)} {wu.dtype} "
                             "must share shape and format")
        I, fp8 = wg.shape[0], wg.dtype == torch.float8_e4m3fn
        if fp8 and I % 128:
            raise ValueError(f"{self.kind}: FP8 {gate} needs a multiple of 128 rows, got {I}")
        W = torch.cat([wg, wu])
        self.W_g, self.W_u = W[:I], W[I:]
        if fp8:
            S = torch.cat([sg, su])
            self.S_g, self.S_u = S[: sg.shape[0]], S[sg.shape[0]:]
        else:
            self.S_g, self.S_u = self.W_g, self.W_u

    def _load_ffn(self, w, sc, p) -> None:
        self._gate_up(w, sc, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.W_d, self.S_d = self._mat(w, sc, p + "mlp.down_proj.weight")
        self.I = self.W_g.shape[0]
        self.fp8 = self.W_g.dtype == torch.float8_e4m3fn or self.W_d.dtype == torch.float8_e4m3fn
        self._no_moe()
        self.ks_gu = self.k_split_for(self.I, self.H, 2 * self.W_g.element_size())     # gate and up: 2 tiles
        if self.fp8 and 128 % self.block_n:
            raise ValueError(f"{self.kind}: FP8 needs block_n dividing 128, got {self.block_n}")

    def _no_moe(self) -> None:
        """Dense FFN: the MoE arguments are placeholders the kernel never reads (MOE=False); KG: the down GEMV's K
        slices (ffn_tasks.py down_task), joined in order by down_join as the MoE's expert groups."""
        self.moe, self.E, self.KE, self.I_E, self.nrpart, self.ks_e = False, 1, 1, 1, 1, 1
        steps = self.W_d.shape[1] // 128
        self.kg = self.down_groups or down_split_for(self.tp_size, *self.W_d.shape, self.W_d.element_size(),
                                                     self.block_n)
        if steps % self.kg:
            raise ValueError(f"{self.kind}: down_groups={self.kg} must divide the down GEMV's {steps} K steps of 128")
        self.act_fold = False
        self.W_r = self.bias_r = self.fn1
        self.w_gu = self.s_gu = self.w_de = self.s_de = self.W_g

    # ------------------------------------------------------------------ plan
    @classmethod
    def site_names(cls, tp_size: int = 1, block_v_split: bool = False, down_groups: int = 1,
                   oproj_split: int = 1) -> list[str]:
        k = cls.kind
        s = ["hp1", "a_in", "yin"] + (["oraw"] if block_v_split else []) + ["o"]
        s += (["xo"] if tp_size > 1 or oproj_split > 1 else []) + ["cf1", "hp2", "a", "hg", "h"]
        s += (["dp"] if down_groups > 1 else []) + ["cf2"] + (["xd"] if tp_size > 1 else [])
        return [f"{k}.{n}" for n in s]

    def build_graph(self) -> TaskGraph:
        g, H, W = TaskGraph(self.kind, FAMILIES), self.H, self.width
        NB = self.DK // self.BV
        wb = 1 if self.fp8 else 2
        self.n_box = {}
        if H % self.block_n:
            raise ValueError(f"{self.kind}: hidden size {H} must be a multiple of block_n={self.block_n}")
        self._graph_pre(g)
        g.stage("inproj")
        self._gemv_stage(g, "inproj", self.N_IN, self.H * 2, ("a_in",), ("yin",), "yin", k_split=self.ks_in)
        g.stage("kda")
        slot = 0
        for r in range(W):
            for h in range(self.NH):
                for cb in range(NB):
                    g.add("kda", (r, h, cb, slot), reads=("yin",), writes=("o" if NB == 1 else "oraw",),
                          nbytes=2 * self.BV * self.DK * 4 + 2 * self.R * (self.DK + self.BV))
                    slot += 1
        self.n_box["o" if NB == 1 else "oraw"] = slot
        if NB > 1:
            g.stage("kda_norm")
            slot = 0
            for r in range(W):
                for h in range(self.NH):
                    for cb in range(NB):
                        g.add("kda_norm", (r, h, cb, slot), reads=("yin", "oraw"), writes=("o",),
                              nbytes=2 * self.R * self.BV)
                        slot += 1
            self.n_box["o"] = slot
        self._graph_oproj(g, self.D * 2)
        self._graph_gate_ffn(g)
        self._ffn_graph(g, wb)
        return g

    # graph pieces shared with the sparse launch (sparse.py; nextn.py overrides pre / gate_ffn)
    def _graph_pre(self, g) -> None:
        """mHC before the mixer: hc_pre partial slots (one per BLOCK_N column tile: join order = tile
        order, whatever the grid), then the gate row a_in."""
        G, H, BN = self.grid, self.H, self.block_n
        g.stage("hc_pre")
        self.block_c = 32
        n_col = H // BN
        parts = _ranges(n_col, min(G, n_col))
        self.n_box["hp1"] = self._row_group_tasks(g, "part", parts, lambda n, nr: n * BN * (24 * 4 * 4 + nr * 4 * 4),
                                                  writes=("hp1",))
        self.npart1 = self.npart2 = n_col
        self.gate_bh = min(512, H)
        g.stage("gate_in")
        self._gate_tasks(g, "1", "hp1", "a_in", "cf1", coef=not self.late_coef1)

    # the mixer's coef tasks in a later stage of the launch's own choosing (_coef_tasks there) instead of
    # beside the gate: where the stage after gate_in has a task for every CTA (sparse: qkv_a's split-K), the
    # coef CTA's task of that stage waited for the Sinkhorn (~11 us traced on the critical path, H200)
    late_coef1 = False

    def _gate_tasks(self, g, k: str, slots: str, row: str, box: str, coef: bool = True) -> None:
        """mHC k ("1" mixer, "2" FFN) after its partial slots: the gate row by (row, column tile) tasks, and
        (coef) per row a coef task for hc_post's coefficients (the Sinkhorn) beside them, on a CTA of its
        own; hc_post waits on the coef box."""
        n_gate, W = self.H // self.gate_bh, self.width
        for r in range(W):
            for t in range(n_gate):
                g.add("gate" + k, (t * self.gate_bh, r * n_gate + t, r), reads=(slots,), writes=(row,),
                      nbytes=4 * self.gate_bh * 4)
        self.n_box[row] = W * n_gate
        if coef:
            self._coef_tasks(g, k, slots, box)

    def _coef_tasks(self, g, k: str, slots: str, box: str) -> None:
        """Per row a coef task of mHC k (the Sinkhorn of its partial slots -> the coef box) in the current
        stage."""
        W = self.width
        # a coef task costs its time, not its 10 KB: the Sinkhorn's ~10-14 us (traced, H200) ~ 5 task floors.
        # At its bytes the placement gave its CTA an in_proj tile next, which started 14 us late
        for r in range(W):
            g.add("coef" + k, (r, r), reads=(slots,), writes=(box,), nbytes=self.npart1 * 40 * 4 + 5 * TASK_COST_FLOOR)
        self.n_box[box] = W

    def _hc_post_reads(self, box: str) -> tuple:
        """The coefficient box a task that runs hc_post waits on (none in the NextN block: no mHC there)."""
        return () if self.NEXTN else (box,)

    def _graph_oproj(self, g, row_bytes: int) -> None:
        """o_proj tiles (row_bytes: bytes of one weight row); TP > 1: the exchange and the rank sums."""
        H, BN, tp = self.H, self.block_n, self.tp_size
        g.stage("o_proj")
        if tp == 1 and self.ks_o == 1:
            self._gemv_stage(g, "oproj", H, row_bytes, ("o",) + self._hc_post_reads("cf1"), ("hp2",), "hp2")
        else:
            ranges = self._gemv_stage(g, "oproj", H, row_bytes, ("o",), ("xo",), None, ret_ranges=True,
                                      k_split=self.ks_o)
            self._peers(g, "peer_o", ranges, "xo")
            g.stage("o_sum")
            self.n_box["hp2"] = self._row_group_tasks(g, "post1", ranges, lambda n, nr: tp * nr * n * BN * 8,
                                                      reads=("xo",) + self._hc_post_reads("cf1"), writes=("hp2",))

    def _graph_gate_ffn(self, g) -> None:
        g.stage("gate_ffn")
        self._gate_tasks(g, "2", "hp2", "a", "cf2")

    def _ffn_graph(self, g: TaskGraph, wb: int) -> None:
        H, tp = self.H, self.tp_size
        g.stage("gate_up")
        self._gemv_stage(g, "gu", self.I, 2 * H * wb, ("a",), ("hg",), "hg", k_split=self.ks_gu)
        g.stage("act")
        self.n_box["h"] = self._act_tasks(g, 0)
        g.stage("down")
        if self.kg > 1:             # K slices -> dpart planes, joined in order (and hc_post / xd) by down_join
            ranges = self._gemv_stage(g, "down", H, self.I * wb, ("h",), ("dp",), "dp", ret_ranges=True,
                                      k_split=self.kg)
            self._down_join(g, ranges)
        elif tp == 1:
            ranges = self._gemv_stage(g, "down", H, self.I * wb, ("h", "cf2"), (), None, ret_ranges=True)
        else:
            ranges = self._gemv_stage(g, "down", H, self.I * wb, ("h", "cf2"), ("xd",), None, ret_ranges=True)
        self._down_sum(g, ranges)

    # the FFN's tail stages, shared with the MoE graph (kda.py)
    def _down_join(self, g, ranges) -> None:
        """down_join tasks (t0, n, producer) over the down stage's tile ranges: the KG planes of dp in order, then
        hc_post (TP 1) or this rank's xd (TP > 1)."""
        g.stage("down_join")
        for s, (t0, n) in enumerate(ranges):
            g.add("down_join", (t0, n, s), reads=("dp",) + self._hc_post_reads("cf2"),
                  writes=("xd",) if self.tp_size > 1 else (), nbytes=self.kg * self.width * n * self.block_n * 4)

    def _down_sum(self, g, ranges, peer_stage: int | None = None) -> None:
        """TP > 1: the loopback peers' xd tiles (in peer_stage if given, else the current one) and the down_sum
        (post2) tasks over the tile ranges."""
        tp, BN = self.tp_size, self.block_n
        if tp > 1:
            self._peers(g, "peer_d", ranges, "xd", stage=peer_stage)
            g.stage("down_sum")
            self._row_group_tasks(g, "post2", ranges, lambda n, nr: tp * nr * n * BN * 8, reads=("xd",))

    def _gemv_stage(self, g, fam, N, row_bytes, reads, writes, box, ret_ranges=False, k_split=1):
        """Tasks (t0, n tiles, producer, K slice) of a weight-streaming GEMV stage: tile ranges over the grid,
        times k_split K slices (each writes its own partial plane; the consumer joins them in order)."""
        ranges = self._stage_ranges(N, k_split)
        s = 0
        for ks in range(k_split):
            for (t0, n) in ranges:
                rows_n = min((t0 + n) * self.block_n, N) - t0 * self.block_n
                g.add(fam, (t0, n, s, ks), reads=reads, writes=writes, nbytes=rows_n * row_bytes // k_split)
                s += 1
        if box is not None:
            self.n_box[box] = s
        return ranges if ret_ranges else s

    def _stage_ranges(self, N: int, k_split: int = 1) -> list[tuple[int, int]]:
        """Tile ranges (t0, n) of a weight-streaming stage over N rows: as many as the grid holds beside its
        k_split K slices (or expert groups), never more than the tiles."""
        tiles = -(-N // self.block_n)
        return _ranges(tiles, min(-(-self.grid // k_split), tiles))

    def _act_tasks(self, g, producer: int) -> int:
        """act kind 0 (ffn_tasks.py): the dense / shared h columns in BLOCK_N-wide tasks, producers from
        `producer` on; -> the next producer index."""
        BN = self.block_n
        for c0 in range(0, self.I, BN):
            g.add("act", (0, 0, c0, min(c0 + BN, self.I), producer), reads=("hg",), writes=("h",),
                  nbytes=self.width * 2 * min(BN, self.I - c0) * 4 * self.ks_gu)
            producer += 1
        return producer

    def k_split_for(self, N: int, K: int, wbytes: int, block_n: int | None = None) -> int:
        """schedule.py choose_k_split for an N x K weight of wbytes per element in this launch's tiles (or tiles of
        block_n rows)."""
        bn = block_n or self.block_n
        step = bn * min(self.block_k, 128) * wbytes
        return choose_k_split(-(-N // bn), K // min(self.block_k, 128), step)

    def _row_group_tasks(self, g, fam, ranges, nbytes, **kw) -> int:
        """Tasks (t0, n tiles, producer, first row, rows) of a row-walking stage (part, post1, post2): one per tile
        range and row group of rows_per_task rows. Such a task walks its rows one after another (a round trip a
        row, a (chunk, row) step), so at 8 rows one task per range took 10-40 us of the path where 1 row takes
        2-5 (H100 traces, 2026-12-05); a row's work and bits are the same in any group. nbytes(n, rows) -> the
        task's cost. -> how many tasks (the producers of the box they write)."""
        per = self.rows_per_task(len(ranges))
        s = 0
        for (t0, n) in ranges:
            for r in range(0, self.width, per):
                g.add(fam, (t0, n, s, r, per), nbytes=nbytes(n, min(per, self.width - r)), **kw)
                s += 1
        return s

    def rows_per_task(self, n_ranges: int) -> int:
        """Rows a task of a row-walking stage (part, post1, post2, moe_down) takes, for n_ranges tasks of all rows:
        the group size that walks the fewest rows on the busiest CTA of the nominal grid (waves x rows a task),
        ties to the larger group (fewer tasks). Where one wave holds every row group (n_ranges x width <= the
        grid) that is one row a task; e.g. 64 ranges at 8 rows: 2 rows (256 tasks, one wave); moe_down's 192
        (tile, group) tasks at 8 rows: 2 rows (768 tasks, 3 waves: 6 rows on the busiest CTA instead of 8).
        A row's work and bits do not depend on its group, so this may follow the grid; the nominal one keeps
        CPU tests on the split path."""
        W, n = self.width, max(1, n_ranges)
        return min(range(1, W + 1), key=lambda per: (-(-n * -(-W // per) // NOMINAL_GRID) * per, -per))

    def _peers(self, g, fam, ranges, region, stage: int | None = None) -> None:
        """Loopback: the other ranks' partial tiles of `region` (in `stage` if given), added as filler tasks
        (schedule.TaskGraph.add): with GLM53_SCHED_FILLER=1 they never queue behind a waiting task of their stage;
        by default (the rule gained nothing timed) they are placed by cost like any task."""
        if not self.loopback:
            return
        for p in range(self.tp_size):
            if p != self.tp_rank:
                for (t0, n) in ranges:
                    g.add(fam, (p, t0, n), writes=(region,), nbytes=self.width * n * self.block_n * 4, filler=True,
                          stage=stage)

    def plan_scratch(self, pl: Planner) -> None:
        W, H, D, NB = self.width, self.H, self.D, self.DK // self.BV
        f32, bf = "float32", self.act_dtype
        self._plan_hc_rows(pl)
        pl.rows("x0", (W, 4, H), f32)
        pl.rows("a_in_rows", (W, H), bf)
        pl.rows("a_rows", (W, H), bf)
        pl.rows("yin_rows", (self.ks_in, W, self.N_IN), f32)
        pl.rows("oraw_rows", (W, D), f32)
        pl.rows("ssq", (W, self.NH, NB), f32)
        pl.rows("ogate", (W, D), f32)                  # kda_norm's gates, formed before its oraw wait
        pl.rows("o_rows", (W, D), bf)
        self._plan_ffn_rows(pl)
        self._plan_boxes(pl)

    # scratch pieces shared with the sparse launch (sparse.py), in the same order
    def _plan_hc_rows(self, pl: Planner) -> None:
        pl.rows("part1", (self.npart1, ROWS_PAD, SLOT), "float32")
        pl.rows("part2", (self.npart2, ROWS_PAD, SLOT), "float32")
        pl.rows("coef1", (self.width, 24), "float32")
        pl.rows("coef2", (self.width, 24), "float32")

    def _plan_ffn_rows(self, pl: Planner) -> None:
        W, H, f32, bf = self.width, self.H, "float32", self.act_dtype
        pl.rows("y1", (W, H), f32)
        pl.rows("xmid", (W, 4, H), f32)
        pl.rows("h_rows", (W, self.I), bf)
        pl.rows("y2", (W, H), f32)
        pl.rows("part_r", (self.nrpart, W, self.E), f32)
        pl.rows("ids_rec", (W, self.KE), "int32")
        pl.rows("rw_rec", (W, self.KE), f32)
        pl.rows("act_e", (W, self.KE, self.I_E), bf)
        pl.rows("hpart", (self.ks_gu, W, 2, self.I), f32)                       # gate|up K-slice planes
        pl.rows("epart", (self.ks_e, W, self.KE, 2, self.I_E), f32)
        pl.rows("dpart", (self.kg, W, H), f32)                                  # moe_down expert-group planes
        # act_fold: each CTA's moe_down joins its expert group's activations of one row here (ffn_tasks.py);
        # dense: unused (KE = I_E = 1 placeholders, KG its down's K slices), one word a CTA
        per_group = (self.KE + 1) // self.kg if self.moe else 1
        pl.rows("act_cta", (self.grid, per_group * self.I_E), bf)

    def _plan_boxes(self, pl: Planner) -> None:
        for b in self.META_LAYOUT[0]:
            pl.box("box_" + b, self.grid, max(1, self.n_box.get(b, 1)))

    def _meta(self) -> torch.Tensor:
        """The kernel's meta words (launches/ffn.py meta_layout): region offsets and scalars, then the
        boxes' (offset, words, producers, site). The layout's names come from the kernel module."""
        L, sched, boxes, regions, meta, words = self.layout, self.schedule, *self.META_LAYOUT
        m = [0] * words
        for n in regions:
            m[meta[n]] = L[n].elem_offset()
        m[meta["hdr"]] = L["hdr"].elem_offset()
        m[meta["site_xo"]], m[meta["site_xd"]] = sched.site_id("xo"), sched.site_id("xd")
        m[meta["npart1"]], m[meta["npart2"]], m[meta["nrpart"]] = self.npart1, self.npart2, self.nrpart
        m[meta["act_fold"]] = int(self.act_fold)
        for i, b in enumerate(boxes):
            r = L["box_" + b]
            m[BOX_BASE + 4 * i: BOX_BASE + 4 * i + 4] = [r.elem_offset(), r.shape[1], self.n_box.get(b, 0),
                                                         sched.site_id(b)]
        return torch.tensor(m, dtype=torch.int32)

    def kernel(self):
        return kda_layer_kernel

    def kernel_args(self, stage_lo, stage_hi, bump, fault_site):
        if self.X is None and not self.embed:
            raise RuntimeError(f"{self.kind}: no input; call run() or set_input() first")
        cfg = self.cfg
        X = self.X if self.X is not None else self.X_out
        args = (self.table, self.starts, self.meta, self.scratch, self.xo, self.xd, self.peer_o, self.peer_d,
                X, self.X_out, self.tokens, self.embed_w,
                self.fn1, self.base1, self.scale1, self.ln1, self.fn2, self.base2, self.scale2, self.ln2,
                self.W_in, self.S_in, self.S_out, self.win_in, self.W_out, self.conv_w, self.A_log, self.dt_bias,
                self.f_b, self.g_b, self.onorm_w, self.W_o, self.W_g, self.S_g, self.W_u, self.S_u, self.W_d, self.S_d,
                self.W_r, self.bias_r, self.w_gu, self.s_gu, self.w_de, self.s_de,
                self.rows, self.width, self.tp_rank, self.tp_size, float(cfg.rms_norm_eps), float(cfg.hc_eps),
                float(cfg.linear_lower_bound), float(cfg.swiglu_limit), float(cfg.routed_scaling_factor),
                stage_lo, stage_hi, bump, self.tag_stride, self.tag_offset, fault_site, self._timeout_ns,
                self.trace_args()[0])
        const = dict(TRACE=self.trace_args()[1], H=self.H, D=self.D, NH=self.NH, R=self.R, N_IN=self.N_IN, I=self.I, DK=self.DK, DV=self.DK,
                     BV=self.BV, KC=self.KC, CK=32, BLOCK_N=self.block_n, BLOCK_K=self.block_k, PF_K=128,
                     NUM_STAGES=self.num_stages, BLOCK_C=self.block_c, GATE_BH=self.gate_bh,
                     ITERS=cfg.hc_sinkhorn_iters, ROWS_PAD=ROWS_PAD, EMBED=self.embed,
                     ACT_F32=self.act_dtype == "float32", MOE=self.moe, E=self.E, KE=self.KE, I_E=self.I_E,
                     E_PAD=triton.next_power_of_2(self.E), K_PAD=triton.next_power_of_2(self.KE),
                     RENORM=bool(cfg.norm_topk_prob), BLOCK_E=ROUTER_BLOCK_E, RCK=self.router_ck, KS_IN=self.ks_in, KS_GU=self.ks_gu,
                     KS_E=self.ks_e, KG=self.kg, KS_O=self.ks_o)
        if self.maxnreg:
            const["maxnreg"] = self.maxnreg       # a compile option (ptxas), not a kernel argument
        return args, const

    # ------------------------------------------------------------------ run
    def _check(self, name, t, shape, dtype=torch.float32):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            desc = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{self.kind}: {name} must be {dtype} {list(shape)}, got {desc}")
        if not t.is_contiguous():
            raise ValueError(f"{self.kind}: {name} must be contiguous")
        if t.device != self.device and not (t.device.type == self.device.type == "cuda"):
            raise ValueError(f"{self.kind}: {name} is on {t.device}, the launch on {self.device}")

    def set_input(self, X, kda_state, conv_window) -> None:
        """Validate and hold this step's inputs (X None for embed, whose rows come from set_tokens)."""
        rows = kda_state.shape[0] if isinstance(kda_state, torch.Tensor) and kda_state.dim() == 4 else 0
        if not 1 <= rows <= self.width:
            raise ValueError(f"{self.kind}: {rows} rows; this launch is built for 1..{self.width}")
        if X is not None:
            self._check("X", X, (rows, 4, self.H))
        self._check("kda_state", kda_state, (rows, self.NH, self.DK, self.DK))
        self._check("conv_window", conv_window, (rows, self.KC - 1, 3 * self.D))
        self.X, self.S_in, self.win_in, self.rows = X, kda_state, conv_window, rows

    def set_step(self, x, kda_state, conv_window) -> None:
        """set_input for run_tp (x: X, or the token ids for embed)."""
        self.set_input(x, kda_state, conv_window)

    def commit(self) -> None:
        """Copy the new state and window into the caller's tensors (after a clean launch only)."""
        self.S_in.copy_(self.S_out[: self.rows])
        self.win_in.copy_(self.W_out[: self.rows])

    def set_peers(self, peer: dict | None) -> None:
        """Loopback: peer rank -> (o_proj partial [rows, H], down partial [rows, H]); absent ranks add 0."""
        self.peer_o.zero_()
        self.peer_d.zero_()
        for p, (po, pd) in (peer or {}).items():
            self.peer_o[p, : po.shape[0]] = po
            self.peer_d[p, : pd.shape[0]] = pd

    def run(self, X, kda_state, conv_window, *, inject_fault: str | None = None, peer: dict | None = None,
            commit: bool = True):
        """One checked launch -> X' [rows, 4, H] fp32. The new state / window are copied into the caller's
        tensors after a clean launch (commit=False: left in S_out / W_out only). Raises HandoffTimeout
        (the caller's state untouched) on a fault."""
        fault = self.fault_id(inject_fault)
        self.set_step(X, kda_state, conv_window)
        if self.loopback:
            self.set_peers(peer)
        self.enqueue(fault)
        self.check()
        if commit:
            self.commit()
        return self.X_out[: self.rows].clone()

    def own_partials(self) -> tuple[torch.Tensor, torch.Tensor]:
        """TP > 1: this rank's own (o_proj, down) partial sums of the latest launch, fp32 [rows, H] each,
        decoded from its slot of the exchange mailboxes (loopback runs feed them to the other ranks)."""
        if self.tp_size == 1:
            raise ValueError(f"{self.kind}: own_partials needs tp_size > 1")
        shape = (self.tp_size, self.tp_size, self.width, self.H)
        out = []
        for x in (self.xo, self.xd):
            w = x.view(shape)[self.tp_rank, self.tp_rank, : self.rows]
            out.append((w >> 32).to(torch.int32).view(torch.float32).clone())
        return out[0], out[1]


def new_xchg(cfg, tp_size: int, width: int, device):
    """The cross-rank mailboxes (xo, xd): int64 [tp (dest), tp (src), width, H] pairs each."""
    n = tp_size * tp_size * width * cfg.hidden_size
    return (torch.zeros(n, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int64, device=device))


def run_tp(launches: list[KdaLayerLaunch], inputs: list[tuple], inject_fault: str | None = None,
           fault_rank: int = 0) -> list[torch.Tensor]:
    """Simulated TP (CPU): inputs[r] = (X or tokens, kda_state, conv_window) of rank r; every rank's
    stage s, then stage s + 1. Commits every rank's state only if no rank faulted. -> X' per rank."""
    faults = []
    for r, (L, inp) in enumerate(zip(launches, inputs)):
        L.set_step(*inp)
        faults.append(L.fault_id(inject_fault) if r == fault_rank else -1)
    run_interleaved(launches, faults)
    for L in launches:
        L.commit()
    return [L.X_out[: L.rows].clone() for L in launches]
