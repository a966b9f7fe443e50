"""Bitwise dumps of the launches and their comparison (`python -m glm53_flash dump / compare`).

A change that claims "same bits" shows it here: `dump` runs fixed inputs (seeded, the same for every
build) through each launch kind at each width and writes every output and every scratch region the
launch holds after it, one file per (kind, width) plus a manifest; `compare A B` checks two dumps byte
for byte and names each differing tensor with its first differing index and the number of differing
elements.

Weights are `weights.RandomWeights(cfg, seed)` (the values of a checkpoint made with that seed), sliced
to the rank like a checkpoint; rank 0 of a loopback TP group runs (the other ranks' exchange partials
come from the loopback peers). Every launch object is new, so its epoch starts at 0 and the tags in the
box words are the same in every dump of the same build. --weights fp8: the same values as an FP8 checkpoint of that
seed (weights.Fp8Weights), the tail's lm_head shard quantized as its FP8 build takes it.
"""
from __future__ import annotations

import json
import os

from .provenance import source_commit

KINDS = ("embed", "dense", "kda", "sparse", "nextn", "tail")
WEIGHTS = ("bf16", "fp8")
MANIFEST = "manifest.json"


def _inputs(kind, cfg, width, device, seed, pos):
    """The fixed inputs of one (kind, width): seeded by (seed, kind, width), the same for every build."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed * 1000003 + KINDS.index(kind) * 101 + width)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)             # noqa: E731
    if kind == "tail":
        return {"X": rnd(width, cfg.hc_mult, cfg.hidden_size)}
    if kind in ("embed", "dense", "kda"):
        return {"X": torch.randint(0, cfg.vocab_size, (width,), generator=g).to(device) if kind == "embed"
                else rnd(width, cfg.hc_mult, cfg.hidden_size)}
    pos_max = -(-(pos + 2) // cfg.index_kpool) * cfg.index_kpool
    d = {"lat": rnd(width, pos_max, cfg.kv_lora_rank).bfloat16(),
         "pk": rnd(width, pos_max // cfg.index_kpool, cfg.index_head_dim).bfloat16(),
         "tr": rnd(width, cfg.index_kpool, 2 * cfg.index_head_dim), "pos_max": pos_max,
         "positions": [max(1, pos - 3 * r) for r in range(width)]}
    if kind == "nextn":
        d.update(X=rnd(width, cfg.hidden_size), tok=torch.randint(0, cfg.vocab_size, (width,), generator=g).to(device))
    else:
        d.update(X=rnd(width, cfg.hc_mult, cfg.hidden_size))
    return d


def source(cfg, seed: int, weights: str):
    """(weights mapping, scales or None) of the dump's builds: RandomWeights(cfg, seed), or with weights="fp8"
    its FP8 checkpoint in memory (weights.Fp8Weights: the tensors an FP8 checkpoint stores as e4m3)."""
    from .weights import Fp8Weights, RandomWeights
    if weights not in WEIGHTS:
        raise ValueError(f"dump: --weights {weights!r}: one of {', '.join(WEIGHTS)}")
    src = RandomWeights(cfg, seed=seed, cache=True)
    if weights == "bf16":
        return src, None
    q = Fp8Weights(src, cfg)
    return q, q.scales


def _run(kind, cfg, src, tp, width, device, seed, pos, scales=None, timeout_s: float = 1.0):
    """One launch of `kind` on fixed inputs -> (launch, {output name: tensor}). The tensors are views of the
    launch's own output buffers (not copies), so a later enqueue of the launch rewrites them (stress.py).
    scales: FP8 weight scales (source()); the tail's lm_head (bf16 in the checkpoint) is then quantized per
    shard, as the FP8 tail build takes it. TP > 1: rank 0 of a loopback group (the peers' partials and
    candidates from the launch's loopback path). timeout_s: every wait site's spin budget (longer under a
    sanitizer, which slows the kernels many times over)."""
    import torch

    from .launches.dense import DenseLaunch
    from .launches.embed import EmbedLaunch
    from .launches.kda import KdaLaunch
    from .launches.nextn import NextnLaunch
    from .launches.sparse import SparseLaunch
    from .launches.tail import TailLaunch
    from .weights import LM_HEAD, PREFIX
    x = _inputs(kind, cfg, width, device, seed, pos)
    if kind == "tail":
        from .fp8 import quantize_fp8
        from .launches.layer_host import rank_tensors
        head = rank_tensors(cfg, src, [LM_HEAD], 0, tp)[0][LM_HEAD]
        q, s = quantize_fp8(head) if scales is not None else (head, None)
        L = TailLaunch(cfg, q.to(device), src[PREFIX + "norm.weight"].to(device),
                       None if s is None else s.to(device), tp_rank=0, tp_size=tp, width=width, device=device,
                       timeout_s=timeout_s)
        L.run(x["X"])
        return L, {"logits": L.logits[:width], "tokens": L.tokens[:width]}
    if kind in ("embed", "dense", "kda"):
        cls = {"embed": EmbedLaunch, "dense": DenseLaunch, "kda": KdaLaunch}[kind]
        layer = next(p.index for p in cfg.layers if p.launch == kind)
        L = cls(cfg, src, layer, tp_rank=0, tp_size=tp, width=width, device=device, scales=scales, timeout_s=timeout_s)
        g = torch.Generator(device="cpu").manual_seed(seed + 17 * width)
        S = (0.1 * torch.randn(width, L.NH, L.DK, L.DK, generator=g)).to(device)
        W = torch.randn(width, L.KC - 1, 3 * L.D, generator=g).to(device)
        L.run(x["X"], S, W, commit=False)
        return L, {"X_out": L.X_out[:width], "S_out": L.S_out[:width], "W_out": L.W_out[:width]}
    kw = dict(tp_rank=0, tp_size=tp, width=width, device=device, max_len=x["pos_max"], scales=scales,
              timeout_s=timeout_s)
    if kind == "nextn":
        L = NextnLaunch(cfg, src, tail_options={"timeout_s": timeout_s}, **kw)
        L.run(x["X"], x["tok"], x["lat"], x["pk"], x["tr"], x["positions"])
        T = L.tail_launch
        outs = ((T.logits[:width], T.tokens[:width]) if T is not None else ()) + (L.n_out[:width],)
    else:
        layer = next(p.index for p in cfg.layers if p.launch == "sparse")
        L = SparseLaunch(cfg, src, layer, **kw)
        L.run(x["X"], x["lat"], x["pk"], x["tr"], x["positions"])
        outs = (L.X_out[:width],)
    return L, {f"out{i}": t for i, t in enumerate(outs)}


def dump(out_dir: str, kinds, tp: int, widths, weights: str, preset_name: str, device: str, seed: int = 0,
         pos: int = 27, log=print, timeout_s: float = 1.0) -> dict:
    """Write every (kind, width)'s outputs and scratch regions under out_dir -> the manifest."""
    import torch

    from .config import preset
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"dump: unknown launch kind {k!r}; kinds: {', '.join(KINDS)}")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"dump: {out_dir} exists and is not empty")
    cfg = preset(preset_name)
    cfg.check_tp(tp)                             # before the directory exists: a bad --tp leaves nothing
    src, scales = source(cfg, seed, weights)
    os.makedirs(out_dir, exist_ok=True)
    man = {"commit": source_commit(), "preset": preset_name, "tp": tp, "weights": weights, "device": device, "seed": seed,
           "pos": pos, "files": {}}
    for kind in kinds:
        for w in widths:
            L, outs = _run(kind, cfg, src, tp, w, device, seed, pos, scales, timeout_s)
            tensors = {f"out.{n}": t.detach().cpu().clone() for n, t in outs.items()}
            for r in L.layout.regions:
                if r.kind != "canary":
                    tensors[f"scratch.{r.name}"] = L.layout.view(L.scratch, r.name).cpu().clone()
            name = f"{kind}_w{w}.pt"
            torch.save(tensors, os.path.join(out_dir, name))
            man["files"][name] = {"kind": kind, "width": w, "grid": L.grid, "build": f"{kind}-tp{tp}-w{w}-{weights}",
                                  "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                                              for n, t in tensors.items()}}
            log(f"dumped {kind} width {w}: {len(tensors)} tensors -> {name}")
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(man, f, indent=1, sort_keys=True)
    return man


def compare(a_dir: str, b_dir: str) -> list[str]:
    """Byte-for-byte comparison of two dumps -> one line per difference (empty: identical)."""
    import torch
    mans = []
    for d in (a_dir, b_dir):
        p = os.path.join(d, MANIFEST)
        if not os.path.exists(p):
            raise FileNotFoundError(f"compare: {d} is not a dump (no {MANIFEST})")
        with open(p) as f:
            mans.append(json.load(f))
    diffs = []
    fa, fb = mans[0]["files"], mans[1]["files"]
    for name in sorted(set(fa) ^ set(fb)):
        diffs.append(f"{name}: only in {'A' if name in fa else 'B'}")
    for name in sorted(set(fa) & set(fb)):
        gone = [s for s, d in (("A", a_dir), ("B", b_dir)) if not os.path.exists(os.path.join(d, name))]
        if gone:
            diffs.append(f"{name}: in the manifest but missing from {' and '.join(gone)}")
            continue
        ta = torch.load(os.path.join(a_dir, name))
        tb = torch.load(os.path.join(b_dir, name))
        for n in sorted(set(ta) ^ set(tb)):
            diffs.append(f"{name} {n}: only in {'A' if n in ta else 'B'}")
        for n in sorted(set(ta) & set(tb)):
            x, y = ta[n], tb[n]
            if x.shape != y.shape or x.dtype != y.dtype:
                diffs.append(f"{name} {n}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
                continue
            if x.numel() == 0:
                continue
            # element-wise over the raw bits (NaNs compare by their bits, -0.0 differs from 0.0)
            ex = x.reshape(-1).view(torch.uint8).reshape(x.numel(), -1)
            ey = y.reshape(-1).view(torch.uint8).reshape(y.numel(), -1)
            bad = (ex != ey).any(-1)
            nbad = int(bad.sum())
            if nbad:
                first = int(bad.nonzero()[0, 0])
                idx = list(torch.unravel_index(torch.tensor(first), x.shape)) if x.dim() else []
                diffs.append(f"{name} {n}: {nbad} of {x.numel()} elements differ, first at "
                             f"{tuple(int(i) for i in idx)} (flat {first}): {x.reshape(-1)[first].item()!r} vs "
                             f"{y.reshape(-1)[first].item()!r}")
    return diffs
