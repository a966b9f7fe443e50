"""Explain a stalled hand-off after a launch recorded a HandoffTimeout (host side, CPU or GPU).

The error record names the wait site and the CTA that gave up; this says why: which producers of that
site's box (or which source ranks of a cross-rank mailbox) never published this launch's tag, which
tasks and CTAs those producers are, and how far each such CTA got through its program (the first of
its tasks whose own outputs never appeared is where it stopped or what it skipped).

Producer numbering: a box's producers are numbered in task-creation order among the tasks that write
it (every graph builder hands out its slot counters that way), so the j-th writer is producer j.
"""
from __future__ import annotations

from ..schedule import Task

MAILBOXES = ("xo", "xd")        # cross-rank tagged-pair mailboxes [tp (dest), tp (src), width, H]


def _writers(L, region: str) -> list[Task]:
    return [t for t in L.schedule.tasks if region in t.writes]


def _box(L, region: str):
    name = "box_" + region
    try:
        return L.layout.view(L.scratch, name)
    except Exception:           # noqa: BLE001 - not a box of this launch
        return None


def box_missing(L, region: str, consumer: int, tag: int) -> list[int]:
    """Producer indices whose word in `consumer`'s block of box `region` is not `tag`."""
    view = _box(L, region)
    n = len(_writers(L, region))
    words = view[consumer, :n].cpu().tolist()
    return [p for p, w in enumerate(words) if w != tag]


def task_published(L, task: Task, tag: int, consumer: int = 0) -> bool | None:
    """Did every box this task writes get its producer word (in `consumer`'s block)? None: no box."""
    seen = None
    for r in task.writes:
        if r in MAILBOXES or _box(L, r) is None:
            continue
        j = [t.id for t in _writers(L, r)].index(task.id)
        ok = int(_box(L, r)[consumer, j]) == tag
        seen = ok if seen is None else (seen and ok)
    return seen


def cta_progress(L, cta: int, tag: int) -> list[str]:
    out = []
    for tid in L.schedule.programs[cta]:
        t = L.schedule.tasks[tid]
        p = task_published(L, t, tag)
        mark = "   " if p is None else (" ok" if p else " NO")
        out.append(f"{mark} {t.label(cta)} reads {list(t.reads)} writes {list(t.writes)}")
    return out


def mailbox_missing(L, region: str, tag: int) -> dict[int, list[tuple[int, int]]]:
    """Source rank -> (row, column) pairs of this rank's slots in mailbox `region` not carrying `tag`."""
    x = getattr(L, region)
    tp, W, H = L.tp_size, L.width, L.H
    v = x[: tp * tp * W * H].view(tp, tp, W, H)[L.tp_rank, :, : L.rows]
    bad = ((v & 0xFFFFFFFF) != tag).cpu()
    return {s: [tuple(i) for i in bad[s].nonzero().tolist()] for s in range(tp) if bad[s].any()}


def explain(L, max_ctas: int = 4) -> str:
    """A report of the latest launch's stall, or a line saying it did not stall."""
    rec = L.record()
    if not rec.failed:
        return f"{L.kind}: the latest launch recorded no stall"
    site = L.sites.name(rec.site)
    region = site.split(".", 1)[1]
    tag = rec.wanted
    lines = [f"{L.kind}: CTA {rec.cta} timed out at {site!r} (#{rec.site}) wanting tag {tag:#x}, saw {rec.seen:#x}"]
    cta_of = L.schedule.cta_of()
    suspects: list[int] = []
    if region in MAILBOXES:
        miss = mailbox_missing(L, region, tag)
        for s, cells in miss.items():
            cols = sorted({c for _, c in cells})
            tiles = sorted({c // L.block_n for c in cols})
            lines.append(f"  mailbox {region}: source rank {s}: {len(cells)} pairs missing, tiles {tiles[:16]}"
                         f"{' ...' if len(tiles) > 16 else ''}")
            for t in _writers(L, region):
                t0, n = (t.args[1], t.args[2]) if t.family.startswith("peer") else (t.args[0], t.args[1])
                src = t.args[0] if t.family.startswith("peer") else L.tp_rank
                if src == s and any(t0 <= k < t0 + n for k in tiles):
                    suspects.append(cta_of[t.id])
                    lines.append(f"    writer {t.label(cta_of[t.id])}")
        if not miss:
            lines.append(f"  mailbox {region}: every pair of rank {L.tp_rank}'s slots carries the tag now")
    else:
        miss = box_missing(L, region, rec.cta, tag)
        writers = _writers(L, region)
        lines.append(f"  box {region}: {len(miss)} of {len(writers)} producers missing in CTA {rec.cta}'s block: "
                     f"{miss[:16]}{' ...' if len(miss) > 16 else ''}")
        for p in miss[:8]:
            t = writers[p]
            suspects.append(cta_of[t.id])
            lines.append(f"    producer {p}: {t.label(cta_of[t.id])}")
    for c in list(dict.fromkeys(suspects))[:max_ctas]:
        lines.append(f"  CTA {c}'s program (ok / NO: its outputs published or not; blank: no box):")
        lines += ["    " + s for s in cta_progress(L, c, tag)]
    return "\n".join(lines)


def box_summary(L, tag: int, consumer: int = 0) -> str:
    """Every box: producers published / expected in `consumer`'s block (a compact whole-launch view)."""
    out = []
    for r in L.META_LAYOUT[0]:
        n = len(_writers(L, r))
        if n == 0 or _box(L, r) is None:
            continue
        got = int((_box(L, r)[consumer, :n] == tag).sum())
        out.append(f"{r}:{got}/{n}")
    return " ".join(out)


__all__ = ["explain", "box_missing", "mailbox_missing", "cta_progress", "box_summary"]
