"""ModelRunner: batched decode over request slots on the persistent launches (issue 13; host code).

    runner = ModelRunner.from_preset("tiny", weight_format="bf16", device="cpu", max_slots=8, max_len=256)
    runner = ModelRunner.from_pretrained(checkpoint_dir, device="cuda", max_slots=8, max_len=4096)
    runner.prefill(slot, token_ids)                     # the reference's batched prefill (decode-first runner)
    logits = runner.decode(input_ids[B] int64, positions[B] int64, slots[B] int32)   # -> [B, V] fp32
    runner.release(slot)

Conventions (SGLang / vLLM style): a slot is one request's cache row; `positions[i]` must be slot
`slots[i]`'s next position (its length); greedy ids are `logits.argmax(-1)` (lowest index on ties).

Decode: B <= the widest built width runs the persistent launches built for the smallest width >= B
(embed, every dense / kda / sparse layer, the tail; widths 1/2/4/8 by default): rows B..width-1 of a
build are pad rows, which compute and write nothing. Wider batches take the fallback path, the torch
reference's decode step (the same math, not the launches). A row's logits are bitwise the same whatever
the batch (the launches are batch invariant, DESIGN.md §7) and run to run.

All-or-nothing steps: every launch of the step is checked; a fault raises the launch's HandoffTimeout
(its wait site named, a note saying which layer) and leaves every slot's caches exactly as before the
step: the KDA layers' new states are committed only once every launch of the step is clean, and the DSA
cache rows a step writes (latent row pos, ring row pos % kpool, pool key pos // kpool) are restored from a
copy taken before the step. Bad input raises ValueError before any launch, caches untouched.

CUDA graphs (eager=False, the GPU): one step program per batch size B <= the widest build (a graph bakes the
launches' row count, so B, not the width, keys it; B runs on the width-w builds, w the smallest >= B). A
program holds static device buffers (ids, positions, slots, each KDA layer's gathered state and window, a copy
of the DSA rows the step writes); its step graph copies the slots' states in, runs every launch (their tags
come from the device epoch, so a replay needs no host argument) and leaves the states in the launches' output
buffers; after the host has read every launch's error record, a second graph commits them (and the lengths),
or the saved DSA rows are put back. All graphs are captured at construction (caches empty), with a progress
bar and a log line of the time and the memory they took. `graph_programs=True` on the CPU runs the same
programs without capture (the tests check them against the plain eager path).

Memory: the widths' builds of a layer share one copy of its weights (the first build's; `share_weights`), and
the tails share the lm_head.

TP > 1 (tp_size 2 / 4 / 8): one runner drives every rank of the group on its one device, in loopback
(tp_loopback.py): each layer's rank launches run one after another in three passes, the exchange fed by the
host, the tail's vocabulary shards in two; the ranks' outputs must agree bitwise. Eager only (no step graphs):
a correctness path (check.py --tp), not a timing one (time_layers.py times one rank's launch in loopback).
Rank r's KDA state is its heads' slice of the slot caches, committed per rank with the rest of the step.

Not yet (issue 13): TP > 1 across devices (one process per rank), the MTP block.
"""
from __future__ import annotations

import time

import torch

from .config import GlmConfig, preset
from .reference.model import ReferenceModel
from .weights import LM_HEAD, PREFIX, Fp8Weights, RandomWeights

WIDTHS = (1, 2, 4, 8)
LAYER_KINDS = ("embed", "dense", "kda", "sparse")


class ModelRunner:
    """Decode-first runner over `max_slots` request slots of one TP rank (TP 1 for now)."""

    def __init__(self, cfg: GlmConfig, source, scales=None, *, reference_weights=None, reference: bool = True,
                 tp_size: int = 1, tp_rank: int = 0, device="cuda", max_slots: int = 8, max_len: int = 4096,
                 widths=WIDTHS, eager: bool | None = None, graph_programs: bool | None = None, log=print,
                 progress: bool = True, rank_sources: list | None = None):
        """reference=False: no torch reference model (its fp32 weights would not fit beside the launches' at real
        shapes): prefill then runs the prompt through decode steps of one row, and there is no fallback path
        for batches wider than the widest build. tp_size > 1: every rank in loopback on this device (module
        note); `source` is then host weights the launches shard (weights.RandomWeights / Fp8Weights), or
        rank_sources the group's loaded checkpoint rank views (from_pretrained)."""
        if tp_size not in (1, 2, 4, 8):
            raise ValueError(f"tp_size={tp_size!r}: 1, 2, 4 or 8")
        if tp_rank != 0:
            raise ValueError(f"tp_rank={tp_rank}: one runner drives every rank of the group (loopback on one "
                             f"device); one process per rank is not built yet")
        if tp_size > 1:
            if eager is False or graph_programs:
                raise ValueError(f"tp_size={tp_size}: the loopback group runs eagerly (three launches a rank and "
                                 f"layer, fed by the host): no step graphs")
            eager = True
            if hasattr(source, "weights") and hasattr(source, "tp_size") and rank_sources is None:
                raise ValueError("tp_size > 1 with a checkpoint: pass rank_sources (ModelRunner.from_pretrained)")
        if rank_sources is not None and len(rank_sources) != tp_size:
            raise ValueError(f"rank_sources: {len(rank_sources)} views for tp_size={tp_size}")
        self.tp_size, self.rank_sources = tp_size, rank_sources
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available on this machine")
        if eager is None:                       # CUDA graphs on the GPU; eager=True for debugging
            eager = dev.type != "cuda"
        if not eager and dev.type != "cuda":
            raise ValueError("eager=False captures CUDA graphs: it needs device='cuda' (graph_programs=True runs the "
                             "same step programs uncaptured on the CPU)")
        for name, v in (("max_slots", max_slots), ("max_len", max_len)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        if widths is WIDTHS:                    # the default: no build wider than max_slots rows can fill
            cap = next((x for x in WIDTHS if x >= max_slots), WIDTHS[-1])
            widths = tuple(w for w in WIDTHS if w <= cap)
        widths = tuple(sorted(set(widths)))
        if not widths or any(w not in WIDTHS for w in widths):
            raise ValueError(f"widths={widths}: each must be one of {WIDTHS}")
        self.cfg, self.device, self.max_slots, self.max_len, self.widths = cfg, dev, max_slots, max_len, widths
        self.log = log
        if reference:
            self.ref = ReferenceModel(cfg, reference_weights if reference_weights is not None else source, device=dev)
            self._caches = self.ref.new_caches(max_slots, max_len)
        else:
            from .reference.caches import DecodeCaches
            self.ref = None
            self._caches = DecodeCaches.allocate(cfg, max_slots, max_len, device=dev)
        self.active = [False] * max_slots
        self._kda_index = {li: j for j, li in enumerate(cfg.kda_layers)}
        self._dsa_index = {li: d for d, li in enumerate(cfg.dsa_layers)}
        self.builds: dict[int, dict] = {}
        t0 = time.perf_counter()
        self._build(source, scales, progress)
        log(f"ModelRunner: {cfg.num_hidden_layers} layers x widths {list(widths)} built on {dev} in "
            f"{time.perf_counter() - t0:.1f} s")
        # after-launch hooks of the eager path: hook(kind, launch, outputs: dict, reference: dict), the reference's
        # own step of that layer (or the tail) on the launch's input (check.py's MONO_CHECK; needs the reference)
        self.hooks = []
        self.capture = not eager
        self.programs: dict[int, StepProgram] = {}
        if not eager or graph_programs:
            self._make_programs(progress)

    @property
    def caches(self):
        """The slot caches (reference.caches.DecodeCaches): every slot's KDA state, conv window, DSA latent /
        pool-key / ring rows and length."""
        return self._caches

    @caches.setter
    def caches(self, c) -> None:
        # the captured graphs hold the caches' addresses: a new object would be invisible to them (copy into
        # the tensors instead). Eager runners (tests) may swap them.
        if getattr(self, "capture", False):
            raise ValueError("this runner's CUDA graphs hold the caches' addresses: copy into runner.caches "
                             "tensors instead of replacing the object")
        self._caches = c

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path, tp_size: int = 1, tp_rank: int = 0, device="cuda", **kw) -> "ModelRunner":
        """A checkpoint directory (bf16 or FP8, checkpoint.py). tp_size > 1: the whole group in loopback (every
        rank's view loaded; the reference from the TP 1 view)."""
        from .checkpoint import load_checkpoint
        if tp_rank != 0:
            raise ValueError(f"tp_rank={tp_rank}: one runner drives every rank of the group (loopback)")
        ck = load_checkpoint(path, 0, 1, progress=kw.get("progress", True))
        ranks = [load_checkpoint(path, r, tp_size, progress=False) for r in range(tp_size)] if tp_size > 1 else None
        return cls(ck.config, ck, reference_weights=ck.dequantized(), tp_size=tp_size, tp_rank=tp_rank,
                   device=device, rank_sources=ranks, **kw)

    @classmethod
    def from_preset(cls, name: str, weights: str = "random", weight_format: str = "bf16", seed: int = 0,
                    **kw) -> "ModelRunner":
        """Random weights of a config preset, no files: bf16, or FP8 (the vendor's e4m3 with 128x128 block
        scales). On the GPU they are made there, at the piece shapes (device_weights.RankSource: nothing
        GB-sized on the host), and there is no reference model unless reference=True is passed (its fp32
        copies do not fit beside a real-shape model); on the CPU they are weights.RandomWeights(cfg, seed)
        (FP8: weights.Fp8Weights) with the reference on their (dequantized) values; so too at tp_size > 1 on
        either device (the loopback group's launches cut their shards from them)."""
        if weights != "random":
            raise ValueError(f"weights={weights!r}: from_preset makes random weights only (weights='random')")
        if weight_format not in ("bf16", "fp8"):
            raise ValueError(f"weight_format={weight_format!r}: 'bf16' or 'fp8'")
        cfg = preset(name)
        if torch.device(kw.get("device", "cuda")).type == "cuda" and kw.get("tp_size", 1) == 1:
            from .checkpoint import dequantized_view
            from .device_weights import RankSource
            torch.manual_seed(seed)
            src = RankSource(cfg, 0, 1, weight_format, kw.get("device", "cuda"), seed=seed)
            if kw.setdefault("reference", False):
                kw["reference_weights"] = dequantized_view(src.weights, src.scales)
            return cls(cfg, src, **kw)
        src = RandomWeights(cfg, seed=seed, cache=True)
        if weight_format == "bf16":
            return cls(cfg, src, **kw)
        from .checkpoint import dequantized_view
        q = Fp8Weights(src, cfg)
        return cls(cfg, q, q.scales, reference_weights=dequantized_view(q, q.scales), **kw)

    def _build(self, source, scales, progress: bool) -> None:
        from tqdm import tqdm

        from .launches import _launch_class, build_launch
        from .launches.tail import TailLaunch
        is_ck = hasattr(source, "weights") and hasattr(source, "tp_size")      # a loaded Checkpoint (rank view)
        w_map = source.weights if is_ck else source
        lm_head = w_map[LM_HEAD].to(self.device, torch.bfloat16).contiguous()
        norm_w = w_map[PREFIX + "norm.weight"].to(self.device, torch.bfloat16).contiguous()
        T = self.tp_size
        total = len(self.widths) * (self.cfg.num_hidden_layers + 1) * T
        bar = tqdm(total=total, desc="building launches", disable=not progress)
        # per width: "layers" {index: rank 0's launch}, "ranks" {index: [every rank's launch]} (one at TP 1),
        # "tail" rank 0's tail, "tails" every rank's
        self.builds = {w: {"layers": {}, "ranks": {}} for w in self.widths}
        for p in self.cfg.layers:          # a layer's widths one after another: its weights are made (or read) once
            if p.launch not in LAYER_KINDS:
                raise ValueError(f"layer {p.index}: launch kind {p.launch!r} has no persistent launch")
            kw = dict(max_len=self.max_len) if p.launch == "sparse" else {}
            first = [None] * T              # each rank's first build: its other widths share those weights
            for w in self.widths:
                ranks = []
                for r in range(T):
                    if self.rank_sources is not None:
                        L = build_launch(p.launch, self.rank_sources[r], device=self.device, width=w,
                                         layer=p.index, **kw)
                    elif is_ck:
                        L = build_launch(p.launch, source, device=self.device, width=w, layer=p.index, **kw)
                    else:
                        L = _launch_class(p.launch)(self.cfg, source, p.index, tp_rank=r, tp_size=T, width=w,
                                                    device=self.device, scales=scales, **kw)
                    if first[r] is None:
                        first[r] = L
                    else:
                        L.share_weights(first[r])
                    ranks.append(L)
                    bar.update(1)
                self.builds[w]["layers"][p.index] = ranks[0]
                self.builds[w]["ranks"][p.index] = ranks
            if hasattr(source, "release") and self.ref is None:
                source.release()              # the launches hold their own copies: drop the generated pieces
        Vr = self.cfg.vocab_size // T
        for w in self.widths:
            tails = [TailLaunch(self.cfg, lm_head[r * Vr:(r + 1) * Vr], norm_w, tp_rank=r, tp_size=T, width=w,
                                device=self.device) for r in range(T)]
            self.builds[w]["tail"], self.builds[w]["tails"] = tails[0], tails
            bar.update(T)
        bar.close()

    # ------------------------------------------------------------------ slots
    def prefill(self, slot: int, token_ids) -> torch.Tensor:
        """The prompt of an empty slot, all at once (the reference's batched path) -> its last position's
        logits [V] fp32. The slot is then active at position len(token_ids)."""
        self._check_slot_id(slot)
        if self.active[slot]:
            raise ValueError(f"slot={slot} is active; release it before a new prefill")
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token_ids: a non-empty 1-D int64 / int32 sequence, got {tuple(ids.shape)} {ids.dtype}")
        V = self.cfg.vocab_size
        if bool((ids < 0).any()) or bool((ids >= V).any()):
            raise ValueError(f"token_ids {ids.tolist()[:8]}: ids outside [0, vocab_size={V})")
        if ids.numel() >= self.max_len:
            raise ValueError(f"token_ids: {ids.numel()} tokens leave no room to decode (max_len={self.max_len})")
        if self.ref is not None:
            out = self.ref.prefill(ids.to(self.device, torch.int64), self.caches, slot)
            self.active[slot] = True
            return out.logits[-1].float()
        self.active[slot] = True             # no reference: the prompt as decode steps of this one row
        try:
            for t, tok in enumerate(ids.tolist()):
                lg = self.decode(torch.tensor([tok]), torch.tensor([t]), torch.tensor([slot], dtype=torch.int32))
        except Exception:
            self.caches.reset(slot)
            self.active[slot] = False
            raise
        return lg[0]

    def release(self, slot: int) -> None:
        """Free a slot (its caches zeroed, length 0)."""
        self._check_slot_id(slot)
        if not self.active[slot]:
            raise ValueError(f"slot={slot} is not active")
        self.caches.reset(slot)
        self.active[slot] = False

    def length(self, slot: int) -> int:
        self._check_slot_id(slot)
        return int(self.caches.lengths[slot])

    def _check_slot_id(self, slot) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot={slot!r}: outside [0, max_slots={self.max_slots})")

    # ------------------------------------------------------------------ decode
    def decode(self, input_ids, positions, slots, *, inject_fault: str | None = None) -> torch.Tensor:
        """One token for each of B rows -> logits [B, V] fp32. input_ids / positions int64 [B], slots int32 [B]
        (CPU or this runner's device). inject_fault "KIND:SITE" (or KIND:N, the site's number): the first launch
        of that kind in this step skips that publish (tests; the step then raises HandoffTimeout)."""
        ids, pos, sl = self._check_decode(input_ids, positions, slots)
        fault = self._parse_fault(inject_fault)
        B = ids.shape[0]
        w = next((w for w in self.widths if w >= B), None)
        if w is None:                                              # fallback: the reference's decode step
            if self.ref is None:
                raise ValueError(f"{B} rows: wider than the widest build ({self.widths[-1]}), and this runner has no "
                                 f"reference model for the fallback path (reference=False)")
            if fault is not None:
                raise ValueError(f"inject_fault: {B} rows run the fallback path, which has no launches")
            out = self.ref.decode_step(self.caches, ids, pos, sl)
            return out.logits.float()
        if self.programs and fault is None and not self.hooks:
            return self.programs[B].step(ids, pos, sl)
        return self._decode_launches(self.builds[w], ids, pos, sl, fault)

    def _make_programs(self, progress: bool) -> None:
        from tqdm import tqdm
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.synchronize()
            m0 = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        Bs = list(range(1, self.widths[-1] + 1))
        for B in tqdm(Bs, desc="capturing step graphs" if self.capture else "step programs", disable=not progress):
            w = next(x for x in self.widths if x >= B)
            self.programs[B] = StepProgram(self, self.builds[w], B, self.capture)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            mem = f", {(torch.cuda.memory_allocated(dev) - m0) / 2**20:.1f} MiB"
        else:
            mem = ""
        self.log(f"ModelRunner: {len(Bs)} step {'graphs captured' if self.capture else 'programs made'} (B = 1.."
                 f"{Bs[-1]}) in {time.perf_counter() - t0:.1f} s{mem}")

    def _decode_launches(self, build, ids, pos, sl, fault) -> torch.Tensor:
        """One eager step on a width's builds. At TP > 1 the group in loopback (tp_loopback.py): each layer's
        rank launches in three passes, the tail's in two; every rank's X' and greedy ids must be the same bits
        (RuntimeError if not). Hooks (check.py) see every launch: X', the KDA state / window (the rank's slice)
        and the tail's ids and logits against the reference's."""
        from sync import HandoffTimeout

        from .tp_loopback import commit_rank_state, rank_state, run_layer, run_tail
        c, cfg, T = self.caches, self.cfg, self.tp_size
        B = ids.shape[0]
        saved = self._save_dsa_rows(sl, pos)
        pending = []                                               # (rank launches, KDA index j)
        X = None
        layer = None
        try:
            for p in cfg.layers:
                layer = p
                Ls = build["ranks"][p.index]
                site = self._take_fault(fault, p.launch)
                X_in = X
                if p.launch == "sparse":
                    d = self._dsa_index[p.index]

                    def run_one(L, peer, f):
                        return L.run(X_in, c.latent[:, d], c.pool_keys[:, d], c.tail_rows[:, d], pos, sl,
                                     inject_fault=f, peer=peer)
                else:
                    j = self._kda_index[p.index]
                    shards = [rank_state(cfg, c.kda_state[sl, j], c.conv_window[sl, j], r, T) for r in range(T)]
                    x = ids if p.launch == "embed" else X_in

                    def run_one(L, peer, f):
                        return L.run(x, *shards[L.tp_rank], inject_fault=f, peer=peer, commit=False)
                outs = run_layer(Ls, run_one, site)
                X = outs[0]
                if self.hooks and self.ref is not None:
                    ref_in = self.ref.embed(ids) if p.launch == "embed" else X_in
                    rc = c.clone()
                    ref = self.ref.layer_step(rc, p.index, ref_in, pos, sl)
                    for L, Xr in zip(Ls, outs):
                        o, rf = {"X": Xr}, {"X": ref}
                        if p.launch != "sparse":
                            Sr, Wr = rank_state(cfg, rc.kda_state[sl, j], rc.conv_window[sl, j], L.tp_rank, T)
                            o.update(state=L.S_out[:B], window=L.W_out[:B])
                            rf.update(state=Sr, window=Wr)
                        for hook in self.hooks:
                            hook(p.launch, L, o, rf)
                bad = [L.tp_rank for L, Xr in zip(Ls, outs) if not torch.equal(Xr, X)]
                if bad:
                    raise RuntimeError(f"layer {p.index} ({p.launch}): TP ranks {bad} computed other X' bits than "
                                       f"rank 0 (loopback group of {T})")
                if p.launch != "sparse":
                    pending.append((Ls, j))
            layer = None
            site = self._take_fault(fault, "tail")
            logits, tok = run_tail(build["tails"], X, site)
            if self.hooks and self.ref is not None:
                ref = self.ref.tail(X)
                for L in build["tails"]:           # rank 0's also: the group's logits (every rank's shard)
                    o = {"logits": logits, "ids": tok[0]} if L.tp_rank == 0 else {"ids": tok[L.tp_rank]}
                    for hook in self.hooks:
                        hook("tail", L, o, {"logits": ref, "ids": ref.argmax(-1)})
            if any(not torch.equal(t, tok[0]) for t in tok):
                raise RuntimeError(f"tail: TP ranks chose other greedy ids than rank 0 (loopback group of {T})")
        except HandoffTimeout as e:
            self._restore_dsa_rows(saved)
            where = f"layer {layer.index} ({layer.launch} launch)" if layer is not None else "the tail launch"
            tp = f" at TP {T} (loopback)" if T > 1 else ""
            e.add_note(f"ModelRunner.decode: {where} of a {B}-row step{tp}; every slot's caches are as before the step")
            raise
        except RuntimeError:
            self._restore_dsa_rows(saved)
            raise
        for Ls, j in pending:                                      # every launch was clean: commit the step
            for L in Ls:
                commit_rank_state(cfg, c.kda_state, c.conv_window, sl, j, L.S_out[:B], L.W_out[:B], L.tp_rank, T)
        c.lengths[sl] += 1
        return logits.float()

    def _save_dsa_rows(self, sl, pos) -> list:
        """Copies of the DSA cache rows this step may write, for every row's slot (see the module note)."""
        c, kp = self.caches, self.cfg.index_kpool
        out = []
        for s, p in zip(sl.tolist(), pos.tolist()):
            out.append((s, p, c.latent[s, :, p].clone(), c.pool_keys[s, :, p // kp].clone(),
                        c.tail_rows[s, :, p % kp].clone()))
        return out

    def _restore_dsa_rows(self, saved) -> None:
        c, kp = self.caches, self.cfg.index_kpool
        for s, p, lat, pk, tr in saved:
            c.latent[s, :, p] = lat
            c.pool_keys[s, :, p // kp] = pk
            c.tail_rows[s, :, p % kp] = tr

    # ------------------------------------------------------------------ input checks (before any launch)
    def _as_ids(self, name, t, dtype, B=None) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: a torch.Tensor of {str(dtype)[6:]}, got {type(t).__name__}")
        if t.dtype != dtype:
            raise ValueError(f"{name}: dtype {str(t.dtype)[6:]}, expected {str(dtype)[6:]}")
        if t.dim() != 1 or (B is not None and t.shape[0] != B):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [{'B' if B is None else B}]")
        if t.device.type not in ("cpu", self.device.type):
            raise ValueError(f"{name}: on {t.device}, expected cpu or {self.device}")
        return t.cpu()

    def _check_decode(self, input_ids, positions, slots):
        ids = self._as_ids("input_ids", input_ids, torch.int64)
        B = ids.shape[0]
        if B == 0:
            raise ValueError("input_ids: empty batch (B = 0)")
        pos = self._as_ids("positions", positions, torch.int64, B)
        sl = self._as_ids("slots", slots, torch.int32, B)
        V = self.cfg.vocab_size
        bad = [int(t) for t in ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"input_ids {bad[:8]}: outside [0, vocab_size={V})")
        s_list = sl.tolist()
        lengths = self.caches.lengths.cpu()           # one copy, not one device read a row
        for s in s_list:
            if not 0 <= s < self.max_slots:
                raise ValueError(f"slots: {s} outside [0, max_slots={self.max_slots})")
            if not self.active[s]:
                raise ValueError(f"slots: slot {s} is not active (prefill it first; released slots stay free)")
        if len(set(s_list)) != B:
            raise ValueError(f"slots {s_list}: a slot appears twice in one step")
        for i, (p, s) in enumerate(zip(pos.tolist(), s_list)):
            if p < 0:
                raise ValueError(f"positions[{i}]={p}: negative")
            if p >= self.max_len:
                raise ValueError(f"positions[{i}]={p}: >= max_len={self.max_len}")
            n = int(lengths[s])
            if p != n:
                raise ValueError(f"positions[{i}]={p}: slot {s} holds {n} tokens, so its next position is {n}")
        dev = self.device
        return ids.to(dev), pos.to(dev), sl.to(torch.int64).to(dev)

    def _parse_fault(self, spec):
        if spec is None:
            return None
        from .runner import parse_fault
        kind, site = parse_fault(spec)
        names = self._sites(kind)
        if site.isdigit():
            if int(site) >= len(names):
                raise ValueError(f"inject_fault {spec!r}: {kind} has {len(names)} wait sites (0-{len(names) - 1})")
            site = names[int(site)]
        if site not in names:
            raise ValueError(f"inject_fault {spec!r}: {kind} has no wait site {site!r}; sites: {names}")
        return [kind, site]                                       # a list: used up by its first launch

    def _sites(self, kind: str) -> list[str]:
        b = self.builds[self.widths[0]]
        if kind == "tail":
            return list(b["tail"].sites)
        for L in b["layers"].values():
            if L.kind == kind:
                return list(L.sites)
        raise ValueError(f"inject_fault: no {kind!r} launch in this model")

    @staticmethod
    def _take_fault(fault, kind):
        if fault is not None and fault[0] == kind and fault[1] is not None:
            site, fault[1] = fault[1], None
            return site
        return None


class StepProgram:
    """One decode step of B rows on one width's builds as device work over static buffers (see the module
    note): `step_body` (captured as the step graph), then the host's check of every launch, then `commit_body`
    (the commit graph) or `restore` (eager, on a fault)."""

    def __init__(self, runner: ModelRunner, build: dict, B: int, capture: bool):
        self.r, self.build, self.B, self.capture = runner, build, B, capture
        cfg, c, dev = runner.cfg, runner.caches, runner.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.ids, self.pos = torch.zeros(B, **i64), torch.zeros(B, **i64)
        self.slots = torch.arange(B, **i64)                       # capture-time values: empty slots 0..B-1
        self.layers = [(p, build["layers"][p.index]) for p in cfg.layers]
        self.launches = [L for _, L in self.layers] + [build["tail"]]
        nj = len(cfg.kda_layers)
        self.S = torch.zeros((nj, B) + tuple(c.kda_state.shape[2:]), dtype=c.kda_state.dtype, device=dev)
        self.W = torch.zeros((nj, B) + tuple(c.conv_window.shape[2:]), dtype=c.conv_window.dtype, device=dev)
        n_att = c.latent.shape[1]
        self.save_lat = torch.zeros((B, n_att, c.latent.shape[3]), dtype=c.latent.dtype, device=dev)
        self.save_pk = torch.zeros((B, n_att, c.pool_keys.shape[3]), dtype=c.pool_keys.dtype, device=dev)
        self.save_tr = torch.zeros((B, n_att, c.tail_rows.shape[3]), dtype=c.tail_rows.dtype, device=dev)
        # every launch's error record, gathered into one buffer at the end of the step (one copy to the host
        # instead of one per launch)
        from sync import HEADER_WORDS
        self._hdrs = [L.header.reshape(-1)[:HEADER_WORDS] for L in self.launches]
        self._hdr_buf = torch.zeros(len(self.launches), HEADER_WORDS, dtype=self._hdrs[0].dtype, device=dev)
        self._bind()
        if capture:
            self._capture()

    def _bind(self) -> None:
        """The launches' host-side inputs: static buffers and the previous launch's output rows (set once; a
        graph bakes them). Positions and slots: the sparse launches' device buffers, filled in step_body."""
        r, c, B = self.r, self.r.caches, self.B
        X = None
        cpu_pos = torch.zeros(B, dtype=torch.int64)
        cpu_sl = torch.arange(B)
        for p, L in self.layers:
            if p.launch == "sparse":
                d = r._dsa_index[p.index]
                L.set_input(X, c.latent[:, d], c.pool_keys[:, d], c.tail_rows[:, d], cpu_pos, cpu_sl)
            else:
                j = r._kda_index[p.index]
                if p.launch == "embed":
                    L.set_tokens(self.ids.to(torch.int64))
                    L.set_input(None, self.S[j], self.W[j])
                else:
                    L.set_input(X, self.S[j], self.W[j])
            X = L.X_out[:B]
        self.build["tail"].set_input(X)

    def step_body(self, fault: tuple | None = None) -> None:
        """fault (uncaptured runs only; tests): (launch index in self.launches, site id) skips that publish."""
        r, c, kp = self.r, self.r.caches, self.r.cfg.index_kpool
        sl, pos = self.slots, self.pos
        self.save_lat.copy_(c.latent[sl, :, pos])
        self.save_pk.copy_(c.pool_keys[sl, :, pos // kp])
        self.save_tr.copy_(c.tail_rows[sl, :, pos % kp])
        for p, L in self.layers:
            if p.launch == "sparse":
                L.positions[: self.B].copy_(pos)
                L.slots[: self.B].copy_(sl)
            else:
                j = r._kda_index[p.index]
                if p.launch == "embed":
                    L.tokens[: self.B].copy_(self.ids)
                self.S[j].copy_(c.kda_state[sl, j])
                self.W[j].copy_(c.conv_window[sl, j])
        for i, L in enumerate(self.launches):
            L.enqueue(fault[1] if fault is not None and fault[0] == i else -1)
        torch.stack(self._hdrs, out=self._hdr_buf)

    def commit_body(self) -> None:
        r, c, B, sl = self.r, self.r.caches, self.B, self.slots
        for p, L in self.layers:
            if p.launch != "sparse":
                j = r._kda_index[p.index]
                c.kda_state[sl, j] = L.S_out[:B]
                c.conv_window[sl, j] = L.W_out[:B]
        c.lengths.index_add_(0, sl, torch.ones_like(sl))

    def restore(self) -> None:
        c, kp, sl, pos = self.r.caches, self.r.cfg.index_kpool, self.slots, self.pos
        c.latent[sl, :, pos] = self.save_lat
        c.pool_keys[sl, :, pos // kp] = self.save_pk
        c.tail_rows[sl, :, pos % kp] = self.save_tr

    def _capture(self) -> None:
        """Warm (compiles, residency checks) on the empty slots 0..B-1 at position 0, put their rows back, then
        capture the two graphs (nothing runs while capturing)."""
        self.step_body()
        torch.cuda.synchronize()
        self.restore()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.commit_body_warm()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.g_step, self.g_commit = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g_step):
            self.step_body()
        with torch.cuda.graph(self.g_commit):
            self.commit_body()

    def commit_body_warm(self) -> None:
        """commit_body's kernels once, with no effect (the indexing kernels' first use outside a capture)."""
        c, sl = self.r.caches, self.slots
        c.kda_state[sl, 0] = c.kda_state[sl, 0]
        c.conv_window[sl, 0] = c.conv_window[sl, 0]
        c.lengths.index_add_(0, sl, torch.zeros_like(sl))

    def step(self, ids, pos, sl, fault: tuple | None = None) -> torch.Tensor:
        from sync import HandoffTimeout
        if fault is not None and self.capture:
            raise ValueError("a captured step graph takes no fault (inject_fault runs the eager path)")
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.slots.copy_(sl)
        if self.capture:
            self.g_step.replay()
        else:                      # uncaptured: the launches may have run other inputs since (eager steps)
            self._bind()
            self.step_body(fault)
        from sync import read_record
        words = self._hdr_buf.cpu()
        try:
            for i, L in enumerate(self.launches):
                if read_record(words[i]).failed:
                    L.check()                          # raises the launch's HandoffTimeout (its site named)
        except HandoffTimeout as e:
            self.restore()
            e.add_note(f"ModelRunner.decode: {e.launch or 'a'} launch of a {self.B}-row step (graph program); every "
                       f"slot's caches are as before the step")
            raise
        if self.capture:
            self.g_commit.replay()
        else:
            self.commit_body()
        return self.build["tail"].logits[: self.B].float().clone()
