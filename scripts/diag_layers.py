"""Run one layer launch at a rank's real shapes and, if a hand-off stalls, explain it
(glm53_flash/launches/diagnose.py): the missing producers, their CTAs, and how far those CTAs got.
Then the same inputs once more stage by stage (one launch per stage, as CPU mode runs), which tells a
stall of the single persistent launch (ordering between CTAs) from one of the code path itself.

  python scripts/diag_layers.py --kind nextn --tp 1 --rows 1 --pos 640          (GPU)
  python scripts/diag_layers.py --kind dense --tp 8 --trace                      (GPU: where the time goes)
  python scripts/diag_layers.py --kind tail --tp 8 --trace                       (the tail launch too)
  python scripts/diag_layers.py --kind sparse --tp 2 --rows 2 --preset tiny --pos 27 \\
         --inject-fault sparse.xd                                                 (CPU, interpreter)
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if not os.path.exists("/dev/nvidiactl"):      # no GPU: kernels run under the interpreter (set before triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def build(kind, cfg, tp, rows, fmt, pos, device, grid=None, **launch_kw):
    import torch
    import layer_bytes
    import rank_source
    from glm53_flash.launches.dense import DenseLaunch
    from glm53_flash.launches.embed import EmbedLaunch
    from glm53_flash.launches.kda import KdaLaunch
    from glm53_flash.launches.nextn import NextnLaunch
    from glm53_flash.launches.sparse import SparseLaunch
    g = torch.Generator(device=device).manual_seed(3)
    if kind == "tail":            # lm_head over this rank's vocabulary shard (TP > 1: loopback), random weights
        from glm53_flash.fp8 import quantize_fp8
        from glm53_flash.launches.tail import TailLaunch
        H, V = cfg.hidden_size, cfg.vocab_size // tp
        w = (torch.randn(V, H, device=device, generator=g) * H ** -0.5).bfloat16()
        w, s = quantize_fp8(w) if fmt == "fp8" else (w, None)
        norm_w = (1 + 0.1 * torch.randn(H, device=device, generator=g)).bfloat16()
        L = TailLaunch(cfg, w, norm_w, s, tp_rank=0, tp_size=tp, width=rows, device=device, grid=grid, **launch_kw)
        X = torch.randn(rows, cfg.hc_mult, H, device=device, generator=g)
        return L, lambda f=None: L.run(X, inject_fault=f)
    src = rank_source.RankSource(cfg, 0, tp, fmt, device, seed=0)
    if kind in ("embed", "dense", "kda"):
        cls = {"embed": EmbedLaunch, "dense": DenseLaunch, "kda": KdaLaunch}[kind]
        L = cls(cfg, src, layer_bytes.layer_of(cfg, kind), tp_rank=0, tp_size=tp, width=rows, device=device, grid=grid,
                **launch_kw)
        nh, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
        S = 0.1 * torch.randn(rows, nh, d, d, device=device, generator=g)
        win = torch.randn(rows, cfg.linear_conv_kernel_dim - 1, 3 * nh * d, device=device, generator=g)
        X = (torch.randint(0, cfg.vocab_size, (rows,), device=device, generator=g) if kind == "embed"
             else torch.randn(rows, cfg.hc_mult, cfg.hidden_size, device=device, generator=g))
        return L, lambda f=None: L.run(X, S, win, inject_fault=f, commit=False)
    pos_max = -(-(pos + 2) // cfg.index_kpool) * cfg.index_kpool
    kw = dict(tp_rank=0, tp_size=tp, width=rows, device=device, max_len=pos_max, grid=grid, **launch_kw)
    L = NextnLaunch(cfg, src, **kw) if kind == "nextn" else SparseLaunch(cfg, src, layer_bytes.layer_of(cfg, kind), **kw)
    lat = torch.randn(rows, pos_max, cfg.kv_lora_rank, device=device, generator=g).bfloat16()
    pk = torch.randn(rows, pos_max // cfg.index_kpool, cfg.index_head_dim, device=device, generator=g).bfloat16()
    tr = torch.randn(rows, cfg.index_kpool, 2 * cfg.index_head_dim, device=device, generator=g)
    positions = [max(1, pos - 37 * r) for r in range(rows)]
    if kind == "nextn":
        X = torch.randn(rows, cfg.hidden_size, device=device, generator=g)
        tok = torch.randint(0, cfg.vocab_size, (rows,), device=device, generator=g)
        run = lambda f=None: L.run(X, tok, lat, pk, tr, positions, inject_fault=f)      # noqa: E731
    else:
        X = torch.randn(rows, cfg.hc_mult, cfg.hidden_size, device=device, generator=g)
        run = lambda f=None: L.run(X, lat, pk, tr, positions, inject_fault=f)           # noqa: E731
    return L, run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--kind", choices=("embed", "dense", "kda", "sparse", "nextn", "tail"), required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--pos", type=int, default=640)
    ap.add_argument("--experts", type=int, default=16, help="routed experts built (the tests' 16)")
    ap.add_argument("--preset", default=None, help="default glm53-flash (tiny on the CPU)")
    ap.add_argument("--inject-fault", default=None, help="a wait site to fault (checks the report on a known stall)")
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--num-stages", type=int, default=None, help="layer kinds: GEMV software-pipeline depth "
                    "(time_layers' flag; default the launch's)")
    ap.add_argument("--ctas-per-sm", type=int, default=None,
                    help="GPU: persistent grid = this many CTAs per SM (default: the launch's), e.g. 1 to trace the "
                         "tasks without a co-resident CTA on their SM (time_layers.py's flag)")
    ap.add_argument("--timeout", type=float, default=None, help="wait budget in seconds (default the launch's)")
    ap.add_argument("--trace", action="store_true",
                    help="then one traced launch (TRACE build): per stage / family times and the critical path "
                         "(glm53_flash/launches/trace.py)")
    ap.add_argument("--profile", type=int, default=0,
                    help="GPU: after the checks, N more checked persistent launches with their wall times (a "
                         "repeated-launch check; where the time goes inside a launch is --trace)")
    ap.add_argument("--save", default=None, metavar="PATH",
                    help="after the checks, one more launch's outputs (X'; TP > 1 layer kinds: this rank's own o_proj "
                         "and down partials too) written to PATH (torch.save), for --same-as in another process")
    ap.add_argument("--same-as", default=None, metavar="PATH",
                    help="compare this run's --save outputs with PATH's bit for bit (a build switch read at import, "
                         "e.g. GLM53_WAIT_IN_LOOP, against the default: two processes); exit 1 on any difference")
    args = ap.parse_args(argv)
    import torch
    from glm53_flash.config import preset
    from glm53_flash.launches.diagnose import box_summary, explain
    from sync import HandoffTimeout
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = preset(args.preset or ("glm53-flash" if device == "cuda" else "tiny"))
    cfg = cfg.replace(n_routed_experts=min(args.experts, cfg.n_routed_experts),
                      num_nextn_predict_layers=max(1, cfg.num_nextn_predict_layers))
    grid = (args.ctas_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
            if args.ctas_per_sm and device == "cuda" else None)
    L, run = build(args.kind, cfg, args.tp, args.rows, args.weights, args.pos, device, grid,
                   **({} if args.num_stages is None else {"num_stages": args.num_stages}))
    if args.num_warps:
        L.num_warps = args.num_warps
    if args.timeout:
        L.timeout_s = args.timeout
    print(f"== {args.kind} tp{args.tp} rows{args.rows} {args.weights} pos {args.pos} on {device}: grid {L.grid}, "
          f"{len(L.schedule.tasks)} tasks, {L.n_stages} stages, sites {L.sites.names if hasattr(L.sites, 'names') else ''}")
    import time
    for label, stagewise in (("one persistent launch", False), ("stage by stage", True)):
        t0 = time.perf_counter()
        try:
            if stagewise:
                L.enqueue(L.fault_id(args.inject_fault) if args.inject_fault else -1, stagewise=True)
                L.check()
            else:
                run(args.inject_fault)
            print(f"-- {label}: no stall ({(time.perf_counter() - t0) * 1e3:.1f} ms wall, compiles included)")
            if hasattr(L, "META_LAYOUT"):                  # the layer kinds' boxes (the tail has none)
                print("   boxes:", box_summary(L, L.record().last_tag))
        except HandoffTimeout as e:
            print(f"-- {label}: {e}")
            print(explain(L))
            if hasattr(L, "META_LAYOUT"):
                print("   boxes (consumer 0):", box_summary(L, L.record().wanted))
        if device == "cuda":
            torch.cuda.synchronize()
    if args.trace:
        from glm53_flash.launches.trace import report
        plain = _snapshot(run())
        L.enable_trace()
        for _ in range(3):                                 # the TRACE build compiles and warms up first
            traced = _snapshot(run())
        print(report(L))
        L.enable_trace(False)
        same = _same(plain, traced)                        # a trace build must not change a bit of the output
        print(f"-- traced launch's outputs bitwise equal to the plain launch's: {'yes' if same else 'NO'}")
        if not same:
            return 1
    if args.save or args.same_as:
        out = _outputs(L, run)
        if args.save:
            torch.save(out, args.save)
        if args.same_as:
            ref = torch.load(args.same_as)
            diff = [k for k in sorted(set(ref) | set(out)) if not _same(ref.get(k), out.get(k))]
            print(f"-- outputs bitwise equal to {args.same_as}'s: "
                  f"{'yes (' + ', '.join(sorted(out)) + ')' if not diff else 'NO: ' + ', '.join(diff)}")
            if diff:
                return 1
    if args.profile and device == "cuda":
        profile(run, args.profile)
    return 0


def _outputs(L, run) -> dict:
    """One launch's outputs by name (CPU tensors): 'out' (what run returns) and, for a TP > 1 layer kind, this
    rank's own o_proj / down partials (independent of the loopback peers' inputs)."""
    out = {"out": _snapshot(run())}
    if getattr(L, "tp_size", 1) > 1 and hasattr(L, "own_partials"):
        out["o_partial"], out["down_partial"] = L.own_partials()
    return {k: (v.cpu() if hasattr(v, "cpu") else [t.cpu() for t in v]) for k, v in out.items()}


def _snapshot(out):
    """A copy of a launch's returned output(s), so a later launch cannot overwrite it."""
    import torch
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_snapshot(o) for o in out)
    return out


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def profile(run, n):
    """Wall time (host, synchronized) of n checked persistent launches, stalls named. Not a kernel time:
    per-stage CUDA events around stage-by-stage launches measured Python launch cost (100-500 us a stage),
    so where a launch's time goes is the trace's job (--trace)."""
    import time
    import torch
    from sync import HandoffTimeout
    walls = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            run()
            ok = "ok"
        except HandoffTimeout as e:
            ok = str(e)
        torch.cuda.synchronize()
        walls.append(f"{(time.perf_counter() - t0) * 1e3:.2f} ms ({ok[:60]})")
    print("   persistent launch wall:", "; ".join(walls))


if __name__ == "__main__":
    sys.exit(main())
