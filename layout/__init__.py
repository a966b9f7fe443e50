"""Model-agnostic scratch layout: `Planner` places named regions, `Layout` is the frozen manifest."""
from .plan import CANARY_BASE, KINDS, LINE, WORDS_PER_LINE, Layout, LayoutError, Planner, Region

__all__ = ["CANARY_BASE", "KINDS", "LINE", "WORDS_PER_LINE", "Layout", "LayoutError", "Planner", "Region"]
