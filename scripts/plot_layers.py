"""Draw time_layers results against rows: us per launch kind and for the whole decode step (`--kind model`),
each beside its floor, from the JSON records time_layers prints (and time_matrix collects with --json-out).

Host-side only; matplotlib is needed here and nowhere else (the GPU machine has none: save the records there,
draw them here). Used by `time_layers.py --plot PNG [--from FILE ...]`; also runnable alone:

    python scripts/plot_layers.py out.png runs/a.jsonl runs/b.jsonl
"""
from __future__ import annotations

import json
import math
import sys


def load_records(paths) -> list[dict]:
    """Every JSON object line of the files (other lines, e.g. time_layers' tables, are skipped)."""
    recs = []
    for p in paths:
        with open(p) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        recs.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    return recs


def series(recs) -> dict[str, dict[int, tuple[float, float]]]:
    """label -> {rows: (us, floor_us)}. A per-kind record (time_layers --kind embed / dense / kda / sparse / nextn /
    tail) gives its judged case as "<kind> TP<t> <fmt>" at its width; a --kind model record gives
    "step <preset> TP1 <fmt>" at its rows. Untimed records (dry runs, failed cases) are left out; a later record
    of the same label and rows replaces an earlier one."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for r in recs:
        if str(r.get("title", "")).startswith("time_layers --kind model"):
            if isinstance(r.get("us"), (int, float)) and isinstance(r.get("rows"), int):
                label = f"step {r.get('preset', '?')} TP1 {r.get('weights', '?')}"
                out.setdefault(label, {})[r["rows"]] = (float(r["us"]), float(r["floor_us"]))
            continue
        if not isinstance(r.get("rows"), list) or "kind" not in r:
            continue
        for row in r["rows"]:
            if row.get("judged") and isinstance(row.get("us"), (int, float)) and not math.isnan(row["us"]):
                label = f"{r['kind']} TP{r.get('tp', 1)} {row.get('fmt', r.get('weights', '?'))}"
                out.setdefault(label, {})[int(r.get("width", 1))] = (float(row["us"]), float(row["floor_us"]))
    return out


def require_matplotlib() -> None:
    """Raise ImportError with what to do, before any timing starts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError("--plot needs matplotlib (pip install matplotlib). On a machine without it, keep the "
                          "JSON lines (time_matrix.py --json-out, or time_layers' output) and draw them elsewhere: "
                          "time_layers.py --from FILE ... --plot PNG") from e


def plot(recs, path: str) -> dict:
    """Write the PNG: one line per label (us, solid, markers) and its floor (dashed, same colour), log2 rows on x,
    log us on y. -> the series drawn. ValueError if no record has a timed case."""
    ser = series(recs)
    if not ser:
        raise ValueError("no timed time_layers records to plot (dry runs and failed cases carry no time)")
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (label, pts) in enumerate(sorted(ser.items())):
        xs = sorted(pts)
        colour = f"C{i % 10}"
        ax.plot(xs, [pts[x][0] for x in xs], "o-", color=colour, label=label)
        ax.plot(xs, [pts[x][1] for x in xs], "--", color=colour, alpha=0.6, label=f"{label} floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 2, 4, 8])
    ax.set_xticklabels(["1", "2", "4", "8"])
    ax.set_xlabel("rows (decode tokens per launch)")
    ax.set_ylabel("us (median)")
    ax.set_title("time_layers: per launch kind and the decode step, beside the floor (dashed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return ser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    ser = plot(load_records(argv[1:]), argv[0])
    print(f"{argv[0]}: {len(ser)} series ({', '.join(sorted(ser))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
