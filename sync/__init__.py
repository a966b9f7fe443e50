"""Model-agnostic hand-off protocols between CTAs of a persistent launch (DESIGN.md §4).

- `sync.asm`: every inline PTX instruction (acquire/relaxed loads, relaxed stores, fences, timer).
- `sync.device`: `@triton.jit` helpers: launch tags, tagged pairs, boxes, drains, guarded waits.
- `sync.header`: the launch header's word offsets (epoch, done, abort, error record).
- `sync.guard`: host side: `SiteRegistry`, `HandoffTimeout`, the error-record decoder.
- `sync.selftest`: a protocol kernel exercising all of it (tests, stress).
"""
from .guard import DEFAULT_TIMEOUT_S, HandoffTimeout, Record, SiteRegistry, check_record, read_record, timeout_ns
from .header import HEADER_LINES, HEADER_WORDS

__all__ = ["DEFAULT_TIMEOUT_S", "HEADER_LINES", "HEADER_WORDS", "HandoffTimeout", "Record", "SiteRegistry",
           "check_record", "read_record", "timeout_ns"]
