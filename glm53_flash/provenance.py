"""Which source tree produced a result: the commit, marked "+ uncommitted" when the tree has changes
(the benchmark cards of scripts/bench_timing.py and the dumps of glm53_flash/dump.py record it)."""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_commit() -> str:
    """HEAD of the repository this package runs from, + " + uncommitted" if `git status` lists anything;
    "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + uncommitted" if dirty.strip() else "")
