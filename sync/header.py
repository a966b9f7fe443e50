"""The launch header: where a launch keeps its epoch, done counter, abort word and error record.

One header per launch (or one per step, shared by the step's launches with `tag_stride`); every word
sits alone on its own 128-byte line because CTAs poll some of them while others write. Word offsets
are in int32 words from the header base. The planner reserves it with
`planner.header(name, HEADER_LINES)`.

Launch tags (DESIGN.md §4): every CTA reads `epoch` at its start and uses
    tag = epoch * tag_stride + tag_offset + 1
(`tag_offset` = the launch's index within a step of `tag_stride` launches). The launch that ends the
step (`bump`) counts its CTAs out on `done`; the last one to arrive, when every CTA of the launch has
already read the epoch, resets `done` and increments `epoch`. So a CUDA-graph replay gets fresh tags
with no host argument, and no mailbox or box word is ever cleared: stale words carry older tags.
"""
import triton.language as tl

WORDS_PER_LINE = 32
EPOCH = 0            # u32: launches (steps) completed
DONE = 32            # u32: CTAs of the bumping launch that have finished; reset by the last one
ABORT = 64           # u32: tag of the launch that aborted (first writer claims the error record)
LAST_TAG = 96        # u32: tag of the latest launch (written by CTA 0), for the host's decode
ERR = 128            # u32[5]: tag, site, cta, wanted, seen (tag written last, with release)
WAIT_CLK = 160       # i32: 0, or (tracing) the int32-word offset from the header of an int64 [grid] array where
                     # every wait stores its CTA's %clock64 when it is satisfied (the trace's wait / work split)
HEADER_LINES = 6
HEADER_WORDS = HEADER_LINES * WORDS_PER_LINE

# device-side copies (jit code may only read tl.constexpr globals)
H_EPOCH: tl.constexpr = tl.constexpr(EPOCH)
H_DONE: tl.constexpr = tl.constexpr(DONE)
H_ABORT: tl.constexpr = tl.constexpr(ABORT)
H_LAST_TAG: tl.constexpr = tl.constexpr(LAST_TAG)
H_ERR: tl.constexpr = tl.constexpr(ERR)
H_WAIT_CLK: tl.constexpr = tl.constexpr(WAIT_CLK)
