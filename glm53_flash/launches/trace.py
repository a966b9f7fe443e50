"""Where a launch's time goes, from its trace (`Launch.enable_trace()`, then one launch).

The kernel records (start, end) %globaltimer ns for every task it ran, in the row of the task table
the task came from, and for every CTA's whole run; and per task the SM's %clock64 cycles from its start
to the end of its last wait and to its end. From that this module gives: the launch's span, per stage
the window its tasks ran in, per family the task durations split into waiting and own work, and the
critical path: from the task that ended last, step back each time to whichever finished later, the
task before it on its CTA or the last producer of a region it waits on, and show the gap before each
step (the hand-off's latency, or a CTA busy with something else). %globaltimer ticks about every
microsecond, so starts and ends are good to ~1 us (spans and paths); the wait / work split comes from
cycles, converted with each CTA's own cycles per ns over its whole run.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class TaskTime:
    task: int          # schedule task id
    cta: int
    start: int         # ns from the launch's first CTA start
    end: int
    wait: float = 0.0  # ns from the start to the end of the task's last wait (cycles / the CTA's cycles per ns)
    work: float = 0.0  # ns from the start to the end, by the same clock (work - wait: the task's own time)
    marks: tuple = ()  # ns from the start to marks 1-3 (None: not reached; GLM53_TRACE_MARKS builds only)
    sm: int = -1       # the SM its CTA ran on (-1: unknown, e.g. the interpreter)


def read(L) -> tuple[list[TaskTime], list[tuple[int, int]]]:
    """(per traced task, per CTA (start, end)), in ns from the earliest CTA start. Tasks not run (other
    stages, or after an abort) are left out."""
    buf = L.trace_buf
    if buf is None:
        raise RuntimeError(f"{L.kind}: not tracing; call enable_trace() before the launch")
    rows = buf.cpu().tolist()
    n = sum(len(p) for p in L.schedule.programs)
    ctas = rows[n: n + L.grid]
    starts = [r[0] for r in ctas if r[0] >= 0] + [r[0] for r in rows[:n] if r[0] >= 0]
    if not starts:
        raise RuntimeError(f"{L.kind}: the trace is empty (no traced launch ran since enable_trace)")
    t0 = min(starts)
    # cycles per ns of each CTA's SM, over its whole run (~100 us: the 1 us ticks cost ~1 %)
    per_ns = [r[3] / (r[1] - r[0]) if r[0] >= 0 and r[1] - r[0] > 0 and r[3] > 0 else None for r in ctas]
    known = sorted(f for f in per_ns if f)
    default = known[len(known) // 2] if known else 1.0
    out, k = [], 0
    for c, prog in enumerate(L.schedule.programs):
        f = per_ns[c] or default
        for tid in prog:
            s, e, w, d = rows[k][:4]
            if s >= 0 and e >= 0:
                out.append(TaskTime(tid, c, s - t0, e - t0, w / f, d / f,
                                    tuple(m / f if m >= 0 else None for m in rows[k][4:7]), int(rows[k][7])))
            k += 1
    return out, [(r[0] - t0, r[1] - t0) if r[0] >= 0 else (-1, -1) for r in ctas]


def critical_path(L, times: list[TaskTime]) -> list[tuple[TaskTime, str, int]]:
    """[(task, what it started after, gap ns since that ended)] from the path's first task to the task
    that ended last."""
    by_id = {t.task: t for t in times}
    tasks = L.schedule.tasks
    prev_on_cta = {}
    for prog in L.schedule.programs:
        ran = [tid for tid in prog if tid in by_id]
        for a, b in zip(ran, ran[1:]):
            prev_on_cta[b] = a
    writers: dict[str, list[int]] = {}
    for t in tasks:
        for w in t.writes:
            if t.id in by_id:
                writers.setdefault(w, []).append(t.id)
    cur = max(times, key=lambda t: (t.end, t.task))
    path, seen = [], {cur.task}
    while True:
        cands = []
        if cur.task in prev_on_cta:
            cands.append((by_id[prev_on_cta[cur.task]], "after the task before it on its CTA"))
        for r in tasks[cur.task].reads:
            if writers.get(r):
                w = max((by_id[i] for i in writers[r]), key=lambda t: (t.end, t.task))
                cands.append((w, f"after the last producer of {r!r}"))
        cands = [(t, why) for t, why in cands if t.task not in seen]
        if not cands:
            path.append((cur, "first", 0))
            break
        pred, why = max(cands, key=lambda c: (c[0].end, c[0].task))
        path.append((cur, why, cur.start - pred.end))
        seen.add(pred.task)
        cur = pred
    path.reverse()
    return path


def by_sm(times: list[TaskTime]) -> dict[int, list[TaskTime]]:
    """The traced tasks grouped by the SM they ran on (unknown SMs left out)."""
    out: dict[int, list[TaskTime]] = {}
    for t in times:
        if t.sm >= 0:
            out.setdefault(t.sm, []).append(t)
    return out


def co_resident(on_sm: dict[int, list[TaskTime]], t: TaskTime, tasks) -> list[str]:
    """Families of the other CTAs' tasks that ran on t's SM while t ran (on_sm: by_sm(times); empty when the
    SM is unknown)."""
    return sorted({tasks[o.task].family for o in on_sm.get(t.sm, ())
                   if o.cta != t.cta and o.start < t.end and o.end > t.start})


def report(L, max_path: int = 40) -> str:
    times, ctas = read(L)
    tasks, names = L.schedule.tasks, L.schedule.stage_names
    us = lambda ns: f"{ns / 1e3:8.1f}"                       # noqa: E731
    span = max(e for _, e in ctas if e >= 0) if any(e >= 0 for _, e in ctas) else max(t.end for t in times)
    lines = [f"{L.kind}: {len(times)} tasks traced on {L.grid} CTAs, launch span {span / 1e3:.1f} us "
             f"(from the first CTA's start to the last CTA's end)"]
    lines.append("  stage              tasks   first start   last end   (us)")
    for s, name in enumerate(names):
        st = [t for t in times if tasks[t.task].stage == s]
        if st:
            lines.append(f"  {name:<18} {len(st):5d}  {us(min(t.start for t in st))}   {us(max(t.end for t in st))}")
    lines.append("  family             tasks   median us   max us   (by cycles: median wait   median own work   max own)")
    fams = sorted({tasks[t.task].family for t in times}, key=lambda f: L.schedule.families[f])
    for f in fams:
        ft = [t for t in times if tasks[t.task].family == f]
        d = [t.end - t.start for t in ft]
        own = [t.work - t.wait for t in ft]
        lines.append(f"  {f:<18} {len(d):5d}  {us(statistics.median(d))}   {us(max(d))}   "
                     f"{us(statistics.median(t.wait for t in ft))}   {us(statistics.median(own))}   {us(max(own))}")
    marked = [f for f in fams if any(m is not None for t in times if tasks[t.task].family == f for m in t.marks)]
    if marked:
        lines.append("  marks (median us of own time from the previous point reached: wait end -> mark 1 -> mark 2 "
                     "-> mark 3 -> end; - not reached)")
        for f in marked:
            ft = [t for t in times if tasks[t.task].family == f]
            segs = [[] for _ in range(4)]
            for t in ft:
                prev = t.wait
                for k, m in enumerate(t.marks):
                    if m is not None:
                        segs[k].append(m - prev)
                        prev = m
                segs[3].append(t.work - prev)
            lines.append(f"  {f:<18} {len(ft):5d}  " + "  ".join(us(statistics.median(d)) if d else "       -"
                                                             for d in segs))
    on_sm = by_sm(times)
    if on_sm:                                               # which families doubled up on an SM
        pairs = []
        for f in fams:
            ft = [t for t in times if tasks[t.task].family == f]
            n = sum(1 for t in ft if f in co_resident(on_sm, t, tasks))
            if n:
                pairs.append(f"{f} {n}/{len(ft)}")
        lines.append("  tasks whose SM ran another CTA's task of the same family at the same time: "
                     + (", ".join(pairs) if pairs else "none"))
    path = critical_path(L, times)
    lines.append(f"  critical path ({len(path)} tasks; gap = its start minus the end of what it started after):")
    for t, why, gap in path[-max_path:]:
        task = tasks[t.task]
        co = co_resident(on_sm, t, tasks)
        where = f"CTA {t.cta}" + (f", SM {t.sm} with {', '.join(co) or 'nothing else'}" if t.sm >= 0 else "")
        lines.append(f"    {us(t.start)} .. {us(t.end)}  gap {us(gap)}  wait {us(t.wait)}  own {us(t.work - t.wait)}  "
                     f"{task.family}{list(task.args)} (stage {names[task.stage]}, {where}): {why}")
    return "\n".join(lines)
