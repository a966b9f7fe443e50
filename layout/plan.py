"""Scratch layout planner: named regions in one flat scratch buffer, and the manifest that describes them.

Why one buffer: a persistent launch hands data between CTAs through global memory; kernels get one base
pointer plus region offsets, tests and dumps read regions back by name, and MONO_CHECK walks the same
manifest. Sync words are polled by spinning threads, so every region starts on its own 128-byte line and
is padded to whole lines: a polled word never shares a line with unrelated data (a store to a neighbour
would bounce the line and cost the poller a re-read). A canary line follows every region so an overflow
is caught by `Layout.check_canaries`.

Nothing here knows the model: callers give sizes (rows, widths, TP, grid) and get offsets back.
The layout is a pure function of the calls made, in order, so two builds with the same inputs agree byte
for byte (`Layout.fingerprint`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

LINE = 128                      # bytes; alignment and padding unit of every region
WORDS_PER_LINE = LINE // 4      # u32 words in a box line: one per producer
CANARY_BASE = 0x5CA90000        # canary word i of region k holds CANARY_BASE | ((k * 32 + i) & 0xFFFF)

_DTYPES = {"int32": 4, "int64": 8, "float32": 4, "bfloat16": 2, "uint8": 1, "float8_e4m3fn": 1}

KINDS = ("header", "pairs", "box", "rows", "counter", "error", "canary")


class LayoutError(ValueError):
    """A region request the planner cannot honour (bad name, size or shape)."""


@dataclass(frozen=True)
class Region:
    name: str
    offset: int                 # bytes from the buffer start, a multiple of LINE
    nbytes: int                 # payload bytes (the region occupies ceil(nbytes / LINE) lines)
    kind: str                   # one of KINDS
    shape: tuple[int, ...]      # element shape of the typed view
    dtype: str                  # element dtype name (see _DTYPES)
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def padded(self) -> int:
        return -(-self.nbytes // LINE) * LINE

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    def elem_offset(self, dtype: str | None = None) -> int:
        """Offset in elements of `dtype` (default: the region's own), for kernel pointer arithmetic."""
        size = _DTYPES[dtype or self.dtype]
        return self.offset // size

    def as_dict(self) -> dict:
        return {"name": self.name, "offset": self.offset, "bytes": self.nbytes, "kind": self.kind,
                "shape": list(self.shape), "dtype": self.dtype, **({"meta": self.meta} if self.meta else {})}


def _positive_int(what: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise LayoutError(f"{what}={v!r}: must be a positive integer")
    return v


class Planner:
    """Accumulates region requests; `build()` freezes them into a `Layout`.

    Each request names the region, its kind and its size in the caller's terms; the planner picks
    offsets in request order. Names must be unique.
    """

    def __init__(self, name: str = "scratch", canaries: bool = True):
        self.name = name
        self.canaries = canaries
        self._regions: list[Region] = []
        self._cursor = 0

    # ------------------------------------------------------------------ generic
    def region(self, name: str, kind: str, shape: tuple[int, ...], dtype: str, meta: dict | None = None) -> Region:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise LayoutError(f"region name {name!r}: must be a non-empty string without spaces")
        if any(r.name == name for r in self._regions):
            raise LayoutError(f"region name {name!r}: already placed in layout {self.name!r}")
        if kind not in KINDS or kind == "canary":
            raise LayoutError(f"region {name!r}: kind={kind!r} must be one of {KINDS[:-1]}")
        if dtype not in _DTYPES:
            raise LayoutError(f"region {name!r}: dtype={dtype!r} must be one of {sorted(_DTYPES)}")
        shape = tuple(shape)
        for i, s in enumerate(shape):
            _positive_int(f"region {name!r} shape[{i}]", s)
        n = 1
        for s in shape:
            n *= s
        r = Region(name, self._cursor, n * _DTYPES[dtype], kind, shape, dtype, dict(meta or {}))
        self._regions.append(r)
        self._cursor += r.padded
        if self.canaries:
            c = Region(f"{name}.canary", self._cursor, LINE, "canary", (WORDS_PER_LINE,), "int32",
                       {"index": len(self._regions) - 1})
            self._regions.append(c)
            self._cursor += LINE
        return r

    # ------------------------------------------------------------------ protocol regions
    def header(self, name: str, lines: int) -> Region:
        """Launch header: `lines` sync words, each alone on its 128-byte line (word 0 of each line)."""
        _positive_int(f"header {name!r} lines", lines)
        return self.region(name, "header", (lines, WORDS_PER_LINE), "int32")

    def pairs(self, name: str, shape: tuple[int, ...] | int) -> Region:
        """Tagged-pair mailbox: u64 words (32-bit payload << 32 | 32-bit tag), one 8-byte store each."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.region(name, "pairs", shape, "int64")

    def box(self, name: str, consumers: int, producers: int) -> Region:
        """A box: for every consumer CTA its own line(s), one u32 word per producer.

        Shape (consumers, lines * 32) int32; producer p owns word p of every consumer's block. A consumer
        polls only its own block, so producers never write a line another consumer polls.
        """
        _positive_int(f"box {name!r} consumers", consumers)
        _positive_int(f"box {name!r} producers", producers)
        lines = -(-producers // WORDS_PER_LINE)
        return self.region(name, "box", (consumers, lines * WORDS_PER_LINE), "int32",
                           {"consumers": consumers, "producers": producers, "lines": lines})

    def rows(self, name: str, shape: tuple[int, ...] | int, dtype: str = "bfloat16") -> Region:
        """Plain payload rows (published with a release drain, guarded by a box)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.region(name, "rows", shape, dtype)

    def counters(self, name: str, n: int) -> Region:
        """n monotonic u32 counters, each on its own line (word 0 of line i)."""
        _positive_int(f"counters {name!r} n", n)
        return self.region(name, "counter", (n, WORDS_PER_LINE), "int32")

    def error_record(self, name: str) -> Region:
        """One line of 8 u32 words for a first-writer-wins error record (format owned by sync/)."""
        return self.region(name, "error", (8,), "int32")

    def build(self) -> "Layout":
        return Layout(self.name, tuple(self._regions), self._cursor)


class Layout:
    """A frozen set of regions: offsets, the manifest, typed views and canary checks."""

    def __init__(self, name: str, regions: tuple[Region, ...], nbytes: int):
        self.name = name
        self.regions = regions
        self.nbytes = max(nbytes, LINE)
        self._by_name = {r.name: r for r in regions}

    def __getitem__(self, name: str) -> Region:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"layout {self.name!r} has no region {name!r}; it has "
                           f"{[r.name for r in self.regions if r.kind != 'canary']}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def manifest(self) -> list[dict]:
        """[{name, offset, bytes, kind, shape, dtype}] in address order (canaries included)."""
        return [r.as_dict() for r in self.regions]

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "bytes": self.nbytes, "regions": self.manifest()}, sort_keys=True)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ buffers (torch imported lazily)
    def alloc(self, device=None):
        """Zeroed int32 scratch tensor of the layout's size with canary lines written."""
        import torch

        buf = torch.zeros(self.nbytes // 4, dtype=torch.int32, device=device)
        for r in self.regions:
            if r.kind == "canary":
                buf[r.offset // 4: r.offset // 4 + WORDS_PER_LINE] = self._canary_words(r).to(buf.device)
        return buf

    def _canary_words(self, r: Region):
        import torch

        k = r.meta["index"]
        vals = [CANARY_BASE | ((k * WORDS_PER_LINE + i) & 0xFFFF) for i in range(WORDS_PER_LINE)]
        return torch.tensor(vals, dtype=torch.int64).to(torch.int32)

    def view(self, buf, name: str):
        """Typed view of region `name` inside scratch `buf` (any dtype; must be contiguous)."""
        import torch

        r = self[name]
        if buf.numel() * buf.element_size() < self.nbytes:
            raise LayoutError(f"scratch buffer has {buf.numel() * buf.element_size()} bytes, layout "
                              f"{self.name!r} needs {self.nbytes}")
        raw = buf.view(torch.uint8)[r.offset: r.offset + r.nbytes]
        return raw.view(getattr(torch, r.dtype)).view(r.shape)

    def check_canaries(self, buf) -> list[str]:
        """Names of regions whose trailing canary line was overwritten (empty list: all intact)."""
        import torch

        bad = []
        words = buf.reshape(-1).view(torch.uint8).view(torch.int32)
        for r in self.regions:
            if r.kind == "canary":
                got = words[r.offset // 4: r.offset // 4 + WORDS_PER_LINE].cpu()
                if not bool((got == self._canary_words(r)).all()):
                    bad.append(r.name[: -len(".canary")])
        return bad
