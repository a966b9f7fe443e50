"""Task graph -> per-CTA task table, and the proofs that a launch of it cannot hang.

A launch kind declares stages of tasks; a task names its family, a few int arguments, the scratch
regions it waits on (`reads`) and publishes (`writes`), and the bytes it reads (for balance). Here:
- placement: stage by stage, pinned tasks first, then the rest largest-first onto the CTA with the
  least of this stage's cost so far, then the one whose last task is of the earliest stage (free soonest:
  a join task's bytes say nothing of its wait), then the least cost over all stages, then the lower CTA. A task
  costs its bytes plus TASK_COST_FLOOR (its waits, signals and dependent loads take time whatever it
  reads): a stage's small tasks spread over distinct CTAs instead of queueing on the few CTAs with the
  fewest bytes (a measured 4-5 hc_post tasks of ~10 us in a row on one CTA, 26 peer stores on another,
  traced on the H200). Deterministic; each stage balanced on its own, since stages are sequential;
- the table: one int32 row of TASK_WORDS per task, CTA programs concatenated, `starts[cta]` indexes;
- the wait sites: one per region that some task waits on, numbered in schedule order (stage of the
  first reader, then first-reader order); its producers publish with the same number;
- `prove()`: dependency edges (every writer of a region -> every reader) go to a strictly later
  stage (CPU mode runs one launch per stage), and dependency edges plus each CTA's program order form
  a DAG (on the GPU all CTAs run at once; a cycle is a deadlock);
- `check_residency()`: the grid fits on the GPU at once (registers, shared memory, warps per SM),
  since a spinning CTA that waits for an unscheduled one never finishes. Launch cooperatively too.
Nothing here imports a kernel; launches compose it with layout/ and sync/.
"""
from __future__ import annotations

import heapq
import math
import os
from dataclasses import dataclass, field

TASK_WORDS = 8          # family, stage, a0..a5
MAX_ARGS = TASK_WORDS - 2
TASK_COST_FLOOR = 64 * 1024     # bytes-equivalent of a task's fixed time: ~2 us of one SM's share of HBM


# ---------------------------------------------------------------------- split-K of weight-streaming stages
# A GEMV task's time is its K steps times a step's cost, and one CTA streams only a share of the chip's
# bandwidth, so a stage of few tiles must also split K (DESIGN.md §5 "every stage on every SM"). The
# split is chosen for a NOMINAL grid, never the launch's own: the partial planes join in a fixed order
# whose count must not depend on the grid, or a row's bits would (grid invariance, tests/test_launch_*).
NOMINAL_GRID = 264              # CTAs of a KDA-family launch on a 132-SM H100 / H200 (2 per SM)
CHIP_BW = 4.4e6                 # bytes per us: the H200's measured streaming read bandwidth
CTA_BW = 30e3                   # bytes per us one CTA streams alone (>= 48 KB in flight; DESIGN.md §5)
TASK_US = 1.0                   # a task's fixed cost: pipeline fill, its wait and publish (us)
MAX_K_SPLIT = 16


def stage_time_us(n_tasks: int, task_bytes: float, grid: int = NOMINAL_GRID) -> float:
    """Model of a weight-streaming stage of n_tasks equal tasks: whole waves over the grid, each task
    streaming at the busy CTAs' share of the chip's bandwidth (at most one CTA's own rate)."""
    waves = -(-n_tasks // grid)
    bw = min(CHIP_BW / min(n_tasks, grid), CTA_BW)
    return waves * (task_bytes / bw + TASK_US)


def choose_k_split(n_tiles: int, k_steps: int, step_bytes: int, *, max_split: int = MAX_K_SPLIT) -> int:
    """K slices per output tile (a power of two dividing k_steps, <= max_split) that minimise
    stage_time_us on the nominal grid; ties to the smaller split (fewer planes to join). Depends only on
    the stage's shape, so every grid and width gets the same bits. E.g. (measured shapes, bf16, 64 x 128
    steps of 16 KB): KDA in_proj TP8 53 tiles x 32 steps -> 4; TP1 389 tiles -> 2."""
    best, best_t = 1, stage_time_us(n_tiles, k_steps * step_bytes)
    s = 2
    while s <= max_split and k_steps % s == 0:
        t = stage_time_us(n_tiles * s, k_steps * step_bytes / s)
        if t < best_t - 1e-9:
            best, best_t = s, t
        s *= 2
    return best


FILLER_LATE = 4 * TASK_COST_FLOOR   # a late CTA takes fillers only once the early ones hold ~4 each (build)
JOIN_US = 2.0                   # a join stage's extra hop (the partials' wait, the join, its publish)


def choose_groups(n_tiles: int, n_parts: int, part_bytes: int, max_groups: int | None = None) -> int:
    """Groups (a divisor of n_parts, <= max_groups) to split each tile's n_parts equal K parts into (e.g. a MoE
    down tile's K + 1 expert GEMVs, or a GEMV's K steps), joined by a later stage in group order: stage_time_us
    plus JOIN_US for a split, minimised on the nominal grid; shapes only, as choose_k_split. KDA TP1 moe_down
    (64 tiles x 9 x 256 KB): 3; TP8 (9 x 32 KB): 3. Dense down (64 tiles x 96 / 12 steps of 16 KB): 3 at TP 1
    and TP 8 (used at TP 1 only); o_proj at TP 1 (64 x 64 steps): 4."""
    best, best_t = 1, stage_time_us(n_tiles, n_parts * part_bytes)
    for d in range(2, min(n_parts, max_groups or n_parts) + 1):
        if n_parts % d == 0:
            t = stage_time_us(n_tiles * d, n_parts * part_bytes / d) + JOIN_US
            if t < best_t - 1e-9:
                best, best_t = d, t
    return best


class ScheduleError(ValueError):
    """The task graph cannot be scheduled safely on this grid (cycle, bad stage order, too big)."""


@dataclass(frozen=True)
class Task:
    id: int
    stage: int
    family: str
    args: tuple[int, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    nbytes: int
    cta: int | None             # pinned CTA, or None
    clear: int = 0              # stages before its own that its CTA runs nothing new in (TaskGraph.add)
    filler: bool = False        # add(filler=True) under FILLER_EARLY: placed by build()'s filler rule

    def label(self, cta: int | None = None) -> str:
        c = self.cta if cta is None else cta
        return f"task#{self.id} {self.family}{list(self.args)} (stage {self.stage}, CTA {c})"


class TaskGraph:
    """Stages of tasks of named families; families map to the kernel's integer codes."""

    def __init__(self, kind: str, families: dict[str, int] | list[str]):
        self.kind = kind
        self.families = dict(families) if isinstance(families, dict) else {f: i for i, f in enumerate(families)}
        self.stage_names: list[str] = []
        self.tasks: list[Task] = []

    def stage(self, name: str) -> int:
        """Open a new stage; following `add` calls go into it. Returns its index."""
        self.stage_names.append(name)
        return len(self.stage_names) - 1

    def add(self, family: str, args=(), *, reads=(), writes=(), nbytes: int = 0, cta: int | None = None,
            clear: int = 0, filler: bool = False, stage: int | None = None) -> Task:
        """clear = n: the task gets a CTA of its own choosing (the highest not yet taken so) that is given no task of
        the n stages before the task's stage, so it is free by the end of its last earlier task, not behind a join
        of those stages: for a latency-critical task whose dry run (ffn.WARM_CODE) must end before its input
        arrives. Skipped on grids too small to spare the CTAs (CPU).
        filler: a task that waits on nothing and is not worth a CTA's balance (the loopback peers' stores): placed
        after its stage's other tasks, never behind a task of its own stage (one that waits: what waits on the
        filler's output would wait for that task too), behind one of the stage before only once the other CTAs
        hold FILLER_LATE each, balanced by this stage's cost (build). Only
        under FILLER_EARLY (GLM53_SCHED_FILLER=1, off by default: measured, no gain); else an ordinary task.
        stage: an earlier stage (an index `stage()` returned) to add the task to instead of the current one."""
        if not self.stage_names:
            raise ScheduleError(f"{self.kind}: add({family!r}) before any stage() call")
        if family not in self.families:
            raise ScheduleError(f"{self.kind}: unknown task family {family!r}; known {sorted(self.families)}")
        args = tuple(int(a) for a in args)
        if len(args) > MAX_ARGS:
            raise ScheduleError(f"{self.kind}: task {family!r} has {len(args)} args, at most {MAX_ARGS}")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ScheduleError(f"{self.kind}: task {family!r} nbytes={nbytes!r} must be an int >= 0")
        if not isinstance(clear, int) or clear < 0 or (clear and cta is not None):
            raise ScheduleError(f"{self.kind}: task {family!r} clear={clear!r} must be an int >= 0, unpinned")
        if filler and (reads or cta is not None or clear):
            raise ScheduleError(f"{self.kind}: filler task {family!r} must wait on nothing and be unpinned, unclear")
        cur = len(self.stage_names) - 1
        if stage is not None and not (isinstance(stage, int) and 0 <= stage <= cur):
            raise ScheduleError(f"{self.kind}: task {family!r} stage={stage!r} must be an opened stage (0..{cur})")
        t = Task(len(self.tasks), cur if stage is None else stage, family, args, tuple(reads), tuple(writes), nbytes, cta,
                 clear, bool(filler) and FILLER_EARLY)
        self.tasks.append(t)
        return t

    def sites(self) -> list[str]:
        """Wait-site names `<kind>.<region>` in schedule order (a region some task waits on)."""
        out: list[str] = []
        for t in sorted(self.tasks, key=lambda t: (t.stage, t.id)):
            for r in t.reads:
                name = f"{self.kind}.{r}"
                if name not in out:
                    out.append(name)
        return out


@dataclass
class Schedule:
    kind: str
    grid: int
    tasks: list[Task]
    programs: list[list[int]]            # task ids per CTA, in execution order
    families: dict[str, int]
    stage_names: list[str]
    sites: list[str]
    bytes_per_cta: list[int] = field(default_factory=list)

    def site_id(self, region: str) -> int:
        """Number of the wait site guarding `region` (-1 if no task waits on it)."""
        name = f"{self.kind}.{region}"
        return self.sites.index(name) if name in self.sites else -1

    def table(self):
        """(table int32 [n_tasks, TASK_WORDS], starts int32 [grid + 1]) as torch CPU tensors."""
        import torch

        rows, starts = [], [0]
        for prog in self.programs:
            for tid in prog:
                t = self.tasks[tid]
                rows.append([self.families[t.family], t.stage, *t.args] + [0] * (MAX_ARGS - len(t.args)))
            starts.append(len(rows))
        if not rows:
            rows = [[-1] + [0] * (TASK_WORDS - 1)]
        return torch.tensor(rows, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)

    def cta_of(self) -> dict[int, int]:
        return {tid: c for c, prog in enumerate(self.programs) for tid in prog}

    def describe(self) -> str:
        lines = [f"schedule {self.kind}: grid {self.grid}, {len(self.tasks)} tasks, sites {self.sites}"]
        for c, prog in enumerate(self.programs):
            fams = [f"{self.tasks[t].family}{list(self.tasks[t].args)}" for t in prog]
            lines.append(f"  CTA {c:3d} {self.bytes_per_cta[c]:>12d} B  {' '.join(fams)}")
        return "\n".join(lines)


def _check_grid(kind: str, grid) -> None:
    if not isinstance(grid, int) or isinstance(grid, bool) or grid < 1:
        raise ScheduleError(f"{kind}: grid={grid!r} must be a positive integer")


def task_cost(t: Task) -> int:
    """Placement cost of a task: its bytes plus the fixed TASK_COST_FLOOR."""
    return t.nbytes + TASK_COST_FLOOR


def build(graph: TaskGraph, grid: int) -> Schedule:
    """Place every task on a CTA (each stage balanced by task cost, see the module note) and prove it."""
    _check_grid(graph.kind, grid)
    load = [0] * grid                                   # cost over all stages so far
    last = [-1] * grid                                  # stage of the CTA's last task (-1: none yet)
    programs: list[list[int]] = [[] for _ in range(grid)]
    cta_of, cleared = _clear_ctas(graph, grid)
    for s in range(len(graph.stage_names)):
        stage = [t for t in graph.tasks if t.stage == s]
        here = [0] * grid                               # this stage's cost
        for t in stage:
            c = t.cta if t.cta is not None else cta_of.get(t.id)
            if c is not None:
                if not 0 <= c < grid:
                    raise ScheduleError(f"{graph.kind}: {t.label()} is pinned outside grid {grid}")
                programs[c].append(t.id)
                here[c] += task_cost(t)
                load[c] += task_cost(t)
                last[c] = s
        free = [c for c in range(grid) if s not in cleared.get(c, ())]
        heap = [_slot_key(here[c], last[c], load[c], c) for c in free]
        heapq.heapify(heap)
        rest = sorted((t for t in stage if t.cta is None and t.id not in cta_of), key=lambda t: (-t.nbytes, t.id))
        for t in (t for t in rest if not t.filler):
            c = heapq.heappop(heap)[-1]
            programs[c].append(t.id)
            here[c] += task_cost(t)
            load[c] += task_cost(t)
            last[c] = s
            heapq.heappush(heap, _slot_key(here[c], last[c], load[c], c))
        # fillers: not behind a task of this stage (it waits on the stage before: a filler would publish only when it
        # ends), then this stage's cost plus FILLER_LATE where the CTA's last task is of the stage before (likely
        # waiting too; but a few CTAs free early must not take them all: kda's 448 peer_d stores on its 8 such CTAs
        # would run ~40 us); `last` stays the CTA's last non-filler stage
        fkey = lambda c: (last[c] >= s, here[c] + (FILLER_LATE if last[c] == s - 1 else 0), last[c], load[c], c)  # noqa
        fheap = [fkey(c) for c in free]
        heapq.heapify(fheap)
        for t in (t for t in rest if t.filler):
            c = heapq.heappop(fheap)[-1]
            programs[c].append(t.id)
            here[c] += task_cost(t)
            load[c] += task_cost(t)
            heapq.heappush(fheap, fkey(c))
    return from_programs(graph, grid, programs)


def _clear_ctas(graph: TaskGraph, grid: int) -> tuple[dict[int, int], dict[int, range]]:
    """The CTAs of the tasks added with clear = n (TaskGraph.add): ({task id: CTA}, {CTA: the stages it takes no
    other task in}), the highest CTAs in task order; none where fewer than half the grid would stay for a stage."""
    want = [t for t in graph.tasks if t.clear and t.cta is None]
    if not want or 2 * len(want) > grid:
        return {}, {}
    cta_of = {t.id: grid - 1 - i for i, t in enumerate(want)}
    return cta_of, {grid - 1 - i: range(max(t.stage - t.clear, 0), t.stage) for i, t in enumerate(want)}


def _slot_key(here: int, last: int, load: int, c: int) -> tuple:
    """Which CTA takes a stage's next task: the least of this stage's cost, then (EARLY_FREE) the CTA whose last
    task is of the earliest stage, i.e. the one likely free soonest, then the least cost over all stages, then
    the lower CTA. Bytes alone rank a CTA behind a join task (an mHC gate row: 8 KB, but it waits for all 64
    partial slots and ends ~10 us in) as idle. It matters for latency-bound stages: sparse's hist task no longer
    starts after its input, with its prologue on the path (-4.6 to -6.6 us, H100, 2026-12-05); a bandwidth-bound
    stage (kda in_proj) ends with its stream wherever its last tile starts (no change)."""
    return (here, last, load, c) if EARLY_FREE else (here, load, c)


EARLY_FREE = os.environ.get("GLM53_SCHED_EARLY_FREE", "1") != "0"   # A/B knob (timings); 1 = the default
# A/B knob, default off: GLM53_SCHED_FILLER=1 places fillers by the rule in build(). Measured (H100, nineteenth
# session, with kda's peer_d in the route stage): kda 89.76 / 91.00 us against 89.82 / 89.79, sparse +1.1 / +2.2,
# kda 8 rows +1.8, dense -1.1, nextn -0.2; the trace's critical path no longer holds a peer store, yet the timed
# launches did not move: the loopback peers' placement is not what bounds them.
FILLER_EARLY = os.environ.get("GLM53_SCHED_FILLER", "0") == "1"


def from_programs(graph: TaskGraph, grid: int, programs: list[list[int]]) -> Schedule:
    """A schedule with explicit per-CTA programs (hand-made schedules, tests); proved before returned."""
    _check_grid(graph.kind, grid)
    if len(programs) != grid:
        raise ScheduleError(f"{graph.kind}: {len(programs)} programs for grid {grid}")
    seen = sorted(t for p in programs for t in p)
    if seen != list(range(len(graph.tasks))):
        raise ScheduleError(f"{graph.kind}: programs must hold every task exactly once")
    load = [sum(graph.tasks[t].nbytes for t in p) for p in programs]
    sched = Schedule(graph.kind, grid, list(graph.tasks), [list(p) for p in programs], dict(graph.families),
                     list(graph.stage_names), graph.sites(), load)
    prove(sched)
    return sched


def _dependency_edges(tasks: list[Task]) -> list[tuple[int, int, str]]:
    writers: dict[str, list[int]] = {}
    for t in tasks:
        for r in t.writes:
            writers.setdefault(r, []).append(t.id)
    edges = []
    for t in tasks:
        for r in t.reads:
            for w in writers.get(r, []):
                edges.append((w, t.id, r))
    return edges


def prove(sched: Schedule) -> None:
    """Refuse a schedule that can deadlock: a cycle of waits and program order, or a wait on a region
    written in the same or a later stage (CPU mode runs one launch per stage)."""
    tasks = sched.tasks
    cta = sched.cta_of()
    deps = _dependency_edges(tasks)
    succ: dict[int, list[tuple[int, str]]] = {t.id: [] for t in tasks}
    for a, b, r in deps:
        succ[a].append((b, f"waits on {r!r} written by"))
    for prog in sched.programs:
        for a, b in zip(prog, prog[1:]):
            succ[a].append((b, "runs after"))
    # iterative DFS for a cycle (white/grey/black), reported as the chain of tasks
    color = {t.id: 0 for t in tasks}
    parent: dict[int, tuple[int, str]] = {}
    for root in sorted(color):
        if color[root]:
            continue
        stack = [(root, iter(succ[root]))]
        color[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = 2
                stack.pop()
                continue
            v, why = nxt
            if color[v] == 0:
                color[v] = 1
                parent[v] = (node, why)
                stack.append((v, iter(succ[v])))
            elif color[v] == 1:
                # back edge node -> v closes the cycle v -> ... -> node -> v; walk it via the parents
                steps = [f"{tasks[v].label(cta[v])} {why} {tasks[node].label(cta[node])}"]
                u = node
                while u != v:
                    p, w = parent[u]
                    steps.append(f"{tasks[u].label(cta[u])} {w} {tasks[p].label(cta[p])}")
                    u = p
                raise ScheduleError(f"{sched.kind}: schedule can deadlock, cycle of waits and program order: "
                                    + "; ".join(reversed(steps)))
    for a, b, r in deps:
        if tasks[a].stage >= tasks[b].stage:
            raise ScheduleError(f"{sched.kind}: {tasks[b].label(cta[b])} waits on {r!r} written by "
                                f"{tasks[a].label(cta[a])} in the same or a later stage (CPU mode runs stage "
                                f"by stage, so it would wait forever)")


# ---------------------------------------------------------------------- residency
H100_LIMITS = dict(regs_per_sm=65536, smem_per_sm=228 * 1024, max_warps_per_sm=64, max_ctas_per_sm=32,
                   reg_alloc=256, smem_reserved=1024)


def max_resident_ctas(n_regs: int, num_warps: int, shared: int, n_sm: int, *, regs_per_sm=65536,
                      smem_per_sm=228 * 1024, max_warps_per_sm=64, max_ctas_per_sm=32, reg_alloc=256,
                      smem_reserved=1024) -> int:
    """CTAs that fit on the device at once (Hopper rules; equals cuOccupancy... per research/triton.md §5)."""
    regs_per_warp = math.ceil(max(n_regs, 1) * 32 / reg_alloc) * reg_alloc
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_warps = max_warps_per_sm // num_warps
    by_smem = smem_per_sm // (math.ceil((shared + smem_reserved) / 128) * 128)
    return n_sm * max(0, min(max_ctas_per_sm, by_regs, by_warps, by_smem))


def check_residency(kind: str, grid: int, *, n_regs: int, num_warps: int, shared: int, n_sm: int, **limits) -> int:
    """Raise ScheduleError unless all `grid` CTAs can be resident at once; returns the maximum."""
    cap = max_resident_ctas(n_regs, num_warps, shared, n_sm, **limits)
    if grid > cap:
        raise ScheduleError(f"{kind}: grid of {grid} CTAs cannot be resident at once: the kernel uses {n_regs} "
                            f"registers x {num_warps} warps and {shared} B shared memory, so at most {cap} CTAs "
                            f"fit on {n_sm} SMs")
    return cap


def kernel_resources(compiled) -> dict:
    """n_regs / n_spills / shared / num_warps of a compiled Triton kernel (loads its module if needed)."""
    from . import offline_build
    if getattr(compiled, "n_regs", None) is None and offline_build.active():     # compiled for a GPU not here
        return offline_build.kernel_resources(compiled)
    if getattr(compiled, "n_regs", None) is None:
        compiled._init_handles()
    return {"n_regs": compiled.n_regs, "n_spills": compiled.n_spills, "shared": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps}


def device_sm_count(device) -> int:
    import torch

    from . import offline_build
    if offline_build.active():                  # building for a GPU this machine does not have
        return offline_build.sm_count()

    return torch.cuda.get_device_properties(device).multi_processor_count
