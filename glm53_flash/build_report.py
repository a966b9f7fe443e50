"""Host side of `python -m glm53_flash build --report`: registers, spills, shared memory and CTAs per SM of
every launch kind's persistent kernel at the real per-rank shapes, from offline sm_90 compiles (sm90_regs.py:
Triton compiles for Hopper here and its wheel's ptxas reports), so a build that no longer fits is seen
without a GPU.

A kernel is compiled once per (kind, TP, format): the batch width is a runtime argument of the layer kernels
(rows padded to 8 in every build), so widths 1/2/4/8 share a build; the tail kernel changes with the width (XR 4
up to 4 rows, 8 above, and its register cap), and nextn's with its norm folds (width 1 folded, wider not). The
constexprs are the launches' own at the real config (H 4096, 64 KDA heads / TP x 128, dense 12288 / MoE 288 x 2048 top-8 / TP, DSA latent 512) and the
K splits the launches choose (schedule.py choose_k_split / choose_groups); the register cap is the launch's.
CTAs per SM: schedule.max_resident_ctas for the compiled registers, warps and shared memory, beside the
CTAs per SM the launch asks for (launches' default_ctas_per_sm): `fits` says whether that grid is resident.
"""
from __future__ import annotations

import math

KINDS = ("embed", "dense", "kda", "sparse", "nextn", "tail")
LAYER_KINDS = ("embed", "dense", "kda")
N_SM = 132                      # H100 / H200


def k_splits(c: dict, fp8: bool, tp: int, k_o: int, wb_o: int) -> dict:
    """KS_IN / KS_GU / KS_E / KG / KS_O as the launches choose them for the constexprs c (layer_host.py
    k_split_for, _oproj_split and _no_moe, kda.py choose_groups); k_o, wb_o: o_proj's K and weight bytes."""
    from .launches.layer_host import down_split_for, oproj_split_for
    from .schedule import choose_groups, choose_k_split
    wb = 1 if fp8 else 2
    step = c["BLOCK_N"] * 128
    tiles = c["H"] // c["BLOCK_N"]
    ks = lambda n, w: choose_k_split(-(-n // c["BLOCK_N"]), c["H"] // 128, step * w)     # noqa: E731
    return dict(KS_IN=ks(c["N_IN"], 2) if "N_IN" in c else 1, KS_GU=ks(c["I"], 2 * wb),
                KS_E=ks(c["KE"] * c["I_E"], 2 * wb) if c["MOE"] else 1,
                KG=choose_groups(tiles, c["KE"] + 1, c["BLOCK_N"] * c["I_E"] * wb) if c["MOE"] else
                down_split_for(tp, c["H"], c["I"], wb, c["BLOCK_N"]),
                KS_O=oproj_split_for(tp, c["H"], k_o, wb_o, c["BLOCK_N"]))


def layer_consts(tp: int = 1, moe: bool = False, embed: bool = False, fp8: bool = False) -> dict:
    """Constexprs of kda_layer_kernel (embed / dense / kda) at the real shapes for TP degree tp."""
    from .launches.ffn_tasks import ROUTER_BLOCK_E, router_rck
    from .launches.kda import ROUTER_PARTS
    H, d, nh = 4096, 128, 64 // tp
    D = nh * d
    c = dict(H=H, D=D, NH=nh, R=d, N_IN=3 * D + nh + 2 * d, I=(2048 if moe else 12288) // tp, DK=d, DV=d, BV=32, KC=4,
             CK=32, BLOCK_N=64, BLOCK_K=128, PF_K=128, NUM_STAGES=5, BLOCK_C=32, GATE_BH=512, ITERS=20, ROWS_PAD=8,
             EMBED=embed, ACT_F32=False, MOE=moe, E=288 if moe else 1, KE=8 if moe else 1,
             I_E=(2048 // tp) if moe else 1, E_PAD=512 if moe else 1, K_PAD=8 if moe else 1, RENORM=True,
             BLOCK_E=ROUTER_BLOCK_E, RCK=router_rck(H, ROUTER_PARTS), TRACE=False)
    c.update(k_splits(c, fp8, tp, D, 2))
    return c


def layer_spec(kind: str, tp: int, fp8: bool, warps: int = 4, maxnreg: int | None = -1) -> list:
    """sm90_regs spec of kda_layer_kernel for kind embed / dense / kda (maxnreg -1: the launch's cap)."""
    from .launches.kda_layer import kda_layer_kernel as k
    from .launches.layer_host import DEFAULT_MAXNREG
    c = layer_consts(tp, moe=kind == "kda", embed=kind == "embed", fp8=fp8)
    F, B, Q = "*fp32", "*bf16", "*fp8e4nv"
    ptr = dict(table="*i32", starts="*i32", meta="*i32", scratch="*i32", xo="*i64", xd="*i64", tokens="*i32",
               embed_w=B, ln1=B, ln2=B, W_in=B, f_b=B, g_b=B, onorm_w=B, W_o=B, trace="*i64",
               W_g=Q if fp8 else B, S_g=F if fp8 else B, W_u=Q if fp8 else B, S_u=F if fp8 else B,
               W_d=Q if fp8 else B, S_d=F if fp8 else B, w_gu=Q if fp8 else B, s_gu=F if fp8 else B,
               w_de=Q if fp8 else B, s_de=F if fp8 else B)
    ints = ("rows", "width", "tp_rank", "tp_size", "stage_lo", "stage_hi", "bump", "tag_stride", "tag_offset",
            "fault_site")
    floats = ("eps", "hc_eps", "lower_bound", "swiglu_limit", "scaling")
    sig = {n: ("constexpr" if n in c else ptr.get(n, "i32" if n in ints else "i64" if n == "timeout_ns" else
               "fp32" if n in floats else F)) for n in k.arg_names}
    cap = DEFAULT_MAXNREG if maxnreg == -1 else maxnreg
    return ["glm53_flash.launches.kda_layer", "kda_layer_kernel", sig, c, warps, [],
            {"maxnreg": cap} if cap else {}]


def dsa_spec(kind: str, tp: int, fp8: bool, warps: int = 4, block_t: int | None = None, width: int = 1) -> list:
    """sm90_regs spec of sparse_layer_kernel (kind sparse / nextn) at the real shapes: the argument types from a
    tiny launch's kernel_args (the same arguments), the constexprs as SparseLaunch.kernel_args gives them at the
    real config (nextn: the norm folds of `width`, launches/nextn.py norm_folds). Needs the interpreter
    (TRITON_INTERPRET=1) for the tiny launch."""
    import torch

    from .config import preset
    from .launches.nextn import NextnLaunch
    from .launches.sparse import SparseLaunch, layer_caches
    from .kernels.mla import att_chunk, choose_attention_split, join_chunk
    from .launches.ffn_tasks import ROUTER_BLOCK_E, router_rck
    from .launches.kda import ROUTER_PARTS
    from .launches.sparse_layer import sparse_layer_kernel as k
    from .reference.caches import DecodeCaches
    from .weights import RandomWeights
    cfg = preset("tiny")
    w = RandomWeights(cfg, seed=0, cache=True)
    caches = DecodeCaches.allocate(cfg, 1, 64)
    bf = torch.bfloat16                                          # the GPU cache layout
    if kind == "nextn":                                          # DSA cache 2: the tiny preset's MTP block
        L = NextnLaunch(cfg, w, max_len=64, logits=False)
        L.set_input(torch.zeros(1, cfg.hidden_size), torch.tensor([1]), *layer_caches(caches, 2, bf, bf), [3])
    else:                                                        # layer 3: the tiny preset's first sparse layer
        L = SparseLaunch(cfg, w, 3, max_len=64)
        L.set_input(torch.zeros(1, 4, cfg.hidden_size), *layer_caches(caches, 0, bf, bf), [3])
    args, const = L.kernel_args(0, 1, 1, -1)
    ty = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32", torch.int64: "*i64"}
    runtime = [n for n in k.arg_names if n not in const]
    sig = {n: ty[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else
           "i64" if n == "timeout_ns" else "i32" for n, a in zip(runtime, args)}
    if fp8:
        sig.update({n: "*fp8e4nv" for n in ("W_qa", "W_kva", "W_qb", "W_o", "W_g", "W_u", "W_d", "w_gu", "w_de")})
        sig.update({n: "*fp32" for n in ("S_qa", "S_kva", "S_qb", "S_o", "S_g", "S_u", "S_d", "s_gu", "s_de")})
    NH, I = 64 // tp, 2048 // tp
    real = dict(H=4096, QL=1536, C=512, DI=128, NI=32, NA=2336, NH=NH, DN=256, DV=256, NQ=NH * 256 + 4096, KP=4,
                TOPK=512, WIDTH=2051, I=I, BLOCK_N=64, BLOCK_K=128, PF_K=128, NUM_STAGES=5, BLOCK_C=32, GATE_BH=512,
                ITERS=20, ROWS_PAD=8, ACT_F32=False, ABS_C=64, ABS_CK=64, HB=min(16, NH), BLOCK_T=block_t, ATT_CK=32,
                OUT_N=64, OUT_PF=128, BLOCK_P=64, T_MAX=16, BITS=8, SEL_BLOCK=1024, NORM_BLOCK=4096, E=288, KE=8,
                I_E=I, E_PAD=512, K_PAD=8, RENORM=True, BLOCK_E=ROUTER_BLOCK_E, RCK=router_rck(4096, ROUTER_PARTS), NEXTN=kind == "nextn",
                TRACE=False, MOE=True)
    sp = choose_attention_split(2051, NH, 264, 132)              # the launch's chooser at its H200 grid (2 per SM)
    real.update(HB=sp.heads_per_task, BLOCK_T=block_t or sp.block_t, ATT_CK=att_chunk(block_t or sp.block_t, 512),
                **dict(zip(("NS_PAD", "SB"), join_chunk(sp.n_splits if not block_t else -(-2051 // block_t), 512))))
    from .schedule import choose_k_split
    ks = k_splits(real, fp8, tp, NH * 256, 1 if fp8 else 2)
    real.update(KS_GU=ks["KS_GU"], KS_E=ks["KS_E"], KG=ks["KG"], KS_O=ks["KS_O"], Q_PAD=2048, C_PAD=512, NI_PAD=32,
                KS_A=choose_k_split(-(-2336 // 64), 4096 // 128, 64 * 128 * (1 if fp8 else 2)),   # sparse.py ks_a
                KS_EH=choose_k_split(4096 // 64, 8192 // 128, 64 * 128 * 2) if kind == "nextn" else 1)  # ks_eh (bf16)
    from .launches.nextn import norm_folds
    real.update(zip(("EH_FOLD", "AIN_FOLD"), norm_folds(width) if kind == "nextn" else (False, False)))
    del real["MOE"]
    if set(real) != set(const):
        raise RuntimeError(f"sparse_layer_kernel's constexprs changed: {sorted(set(real) ^ set(const))}")
    sig.update({n: "constexpr" for n in real})
    return ["glm53_flash.launches.sparse_layer", "sparse_layer_kernel", {n: sig[n] for n in k.arg_names}, real, warps]


# the tail kernel's non-constexpr pointer / float arguments (everything else: i32) and the ints a launch passes
# as multiples of 16 (offsets and sizes at the real shapes)
TAIL_TYPES = dict(table="*i32", starts="*i32", X="*fp32", norm_w="*bf16", logits="*fp32", tokens="*i32", best="*i32",
                  scratch="*i32", xchg="*i64", peer_src="*i32", trace="*i64", eps="fp32", timeout_ns="i64")
TAIL_DIV16 = ("o_hdr", "o_xn", "o_box", "o_cand", "o_ssq", "xn_cta_stride", "box_words", "V_rank")


def tail_consts(fp8: bool, width: int, **over) -> dict:
    """tail_kernel's constexprs as TailLaunch.kernel_args gives them at H 4096 (overridden by `over`)."""
    from .launches.tail import reduce_rows, reduce_slots
    from .launches.tail import tail_kernel as k
    C = dict(H=4096, BLOCK_N=64, BLOCK_K=128, PF_K=128, NUM_STAGES=4, LOCAL_NORM=False,
             SLOTS=reduce_slots(width), L2_LINES=2 if fp8 else 4, EPL=128 if fp8 else 64, XPF=False,
             ROW16=True, XR=4 if width <= 4 else 8, RP=reduce_rows(width), TRACE=False)
    C.update(over)
    return {n: v for n, v in C.items() if n in k.arg_names}


def tail_spec(fp8: bool, width: int, warps: int = 4, **over) -> list:
    """sm90_regs spec of tail_kernel; the register cap of TailLaunch at this width."""
    from .launches.tail import DEFAULT_MAXNREG
    from .launches.tail import tail_kernel as k
    C = tail_consts(fp8, width, **over)
    sig = {n: ("constexpr" if n in C else TAIL_TYPES.get(n, "i32")) for n in k.arg_names}
    sig["W"], sig["S"] = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    opts = {"maxnreg": DEFAULT_MAXNREG} if width <= 4 else {}
    return ["glm53_flash.launches.tail", "tail_kernel", sig, C, warps, list(TAIL_DIV16), opts]


def launch_ctas_per_sm(kind: str) -> int:
    """CTAs per SM the launch asks for with grid=None (launches' default_ctas_per_sm; the tail fits its grid)."""
    from .launches.dense import DenseLaunch
    from .launches.embed import EmbedLaunch
    from .launches.kda import KdaLaunch
    from .launches.nextn import NextnLaunch
    from .launches.sparse import SparseLaunch
    from .launches.tail import DEFAULT_CTAS_PER_SM
    cls = {"embed": EmbedLaunch, "dense": DenseLaunch, "kda": KdaLaunch, "sparse": SparseLaunch,
           "nextn": NextnLaunch}.get(kind)
    return DEFAULT_CTAS_PER_SM if cls is None else cls.default_ctas_per_sm


def builds(kinds=KINDS, tps=(1, 2, 4, 8), fmts=("bf16", "fp8"), warps: int = 4) -> list[dict]:
    """The distinct builds of the matrix: [{kind, tp, fmt, widths, spec}] (the tail: one per width class, the
    same for every TP)."""
    out = []
    for kind in kinds:
        for fmt in fmts:
            fp8 = fmt == "fp8"
            if kind == "tail":
                for widths in ((1, 2, 4), (8,)):
                    out.append(dict(kind=kind, tp=",".join(map(str, tps)), fmt=fmt, widths=widths,
                                    spec=tail_spec(fp8, widths[0], warps)))
                continue
            for tp in tps:
                if kind in LAYER_KINDS:
                    out.append(dict(kind=kind, tp=str(tp), fmt=fmt, widths=(1, 2, 4, 8),
                                    spec=layer_spec(kind, tp, fp8, warps)))
                    continue
                for widths in _fold_classes(kind):             # nextn: the norm folds by width, a build each
                    out.append(dict(kind=kind, tp=str(tp), fmt=fmt, widths=widths,
                                    spec=dsa_spec(kind, tp, fp8, warps, width=widths[0])))
    return out


def _fold_classes(kind: str) -> list[tuple]:
    """The widths 1/2/4/8 grouped by NextN's norm folds (one kernel each; sparse: one group)."""
    if kind != "nextn":
        return [(1, 2, 4, 8)]
    from .launches.nextn import norm_folds
    groups: dict = {}
    for w in (1, 2, 4, 8):
        groups.setdefault(norm_folds(w), []).append(w)
    return [tuple(g) for g in groups.values()]


def report_rows(blds: list[dict], stats: list[dict], n_sm: int = N_SM) -> list[dict]:
    """One row per build: its compile stats and residency (fits: the launch's CTAs per SM are resident)."""
    from .schedule import max_resident_ctas
    rows = []
    for b, s in zip(blds, stats):
        cap = max_resident_ctas(s["regs"], b["spec"][4], s["shared"], n_sm) // n_sm
        want = launch_ctas_per_sm(b["kind"])
        # the tail fits its grid to what is resident (TailLaunch._fit_grid, at most `want` per SM): one CTA will do
        fits = cap >= 1 if b["kind"] == "tail" else cap >= want
        rows.append(dict(kind=b["kind"], tp=b["tp"], fmt=b["fmt"], widths=",".join(map(str, b["widths"])),
                         warps=b["spec"][4], regs=s["regs"], spill=s["spill"], shared=s["shared"], ctas_per_sm=cap,
                         launch_ctas_per_sm=want, fits=fits, code=s.get("code_instructions"),
                         copies={k: v for k, v in s.get("functions", {}).items() if v[0] > 1},
                         serial_spins={k: v for k, v in s.get("spins", {}).items() if v[1] < v[0]}))
    return rows


def passes(row: dict) -> bool:
    """A build the command accepts: its grid is resident and no box spin's polls were serialised."""
    return row["fits"] and not row.get("serial_spins")


def format_table(rows: list[dict]) -> str:
    """The residency table; `code`: SASS instructions of the kernel and its noinline functions (sm90_regs), and
    the functions compiled more than once (copies: what a constexpr argument of a noinline function costs);
    `spins`: "ok", or each wait function whose poll loads share registers (loads / registers: every hop of the
    launch pays a round trip per load instead of one per poll cycle; sync/asm.py, chunked polls)."""
    head = ("kind", "TP", "weights", "widths", "warps", "registers", "spill B", "shared KB", "CTAs/SM", "launch",
            "fits", "code", "copies", "spins")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        code = "-" if r.get("code") is None else r["code"]
        copies = ", ".join(f"{k} x{v[0]}" for k, v in sorted(r.get("copies", {}).items())) or "-"
        spins = ", ".join(f"SERIAL {k} {v[0]} loads / {v[1]} registers"
                          for k, v in sorted(r.get("serial_spins", {}).items())) or "ok"
        lines.append(" | ".join(str(x) for x in (r["kind"], r["tp"], r["fmt"], r["widths"], r["warps"], r["regs"],
                                                  r["spill"], math.ceil(r["shared"] / 1024), r["ctas_per_sm"],
                                                  (f"<= {r['launch_ctas_per_sm']}" if r["kind"] == "tail" else
                                                   r["launch_ctas_per_sm"]), "yes" if r["fits"] else "NO", code,
                                                  copies, spins)))
    return "\n".join(lines)
