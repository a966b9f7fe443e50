"""schedule.py: placement balanced by bytes, the task table, wait-site order, and the proofs that refuse
a deadlock (injected cycle, program-order cycle, wait on a later stage) and an oversize grid."""
import pytest

from glm53_flash.schedule import (TASK_WORDS, ScheduleError, TaskGraph, build, check_residency, from_programs,
                                  max_resident_ctas)

FAMS = {"prod": 0, "work": 1, "red": 2}


def _graph(n_work=13, sizes=None):
    g = TaskGraph("k", FAMS)
    g.stage("produce")
    for r in range(3):
        g.add("prod", (r,), writes=("row",), nbytes=100)
    g.stage("work")
    sizes = sizes or [1000 + 37 * i for i in range(n_work)]
    for i, b in enumerate(sizes):
        g.add("work", (i, b), reads=("row",), writes=("part",), nbytes=b)
    g.stage("reduce")
    g.add("red", (), reads=("part",), cta=2)
    return g


def test_balanced_deterministic_and_ordered():
    g = _graph()
    s = build(g, 5)
    assert s.programs == build(_graph(), 5).programs                   # deterministic
    loads = s.bytes_per_cta
    biggest = max(t.nbytes for t in g.tasks)
    assert max(loads) - min(loads) <= biggest                           # greedy largest-first bound
    assert sum(loads) == sum(t.nbytes for t in g.tasks)
    cta = s.cta_of()
    assert cta[g.tasks[-1].id] == 2                                     # pinned reducer
    for prog in s.programs:                                             # each CTA runs stages in order
        stages = [s.tasks[t].stage for t in prog]
        assert stages == sorted(stages)
    assert s.sites == ["k.row", "k.part"] and s.site_id("part") == 1 and s.site_id("nope") == -1


def test_small_tasks_spread_over_ctas():
    """A stage of small tasks after an uneven stage: one per CTA (by bytes alone they all queued on the
    CTAs that had no big task), and each stage balanced on its own."""
    g = TaskGraph("k", FAMS)
    g.stage("big")
    for i in range(4):
        g.add("prod", (i,), writes=("row",), nbytes=1 << 20)
    g.stage("small")
    for i in range(8):
        g.add("work", (i,), reads=("row",), writes=("part",), nbytes=100)
    s = build(g, 8)
    per_cta = [sum(s.tasks[t].family == "work" for t in prog) for prog in s.programs]
    assert per_cta == [1] * 8
    g.stage("more")                                     # 16 more small tasks: two per CTA
    for i in range(16):
        g.add("red", (i,), reads=("part",), nbytes=100)
    s = build(g, 8)
    assert [sum(s.tasks[t].family == "red" for t in prog) for prog in s.programs] == [2] * 8


def test_overflow_goes_behind_the_earliest_stage():
    """A stage with more tasks than idle CTAs puts the rest behind the earliest stage's tasks, not behind a join
    stage's smaller ones: a join task ends when its inputs are all in (the KDA launch's mHC gate rows, 8 KB each,
    end ~10 us in), so a GEMV tile queued behind it starts late and ends its stage late (H200 trace, 2026-12-05),
    where by bytes alone the join's CTAs looked the least loaded."""
    g = TaskGraph("k", {"part": 0, "gate": 1, "gemv": 2})
    g.stage("hc_pre")
    for i in range(4):
        g.add("part", (i,), writes=("hp",), nbytes=25 << 10)
    g.stage("gate_in")
    for i in range(2):
        g.add("gate", (i,), reads=("hp",), writes=("a",), nbytes=8 << 10)
    g.stage("inproj")
    for i in range(6):
        g.add("gemv", (i,), reads=("a",), nbytes=128 << 10)
    s = build(g, 8)
    after = {s.tasks[p[i]].family: s.tasks[p[i - 1]].family for p in s.programs for i in range(1, len(p))}
    behind = [s.tasks[p[i - 1]].family for p in s.programs for i in range(1, len(p)) if s.tasks[p[i]].family == "gemv"]
    assert sorted(behind) == ["part"] * 4, behind          # 2 on the idle CTAs, 4 behind part, none behind gate
    assert after.get("gate") is None                        # the gates went to idle CTAs of their own


def test_clear_keeps_a_latency_task_cta_free():
    """TaskGraph.add(clear=n): the task gets the highest CTA, which takes no task of the n stages before the task's
    stage, so the task starts when that CTA's earlier work ends, not behind a join of those stages (the route's
    cold dry run behind a post1, H100 trace); the rest spread over the other CTAs, the schedule is proved, a second
    such task takes the next CTA down, and a grid too small to spare them places every task by cost."""
    def graph(n_clear=1):
        g = TaskGraph("k", {"part": 0, "join": 1, "gemv": 2, "route": 3})
        g.stage("a")
        for i in range(8):
            g.add("part", (i,), writes=("p",), nbytes=4096)
        g.stage("b")
        for i in range(8):
            g.add("join", (i,), reads=("p",), writes=("j",), nbytes=1024)
        g.stage("c")
        for i in range(8):
            g.add("gemv", (i,), reads=("j",), writes=("rl",), nbytes=1 << 20)
        g.stage("route")
        for r in range(n_clear):
            g.add("route", (r,), reads=("rl",), writes=("sel",), nbytes=64, clear=2)
        return g
    s = build(graph(), 8)
    prog = {c: [s.tasks[t].family for t in p] for c, p in enumerate(s.programs)}
    assert prog[7] == ["part", "route"]                                # free after stage a, nothing of b, c
    assert sum(f == "gemv" for p in prog.values() for f in p) == 8 and all("gemv" in prog[c] for c in range(7))
    s2 = build(graph(2), 8)
    assert [s2.tasks[t].family for t in s2.programs[6]][-1] == "route" and "join" not in {
        s2.tasks[t].family for t in s2.programs[6]}
    small = build(graph(2), 3)                                         # 2 x 2 > 3: no CTA spared
    assert sum(small.tasks[t].family == "route" for p in small.programs for t in p) == 2
    g = TaskGraph("k", FAMS)
    g.stage("x")
    with pytest.raises(ScheduleError):
        g.add("work", (), clear=1, cta=0)                              # clear picks the CTA: not with a pin


def test_fillers_never_queue_behind_a_waiting_task(monkeypatch):
    """TaskGraph.add(filler=True) (the loopback peers' stores): placed after the stage's other tasks, never on a CTA
    whose last task is of the filler's own stage (a join that waits), on a CTA whose last task is of the stage before
    only once the CTAs free earlier hold FILLER_LATE's worth each, and balanced over those. Program order: a filler
    follows its CTA's non-filler task of the same stage. Without the rule (GLM53_SCHED_FILLER=0) some do queue behind
    the joins, which is what the rule is for (the default: the rule gained nothing measured, schedule.FILLER_EARLY).
    A filler that waits on something is refused."""
    import glm53_flash.schedule as sched

    def graph():
        g = TaskGraph("k", {"part": 0, "wait": 1, "join": 2, "peer": 3})
        g.stage("a")
        for i in range(2):
            g.add("part", (i,), writes=("p",), nbytes=1 << 20)
        g.stage("b")
        for i in range(4):
            g.add("wait", (i,), reads=("p",), writes=("w",), nbytes=1 << 20)
        g.stage("c")
        for i in range(2):
            g.add("join", (i,), reads=("w",), writes=("x",), nbytes=16384)       # small, as a join is
        for i in range(16):
            g.add("peer", (i,), writes=("x",), nbytes=4096, filler=True)
        return g

    monkeypatch.setattr(sched, "FILLER_EARLY", True)                  # the rule (an A/B knob, default off)
    s = build(graph(), 8)          # CTAs: 2 part, 4 wait, 2 join (free ones first); peers on the 2 + 2 left
    fam = {c: [s.tasks[t].family for t in p] for c, p in enumerate(s.programs)}
    join_ctas = {c for c, f in fam.items() if "join" in f}
    wait_ctas = {c for c, f in fam.items() if "wait" in f}
    assert len(join_ctas) == 2 and not any("peer" in fam[c] for c in join_ctas)
    peers = {c: fam[c].count("peer") for c in fam if "peer" in fam[c]}
    assert sum(peers.values()) == 16
    early = {c: n for c, n in peers.items() if c not in wait_ctas}
    late = {c: n for c, n in peers.items() if c in wait_ctas}
    assert early and all(n >= 4 for n in early.values()), (early, late)   # FILLER_LATE = 4 task floors
    assert max(peers.values()) - min(early.values()) <= 5 and max(early.values()) <= 6
    for c, f in fam.items():                                           # fillers last in their CTA's stage
        if "peer" in f:
            assert f[f.index("peer"):] == ["peer"] * f.count("peer")
    monkeypatch.setattr(sched, "FILLER_EARLY", False)
    old = build(graph(), 8)
    ofam = {c: [old.tasks[t].family for t in p] for c, p in enumerate(old.programs)}
    assert any("join" in f and "peer" in f[f.index("join"):] for f in ofam.values())
    g = TaskGraph("k", {"peer": 0})
    g.stage("x")
    with pytest.raises(ScheduleError):
        g.add("peer", (), reads=("y",), filler=True)
    with pytest.raises(ScheduleError):
        g.add("peer", (), stage=1)                                     # not opened yet


def test_a_task_added_to_an_earlier_stage():
    """add(stage=k) (the loopback peer_d stores, added with the down stage's ranges but placed in the route stage,
    whose CTAs then wait for sel): the task is of stage k, so it runs before its CTA's tasks of later stages, and the
    proof still holds its readers to a later stage."""
    g = TaskGraph("k", {"a": 0, "slot": 1, "peer": 2, "sum": 3})
    s0 = g.stage("route")
    g.add("a", (), writes=("sel",))
    g.stage("slots")
    for i in range(3):
        g.add("slot", (i,), reads=("sel",), writes=("d",), nbytes=1 << 20)
    g.stage("sum")
    g.add("sum", (), reads=("d",))
    for i in range(3):
        g.add("peer", (i,), writes=("d",), filler=True, stage=s0)
    s = build(g, 4)
    for p in s.programs:
        st = [s.tasks[t].stage for t in p]
        assert st == sorted(st)
    assert all(t.stage == s0 for t in s.tasks if t.family == "peer")
    bad = TaskGraph("k", {"a": 0, "b": 1})
    bad.stage("x")
    bad.add("a", (), writes=("r",))
    bad.stage("y")
    bad.add("b", (), reads=("r",), stage=0)                            # a reader in its writer's stage
    with pytest.raises(ScheduleError):
        build(bad, 2)


def test_table_matches_programs():
    g = _graph()
    s = build(g, 4)
    table, starts = s.table()
    assert table.shape == (len(g.tasks), TASK_WORDS) and starts.shape == (5,)
    for c, prog in enumerate(s.programs):
        rows = table[int(starts[c]): int(starts[c + 1])].tolist()
        assert [r[0] for r in rows] == [FAMS[s.tasks[t].family] for t in prog]
        assert [r[1] for r in rows] == [s.tasks[t].stage for t in prog]
        assert [tuple(r[2: 2 + len(s.tasks[t].args)]) for r, t in zip(rows, prog)] == [s.tasks[t].args for t in prog]


def test_injected_cycle_is_refused():
    g = TaskGraph("k", FAMS)
    g.stage("s0")
    g.add("work", (0,), reads=("b",), writes=("a",), nbytes=1)
    g.add("work", (1,), reads=("a",), writes=("b",), nbytes=1)
    with pytest.raises(ScheduleError, match="cycle") as ei:
        build(g, 2)
    assert "task#0" in str(ei.value) and "task#1" in str(ei.value)


def test_program_order_cycle_is_refused():
    # CTA 0 runs the consumer before its own producer: the consumer waits forever
    g = TaskGraph("k", FAMS)
    g.stage("s0")
    p = g.add("prod", (), writes=("row",))
    g.stage("s1")
    c = g.add("work", (), reads=("row",))
    with pytest.raises(ScheduleError, match="cycle.*runs after"):
        from_programs(g, 1, [[c.id, p.id]])
    assert from_programs(g, 1, [[p.id, c.id]]).programs == [[0, 1]]


def test_wait_on_later_stage_is_refused():
    g = TaskGraph("k", FAMS)
    g.stage("s0")
    g.add("work", (), reads=("late",), cta=0)
    g.stage("s1")
    g.add("prod", (), writes=("late",), cta=1)
    with pytest.raises(ScheduleError, match="same or a later stage"):
        build(g, 2)


def test_graph_errors():
    g = TaskGraph("k", FAMS)
    with pytest.raises(ScheduleError, match="before any stage"):
        g.add("prod")
    g.stage("s")
    with pytest.raises(ScheduleError, match="unknown task family 'zap'"):
        g.add("zap")
    with pytest.raises(ScheduleError, match="7 args"):
        g.add("prod", tuple(range(7)))
    g.add("prod", (), cta=9)
    with pytest.raises(ScheduleError, match="pinned outside grid 4"):
        build(g, 4)
    with pytest.raises(ScheduleError, match="grid=0"):
        build(_graph(), 0)


def test_residency_formula_and_refusal():
    # research/triton.md §5 (H200, measured equal to the driver's occupancy query)
    assert max_resident_ctas(25, 8, 0, 132) == 132 * 8                 # warp-limited: 64 / 8
    assert max_resident_ctas(255, 8, 16384, 132) == 132                 # register-limited: 1 per SM
    assert max_resident_ctas(90, 4, 48 * 1024, 132) == 132 * 4          # shared-memory-limited
    assert check_residency("tail", 132, n_regs=255, num_warps=8, shared=16384, n_sm=132) == 132
    with pytest.raises(ScheduleError, match="grid of 133 CTAs cannot be resident.*at most 132 CTAs fit on 132 SMs"):
        check_residency("tail", 133, n_regs=255, num_warps=8, shared=16384, n_sm=132)


def _demo_trace(sm=(0, 0)):
    """A hand-made two-CTA schedule (load x on both, mix y on CTA 0, out on CTA 1) and its trace buffer (ns);
    sm: the SM word of CTA 0's and CTA 1's rows."""
    import types

    import torch
    g = TaskGraph("demo", ["load", "mix", "out"])
    g.stage("a")
    a0 = g.add("load", (0,), writes=("x",), cta=0)
    a1 = g.add("load", (1,), writes=("x",), cta=1)
    g.stage("b")
    b0 = g.add("mix", (0,), reads=("x",), writes=("y",), cta=0)
    g.stage("c")
    c1 = g.add("out", (0,), reads=("y",), cta=1)
    sched = from_programs(g, 2, [[a0.id, b0.id], [a1.id, c1.id]])
    # table rows (start ns, end ns, cycles to the last wait's end, to the end, to marks 1-3, SM): CTA 0's
    # program, then CTA 1's; then one row per CTA, whose cycles over its run give its cycles per ns (2 and 1)
    ns = {a0.id: (1000, 3000, 0, 4000), b0.id: (9000, 12000, 2000, 6000), a1.id: (1000, 8000, 0, 7000),
          c1.id: (15000, 16000, 400, 1000)}
    rows = [(*ns[t], -1, -1, -1, sm[c]) for c, prog in enumerate(sched.programs) for t in prog]
    rows += [(1000, 12500, 0, 23000, -1, -1, -1, sm[0]), (1000, 16500, 0, 15500, -1, -1, -1, sm[1])]
    L = types.SimpleNamespace(kind="demo", grid=2, schedule=sched, trace_buf=torch.tensor(rows, dtype=torch.int64))
    return L, (a0, a1, b0, c1)


def test_trace_report_critical_path_with_known_times():
    """launches/trace.py on a hand-made two-CTA schedule and trace (ns): the critical path follows the
    later-finishing predecessor (program order or the last producer), with the gaps between."""
    from glm53_flash.launches.trace import critical_path, read, report
    L, (a0, a1, b0, c1) = _demo_trace()
    times, ctas = read(L)
    assert ctas == [(0, 11500), (0, 15500)] and {t.task: (t.start, t.end) for t in times}[b0.id] == (8000, 11000)
    # b0 on CTA 0 (2 cycles per ns): waited 1000 ns of its 3000; c1 on CTA 1: 400 of 1000; no marks
    assert {t.task: (t.wait, t.work, t.marks) for t in times}[b0.id] == (1000, 3000, (None, None, None))
    assert {t.task: (t.wait, t.work) for t in times}[c1.id] == (400, 1000)
    path = critical_path(L, times)
    # out waits on y (mix, ends 11000 -> gap 3000); mix ran after load 0 on CTA 0 (ends 2000) but its
    # input x's last producer is load 1 (ends 7000): that one, gap 1000
    assert [(t.task, gap) for t, _, gap in path] == [(a1.id, 0), (b0.id, 1000), (c1.id, 3000)]
    assert "after the last producer of 'x'" in path[1][1] and "'y'" in path[2][1]
    text = report(L)
    assert "launch span 15.5 us" in text and "mix" in text


def test_trace_report_co_resident_ctas():
    """The SM word of a trace row: tasks of two CTAs on one SM that overlap in time are each other's
    co-residents (the two loads: 0-2000 and 0-7000 ns; mix at 8000-11000 and out at 14000-15000 overlap
    nothing); on different SMs, or with the SM unknown (-1, the interpreter), nothing is named."""
    from glm53_flash.launches.trace import by_sm, co_resident, read, report
    L, (a0, a1, b0, c1) = _demo_trace(sm=(3, 3))
    times, _ = read(L)
    fam = L.schedule.tasks
    on = by_sm(times)
    got = {t.task: co_resident(on, t, fam) for t in times}
    assert got == {a0.id: ["load"], a1.id: ["load"], b0.id: [], c1.id: []}
    text = report(L)
    assert "same family at the same time: load 2/2" in text and "SM 3 with load" in text
    for sm in ((3, 4), (-1, -1)):
        L, _ = _demo_trace(sm=sm)
        times, _ = read(L)
        assert all(co_resident(by_sm(times), t, L.schedule.tasks) == [] for t in times)
    assert "SM " not in report(L) and "same family" not in report(L)
