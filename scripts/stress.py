"""Protocol stress: thousands of launches of the hand-off self-test (and of the tail launch), every word
checked after every launch, plus CUDA-graph replays that take their tags from the device epoch; and, with
--launches KIND,..., every width of those launch kinds replayed in random width order.

  python3 scripts/stress.py [--selftest-launches N] [--graph-replays R] [--tail-launches T] [--quick]
  python3 scripts/stress.py --launches embed,dense,kda,sparse,nextn,tail [--replays N] [--tp T] [--weights W]
                            [--flip-bit]

Launch kinds (launch_phase): each (kind, width 1/2/4/8) is built on the fixed inputs of `python -m glm53_flash
dump` (tiny preset by default), run once clean, then captured as a CUDA graph on the GPU (eagerly replayed on the
CPU); N replays (default 30,000 on the GPU, 4 on the CPU) pick a (kind, width) at random, and after each one every
output word is compared bitwise with that (kind, width)'s clean result and the launch's error record is read.
--flip-bit: one replay runs with one input bit flipped (then restored): a positive control that must show bad
words, or the run fails. Prints the bad words, the error records and the control; exit status 1 on any.

Phases (GPU): eager self-test launches over several shapes (warps 1.. of the producers sleep before
storing, so the CTA barrier + release must cover them), a graph of 50 launches replayed R times (the
accumulated wrong-word counters and the epoch are checked at the end), a positive control (one word
flipped: every consumer must count it), and tail launches with random widths, each compared bitwise with
the first result for its input. CPU (TRITON_INTERPRET=1): a short self-test run, stage by stage.
Prints one JSON line last: {"wrong_words": 0, ...}; exit status 1 if any word was wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sync import read_record  # noqa: E402
from sync.selftest import SelfTest  # noqa: E402


def selftest_phase(shapes, launches: int, device) -> dict:
    wrong = 0
    n = 0
    for grid, P, C, words, pairs in shapes:
        st = SelfTest(grid, P, C, words, pairs, device=device)
        for i in range(launches):
            r = st.run(sleep_ns=(i % 4) * 1500 if device != "cpu" else 0)
            wrong += r["consumer_bad"] + r["total"]
            n += 1
        assert st.layout.check_canaries(st.scratch) == [], "canary overwritten"
    return {"selftest_launches": n, "selftest_wrong": wrong}


def graph_phase(grid, replays: int, per_graph: int = 50) -> dict:
    st = SelfTest(grid, 8, grid, 2048, 32, device="cuda")
    st.run()                                                   # compile + warm
    hdr = st.layout.view(st.scratch, "hdr")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        st.launch(sleep_ns=1000)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    e0 = read_record(hdr).epoch
    base = st.bad.clone()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            st.launch(sleep_ns=1000)
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    rec = read_record(hdr)
    wrong = int((st.bad - base).sum())
    launches = replays * per_graph
    return {"graph_launches": launches, "graph_wrong": wrong, "graph_epoch_ok": rec.epoch - e0 == launches,
            "graph_error_record": rec.failed}


def control_phase(device) -> dict:
    st = SelfTest(8 if device == "cpu" else 132, 3, 5 if device == "cpu" else 132, 64, 4, device=device)
    r = st.run(corrupt=True)
    return {"control_detected": r["consumer_bad"] == st.C and r["total"] == st.C}


def tail_phase(launches: int) -> dict:
    from glm53_flash.config import preset
    from glm53_flash.launches.tail import TailLaunch
    cfg = preset("glm53-flash")
    g = torch.Generator(device="cuda").manual_seed(7)
    W = (torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) / 64).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(cfg.hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    L = TailLaunch(cfg, W, nw, width=8, device="cuda")
    inputs = [torch.randn(r, 4, cfg.hidden_size, device="cuda", generator=g) for r in (1, 2, 3, 4, 5, 6, 7, 8)]
    first = {}
    wrong = 0
    for i in range(launches):
        k = int(torch.randint(0, len(inputs), (1,), generator=torch.Generator().manual_seed(i)))
        lg, tok = L.run(inputs[k])
        if k not in first:
            first[k] = (lg, tok)
        else:
            wrong += int((lg != first[k][0]).sum()) + int((tok != first[k][1]).sum())
    return {"tail_launches": launches, "tail_wrong": wrong}


def launch_phase(kinds, widths, replays: int, tp: int, preset_name: str, flip_bit: bool, seed: int = 0,
                 pos: int = 27, log=print, weights: str = "bf16") -> dict:
    """Random-order replays of every (kind, width), each compared bitwise with its clean result (see above)."""
    import random

    from glm53_flash import dump as dump_mod
    from glm53_flash.config import preset
    from sync import HandoffTimeout
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = preset(preset_name)
    src, scales = dump_mod.source(cfg, seed, weights)
    items = []
    for kind in kinds:
        for w in widths:
            L, outs = dump_mod._run(kind, cfg, src, tp, w, dev, seed, pos, scales)
            # nextn: its draft tail replays on the input the clean run made from X_out on the host (as time_layers
            # replays it): the tail's words are checked against that input's clean result
            launches = [L] + ([L.tail_launch] if getattr(L, "tail_launch", None) is not None else [])
            fn = lambda ls=launches: [x.enqueue() for x in ls]            # noqa: E731
            if dev == "cuda":
                fn()                                                       # warm (compiled by the clean run)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                fn = g.replay
            items.append(dict(name=f"{kind}-w{w}", launches=launches, outs=outs, fn=fn,
                              ref={n: t.detach().clone() for n, t in outs.items()}))
            log(f"stress: {kind} width {w} built")
    rng = random.Random(seed)
    flip_at = rng.randrange(replays) if flip_bit else -1
    bad = errors = control_bad = 0
    for i in range(replays):
        it = items[rng.randrange(len(items))]
        L0 = it["launches"][0]
        x = L0.X if L0.X is not None else L0.tokens          # the embed launch reads token ids
        if i == flip_at:                         # the positive control: one bit of the launch's input (the top
            bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32 if x.element_size() == 4 else
                          torch.int64).reshape(-1)   # mantissa bit of an activation, which survives the bf16
            flip = ({2: 1 << 6, 4: 1 << 22}[x.element_size()] if x.dtype.is_floating_point   # rounding downstream;
                    else 1)                                                         # bit 0 of a token id
            bits[0] ^= flip
        it["fn"]()
        if i == flip_at:
            bits[0] ^= flip
        for L in it["launches"]:
            try:
                L.check()
            except HandoffTimeout as e:
                errors += 1
                log(f"stress: replay {i} {it['name']}: {e}")
        nb = sum(_bad_words(o, it["ref"][n]) for n, o in it["outs"].items())
        if i == flip_at:
            control_bad = nb
        elif nb:
            bad += nb
            log(f"stress: replay {i} {it['name']}: {nb} bad words")
    return {"launch_replays": replays, "launch_builds": len(items), "launch_wrong": bad, "launch_error_records": errors,
            **({"flip_control_bad": control_bad, "control_detected": control_bad > 0} if flip_bit else {})}


def _bad_words(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of a whose bits differ from b's (NaNs by their bits; -0.0 differs from 0.0)."""
    ea = a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
    eb = b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    return int((ea != eb).any(-1).sum())


def _kinds(s: str) -> list[str]:
    from glm53_flash.dump import KINDS
    ks = [k for k in s.split(",") if k]
    bad = [k for k in ks if k not in KINDS]
    if bad or not ks:
        raise argparse.ArgumentTypeError(f"--launches {s!r}: kinds are {', '.join(KINDS)}")
    return ks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest-launches", type=int, default=1000, help="eager self-test launches per shape")
    ap.add_argument("--launches", type=_kinds, metavar="KIND,...",
                    help="stress these launch kinds instead (every width, random order; see the module note)")
    ap.add_argument("--replays", type=int, help="--launches: replays (default 30000 on the GPU, 4 on the CPU)")
    ap.add_argument("--widths", default="1,2,4,8", help="--launches: batch widths (default 1,2,4,8)")
    ap.add_argument("--tp", type=int, default=1, help="--launches: TP degree (rank 0 of a loopback group)")
    ap.add_argument("--preset", default="tiny", help="--launches: config preset (default tiny)")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="--launches: weight format (fp8: the dump's FP8 checkpoint of the same seed)")
    ap.add_argument("--flip-bit", action="store_true", help="--launches: the positive control (one flipped input bit)")
    ap.add_argument("--graph-replays", type=int, default=40, help="replays of a 50-launch graph")
    ap.add_argument("--tail-launches", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="a few launches (smoke run)")
    a = ap.parse_args(argv)
    t0 = time.time()
    out: dict = {}
    if a.launches:
        replays = a.replays if a.replays is not None else (30000 if torch.cuda.is_available() else 4)
        if replays < 1:
            ap.error("--replays must be >= 1")
        out.update(launch_phase(a.launches, [int(w) for w in a.widths.split(",") if w], replays, a.tp, a.preset,
                                a.flip_bit, log=lambda m: print(m, file=sys.stderr, flush=True), weights=a.weights))
        ok = out["launch_wrong"] == 0 and out["launch_error_records"] == 0 and out.get("control_detected", True)
        out.update(wrong_words=out["launch_wrong"], ok=bool(ok), seconds=round(time.time() - t0, 1))
        print(json.dumps(out))
        return 0 if ok else 1
    if torch.cuda.is_available():
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        n = 20 if a.quick else a.selftest_launches
        shapes = [(n_sm, 8, n_sm, 4096, 64), (4 * n_sm, 16, 4 * n_sm, 256, 8), (2 * n_sm, 33, n_sm, 1024, 16)]
        out.update(selftest_phase(shapes, n, "cuda"))
        out.update(graph_phase(2 * n_sm, 2 if a.quick else a.graph_replays))
        out.update(control_phase("cuda"))
        out.update(tail_phase(10 if a.quick else a.tail_launches))
    else:
        out.update(selftest_phase([(6, 2, 4, 40, 3), (40, 3, 36, 16, 2)], 2 if a.quick else 5, "cpu"))
        out.update(control_phase("cpu"))
    wrong = sum(v for k, v in out.items() if k.endswith("_wrong"))
    ok = wrong == 0 and out.get("control_detected", False) and out.get("graph_epoch_ok", True) \
        and not out.get("graph_error_record", False)
    out.update(wrong_words=wrong, ok=bool(ok), seconds=round(time.time() - t0, 1))
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
