"""The model runner: one decode step = the launch plan of the config, each launch kind run by its
persistent Triton launch where one exists and by the torch reference otherwise.

Owns the per-slot caches and the retry policy. Every launch is all-or-nothing (a faulted launch leaves
caches and state as they were), so a launch that raises HandoffTimeout is reported and simply run again
with the same inputs; the step then ends exactly as it would have without the fault.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .checkpoint import load_checkpoint
from .config import GlmConfig
from .reference.model import ReferenceModel


# launch kinds this runner drives as kernels when they exist (the rest of a step runs on the reference)
DRIVEN_KINDS = ("tail", "embed", "dense", "kda", "sparse")
# run as kernels unless `kinds` says otherwise: the kinds whose launches passed their GPU tests at the
# runner's TP 1 (bench/RESULTS.md; the MTP block is not driven: no speculative step yet)
DEFAULT_KINDS = ("tail", "embed", "dense", "kda", "sparse")


@dataclass
class GenerateResult:
    tokens: list[int]                      # generated ids
    last_logits: torch.Tensor              # [V] fp32, logits that chose the last generated token
    prompt_logits: torch.Tensor            # [T, V] logits of the teacher-forced prompt steps
    seconds: float                         # wall time of the greedy decode steps
    faults: list[str] = field(default_factory=list)   # HandoffTimeout messages seen (and retried)
    paths: dict[str, str] = field(default_factory=dict)  # launch kind -> "kernel" | "reference"


def parse_fault(spec: str | None) -> tuple[str, str] | None:
    """`KIND:SITE` -> (kind, site); SITE is a site's name or its number in `sites --launch KIND`."""
    if spec is None:
        return None
    kind, sep, site = spec.partition(":")
    if not sep or not kind or not site:
        raise ValueError(f"--inject-fault {spec!r}: expected KIND:SITE, e.g. tail:<site> "
                         f"(list sites with `python -m glm53_flash sites --launch KIND`)")
    return kind, site


class Runner:
    """Greedy decode of one request on the reference + whatever launch kinds exist."""

    def __init__(self, checkpoint: str, device: str = "cpu", path: str = "auto", max_len: int = 4096,
                 log=print, kinds: list[str] | None = None):
        """kinds: with path="auto", the launch kinds to run as kernels (default: every kind that exists)."""
        if path not in ("auto", "reference"):
            raise ValueError(f"path={path!r}: expected 'auto' or 'reference'")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available on this machine")
        self.device, self.path, self.log = device, path, log
        self.ckpt = load_checkpoint(checkpoint, progress=False)
        self.cfg: GlmConfig = self.ckpt.config
        if max_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        self.max_len = max_len
        self.ref = ReferenceModel(self.cfg, self.ckpt.dequantized(), device=device)
        self.kernels = {}
        # after-launch hooks: hook(kind, launch, outputs: dict, reference: dict) (check.py's MONO_CHECK)
        self.hooks = []
        self.layer_kernels = {}      # layer index -> launch (one launch per layer: it holds that layer's weights)
        if path == "auto":
            from .launches import available, build_launch
            unknown = sorted(set(kinds or ()) - set(available()))
            if unknown:
                raise ValueError(f"kernels {unknown} do not exist; launch kinds with kernels: {available()}")
            undriven = sorted(set(kinds or ()) - set(DRIVEN_KINDS))
            if undriven:
                raise ValueError(f"kernels {undriven} exist but the runner does not drive them yet; "
                                 f"it drives {list(DRIVEN_KINDS)}")
            wanted = DEFAULT_KINDS if kinds is None else kinds
            driven = [k for k in available() if k in DRIVEN_KINDS and k in wanted]
            for p in self.cfg.layers:
                if p.launch in driven:
                    extra = dict(max_len=max_len) if p.launch == "sparse" else {}
                    self.layer_kernels[p.index] = build_launch(p.launch, self.ckpt, device=device, layer=p.index,
                                                               **extra)
                    self.kernels.setdefault(p.launch, self.layer_kernels[p.index])
            if "tail" in driven:
                self.kernels["tail"] = build_launch("tail", self.ckpt, device=device)

    @property
    def paths(self) -> dict[str, str]:
        kinds = dict.fromkeys(self.cfg.launch_plan)
        kinds.pop("nextn", None)   # the runner drives the trunk; the MTP block is a separate step
        return {k: ("kernel" if k in self.kernels else "reference") for k in kinds}

    # ------------------------------------------------------------------ one step
    def _run_launch(self, kind: str, fn, fault: tuple[str, str] | None, faults: list[str]):
        """Run one launch; on a HandoffTimeout report it and run the launch again without the fault."""
        from sync import HandoffTimeout
        site = fault[1] if fault is not None and fault[0] == kind else None
        try:
            return fn(site)
        except HandoffTimeout as e:
            msg = f"HandoffTimeout in {kind} launch: {e}"
            faults.append(msg)
            self.log(msg + " -- retrying the launch", file=sys.stderr)
            return fn(None)

    def step(self, caches, token: int, pos: int, fault=None, faults=None) -> tuple[torch.Tensor, int]:
        """One decode step of slot 0: returns (logits [V] fp32, greedy next id). `fault` = (kind, site) is
        injected into the first launch of that kind in this step."""
        faults = [] if faults is None else faults
        fault = [fault]                                                  # one-shot within the step
        tokens = torch.tensor([token], dtype=torch.long, device=self.device)
        positions = torch.tensor([pos], dtype=torch.long, device=self.device)
        if not self.layer_kernels:
            X = self.ref.decode_trunk(caches, tokens, positions)        # [1, 4, H] fp32 mHC streams
        else:
            X = self._trunk(caches, tokens, positions, fault, faults)
        if "tail" in self.kernels:
            tail = self.kernels["tail"]
            logits, ids = self._launch("tail", tail, lambda site: tail.run(X, inject_fault=site), fault, faults)
            if self.hooks:
                ref = self.ref.tail(X)
                for hook in self.hooks:
                    hook("tail", tail, {"logits": logits, "ids": ids}, {"logits": ref, "ids": ref.argmax(-1)})
            return logits[0].float(), int(ids[0])
        logits = self.ref.tail(X)
        return logits[0], int(torch.argmax(logits[0]))                 # argmax: first max = lowest index

    def _launch(self, kind, launch, fn, fault: list, faults: list[str]):
        """Run one launch, injecting the pending fault if it targets this kind (then it is used up)."""
        f = fault[0]
        if f is not None and f[0] == kind:
            fault[0] = None
        return self._run_launch(kind, fn, f, faults)

    def _trunk(self, caches, tokens, positions, fault: list, faults: list[str]) -> torch.Tensor:
        """Embed + every layer, each on its launch where one exists, else on the reference; lengths
        advanced at the end (as ReferenceModel.decode_trunk). Each launch commits its layer's KDA state
        only after a clean run, so a retried launch sees the state as it was."""
        kda_index = {li: j for j, li in enumerate(self.cfg.kda_layers)}
        dsa_index = {li: d for d, li in enumerate(self.cfg.dsa_layers)}
        X = None
        for p in self.cfg.layers:
            L = self.layer_kernels.get(p.index)
            if L is None:
                if X is None:
                    X = self.ref.embed(tokens)
                X = self.ref.layer_step(caches, p.index, X, positions)
                continue
            if p.launch == "sparse":       # latent / pool-key / tail-row caches of this DSA layer, in place
                from .launches.sparse import layer_caches
                lat, pk, tr = layer_caches(caches, dsa_index[p.index])
                run = (lambda site, L=L, X=X, lat=lat, pk=pk, tr=tr:
                       L.run(X, lat, pk, tr, positions, inject_fault=site))
            else:
                j = kda_index[p.index]
                state, window = caches.kda_state[0:1, j], caches.conv_window[0:1, j]   # views: committed in place
                inp = tokens if p.launch == "embed" else X
                run = (lambda site, L=L, inp=inp, state=state, window=window:
                       L.run(inp, state, window, inject_fault=site))
            if self.hooks:   # the reference's own step of this layer, on a copy of the caches before the launch
                ref_in = self.ref.embed(tokens) if p.launch == "embed" else X
                ref_out = self.ref.layer_step(caches.clone(), p.index, ref_in, positions)
            X = self._launch(p.launch, L, run, fault, faults)
            for hook in self.hooks:
                hook(p.launch, L, {"X": X}, {"X": ref_out})
        caches.lengths[0] += 1
        return X

    def generate(self, prompt: list[int], max_new_tokens: int, inject_fault: str | None = None) -> GenerateResult:
        fault = parse_fault(inject_fault)
        if fault is not None:
            if fault[0] not in self.kernels:
                raise ValueError(f"--inject-fault {inject_fault}: launch kind {fault[0]!r} does not run as a "
                                 f"kernel here (kernel kinds: {sorted(self.kernels) or 'none'})")
            names = list(self.kernels[fault[0]].sites)
            if fault[1].isdigit():                  # the number `sites` prints beside the name
                if int(fault[1]) >= len(names):
                    raise ValueError(f"--inject-fault {inject_fault}: {fault[0]} has {len(names)} wait sites "
                                     f"(0-{len(names) - 1}): {names}")
                fault = (fault[0], names[int(fault[1])])
            if fault[1] not in names:
                raise ValueError(f"--inject-fault {inject_fault}: {fault[0]} has no wait site {fault[1]!r}; "
                                 f"sites: {names}")
        self._check_prompt(prompt, max_new_tokens)
        caches = self.ref.new_caches(1, self.max_len)
        faults: list[str] = []
        prompt_logits = []
        nxt = None
        logits = None
        for pos, tok in enumerate(prompt):                              # teacher-forced prompt
            logits, nxt = self.step(caches, tok, pos, fault, faults)
            fault = None                                                # the fault is one-shot
            prompt_logits.append(logits)
        out = [nxt]
        t0 = time.perf_counter()
        pos = len(prompt)
        while len(out) < max_new_tokens:
            logits, nxt = self.step(caches, out[-1], pos, None, faults)
            out.append(nxt)
            pos += 1
        if self.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return GenerateResult(out[:max_new_tokens], logits.cpu(), torch.stack(prompt_logits).cpu(), dt, faults,
                              self.paths)

    def _check_prompt(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("prompt is empty: give at least one token id")
        V = self.cfg.vocab_size
        bad = [t for t in prompt if not (0 <= t < V)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside [0, vocab_size={V})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_len="
                             f"{self.max_len}")
