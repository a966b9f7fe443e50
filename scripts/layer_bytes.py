"""What a layer launch must read, for the layer benchmarks (scripts/time_layers.py): the bytes by
component (its floor, DESIGN.md §8), a decode step summed from per-kind timings, and the printed
accounting. CPU-testable against a hand count (tests/test_time_layers.py) without timing anything.

`launch_bytes(kind, ...)`: bytes one launch of `kind` must move, by component (weights of this rank
without the routed experts, the routed experts actually chosen, state and window read + written, the
latent rows selected, the pooled keys scored, activations in and out).
"""
from __future__ import annotations

import json

from glm53_flash.weights import LM_HEAD, layer_specs, weight_specs
from rank_source import EMBED, piece_bytes


def layer_of(cfg, kind: str) -> int:
    if kind == "nextn":
        return cfg.num_hidden_layers
    return next(p.index for p in cfg.layers if p.launch == kind)


def resident_bytes(cfg, kind: str, tp: int, fmt: str) -> int:
    """Bytes of one copy of this rank's tensors of the launch (all experts: what memory must hold)."""
    if kind == "tail":
        return piece_bytes(weight_specs(cfg)[LM_HEAD], tp, fmt)
    n = sum(piece_bytes(s, tp, fmt) for s in layer_specs(cfg, layer_of(cfg, kind)))
    if kind in ("embed", "nextn"):
        n += piece_bytes(weight_specs(cfg)[EMBED], tp, fmt)
    if kind == "nextn":
        n += piece_bytes(weight_specs(cfg)[LM_HEAD], tp, fmt)
    return n


def selected_tokens(cfg, pos: int) -> int:
    """Latent rows a query at `pos` attends to (reference ops.indexer_select)."""
    P = (pos + 1) // cfg.index_kpool
    if P <= cfg.index_topk_pools:
        return pos + 1
    return cfg.index_topk_pools * cfg.index_kpool + (pos + 1 - P * cfg.index_kpool)


def launch_bytes(kind: str, cfg, tp: int, rows: int, fmt: str, pos: int = 0, n_routed: int | None = None,
                 logits: bool = True) -> dict[str, int]:
    """Bytes one launch of `kind` (one rank) must move, by component (ordered).

    weights: every tensor of the layer this rank holds except routed experts (+ FP8 scales);
    routed experts: `n_routed` distinct experts (default rows x top-k, capped by E) at this rank's piece;
    kda state [rows, nh/tp, 128, 128] fp32 and conv window [rows, K-1, 3D/tp] fp32, each read + written;
    DSA caches: latent rows selected (bf16), pooled keys scored (bf16, only in the sparse regime, where
    the indexer must score them), the open pool's ring rows (fp32), and this token's writes;
    activations: X [rows, 4, H] fp32 read + X' written (embed: the embedding rows; nextn: hidden in,
    z and n out, + the draft logits' lm_head shard when `logits`)."""
    specs = weight_specs(cfg)
    H = cfg.hidden_size
    out: dict[str, int] = {}
    if kind == "tail":
        out["lm_head"] = piece_bytes(specs[LM_HEAD], tp, fmt)
        out["norm"] = H * 2
        out["X in"] = rows * cfg.hc_mult * H * 4
        return out
    L = layer_of(cfg, kind)
    lay = layer_specs(cfg, L)
    exp = [s for s in lay if ".mlp.experts." in s.name]
    shared = [s for s in lay if ".mlp.shared_experts." in s.name]
    rest = [s for s in lay if s not in exp and s not in shared]
    out["weights"] = sum(piece_bytes(s, tp, fmt) for s in rest)
    if shared:
        out["shared expert"] = sum(piece_bytes(s, tp, fmt) for s in shared)
    if exp:
        per = sum(piece_bytes(s, tp, fmt) for s in exp) // cfg.n_routed_experts
        n = n_routed if n_routed is not None else min(rows * cfg.num_experts_per_tok, cfg.n_routed_experts)
        out[f"routed experts ({n})"] = n * per
    if kind in ("embed", "dense", "kda"):
        nh, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
        out["kda state r+w"] = 2 * rows * nh * d * d * 4
        out["conv window r+w"] = 2 * rows * (cfg.linear_conv_kernel_dim - 1) * 3 * nh * d * 4
    if kind in ("sparse", "nextn"):
        C, DI, KP = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool
        P = (pos + 1) // KP
        out["latent rows selected"] = rows * selected_tokens(cfg, pos) * C * 2
        out["pool keys scored"] = rows * P * DI * 2 if P > cfg.index_topk_pools else 0
        out["ring rows"] = rows * KP * 2 * DI * 4
        out["cache writes"] = rows * (C * 2 + 2 * DI * 4 + (DI * 2 if (pos + 1) % KP == 0 else 0))
    if kind == "embed":
        out["embed rows"] = rows * H * 2
        out["X' out"] = rows * cfg.hc_mult * H * 4
    elif kind == "nextn":
        out["embed rows"] = rows * H * 2
        out["hidden in, z + n out"] = 3 * rows * H * 4
        if logits:
            out["draft lm_head"] = piece_bytes(specs[LM_HEAD], tp, fmt)
    else:
        out["X in + X' out"] = 2 * rows * cfg.hc_mult * H * 4
    return out


def print_accounting(kind, acct, bw, out: list) -> int:
    """Append the byte accounting of one launch to `out` (lines for the header card); return the total."""
    total = sum(acct["bytes"].values())
    out.append(f"   bytes of one {kind} launch ({acct.get('timing')}, {acct.get('copies')} weight copies"
          + (f", {acct['n_routed']} routed experts: {acct.get('n_routed_source')}" if acct.get("n_routed") is not None
             else "") + "):")
    for k, v in acct["bytes"].items():
        out.append(f"     {k:28s} {v / 1e6:12.3f} MB")
    out.append(f"     {'total':28s} {total / 1e6:12.3f} MB  floor {total / bw * 1e6:.2f} us")
    return total


def step_summary(cfg, per_kind: dict, kinds: tuple, out: list) -> dict:
    """One decode step = the launch plan (no nextn) with each kind's timing and floor times its count."""
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    counts = {k: plan.count(k) for k in kinds}
    out.append(f"-- step: {len(plan)} launches " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    out.append(f"   {'kind':8s} {'n':>3s} {'us each':>9s} {'floor each':>10s} {'torch each':>10s} {'us sum':>9s} "
          f"{'floor sum':>9s} {'torch sum':>9s}")
    tot = {"us": 0.0, "floor_us": 0.0, "torch_us": 0.0, "bytes": 0}
    for k, n in counts.items():
        v = per_kind[k]
        t = v["torch_us"] if v["torch_us"] is not None else float("nan")
        out.append(f"   {k:8s} {n:3d} {v['us']:9.2f} {v['floor_us']:10.2f} {t:10.2f} {n * v['us']:9.1f} "
              f"{n * v['floor_us']:9.1f} {n * t:9.1f}")
        tot["us"] += n * v["us"]
        tot["floor_us"] += n * v["floor_us"]
        tot["torch_us"] += n * t
        tot["bytes"] += n * v["bytes"]
    pct = 100 * tot["floor_us"] / tot["us"] if tot["us"] == tot["us"] and tot["us"] > 0 else float("nan")
    out.append(f"   {'step':8s} {len(plan):3d} {'':9s} {'':10s} {'':10s} {tot['us']:9.1f} {tot['floor_us']:9.1f} "
          f"{tot['torch_us']:9.1f}   ({tot['bytes'] / 1e9:.3f} GB, {pct:.1f}% of floor)")
    return {"launches": len(plan), "counts": counts, "us": round(tot["us"], 2), "floor_us": round(tot["floor_us"], 2),
            "torch_us": round(tot["torch_us"], 2), "bytes": tot["bytes"], "pct_floor": round(pct, 1)}


def dry_report(title, card, bw, cases, extra, notes=(), post=()) -> None:
    print(f"== {title}")
    for k, v in card.items():
        print(f"   {k:10s} {v}")
    for line in notes:
        print(line)
    print(f"{'case':44s} {'bytes MB':>10s} {'floor us':>9s}  info")
    rows = []
    for c in cases:
        print(f"{c.name:44s} {c.bytes_read / 1e6:10.3f} {c.bytes_read / bw * 1e6:9.3f}  "
              + " ".join(f"{k}={v}" for k, v in c.info.items() if k not in ("minus",) and v is not None))
        rows.append({"case": c.name, "bytes": c.bytes_read, "floor_us": round(c.bytes_read / bw * 1e6, 4),
                     "judged": c.floor, **c.info})
    for line in post:
        print(line)
    print(json.dumps({"title": title, **card, "read_bw_tbps": bw / 1e12, "rows": rows, **extra}, default=str))


def per_kind_from_json(paths, kinds: tuple) -> dict:
    """`--kind step --from`: each kind's launch time, bytes, floor and torch time from the JSON lines of
    earlier runs (the last JSON line of each file; a later file overrides an earlier one for a kind)."""
    per: dict = {}
    for path in paths:
        with open(path) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
        if not lines:
            raise ValueError(f"{path}: no JSON line")
        rec = json.loads(lines[-1])
        title_kind = rec.get("title", "").split("--kind ")[-1].split()[0] if "--kind" in rec.get("title", "") else None
        bw = rec["read_bw_tbps"] * 1e12
        for r in rec["rows"]:
            k = r.get("kind") or title_kind
            if k not in kinds:
                continue
            if r.get("judged"):
                per.setdefault(k, {"torch_us": None})
                per[k].update(us=r["us"], bytes=r["bytes"], floor_us=r["bytes"] / bw * 1e6, source=path)
            elif r["case"].startswith("  torch ops"):
                per.setdefault(k, {})["torch_us"] = r["us"]
    missing = [k for k in kinds if "us" not in per.get(k, {})]
    if missing:
        raise ValueError(f"--from: no timing for {missing} in {list(paths)}")
    return per
