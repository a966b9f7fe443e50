"""Command line: `python -m glm53_flash {make-checkpoint,generate,demo,sites,dump,compare} ...` (each has --help).

Heavy modules (torch, triton, kernels) are imported only after the arguments are parsed, because
TRITON_INTERPRET must be set before any @triton.jit function is defined when running on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_DEMO_DIR = os.path.join("checkpoints", "tiny")
DEFAULT_DEMO_PROMPT = "3,17,42,7,99,256,511,12"


def _prompt(s: str) -> list[int]:
    try:
        ids = [int(t) for t in s.split(",") if t.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt {s!r}: expected comma-separated token ids, e.g. 3,17,42")
    if not ids:
        raise argparse.ArgumentTypeError("--prompt is empty: give at least one token id")
    return ids


def _kinds(s: str) -> list[str]:
    kinds = [k.strip() for k in s.split(",") if k.strip()]
    if not kinds:
        raise argparse.ArgumentTypeError("--kernels is empty: give launch kinds, e.g. tail")
    return kinds


def _prepare_device(device: str) -> None:
    """On the CPU, kernels run under the Triton interpreter (must be set before triton is imported)."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m glm53_flash",
        description="glm53-flash: persistent-megakernel decode of GLM-5.3-Flash (glm5_next).")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    m = sub.add_parser("make-checkpoint", help="write a random checkpoint in the vendor layout",
                       description="Write a checkpoint directory (config.json, safetensors shards, "
                                   "model.safetensors.index.json) with deterministic random weights.")
    m.add_argument("--preset", required=True, help="config preset: tiny, glm53-flash-e80 or glm53-flash")
    m.add_argument("--out", required=True, help="output directory (created; must be empty or absent)")
    m.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="bf16, or FP8 e4m3 with 128x128 block scales for the tensors the vendor ships in FP8")
    m.add_argument("--seed", type=int, default=0, help="random seed (same seed, same weights)")

    def run_args(sp, need_ckpt: bool):
        if need_ckpt:
            sp.add_argument("--checkpoint", required=True, help="checkpoint directory")
        sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: kernels run under the Triton interpreter; cuda: natively on the GPU")
        sp.add_argument("--path", choices=("auto", "reference"), default="auto",
                        help="auto: every launch kind that exists runs as a kernel, the torch reference "
                             "runs the rest; reference: the torch reference only")
        sp.add_argument("--inject-fault", metavar="KIND:SITE", default=None,
                        help="make the producer of wait site SITE (a name or its number from `sites`) in "
                             "launch KIND skip its publish on the first "
                             "step: the HandoffTimeout is printed, the launch retried, and the tokens must "
                             "equal those of a run without the fault")
        sp.add_argument("--max-len", type=int, default=4096, help="cache length per slot (positions)")
        sp.add_argument("--kernels", type=_kinds, default=None, metavar="KIND,...",
                        help="with --path auto: only these launch kinds run as kernels, e.g. tail or "
                             "embed,dense,kda,tail (default: every kind that exists)")

    g = sub.add_parser("generate", help="teacher-force a prompt, then greedy-decode",
                       description="With --checkpoint: teacher-forces the prompt through decode steps of one "
                                   "request, then greedy-decodes --max-new-tokens tokens. With --preset and "
                                   "--random-weights: the batched ModelRunner on random weights made in memory "
                                   "(no files): --batch rows (row i's prompt is the prompt's ids + i), each "
                                   "prefilled, then decoded together on the persistent launches; prints each "
                                   "row's tokens, the time per output token (median ms per step) and tokens/s.")
    run_args(g, need_ckpt=False)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory")
    src.add_argument("--preset", help="config preset (tiny, glm53-flash-e80, glm53-flash); needs --random-weights")
    g.add_argument("--random-weights", action="store_true", help="with --preset: random weights (the only kind)")
    g.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="with --preset: weight format (fp8: e4m3 with 128x128 block scales, as the vendor ships)")
    g.add_argument("--seed", type=int, default=0, help="with --preset: the random weights' seed")
    g.add_argument("--batch", type=int, default=1, help="with --preset: rows decoded together (default 1)")
    g.add_argument("--prompt", type=_prompt, default=_prompt("3,17,42"),
                   help="comma-separated token ids (default 3,17,42)")
    g.add_argument("--max-new-tokens", type=int, required=True, help="number of tokens to generate")
    g.add_argument("--json", action="store_true",
                   help='print one line {"tokens": [...], "last_logits_top5": [[id, logit], ...]}')

    d = sub.add_parser("demo", help="decode demo on a tiny checkpoint (made if absent)",
                       description="Makes (or reuses) a tiny random checkpoint, prefills a prompt with the "
                                   "reference, decodes through the launches, prints the tokens, tokens/s and "
                                   "whether decode agrees with prefill.")
    run_args(d, need_ckpt=False)
    d.add_argument("--checkpoint", default=DEFAULT_DEMO_DIR, help=f"checkpoint dir (default {DEFAULT_DEMO_DIR})")
    d.add_argument("--prompt", type=_prompt, default=_prompt(DEFAULT_DEMO_PROMPT), help="comma-separated ids")
    d.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate")

    s = sub.add_parser("sites", help="list the wait sites of a launch kind",
                       description="Lists the numbered wait sites of a launch kind in schedule order "
                                   "(names accepted by --inject-fault KIND:SITE).")
    s.add_argument("--launch", required=True, help="launch kind, e.g. tail")

    du = sub.add_parser("dump", help="bitwise dump of every launch kind's outputs and scratch on fixed inputs",
                        description="Runs fixed (seeded) inputs through each launch kind at each width and writes "
                                    "every output and every scratch region, one file per (kind, width), with a "
                                    "manifest (shapes, dtypes, commit, build). Compare two dumps with `compare`.")
    du.add_argument("--out", required=True, help="output directory (created; must be empty or absent)")
    du.add_argument("--kinds", type=_kinds, default=["embed", "dense", "kda", "sparse", "nextn", "tail"],
                    metavar="KIND,...", help="launch kinds (default: embed,dense,kda,sparse,nextn,tail)")
    du.add_argument("--tp", type=int, default=1, help="TP degree; rank 0 runs, the others are loopback peers")
    du.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",") if w], default=[1, 2, 4, 8],
                    metavar="W,...", help="batch widths (default 1,2,4,8)")
    du.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="weight format: bf16, or fp8 (the FP8 checkpoint of the same seed: e4m3, 128x128 block scales)")
    du.add_argument("--preset", default="tiny", help="config preset (default tiny)")
    du.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: kernels run under the Triton interpreter; cuda: natively on the GPU")
    du.add_argument("--seed", type=int, default=0, help="weights and inputs seed")
    du.add_argument("--pos", type=int, default=27, help="decode position of the sparse / nextn launches")
    du.add_argument("--timeout-s", type=float, default=1.0,
                    help="spin budget of every wait site in seconds (default 1; raise it under compute-sanitizer)")

    bu = sub.add_parser("build", help="offline sm_90 build report: registers, spills, shared memory, CTAs per SM, "
                                         "code size",
                        description="Compiles every launch kind's persistent kernel for sm_90 at the real per-rank "
                                    "shapes (Triton's bundled ptxas; no GPU needed) and lists registers, spill "
                                    "bytes, shared memory and resident CTAs per SM beside the CTAs per SM the "
                                    "launch asks for, and the code: SASS instructions of the kernel and the "
                                    "functions compiled more than once (a constexpr argument of a noinline "
                                    "function makes one copy per value). Widths share a build (rows are a "
                                    "runtime argument) except the tail's. Exit status 1 if a build does not fit. "
                                    "A full matrix takes tens of minutes on 2 cores: narrow it with --kinds / "
                                    "--tp / --weights.")
    bu.add_argument("--report", action="store_true", required=True, help="print the report (the only action)")
    bu.add_argument("--kinds", type=_kinds, default=["embed", "dense", "kda", "sparse", "nextn", "tail"],
                    metavar="KIND,...", help="launch kinds (default: all six)")
    bu.add_argument("--tp", type=lambda s: [int(t) for t in s.split(",") if t], default=[1, 2, 4, 8],
                    metavar="T,...", help="TP degrees (default 1,2,4,8)")
    bu.add_argument("--weights", type=lambda s: [f for f in s.split(",") if f], default=["bf16", "fp8"],
                    metavar="FMT,...", help="weight formats (default bf16,fp8)")
    bu.add_argument("--warps", type=int, default=4, help="warps per CTA (default 4, the launches')")
    bu.add_argument("--json", help="also write the rows as JSON lines to this file")

    c = sub.add_parser("compare", help="compare two dumps byte for byte (exit 1 on any difference)",
                       description="Checks two `dump` directories byte for byte: lists every differing tensor "
                                   "with its first differing index and its count of differing elements, and "
                                   "files or tensors only one side has. Exit status 0: identical; 1: different.")
    c.add_argument("a", help="first dump directory")
    c.add_argument("b", help="second dump directory")
    return p


def cmd_make_checkpoint(a) -> int:
    from .checkpoint import make_random_checkpoint
    from .config import preset
    path = make_random_checkpoint(preset(a.preset), a.out, seed=a.seed, weights=a.weights)
    print(f"wrote {a.weights} checkpoint of preset {a.preset} (seed {a.seed}) to {path}")
    return 0


def _mono_check(runner):
    """GLM53_MONO_CHECK=1: attach check.py (repo root) to the runner; returns the checker or None."""
    if os.environ.get("GLM53_MONO_CHECK", "") in ("", "0"):
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    import check
    checker = check.MonoCheck()
    runner.hooks.append(check.hook(checker))
    return checker


def _generate_batched(a) -> int:
    """generate --preset P --random-weights: ModelRunner over --batch slots (issue 13)."""
    import statistics

    import torch

    from .model_runner import ModelRunner
    from sync import HandoffTimeout
    if not a.random_weights:
        raise ValueError("--preset needs --random-weights (presets have no weights on disk; or pass --checkpoint)")
    if a.path != "auto" or a.kernels is not None:
        raise ValueError("--preset runs every launch kind as a kernel (ModelRunner): drop --path / --kernels")
    if not 1 <= a.batch:
        raise ValueError(f"--batch {a.batch}: must be >= 1")
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens}: must be >= 1")
    B = a.batch
    r = ModelRunner.from_preset(a.preset, weight_format=a.weights, seed=a.seed, device=a.device, max_slots=B,
                                max_len=a.max_len, log=lambda m: print(m, file=sys.stderr))
    V = r.cfg.vocab_size
    if len(a.prompt) + a.max_new_tokens > a.max_len:
        raise ValueError(f"prompt ({len(a.prompt)}) + max-new-tokens ({a.max_new_tokens}) exceeds --max-len {a.max_len}")
    nxt, toks = [], [[] for _ in range(B)]
    for i in range(B):
        lg = r.prefill(i, [(t + i) % V for t in a.prompt])
        nxt.append(int(torch.argmax(lg)))
    for i in range(B):
        toks[i].append(nxt[i])
    slots = torch.arange(B, dtype=torch.int32)
    fault, times = a.inject_fault, []
    while len(toks[0]) < a.max_new_tokens:
        ids = torch.tensor([t[-1] for t in toks], dtype=torch.int64)
        pos = torch.tensor([r.length(i) for i in range(B)], dtype=torch.int64)
        t0 = time.perf_counter()
        try:
            lg = r.decode(ids, pos, slots, inject_fault=fault)
        except HandoffTimeout as e:                 # the step rolled back: report it and run it again
            print(f"HandoffTimeout: {e} {' '.join(getattr(e, '__notes__', []))} -- step retried", file=sys.stderr)
            lg = r.decode(ids, pos, slots)
        fault = None
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for i, t in enumerate(lg.argmax(-1).tolist()):
            toks[i].append(int(t))
    for i, t in enumerate(toks):
        print(f"row {i}: {','.join(map(str, t))}")
    if times:
        tpot = statistics.median(times)
        print(f"TPOT {tpot * 1e3:.2f} ms (median of {len(times)} steps), {B / tpot:.1f} tokens/s, batch {B}, "
              f"{a.preset} {a.weights} on {a.device}")
    if a.json:
        print(json.dumps({"tokens": toks, "tpot_ms": statistics.median(times) * 1e3 if times else None}))
    return 0


def cmd_generate(a) -> int:
    if a.preset is not None:
        return _generate_batched(a)
    for flag, v in (("--random-weights", a.random_weights), ("--batch", a.batch != 1)):
        if v:
            raise ValueError(f"{flag} goes with --preset (a checkpoint run decodes one request)")
    from .runner import Runner
    r = Runner(a.checkpoint, device=a.device, path=a.path, max_len=a.max_len, kinds=a.kernels)
    checker = _mono_check(r)
    res = r.generate(a.prompt, a.max_new_tokens, inject_fault=a.inject_fault)
    if checker is not None:
        print(checker.report(), file=sys.stderr)
        if checker.violations:
            return 1
    if a.json:
        top = res.last_logits.topk(5)
        print(json.dumps({"tokens": res.tokens,
                          "last_logits_top5": [[int(i), float(v)] for v, i in zip(top.values, top.indices)]}))
    else:
        print("tokens:", ",".join(map(str, res.tokens)))
        print("paths:", ", ".join(f"{k}={v}" for k, v in res.paths.items()))
    return 0


def cmd_demo(a) -> int:
    import torch

    from .checkpoint import make_random_checkpoint
    from .config import preset
    from .runner import Runner
    if not os.path.exists(os.path.join(a.checkpoint, "model.safetensors.index.json")):
        print(f"making a tiny random checkpoint in {a.checkpoint}")
        make_random_checkpoint(preset("tiny"), a.checkpoint, seed=0, weights="bf16")
    r = Runner(a.checkpoint, device=a.device, path=a.path, max_len=a.max_len, kinds=a.kernels)
    print("launch paths:", ", ".join(f"{k}={v}" for k, v in r.paths.items()))
    prompt = a.prompt
    t0 = time.perf_counter()
    pre = r.ref.prefill(torch.tensor(prompt, dtype=torch.long, device=a.device))
    t_pre = time.perf_counter() - t0
    res = r.generate(prompt, a.max_new_tokens, inject_fault=a.inject_fault)
    # the launches hand bf16 rows between stages (DESIGN.md §7): agreement = the per-launch gate on the
    # logits (relative error <= 1e-2) and the same greedy token after the prompt
    ref_logits = pre.logits.cpu()
    diff = float((res.prompt_logits - ref_logits).abs().max())
    rel = float((res.prompt_logits - ref_logits).norm() / ref_logits.norm())
    same_next = int(ref_logits[-1].argmax()) == res.tokens[0]
    agree = rel <= 1e-2 and same_next
    steps = max(1, a.max_new_tokens - 1)
    tps = steps / res.seconds if res.seconds > 0 else float("inf")
    print(f"prompt ({len(prompt)} tokens): {','.join(map(str, prompt))}   prefill {t_pre:.2f} s")
    print(f"generated: {','.join(map(str, res.tokens))}")
    print(f"decode: {tps:.2f} tokens/s on {a.device}")
    print(f"decode agrees with prefill: {'yes' if agree else 'NO'} (relative logit error {rel:.1e} over the "
          f"prompt, max |diff| {diff:.2e}; same next token: {same_next})")
    if res.faults:
        print(f"faults seen and retried: {len(res.faults)}")
    return 0 if agree else 1


def cmd_sites(a) -> int:
    from .launches import available, sites
    if a.launch not in available():
        print(f"launch kind {a.launch!r} is not implemented yet; implemented: {', '.join(available())}",
              file=sys.stderr)
        return 2
    try:
        for i, name in enumerate(sites(a.launch)):
            print(f"{i:3d}  {name}", flush=True)
    except BrokenPipeError:                         # `sites ... | head`: the reader left; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def cmd_dump(a) -> int:
    from .dump import dump
    man = dump(a.out, a.kinds, a.tp, a.widths, a.weights, a.preset, a.device, seed=a.seed, pos=a.pos,
               timeout_s=a.timeout_s)
    print(f"wrote {len(man['files'])} files to {a.out} (commit {man['commit']})")
    return 0


def cmd_compare(a) -> int:
    from .dump import compare
    diffs = compare(a.a, a.b)
    for d in diffs:
        print(d)
    print(f"{len(diffs)} differences" if diffs else "identical")
    return 1 if diffs else 0


def cmd_build(a) -> int:
    import json

    from . import build_report as br
    from .config import preset
    from .sm90_regs import kernel_registers, ptxas_available
    bad = [f for f in a.weights if f not in ("bf16", "fp8")]
    if bad:
        raise ValueError(f"--weights: {bad} (choose from bf16, fp8)")
    for t in a.tp:
        preset("glm53-flash").check_tp(t)              # the real shapes the report compiles
    if not ptxas_available():
        raise FileNotFoundError("Triton's bundled ptxas is missing (triton/backends/nvidia/bin/ptxas)")
    blds = br.builds(a.kinds, tuple(a.tp), tuple(a.weights), a.warps)
    print(f"compiling {len(blds)} builds for sm_90 ...", file=sys.stderr, flush=True)
    rows = br.report_rows(blds, kernel_registers([b["spec"] for b in blds], timeout=3600))
    print(br.format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0 if all(br.passes(r) for r in rows) else 1


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    _prepare_device(getattr(a, "device", "cpu"))
    try:
        return {"make-checkpoint": cmd_make_checkpoint, "generate": cmd_generate, "demo": cmd_demo,
                "sites": cmd_sites, "dump": cmd_dump, "compare": cmd_compare, "build": cmd_build}[a.cmd](a)
    except (ValueError, FileNotFoundError) as e:   # ConfigError/CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
