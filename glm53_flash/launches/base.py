"""The launch driver shared by every launch kind: graph -> schedule -> scratch -> kernel call -> errors.

A subclass declares its task graph (`build_graph`), its scratch regions (`plan_scratch`), its kernel
and the kernel's arguments for a stage range (`kernel_args`). This class then
- places the tasks (schedule.build: balanced by bytes, proved deadlock-free),
- lays out the scratch (the launch header first, then the subclass's regions; layout/),
- on the GPU, compiles once per variant and refuses a grid that cannot be co-resident
  (schedule.check_residency), then launches cooperatively,
- under TRITON_INTERPRET=1 runs the same kernel one stage per launch (programs run one after another
  there, so only a wait on an earlier stage can be satisfied), ranks interleaved for simulated TP,
- after the launch decodes the error record into `HandoffTimeout` (sync.guard).
Launch tags come from the header's device epoch (sync/header.py), so `enqueue()` needs no per-call
host state and can be captured in a CUDA graph.
"""
from __future__ import annotations

import triton

from layout import Planner
from sync import HEADER_LINES, SiteRegistry, check_record, read_record, timeout_ns
from sync.header import WAIT_CLK as H_WAIT_CLK
from sync.guard import DEFAULT_TIMEOUT_S

from .. import offline_build
from .. import schedule as sched_mod


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


WIDTHS = (1, 2, 4, 8)       # batch widths a launch is built for


def check_rank_width(kind: str, cfg, tp_rank, tp_size, width) -> None:
    """The TP degree (cfg.check_tp), this rank's index in it and the batch width, or a ValueError."""
    cfg.check_tp(tp_size)
    if not (isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ValueError(f"{kind}: tp_rank={tp_rank!r} must be in [0, tp_size={tp_size})")
    if width not in WIDTHS:
        raise ValueError(f"{kind}: width={width!r} must be one of {WIDTHS}")


def _env_flag(name: str, default: str) -> bool:
    import os
    v = os.environ.get(name, default)
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r} must be 0 or 1")
    return v == "1"


def launch_options() -> dict:
    """Launch options of every GPU kernel call of a launch (the compiled variant depends on them, so warmups
    pass the same). GLM53_COOP (default 1): cooperative, the grid is co-resident or the call fails (the
    residency check in check_resident proves it fits either way). GLM53_PDL (default 0): Programmatic
    Dependent Launch, the next launch's CTAs start as this one's leave the SMs and run their prologue up to
    sync.device.launch_begin's griddepcontrol.wait while this one finishes, as consecutive layers of a
    decode step do (sync.device PDL_TRIGGER: when a CTA lets the next kernel start)."""
    return {"launch_cooperative_grid": _env_flag("GLM53_COOP", "1"), "launch_pdl": _env_flag("GLM53_PDL", "0")}


class Launch:
    kind = "base"
    num_warps = 4
    default_ctas_per_sm = 1     # grid=None on the GPU: this many CTAs per SM (check_resident refuses a misfit)

    def __init__(self, *, grid: int | None, device, timeout_s: float = DEFAULT_TIMEOUT_S, tag_stride: int = 1,
                 tag_offset: int = 0, bump: bool = True):
        import torch

        self.device = torch.device(device if device is not None else ("cpu" if interpreting() else "cuda"))
        if self.device.type != "cpu" and interpreting():
            raise ValueError(f"{self.kind}: device={self.device} but TRITON_INTERPRET=1 runs on the CPU")
        if self.device.type == "cpu" and not interpreting() and not offline_build.active():
            raise ValueError(f"{self.kind}: device=cpu needs TRITON_INTERPRET=1 (set before importing kernels)")
        if grid is None:
            grid = 4 if interpreting() else sched_mod.device_sm_count(self.device) * self.default_ctas_per_sm
        if not isinstance(grid, int) or isinstance(grid, bool) or grid < 1:
            raise ValueError(f"{self.kind}: grid={grid!r} must be a positive integer")
        if not (isinstance(tag_stride, int) and tag_stride >= 1 and isinstance(tag_offset, int)
                and 0 <= tag_offset < tag_stride):
            raise ValueError(f"{self.kind}: tag_stride={tag_stride!r}, tag_offset={tag_offset!r}: need "
                             f"0 <= tag_offset < tag_stride")
        self.grid = grid
        self.timeout_s = timeout_s
        self.tag_stride, self.tag_offset, self.bump = tag_stride, tag_offset, bool(bump)
        self._resident: dict = {}
        self.trace_buf = None             # int64 [table rows + grid, 8] when tracing (enable_trace)

    # ------------------------------------------------------------------ subclass hooks
    def build_graph(self) -> sched_mod.TaskGraph:
        raise NotImplementedError

    def plan_scratch(self, planner: Planner) -> None:
        raise NotImplementedError

    def kernel(self):
        raise NotImplementedError

    def kernel_args(self, stage_lo: int, stage_hi: int, bump: int, fault_site: int) -> tuple[tuple, dict]:
        """(positional args, constexpr kwargs) of one kernel call over stages [stage_lo, stage_hi)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
        """Call at the end of the subclass's __init__, once its fields exist."""
        graph = self.build_graph()
        self.schedule = sched_mod.build(graph, self.grid)
        self.sites = SiteRegistry(self.schedule.sites)
        pl = Planner(self.kind)
        pl.header("hdr", HEADER_LINES)
        pl.rows("wait_clk", (self.grid, 4), "int64")     # the trace's per-CTA clock slots (sync/header.py WAIT_CLK)
        self.plan_scratch(pl)
        self.layout = pl.build()
        self.scratch = self.layout.alloc(self.device)
        table, starts = self.schedule.table()
        self.table = table.to(self.device)
        self.starts = starts.to(self.device)
        self.n_stages = len(self.schedule.stage_names)

    # ------------------------------------------------------------------ tracing
    def enable_trace(self, on: bool = True) -> None:
        """Kernels that support it (the layer kinds) record for every task, in row = its table row, its
        (start, end) %globaltimer ns and the %clock64 cycles from its start to the end of its last wait, to
        its end and to its marks (sync.device.trace_mark, GLM53_TRACE_MARKS=1); every CTA's whole run goes
        in row n_tasks + pid (launches/trace.py reads them). The waits find the per-CTA clock slots through
        the header's WAIT_CLK word, set here (0: off). A different build of the kernel (TRACE is a
        constexpr): off, the kernel has no trace code."""
        import torch
        n = int(self.starts[-1]) + self.grid
        self.trace_buf = torch.full((n, 8), -1, dtype=torch.int64, device=self.device) if on else None
        hdr, clk = self.layout["hdr"], self.layout["wait_clk"]
        self.scratch[hdr.offset // 4 + H_WAIT_CLK] = (clk.offset - hdr.offset) // 4 if on else 0

    def trace_args(self) -> tuple:
        """(trace buffer, TRACE) for kernel_args: a 2-word dummy when not tracing (never touched)."""
        import torch
        if self.trace_buf is None:
            if getattr(self, "_no_trace", None) is None:
                self._no_trace = torch.zeros(2, dtype=torch.int64, device=self.device)
            return self._no_trace, False
        return self.trace_buf, True

    @property
    def header(self):
        return self.layout.view(self.scratch, "hdr")

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, v: float) -> None:
        self._timeout_ns = timeout_ns(v)       # validates
        self._timeout_s = float(v)

    def fault_id(self, inject_fault: str | None) -> int:
        return -1 if inject_fault is None else self.sites.id(inject_fault)

    # ------------------------------------------------------------------ launching
    def spans(self, stagewise: bool | None = None) -> list[tuple[int, int]]:
        if stagewise is None:
            stagewise = interpreting()
        return [(s, s + 1) for s in range(self.n_stages)] if stagewise else [(0, self.n_stages)]

    def enqueue_span(self, lo: int, hi: int, bump: bool, fault_site: int = -1) -> None:
        args, const = self.kernel_args(lo, hi, int(bump and self.bump), fault_site)
        kw = dict(const, num_warps=self.num_warps)
        k = self.kernel()
        if not interpreting():
            kw.update(launch_options())
            if offline_build.active():           # no GPU here: compile into the cache, launch nothing
                k.warmup(*args, grid=(self.grid,), **kw)
                return
            key = tuple(sorted(const.items()))
            if key not in self._resident:
                self._resident[key] = self.check_resident(k, args, kw)
        k[(self.grid,)](*args, **kw)

    def check_resident(self, k, args, kw) -> dict:
        """Compile (cached) and refuse a grid that cannot be resident at once."""
        ck = k.warmup(*args, grid=(self.grid,), **kw)
        res = sched_mod.kernel_resources(ck)
        cap = sched_mod.check_residency(self.kind, self.grid, n_regs=res["n_regs"], num_warps=res["num_warps"],
                                        shared=res["shared"], n_sm=sched_mod.device_sm_count(self.device))
        return dict(res, max_ctas=cap)

    def enqueue(self, fault_site: int = -1, stagewise: bool | None = None) -> None:
        """Enqueue one logical launch (no sync, no check): CUDA-graph capturable on the GPU."""
        spans = self.spans(stagewise)
        for i, (lo, hi) in enumerate(spans):
            self.enqueue_span(lo, hi, i == len(spans) - 1, fault_site)

    def check(self):
        """Raise HandoffTimeout if the latest launch recorded a timeout; returns the header record."""
        return check_record(self.header, self.sites, self.kind)

    def record(self):
        return read_record(self.header)

    def canaries(self) -> list[str]:
        return self.layout.check_canaries(self.scratch)


def run_interleaved(launches: list[Launch], fault_sites: list[int] | None = None) -> None:
    """Simulated TP on the CPU: stage s of every rank, then stage s + 1 (ranks in order), then check all.

    Each rank's launch must already hold its inputs (kernel_args reads them). Raises the first rank's
    HandoffTimeout after all ranks ran."""
    n = {L.n_stages for L in launches}
    if len(n) != 1:
        raise ValueError(f"ranks disagree on the stage count: {sorted(n)}")
    n_stages = n.pop()
    faults = fault_sites or [-1] * len(launches)
    for s in range(n_stages):
        for L, f in zip(launches, faults):
            L.enqueue_span(s, s + 1, s == n_stages - 1, f)
    errors = []
    for L in launches:
        try:
            L.check()
        except Exception as e:       # HandoffTimeout; keep checking the other ranks' records
            errors.append(e)
    if errors:
        raise errors[0]
