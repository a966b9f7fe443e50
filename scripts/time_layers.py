"""Kernel-only time per launch at one rank's real shapes, beside its floor (DESIGN.md §8).

Why: a launch is judged against the bytes it must read over the measured HBM read bandwidth, so every
timing here is printed beside that floor. Random weights at real shapes (preset glm53-flash) are made
directly on the GPU (torch.randn, scaled), several copies of each, and the timed graph rotates among
them so the 60 MB L2 never holds a weight. Each case is captured once as a CUDA graph of `--reps`
launches; windows of all cases are interleaved and the median per-launch time is reported.

Kinds: `gemv` times the GEMVs of one rank (our GEMV family beside cuBLAS); `tail` times the tail launch
(glm53_flash/launches/tail.py); `embed`, `dense`, `kda`, `sparse`, `nextn` time one layer launch of that
kind (rank 0; TP > 1 in loopback mode, the other ranks' partial sums read as zeros) built from random rank
weights made on the GPU (scripts/rank_source.py `RankSource`), beside the same layer as torch ops
(bf16 weights, cuBLAS GEMVs, the reference's fp32 math between them, MoE through torch._grouped_mm or a
gather) in a CUDA graph, interleaved in the same windows; `step` times embed, dense, kda, sparse and tail
in turn and sums them over one decode step's launch plan beside the sum of floors (or, with --from, sums
the JSON lines of earlier per-kind runs); `model` measures the whole step as one captured graph (TP 1: ModelRunner's;
TP > 1: rank 0's launches in loopback, beside the sum of each kind's launch timed alone). A kind is a builder
returning [BenchCase] (name, one callable per weight copy, bytes read).

Layer kinds rotate over as many weight copies as fit (3x the L2 in bytes read); when only one fits, every
launch is preceded by a pure read over 3x the L2 and that read, timed alone in the same windows, is
subtracted (the card says which: timing=rotate|flush). The floor counts the bytes one launch must read
(layer_bytes.launch_bytes): this rank's weights, the routed experts actually chosen (distinct ids of
the baseline's routing of the same rows), KDA state and conv window read + written, DSA latent rows
selected, pooled keys scored, activations. `--dry-run` builds everything at the tiny preset on the CPU
(TRITON_INTERPRET=1), runs each launch once against its baseline and prints the accounting, untimed.

Output: a header card, a table (us, floor us, % of floor, GB/s), then one JSON line.
The measuring itself (read bandwidth, interleaved graph timing, card, report) is scripts/bench_timing.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))      # rank_source, layer_bytes, layer_baselines
if "--dry-run" in sys.argv[1:]:          # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch                     # noqa: E402
import triton                    # noqa: E402

from bench_timing import (L2_BYTES, BenchCase, _read_kernel, env_card, measure_read_bw, report,  # noqa: E402
                          time_interleaved)
DEVICE = "cuda"                  # where timed runs build (tests set "cpu" to walk the timed path under the interpreter)


# ------------------------------------------------------------------------------------ kind: gemv
def copies_for(nbytes: int) -> int:
    """Weight copies so the rotation spans at least 3x the L2."""
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def random_weight(n: int, k: int, fp8: bool, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """N(0, 1/k) weights made on the GPU; FP8 as e4m3 codes with random positive block scales."""
    w = torch.randn(n, k, device=device) * k ** -0.5
    if not fp8:
        return w.bfloat16(), None
    s = torch.rand((n + 127) // 128, (k + 127) // 128, device=device) * 0.01 + 0.005
    return (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn), s


def gemv_shapes(cfg, tp: int) -> list[tuple[str, int, int, list[str]]]:
    """(label, N, K, checkpoint names whose FP8-ness applies) of the GEMVs one rank runs per step."""
    from glm53_flash.weights import LM_HEAD, PREFIX
    H, D, d, nh = cfg.hidden_size, cfg.kda_dim, cfg.linear_head_dim, cfg.linear_num_heads
    L = lambda i, s: f"{PREFIX}layers.{i}.{s}"           # noqa: E731
    kda, dsa, dense, moe = 1, 3, 1, 4                     # representative layers of each kind
    return [
        ("kda.inproj q|k|v|b|f_a|g_a", (3 * D + nh) // tp + 2 * d, H, [L(kda, "self_attn.q_proj.weight")]),
        ("kda.f_b|g_b", 2 * D // tp, d, [L(kda, "self_attn.f_b_proj.weight")]),
        ("kda.o_proj", H, D // tp, [L(kda, "self_attn.o_proj.weight")]),
        ("dsa.q_a|kv_a", cfg.q_lora_rank + cfg.kv_lora_rank, H, [L(dsa, "self_attn.q_a_proj.weight")]),
        ("dsa.q_b", cfg.num_attention_heads * cfg.qk_head_dim // tp, cfg.q_lora_rank,
         [L(dsa, "self_attn.q_b_proj.weight")]),
        ("dsa.o_proj", H, cfg.num_attention_heads * cfg.v_head_dim // tp, [L(dsa, "self_attn.o_proj.weight")]),
        ("dense.gate|up", 2 * cfg.intermediate_size // tp, H, [L(dense, "mlp.gate_proj.weight")]),
        ("dense.down", H, cfg.intermediate_size // tp, [L(dense, "mlp.down_proj.weight")]),
        ("moe.expert gate|up (one)", 2 * cfg.moe_intermediate_size // tp, H,
         [L(moe, "mlp.shared_experts.gate_proj.weight")]),
        ("moe.expert down (one)", H, cfg.moe_intermediate_size // tp, [L(moe, "mlp.shared_experts.down_proj.weight")]),
        ("tail.lm_head", cfg.vocab_size // tp, H, [LM_HEAD]),
    ]


def pick_gemv_config(n: int, k: int, fp8: bool):
    """Tile config for a standalone GEMV: the benchmarked default, split-K when column tiles are few."""
    from glm53_flash.kernels.gemv import TUNED
    base = TUNED["fp8" if fp8 else "bf16"]
    block_k = base.block_k if k >= base.block_k else 128
    tiles = triton.cdiv(n, base.block_n) * base.k_split
    split = 1
    while tiles * split * 2 <= 2 * 132 and k // (split * 2) >= 4 * block_k:
        split *= 2
    return dataclasses.replace(base, block_k=block_k, split_k=split)


def build_gemv(cfg, tp: int, rows: int, weights: str, device: str) -> list[BenchCase]:
    from glm53_flash.kernels.gemv import gemv
    from glm53_flash.weights import weight_specs
    specs = weight_specs(cfg)
    cases = []
    for label, n, k, names in gemv_shapes(cfg, tp):
        fp8 = weights == "fp8" and all(specs[nm].fp8 for nm in names)
        one = n * k * (1 if fp8 else 2) + (((n + 127) // 128) * ((k + 127) // 128) * 4 if fp8 else 0)
        ws = [random_weight(n, k, fp8, device) for _ in range(copies_for(one))]
        x = torch.randn(rows, k, device=device).bfloat16()
        y = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
        gcfg = pick_gemv_config(n, k, fp8)
        fns = [lambda w=w, s=s, x=x, y=y, c=gcfg: gemv(x, w, s, cfg=c, out=y) for w, s in ws]
        info = {"N": n, "K": k, "fmt": "fp8" if fp8 else "bf16", "split": gcfg.split_k}
        cases.append(BenchCase(f"{label} {n}x{k}", fns, one + rows * k * 2, info))
        if not fp8:                                   # cuBLAS beside it (bf16 only)
            fns = [lambda w=w, x=x, y=y: torch.matmul(x, w.T, out=y) for w, _ in ws]
            cases.append(BenchCase(f"  cuBLAS {n}x{k}", fns, one + rows * k * 2, dict(info, split="-"),
                                   floor=False))
    return cases


def build_tail(cfg, tp: int, rows: int, weights: str, device: str, opts: dict | None = None) -> list[BenchCase]:
    """The tail launch (glm53_flash/launches/tail.py) of one rank (TP > 1: loopback mode), beside the
    same math as plain torch ops (mean of streams, RMSNorm, lm_head, argmax), both in CUDA graphs."""
    from glm53_flash.launches.tail import TailLaunch
    opts = {k: v for k, v in (opts or {}).items() if v is not None}
    H, V = cfg.hidden_size, cfg.vocab_size // tp
    fp8 = weights == "fp8"            # FP8 lm_head: a launch option (the vendor ships lm_head in bf16)
    one = V * H * (1 if fp8 else 2) + (((V + 127) // 128) * (H // 128) * 4 if fp8 else 0)
    norm_w = (1 + 0.1 * torch.randn(H, device=device)).bfloat16()
    X = torch.randn(rows, cfg.hc_mult, H, device=device)
    launches = []
    for _ in range(copies_for(one)):
        w, s = random_weight(V, H, fp8, device)
        L = TailLaunch(cfg, w, norm_w, s, tp_rank=0, tp_size=tp, width=rows, device=device, **opts)
        L.set_input(X)
        launches.append(L)
    L0 = launches[0]
    logits, _ = L0.run(X)                                    # checked launch: raises on a hand-off timeout
    wf = L0.W.float() if not fp8 else L0.W.float() * L0.S.repeat_interleave(128, 0)[:V].repeat_interleave(128, 1)
    xm = X.mean(1)
    xn = xm * torch.rsqrt(xm.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm_w.float()
    ref = xn.double() @ wf.double().T
    err = float((logits.double() - ref).norm() / ref.norm())
    info = {"fmt": "fp8" if fp8 else "bf16", "grid": L0.grid, "warps": L0.num_warps, "block_n": L0.block_n,
            "err": f"{err:.1e}"}
    bytes_read = one + rows * cfg.hc_mult * H * 4 + H * 2
    cases = [BenchCase(f"tail launch tp{tp} rows{rows} {info['fmt']}", [lambda L=L: L.enqueue() for L in launches],
                       bytes_read, info, checks=[L.check for L in launches])]
    if not fp8:                                              # what an engine does today, in a graph
        def torch_tail(W, X=X, out=torch.empty(rows, V, device=device, dtype=torch.bfloat16)):
            m = X.mean(1)
            n = (m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm_w.float()).bfloat16()
            torch.matmul(n, W.T, out=out)
            return out.argmax(-1)
        cases.append(BenchCase("  torch ops (mean, norm, matmul, argmax)", [lambda L=L: torch_tail(L.W) for L in launches],
                               bytes_read, {"fmt": "bf16"}, floor=False))
    return cases


# ------------------------------------------------------------------- kinds: embed dense kda sparse nextn
def _flush_fn(device: str):
    """A pure read over 3x the L2 (clean lines: no write-backs land in the timed launch)."""
    buf = torch.ones(3 * L2_BYTES // 4 // 2 ** 15 * 2 ** 15, dtype=torch.int32, device=device)
    out = torch.empty(buf.numel() // 2 ** 12, dtype=torch.int32, device=device)
    return lambda: _read_kernel[(buf.numel() // 2 ** 15,)](buf, out, 2 ** 15, BLOCK=2048, num_warps=8)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def build_layer(kind: str, cfg, tp: int, rows: int, weights: str, device: str, opts: dict | None = None):
    """One layer launch of `kind` (launches/{embed,dense,kda,sparse,nextn}.py, TP rank 0, loopback for TP > 1)
    over rotated copies of random rank weights made on the device, beside the same layer as torch ops (unless
    opts["baseline"] is False). Returns (cases, accounting dict)."""
    import layer_baselines as lb
    import layer_bytes as lbytes
    import rank_source
    from glm53_flash.launches.dense import DenseLaunch
    from glm53_flash.launches.embed import EmbedLaunch
    from glm53_flash.launches.kda import KdaLaunch
    from glm53_flash.launches.nextn import NextnLaunch
    from glm53_flash.launches.sparse import SparseLaunch
    o = dict(opts or {})
    pos, dry = o.get("pos", 4095), o.get("dry", device == "cpu")
    fmt, H = weights, cfg.hidden_size
    est = sum(lbytes.launch_bytes(kind, cfg, tp, rows, fmt, pos).values())
    res = lbytes.resident_bytes(cfg, kind, tp, fmt)
    if dry:
        copies = 1
    else:
        free = torch.cuda.mem_get_info()[0]
        per = res * (3 if fmt == "bf16" else 2)          # launch banks + baseline banks + pieces while packing
        copies = max(1, min(copies_for(est), o.get("max_copies") or 64, int(0.8 * free) // max(per, 1)))
    mode = "none (dry run)" if dry else ("rotate" if copies >= 2 else "flush")
    moe_mode = "grouped"                                # falls back to gather if it fails or disagrees
    pos_max = -(-(pos + 2) // cfg.index_kpool) * cfg.index_kpool
    cls = {"embed": EmbedLaunch, "dense": DenseLaunch, "kda": KdaLaunch, "sparse": SparseLaunch,
           "nextn": NextnLaunch}[kind]
    layer = lbytes.layer_of(cfg, kind)
    lkw = {k: v for k, v in o.items() if k in ("grid", "num_warps", "block_n", "block_k", "num_stages", "block_v")
           and v is not None}
    launches, bases, fns, bfns = [], [], [], []
    info: dict = {"fmt": fmt, "copies": copies, "timing": mode}
    n_routed, err = None, {}
    for c in range(copies):
        torch.manual_seed(c)
        src = rank_source.RankSource(cfg, 0, tp, fmt, device, seed=c)
        kw = dict(tp_rank=0, tp_size=tp, width=rows, device=device, **lkw)
        if kind in ("sparse", "nextn"):
            kw["max_len"] = pos_max
        L = cls(cfg, src, layer, **kw) if kind != "nextn" else cls(cfg, src, **kw)
        base = None
        if (fmt == "bf16" or dry) and o.get("baseline", True):
            base = (lb.DsaBaseline(src, cfg, kind, pos, moe_mode) if kind in ("sparse", "nextn")
                    else lb.KdaLayerBaseline(src, cfg, kind, rows, moe_mode))
        src.release()
        if kind in ("embed", "dense", "kda"):
            nh, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
            S = 0.1 * torch.randn(rows, nh, d, d, device=device)
            win = torch.randn(rows, cfg.linear_conv_kernel_dim - 1, 3 * nh * d, device=device)
            X = (torch.randint(0, cfg.vocab_size, (rows,), device=device) if kind == "embed"
                 else torch.randn(rows, cfg.hc_mult, H, device=device))
            ref = base(X, S, win) if base is not None else None
            if c == 0 and ref is not None:
                S_ref, W_ref = base.S_out[:rows].clone(), base.W_out[:rows].clone()
            out = L.run(X, S, win)                             # checked launch (commits S, win)
            if c == 0 and ref is not None:
                err = {"err": _rel(out, ref), "err_state": _rel(S, S_ref), "err_win": _rel(win, W_ref)}
            args = (X, S, win)
        else:
            S_ = rows                                          # one cache slot per row; filled up to pos
            lat = torch.randn(S_, pos_max, cfg.kv_lora_rank, device=device).bfloat16()
            pk = torch.randn(S_, pos_max // cfg.index_kpool, cfg.index_head_dim, device=device).bfloat16()
            tr = torch.randn(S_, cfg.index_kpool, 2 * cfg.index_head_dim, device=device)
            positions = torch.full((rows,), pos, dtype=torch.int32)
            if kind == "sparse":
                X = torch.randn(rows, cfg.hc_mult, H, device=device)
                ref = base(X, lat, pk, tr) if base is not None else None
                out = L.run(X, lat, pk, tr, positions)
                args = (X, lat, pk, tr)
            else:
                X = torch.randn(rows, H, device=device)
                tok = torch.randint(0, cfg.vocab_size, (rows,), device=device)
                ref = base(X, lat, pk, tr, tok) if base is not None else None
                logits, tokens, n = L.run(X, tok, lat, pk, tr, positions)
                out = n
                if ref is not None:
                    ref = ops_rms(ref[0], base.shn, cfg.rms_norm_eps)
                args = (X, lat, pk, tr, tok)
            if c == 0 and ref is not None:
                err = {"err": _rel(out, ref)}
        if c == 0 and base is not None and base.ffn.idx is not None:
            n_routed = int(torch.unique(base.ffn.idx.reshape(-1)).numel())
        launches.append(L)
        if base is not None:
            bases.append(base)
            bfns.append(lambda b=base, a=args: b(*a))
        if kind == "nextn":
            fns.append(lambda L=L: (L.enqueue(), L.tail_launch.enqueue()))
        else:
            fns.append(lambda L=L: L.enqueue())
    source = "distinct ids of the baseline's routing"
    if n_routed is None and kind in ("kda", "sparse", "nextn"):    # fp8: no baseline; rows x top-k bounds it
        n_routed = min(rows * cfg.num_experts_per_tok, cfg.n_routed_experts)
        source = "rows x top-k: exact for 1 row, an upper bound for more"
    acct = lbytes.launch_bytes(kind, cfg, tp, rows, fmt, pos, n_routed)
    nbytes = sum(acct.values())
    L0 = launches[0]
    info.update({"grid": L0.grid, "warps": L0.num_warps, "block_n": L0.block_n,
                 **({"block_v": L0.BV} if kind in ("embed", "dense", "kda") else {}),
                 **{k: f"{v:.1e}" for k, v in err.items()}})
    if base is not None and getattr(bases[0].ffn, "mode", None):
        info["moe"] = bases[0].ffn.mode
    label = f"{kind} launch tp{tp} rows{rows} {fmt}" + (" + draft tail" if kind == "nextn" else "")
    cases = []
    if mode == "flush" and not dry:
        flush = _flush_fn(device)
        cases.append(BenchCase(f"  {kind}: L2 flush alone (subtracted)", [flush], 3 * L2_BYTES, {}, floor=False))
        fns = [lambda f=f: (flush(), f()) for f in fns]
        bfns = [lambda f=f: (flush(), f()) for f in bfns]
        info["minus"] = cases[0].name
    checks = [L.check for L in launches] + [L.tail_launch.check for L in launches if kind == "nextn"]
    cases.insert(0, BenchCase(label, fns, nbytes, info, checks=checks))
    if kind == "nextn":
        nb = sum(lbytes.launch_bytes(kind, cfg, tp, rows, fmt, pos, n_routed, logits=False).values())
        f2 = [lambda L=L: L.enqueue() for L in launches]
        if mode == "flush" and not dry:
            f2 = [lambda L=L: (flush(), L.enqueue()) for L in launches]
        cases.insert(1, BenchCase("  nextn block only (no draft logits)", f2, nb, dict(info), floor=False,
                                  checks=[L.check for L in launches]))
    if bfns:
        moe = f", MoE {bases[0].ffn.mode}" if getattr(bases[0].ffn, "mode", None) else ""
        cases.insert(1 + (kind == "nextn"), BenchCase(f"  torch ops {kind} (cuBLAS bf16{moe})", bfns, nbytes,
                                                      {"fmt": "bf16", "minus": info.get("minus")}, floor=False))
    return cases, {"bytes": acct, "n_routed": n_routed, "n_routed_source": source if n_routed is not None else None,
                   "copies": copies, "timing": mode,
                   "resident_mb_per_copy": round(res / 1e6, 1), "pos": pos if kind in ("sparse", "nextn") else None}


def ops_rms(x, w, eps):
    from glm53_flash.reference import ops
    return ops.rms_norm(x, w, eps)


STEP_KINDS = ("embed", "dense", "kda", "sparse", "tail")
KINDS = {"gemv": build_gemv, "tail": build_tail, "embed": None, "dense": None, "kda": None, "sparse": None,
         "nextn": None, "step": None, "model": None}


def _print_model(rec: dict, what: str, bw: float, sum_label: str) -> None:
    """A --kind model record's two lines, then its JSON line."""
    print(f"== {rec['title']}: {what}, {rec['launches']} launches")
    print(f"   floor {rec['floor_us']:.1f} us ({rec['floor_bytes'] / 1e9:.3f} GB at {bw / 1e12:.2f} TB/s)"
          + (f", step graph {rec['us']:.1f} us ({rec['pct_floor']:.1f}% of floor), {sum_label} {rec['sum_us']:.1f} us"
             if "us" in rec else ", untimed"))
    print(json.dumps(rec, default=str))


def kind_groups(plan: list[str], launches: list) -> dict[str, list]:
    """{kind: its launches in plan order} for a step program's launches (plan: their kinds, one each)."""
    if len(plan) != len(launches):
        raise ValueError(f"{len(launches)} launches for a plan of {len(plan)}")
    groups: dict[str, list] = {}
    for k, L in zip(plan, launches):
        groups.setdefault(k, []).append(L)
    return groups


def time_model_rank(args, dry: bool, bw: float, card: dict) -> list[dict]:
    """--kind model --tp T > 1: rank 0's whole decode step in loopback, measured as ONE captured graph: the launch
    plan's launches (embed, every layer, tail; not nextn) in plan order, each kind's launches built as the
    per-kind timings build them (random rank weights made on the device, rotated over copies, the other ranks'
    partial sums read as zeros) and taken in turn from the kind's rotation, so consecutive layers of a kind read
    different weights. Each launch reads its own static inputs (the step's data does not flow from layer to layer;
    the graph still runs the launches one after another, as a real step does). Timed in the same interleaved windows
    beside each kind's launch alone: `sum_us` = the plan's count of each kind x its time, so `us - sum_us` is what
    the chained step adds or saves (launch boundaries inside one graph). One record per batch size in `--rows`.
    With --dry-run: the tiny preset on the CPU, one step per B through the interpreter, untimed."""
    import gc

    from glm53_flash.config import preset
    pname = args.preset or ("tiny" if dry else "glm53-flash")
    cfg = preset(pname)
    if args.experts:
        cfg = cfg.replace(n_routed_experts=args.experts)
    cfg.check_tp(args.tp)
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    kinds = sorted(set(plan), key=plan.index)
    device = "cpu" if dry else DEVICE
    recs = []
    for R in sorted(set(args.rows_list)):
        a = argparse.Namespace(**{**vars(args), "rows": R})
        cases, floor_bytes = {}, 0
        for k in kinds:
            if k == "tail":
                cs, acct = build_kind("tail", cfg, a, device)
            else:
                opts = dict(pos=args.pos, dry=dry, max_copies=args.max_copies or 2, baseline=False)
                cs, acct = build_layer(k, cfg, args.tp, R, args.weights, device, opts)
            cases[k] = cs[0]                                     # the launch case (flush mode: flush + launch)
            floor_bytes += plan.count(k) * cases[k].bytes_read
        turn = {k: 0 for k in kinds}

        def step(cases=cases, turn=turn):
            for k in plan:
                fns = cases[k].fns
                fns[turn[k] % len(fns)]()
                turn[k] += 1
        name = f"model step tp{args.tp} rows{R} {args.weights} ({len(plan)} launches, rank 0 loopback)"
        checks = [c for k in kinds for c in cases[k].checks]
        step_case = BenchCase(name, [step], floor_bytes, {"fmt": args.weights}, checks=checks)
        rec = dict(card, title="time_layers --kind model" + (" --dry-run" if dry else ""), preset=pname, rows=R,
                   tp=args.tp, pos=args.pos, launches=len(plan), floor_bytes=floor_bytes,
                   floor_us=round(floor_bytes / bw * 1e6, 2),
                   counts={k: plan.count(k) for k in kinds},
                   timing={k: cases[k].info.get("timing") for k in kinds if k != "tail"})
        if dry:
            step()                                               # every launch of the plan once, interpreted
            for c in checks:
                c()
        else:
            us = time_interleaved([step_case] + [cases[k] for k in kinds], args.reps, args.windows)
            if any(cases[k].info.get("minus") for k in kinds):
                rec["note"] = "a kind timed in flush mode: its launches in the step include the L2 flush"
            rec["us"] = round(us[name], 2)
            rec["per_kind_us"] = {k: round(us[cases[k].name], 2) for k in kinds}
            rec["sum_us"] = round(sum(plan.count(k) * us[cases[k].name] for k in kinds), 2)
            rec["pct_floor"] = round(100 * rec["floor_us"] / rec["us"], 1)
        _print_model(rec, f"{pname} {args.weights}, TP {args.tp} rank 0 (loopback), {R} rows at position {args.pos}",
                     bw, "sum of the launches timed alone")
        recs.append(rec)
        del cases, step_case, checks
        gc.collect()
        if not dry:
            torch.cuda.empty_cache()
    return recs


def time_model(args, dry: bool, bw: float, card: dict) -> list[dict]:
    """--kind model: the whole decode step of ModelRunner (TP 1) as its captured step graph, replayed back to back
    (the commit graph is not replayed, so every replay is the same step: the state does not move), beside the sum
    of its launches' floors (layer_bytes over the launch plan), once per batch size B in `--rows` (e.g. 1,2,4,8:
    one runner built with those widths and max(B) slots, one graph per B, one record per B). The slots are
    prefilled with `--pos` tokens through decode steps (no reference model on the GPU). Timed in the same windows:
    each kind's launches of the step as one graph of their own (`per_kind_us` per launch, `sum_us` their sum: the
    step kind by kind). With --dry-run: the tiny preset on the CPU, one step per B run through the same step
    program, untimed."""
    import layer_bytes as lbytes

    from glm53_flash.model_runner import ModelRunner
    name = args.preset or ("tiny" if dry else "glm53-flash-e80")
    Bs = sorted(set(args.rows_list))
    Rmax, P = Bs[-1], (min(args.pos, 2) if dry else args.pos)      # dry: each prompt token is an interpreted step
    kw = dict(weight_format=args.weights, device="cpu" if dry else DEVICE, max_slots=Rmax,
              max_len=max(64, P + 8 + len(Bs)), widths=tuple(Bs), eager=dry, graph_programs=dry)
    if dry:
        kw["reference"] = False
    runner = ModelRunner.from_preset(name, **kw)
    cfg = runner.cfg
    for s in range(Rmax):
        runner.prefill(s, [(7 + 3 * s + t) % cfg.vocab_size for t in range(P)])
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    recs = []
    for R in Bs:
        ids = torch.tensor([(11 + s) % cfg.vocab_size for s in range(R)], dtype=torch.int64)
        pos = torch.tensor([runner.length(s) for s in range(R)], dtype=torch.int64)
        sl = torch.arange(R, dtype=torch.int32)
        logits = runner.decode(ids, pos, sl)                        # one checked step (binds the static inputs)
        floor_bytes = sum(sum(lbytes.launch_bytes(k, cfg, 1, R, args.weights, pos=int(pos.max())).values())
                          for k in plan)
        rec = dict(card, title="time_layers --kind model" + (" --dry-run" if dry else ""), preset=name, rows=R,
                   pos=int(pos.max()), launches=len(plan), floor_bytes=floor_bytes,
                   floor_us=round(floor_bytes / bw * 1e6, 2), logits_finite=bool(torch.isfinite(logits).all()))
        prog = runner.programs[R]
        groups = kind_groups(plan, prog.launches)
        rec["counts"] = {k: len(v) for k, v in groups.items()}
        if not dry:
            prog.ids.copy_(ids.to(prog.ids.device))
            prog.pos.copy_((pos + 1).to(prog.pos.device))           # the next step of every slot, replayed
            prog.slots.copy_(sl.to(prog.slots.device))
            # beside the step graph, the same launches kind by kind: one graph per kind of its launches in plan
            # order (each on its own layer's weights and the step's bound inputs), in the same windows; their sum
            # is the step without what the chained graph adds or saves at launch boundaries
            graphs = {"step": prog.g_step}
            for k, Ls in groups.items():
                for L in Ls:                                          # warm outside the capture
                    L.enqueue()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for L in Ls:
                        L.enqueue()
                graphs[k] = g
            for g in graphs.values():
                for _ in range(3):
                    g.replay()
            torch.cuda.synchronize()
            times = {n: [] for n in graphs}
            for w in range(args.windows):
                order = list(graphs)[w % len(graphs):] + list(graphs)[:w % len(graphs)]   # rotate who goes first
                for n in order:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(args.reps):
                        graphs[n].replay()
                    b.record()
                    b.synchronize()
                    times[n].append(a.elapsed_time(b) * 1e3 / args.reps)
            for L in prog.launches:                                 # every timed launch was clean
                L.check()
            med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
            rec["us"] = round(med["step"], 2)
            rec["pct_floor"] = round(100 * rec["floor_us"] / rec["us"], 1)
            rec["per_kind_us"] = {k: round(med[k] / len(groups[k]), 2) for k in groups}   # per launch
            rec["sum_us"] = round(sum(med[k] for k in groups), 2)
        _print_model(rec, f"{name} {args.weights}, TP 1, {R} rows at position {rec['pos']}", bw,
                     "its launches kind by kind")
        recs.append(rec)
    if not dry:
        del runner
        torch.cuda.empty_cache()
    return recs


def build_kind(kind, cfg, args, device):
    if kind == "tail":
        opts = dict(num_warps=args.num_warps, block_n=args.block_n, block_k=args.block_k, num_stages=args.num_stages,
                    l2_prefetch_k=args.l2_prefetch_k,
                    grid=(args.ctas_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                          if args.ctas_per_sm and device != "cpu" else None))
        cases = build_tail(cfg, args.tp, args.rows, args.weights, device, opts)
        return cases, {"bytes": {"lm_head + norm + X": cases[0].bytes_read}, "copies": len(cases[0].fns),
                       "timing": "rotate"}
    opts = dict(pos=args.pos, dry=args.dry_run, max_copies=args.max_copies, num_warps=args.num_warps,
                block_n=args.block_n, block_k=args.block_k, num_stages=args.num_stages, block_v=args.block_v,
                grid=(args.ctas_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                      if args.ctas_per_sm and not args.dry_run else None))
    return build_layer(kind, cfg, args.tp, args.rows, args.weights, device, opts)


def apply_minus(cases, us):
    """Flush mode: each case's time minus the flush-only case's (same interleaved windows)."""
    for c in cases:
        m = c.info.get("minus")
        if m and c.name != m:
            us[c.name] = max(us[c.name] - us[m], 1e-3)
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Needs a CUDA GPU, except with --dry-run. Per kind, one call takes ~30-60 s; "
                                        "--kind step runs embed, dense, kda, sparse and tail in turn.")
    ap.add_argument("--kind", choices=sorted(KINDS), default="gemv",
                    help="gemv = the GEMVs of one rank (our family beside cuBLAS); tail = the tail launch; "
                         "embed / dense / kda = the KDA layer launches (layer 0 with the token gather, a dense-MLP "
                         "layer, a MoE layer); sparse = a DSA + MoE layer; nextn = the MTP block + its draft-logits "
                         "tail; step = every kind of one decode step's launch plan (embed, 2 dense, 31 kda, "
                         "11 sparse, tail: 46 launches) timed in turn and summed beside the sum of floors; model = "
                         "the whole step as one captured graph, measured per batch size in --rows (e.g. 1,2,4,8), "
                         "beside the sum of floors: TP 1 = ModelRunner's step graph (default preset "
                         "glm53-flash-e80, --pos prompt tokens per slot, default 16); TP > 1 = rank 0's launches "
                         "of the plan in loopback (default preset glm53-flash), beside the sum of each kind's "
                         "launch timed alone")
    ap.add_argument("--tp", type=int, choices=(1, 2, 4, 8), default=1,
                    help="tensor-parallel degree: time rank 0's shapes (heads/rows split by TP); TP > 1 runs the "
                         "launch in loopback mode (the other ranks' partial sums read as zeros)")
    ap.add_argument("--rows", default="1",
                    help="batch width: activation rows (decode tokens) per launch, 1 / 2 / 4 / 8; --kind model "
                         "takes a list (e.g. 1,2,4,8: one runner, a graph and a record per batch size)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="weight format: fp8 = e4m3 + 128x128 block scales for the tensors the vendor ships in FP8 "
                         "(dense MLP, experts, DSA q_a/kv_a/q_b/o_proj; KDA, kv_b, router, indexer stay bf16/fp32; "
                         "tail: lm_head itself in FP8). The torch baseline is timed for bf16 only")
    ap.add_argument("--preset", default=None,
                    help="model preset for the shapes (default glm53-flash; tiny with --dry-run)")
    ap.add_argument("--experts", type=int, default=None,
                    help="MoE kinds: routed experts built per layer (default: the preset's, 288). Routing reads only "
                         "top-8 per row, so fewer fit more weight copies; the floor counts only the experts chosen")
    ap.add_argument("--pos", type=int, default=None,
                    help="sparse / nextn: the rows' context position P; caches hold random values up to P "
                         "(default 4095, 27 in a tiny dry run; the indexer scores and selects (sparse regime) "
                         "when P >= 2051, at the tiny preset when P >= 19)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU only: build every launch and baseline at the tiny preset under TRITON_INTERPRET=1, run "
                         "each once (error vs the baseline), print the byte / floor accounting (floor at the "
                         "nominal 4.48 TB/s), no timing")
    ap.add_argument("--from", dest="from_json", nargs="+", metavar="FILE", default=None,
                    help="--kind step only: sum the step from the JSON lines of earlier per-kind runs (outputs of "
                         "--kind embed / dense / kda / sparse / tail) instead of timing; needs no GPU")
    ap.add_argument("--plot", metavar="PNG", default=None,
                    help="also draw us against rows per launch kind and for the model step, each beside its floor "
                         "(dashed), into this PNG: the records of --from FILE ... (time_layers / time_matrix JSON "
                         "lines of runs at rows 1 / 2 / 4 / 8) and the one this run measures; needs matplotlib, "
                         "checked before any timing (scripts/plot_layers.py)")
    ap.add_argument("--max-copies", type=int, default=None,
                    help="layer kinds: at most this many weight copies (1 = one copy, L2 flushed between launches)")
    ap.add_argument("--reps", type=int, default=16, help="launches per timed CUDA graph (rotating weight copies)")
    ap.add_argument("--windows", type=int, default=15, help="interleaved timing windows; the median is reported")
    ap.add_argument("--num-warps", type=int, default=None,
                    help="tail / layer kinds: warps per CTA (default: the launch's)")
    ap.add_argument("--block-n", type=int, default=None, help="tail / layer kinds: GEMV rows per tile")
    ap.add_argument("--block-k", type=int, default=None, help="K chunk per pipelined GEMV step (layer kinds: "
                    "128 by default; 256 streams two 128-wide MMA chunks a step, half the steps and barriers)")
    ap.add_argument("--num-stages", type=int, default=None, help="tail / layer kinds: GEMV software-pipeline depth")
    ap.add_argument("--block-v", type=int, default=None,
                    help="embed / dense / kda: value rows per KDA task (default: the launch's, 32 at head dim 128; "
                         "a power of two >= 16 dividing the head dim; below the head dim a kda_norm stage joins the "
                         "blocks). The bits depend on it")
    ap.add_argument("--ctas-per-sm", type=int, default=None,
                    help="tail / layer kinds: persistent grid = this many CTAs per SM (default: the launch's; "
                         "a grid that cannot be co-resident is refused)")
    ap.add_argument("--l2-prefetch-k", type=int, default=None,
                    help="tail: columns of each row of a CTA's first tile moved toward L2 before its xn wait "
                         "(default: the launch's, 256)")
    args = ap.parse_args(argv)
    if args.block_v is not None and args.kind not in ("embed", "dense", "kda"):
        ap.error(f"--block-v {args.block_v}: --kind {args.kind} has no KDA mixer (embed, dense, kda)")
    if args.l2_prefetch_k is not None and (args.kind != "tail" or args.l2_prefetch_k < 1):
        ap.error(f"--l2-prefetch-k {args.l2_prefetch_k}: a positive column count, for --kind tail")
    try:
        args.rows_list = [int(v) for v in str(args.rows).split(",") if v.strip()]
    except ValueError:
        args.rows_list = []
    if not args.rows_list or any(r not in (1, 2, 4, 8) for r in args.rows_list):
        ap.error(f"--rows {args.rows}: each must be 1, 2, 4 or 8")
    if len(args.rows_list) > 1 and args.kind != "model":
        ap.error(f"--rows {args.rows}: a list goes with --kind model (time_matrix.py runs the other kinds per row count)")
    args.rows = args.rows_list[0]
    dry = args.dry_run
    import layer_bytes as lbytes
    import plot_layers
    if args.plot and args.kind == "gemv" and not args.from_json:
        ap.error("--plot draws launch kinds and the model step against rows; --kind gemv has nothing to draw")
    if args.plot:
        try:
            plot_layers.require_matplotlib()
        except ImportError as e:
            ap.error(str(e))
    if args.from_json and args.kind != "step":
        if not args.plot:
            ap.error("--from goes with --kind step (a summed step) or with --plot (a drawing of the records)")
        try:
            ser = plot_layers.plot(plot_layers.load_records(args.from_json), args.plot)
        except (OSError, ValueError) as e:
            ap.error(str(e))
        print(f"{args.plot}: {len(ser)} series ({', '.join(sorted(ser))})")
        return 0
    if args.from_json:
        from glm53_flash.config import preset
        cfg = preset(args.preset or "glm53-flash")
        per, post = lbytes.per_kind_from_json(args.from_json, STEP_KINDS), []
        rec = {"title": "time_layers --kind step --from", "files": args.from_json,
               "step": lbytes.step_summary(cfg, per, STEP_KINDS, post),
               "per_kind": {k: {kk: v[kk] for kk in ("us", "floor_us", "torch_us", "bytes", "source")}
                            for k, v in per.items()}}
        print("\n".join(post))
        print(json.dumps(rec, default=str))
        _plot_after(args, None)
        return 0
    if not dry and not torch.cuda.is_available():
        print("time_layers.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    if dry and args.kind == "gemv":
        print("--dry-run covers the launch kinds, not gemv", file=sys.stderr)
        return 2
    from glm53_flash.config import preset
    model_tp1 = args.kind == "model" and args.tp == 1           # ModelRunner's default: the 80-expert preset
    cfg = preset(args.preset or ("tiny" if dry else "glm53-flash-e80" if model_tp1 else "glm53-flash"))
    if args.experts:
        cfg = cfg.replace(n_routed_experts=args.experts)
    if args.pos is None:
        args.pos = 16 if args.kind == "model" else 4095 if cfg.max_position_embeddings > 4096 or not dry else 27
    cfg.check_tp(args.tp)
    device = "cpu" if dry else DEVICE
    if dry:
        torch.set_num_threads(1)
        bw, bw_detail = 4.48e12, "nominal (DESIGN.md §8), not measured"
        card = {"mode": "dry run (CPU, TRITON_INTERPRET=1, no timing)", "torch": torch.__version__,
                "triton": triton.__version__}
    else:
        bw, bw_detail = measure_read_bw()
        card = env_card()
    card.update({"kind": args.kind, "tp": args.tp, "rows": args.rows, "weights": args.weights,
                 "preset": args.preset or ("tiny" if dry else "glm53-flash"), "experts": cfg.n_routed_experts,
                 "read_kernels_gbps": bw_detail})
    if args.kind == "model":
        recs = (time_model if args.tp == 1 else time_model_rank)(args, dry, bw, card)
        _plot_after(args, recs)
        return 0
    if args.kind in ("gemv",):
        cases = build_gemv(cfg, args.tp, args.rows, args.weights, device)
        us = time_interleaved(cases, args.reps, args.windows)
        report(f"time_layers --kind {args.kind}", card, bw, cases, us, extra_cols=("fmt", "split"))
        return 0
    kinds = STEP_KINDS if args.kind == "step" else (args.kind,)
    per_kind, all_cases, all_us, notes, post = {}, [], {}, [], []
    cols = ("fmt", "grid", "warps", "timing", "err")
    for kind in kinds:
        import gc
        cases, acct = build_kind(kind, cfg, args, device)
        if dry:
            us = {c.name: float("nan") for c in cases}
        else:
            us = apply_minus(cases, time_interleaved(cases, args.reps, args.windows))
        total = lbytes.print_accounting(kind, acct, bw, notes)
        base = next((c for c in cases if c.name.startswith("  torch ops")), None)
        per_kind[kind] = {"us": us[cases[0].name], "bytes": total, "floor_us": total / bw * 1e6,
                          "torch_us": us[base.name] if base else None, "acct": acct}
        for c in cases:
            c.info.setdefault("kind", kind)
            c.fns = []                       # drop the launches and weights: step builds the next kind in their place
        all_cases += cases
        all_us.update(us)
        del cases
        gc.collect()
        if not dry:
            torch.cuda.empty_cache()
    extra = {"accounting": {k: {"bytes": v["acct"]["bytes"], "n_routed": v["acct"].get("n_routed"),
                                "n_routed_source": v["acct"].get("n_routed_source"),
                                "timing": v["acct"].get("timing"), "copies": v["acct"].get("copies")}
                            for k, v in per_kind.items()}, "pos": args.pos}
    if args.kind == "step":
        extra["step"] = lbytes.step_summary(cfg, per_kind, STEP_KINDS, post)
    title = f"time_layers --kind {args.kind}" + (" --dry-run" if dry else "")
    if dry:
        lbytes.dry_report(title, card, bw, all_cases, extra, notes, post)
        _plot_after(args, None)
    else:
        _plot_after(args, report(title, card, bw, all_cases, all_us, extra_cols=cols, extra=extra, notes=notes,
                                 post=post))
    return 0


def _plot_after(args, rec) -> None:
    """--plot: the --from files' records and this run's (rec: a record, a list of them, or None) into args.plot."""
    if not args.plot:
        return
    import plot_layers
    recs = plot_layers.load_records(args.from_json or []) + (rec if isinstance(rec, list) else [rec] if rec else [])
    try:
        ser = plot_layers.plot(recs, args.plot)
    except ValueError as e:
        print(f"--plot {args.plot}: {e}", file=sys.stderr)
        return
    print(f"{args.plot}: {len(ser)} series ({', '.join(sorted(ser))})")


if __name__ == "__main__":
    sys.exit(main())
