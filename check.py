"""MONO_CHECK: invariants checked after every persistent launch (enable with GLM53_MONO_CHECK=1).

After a launch the runner hands this checker the launch object, its outputs and the reference's
outputs for the same inputs. Checked, each counted as one check:
- the launch's error record is clean (no wait site timed out, no abort);
- every canary line after every scratch region is intact (no region overran its neighbour);
- tagged-pair mailboxes: no word carries a tag newer than the launch's own (a future tag means a word
  was written by something other than a launch of this header), and each pairs region holds at least
  one word with the launch's tag (the region was used this launch);
- box words: none newer than the launch's tag;
- outputs finite;
- at TP > 1 (the ModelRunner's loopback group): every rank's layer output and greedy ids the same bits as rank
  0's (the runner's own check: a step where they differ is one violation, and the decode stops there);
- per-output relative error ||out - ref|| / ||ref|| against the reference within its bound, and greedy
  ids equal where both give them.
`report()` gives "N checks, M violations" and the metrics table (per launch kind and output: relative error,
max |diff|, cosine; the batched runner also reports the KDA layers' new states and windows). Usage:
    GLM53_MONO_CHECK=1 python -m glm53_flash generate --checkpoint DIR --prompt 3,17,42 --max-new-tokens 8
    python check.py --preset tiny --steps 4           (a random checkpoint; exit 1 on any violation)
    python check.py --preset tiny --rows 2 --steps 3  (the batched ModelRunner over 2 slots)
    python check.py --preset tiny --tp 2 --steps 3    (every rank of a TP 2 group, loopback on one device)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

TAG_MASK = 0xFFFFFFFF


def enabled() -> bool:
    return os.environ.get("GLM53_MONO_CHECK", "") not in ("", "0")


@dataclass
class Metric:
    launch: str
    output: str
    rel_err: float
    bound: float
    max_abs: float = float("nan")
    cosine: float = float("nan")


@dataclass
class MonoCheck:
    checks: int = 0
    violations: list[str] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)

    def _expect(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            self.violations.append(what)

    # ------------------------------------------------------------------ scratch invariants
    def scratch(self, launch) -> None:
        """Header record, canaries, pair and box tags of the latest launch of `launch`."""
        name = launch.kind
        rec = launch.record()
        self._expect(not rec.failed, f"{name}: error record set (site {rec.site}, cta {rec.cta}, "
                                     f"wanted {rec.wanted}, seen {rec.seen})")
        bad = launch.canaries()
        self._expect(not bad, f"{name}: canaries overwritten after regions {bad}")
        tag = rec.last_tag & TAG_MASK
        for r in launch.layout.regions:
            if r.kind == "pairs":
                words = launch.layout.view(launch.scratch, r.name).reshape(-1).to(torch.int64).cpu()
                tags = words & TAG_MASK
                self._expect(bool((tags <= tag).all()), f"{name}.{r.name}: pair words carry tags newer than {tag}")
                self._expect(bool((tags == tag).any()), f"{name}.{r.name}: no pair word carries the launch tag {tag}")
            elif r.kind == "box":
                words = launch.layout.view(launch.scratch, r.name).reshape(-1).to(torch.int64).cpu() & TAG_MASK
                self._expect(bool((words <= tag).all()), f"{name}.{r.name}: box words newer than tag {tag}")

    # ------------------------------------------------------------------ outputs vs reference
    def output(self, launch: str, out_name: str, out: torch.Tensor, ref: torch.Tensor | None,
               bound: float = 1e-2) -> None:
        out = out.detach().float().cpu()
        self._expect(bool(torch.isfinite(out).all()), f"{launch}.{out_name}: non-finite values")
        if ref is None:
            return
        ref = ref.detach().float().cpu()
        self._expect(out.shape == ref.shape, f"{launch}.{out_name}: shape {tuple(out.shape)} vs reference "
                                             f"{tuple(ref.shape)}")
        if out.shape != ref.shape:
            return
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
        cos = float(torch.nn.functional.cosine_similarity(out.reshape(1, -1).double(), ref.reshape(1, -1).double()))
        self.metrics.append(Metric(launch, out_name, err, bound, float((out - ref).abs().max()), cos))
        self._expect(err <= bound, f"{launch}.{out_name}: relative error {err:.2e} > {bound:.0e}")

    def ids(self, launch: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ok = torch.equal(got.cpu().long(), want.cpu().long())
        self._expect(ok, f"{launch}: greedy ids {got.tolist()} differ from the reference's {want.tolist()}")

    # ------------------------------------------------------------------ report
    def report(self) -> str:
        lines = [f"MONO_CHECK: {self.checks} checks, {len(self.violations)} violations"]
        lines += [f"  violation: {v}" for v in self.violations[:20]]
        if len(self.violations) > 20:
            lines.append(f"  ... and {len(self.violations) - 20} more")
        if self.metrics:
            lines.append(f"  {'launch':<10} {'output':<10} {'max rel err':>12} {'mean rel err':>13} {'max abs':>9} "
                         f"{'min cosine':>11} {'bound':>7} n")
            groups: dict[tuple[str, str], list[Metric]] = {}
            for m in self.metrics:
                groups.setdefault((m.launch, m.output), []).append(m)
            for (ln, on), ms in groups.items():
                errs = [m.rel_err for m in ms]
                lines.append(f"  {ln:<10} {on:<10} {max(errs):12.2e} {sum(errs) / len(errs):13.2e} "
                             f"{max(m.max_abs for m in ms):9.2e} {min(m.cosine for m in ms):11.6f} "
                             f"{ms[0].bound:7.0e} {len(ms)}")
        return "\n".join(lines)


def hook(checker: MonoCheck):
    """A runner after-launch hook feeding `checker`."""
    def after_launch(kind, launch, outputs: dict, reference: dict) -> None:
        checker.scratch(launch)
        for name, out in outputs.items():
            if name == "ids":
                checker.ids(kind, out, reference["ids"])
            else:
                checker.output(kind, name, out, reference.get(name))
    return after_launch


def main(argv=None) -> int:
    """`python check.py [--checkpoint DIR | --preset P [--weights W]] [--steps N] [--device cpu|cuda]`: a greedy
    decode with every launch checked; prints "N checks, M violations" and the metrics table; exit 1 on any
    violation, 2 on bad input."""
    import argparse
    import sys
    import tempfile
    p = argparse.ArgumentParser(description="Decode with MONO_CHECK invariants after every launch: the error "
                                            "record, canaries, mailbox and box tags, finite outputs and the "
                                            "relative error against the torch reference.")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint directory (default: a random checkpoint of --preset in a temporary directory)")
    p.add_argument("--preset", default="tiny", help="config preset of the random checkpoint (default tiny)")
    p.add_argument("--weights", choices=("bf16", "fp8"), default="bf16", help="format of the random checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the random checkpoint")
    p.add_argument("--prompt", default="3,17,42,7,99", help="comma-separated token ids")
    p.add_argument("--steps", "--max-new-tokens", dest="steps", type=int, default=4, help="decode steps (tokens)")
    p.add_argument("--kernels", default=None, metavar="KIND,...",
                   help="only these launch kinds run as kernels (default: every kind the runner drives)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8),
                   help="TP degree: > 1 runs every rank of the group on one device (the batched ModelRunner in "
                        "loopback: each layer's rank launches in three passes, the exchange fed by the host)")
    p.add_argument("--rows", type=int, default=1,
                   help="decode rows: 1 (with --tp 1) runs the one-request runner (runner.py); more run the batched "
                        "ModelRunner (model_runner.py, eager) over that many slots, row i's prompt the prompt's ids "
                        "+ i")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args(argv)
    if not 1 <= a.rows <= 64:
        print(f"check.py: --rows {a.rows}: need 1..64", file=sys.stderr)
        return 2
    if a.steps < 1:
        print(f"check.py: --steps {a.steps}: need at least 1", file=sys.stderr)
        return 2
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.rows > 1 or a.tp > 1:
        return _check_batched(a)
    from glm53_flash.runner import Runner
    with tempfile.TemporaryDirectory(prefix="check_ckpt_") as tmp:
        ckpt = a.checkpoint
        if ckpt is None:
            from glm53_flash.checkpoint import make_random_checkpoint
            from glm53_flash.config import preset
            ckpt = os.path.join(tmp, a.preset)
            make_random_checkpoint(preset(a.preset), ckpt, seed=a.seed, weights=a.weights, progress=False)
        kinds = [k for k in a.kernels.split(",") if k] if a.kernels else None
        r = Runner(ckpt, device=a.device, kinds=kinds)
        checker = MonoCheck()
        r.hooks.append(hook(checker))
        res = r.generate([int(t) for t in a.prompt.split(",")], a.steps)
    print("tokens:", ",".join(map(str, res.tokens)))
    print(checker.report())
    return 1 if checker.violations else 0


def _check_batched(a) -> int:
    """check.py --rows R > 1 or --tp T > 1: R slots prefilled by the reference, then --steps decode steps of all R
    rows on the ModelRunner's launches (eager; at TP > 1 every rank's), every launch checked against the
    reference's step of the same layer."""
    import sys

    import torch

    from glm53_flash.model_runner import ModelRunner
    if a.kernels:
        print("check.py: --kernels goes with --rows 1 --tp 1 (the ModelRunner runs every launch kind)",
              file=sys.stderr)
        return 2
    kw = dict(device=a.device, max_slots=a.rows, max_len=max(64, 8 + len(a.prompt.split(",")) + a.steps),
              eager=True, reference=True, progress=False, log=lambda *_: None, tp_size=a.tp)
    if a.checkpoint:
        r = ModelRunner.from_pretrained(a.checkpoint, **kw)
    else:
        r = ModelRunner.from_preset(a.preset, weight_format=a.weights, seed=a.seed, **kw)
    V = r.cfg.vocab_size
    prompt = [int(t) for t in a.prompt.split(",") if t.strip()]
    nxt = [int(torch.argmax(r.prefill(i, [(t + i) % V for t in prompt]))) for i in range(a.rows)]
    checker = MonoCheck()
    r.hooks.append(hook(checker))
    toks = [[t] for t in nxt]
    slots = torch.arange(a.rows, dtype=torch.int32)
    try:
        for _ in range(a.steps - 1):
            ids = torch.tensor([t[-1] for t in toks], dtype=torch.int64)
            pos = torch.tensor([r.length(i) for i in range(a.rows)], dtype=torch.int64)
            for i, t in enumerate(r.decode(ids, pos, slots).argmax(-1).tolist()):
                toks[i].append(int(t))
    except RuntimeError as e:       # the runner's own checks: TP ranks that disagree, a hand-off that timed out
        checker._expect(False, f"decode step: {e}")
    for i, t in enumerate(toks):
        print(f"row {i} tokens:", ",".join(map(str, t)))
    print(checker.report())
    return 1 if checker.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
