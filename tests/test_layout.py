"""layout/: region placement, alignment, line exclusivity of sync words, manifest, canaries, errors."""
import pytest
import torch

from layout import CANARY_BASE, LINE, LayoutError, Planner


def _plan(grid=5, producers=40, width=4, H=256):
    pl = Planner("t")
    pl.header("hdr", 5)
    pl.rows("xn", (width, H), "float32")
    pl.box("box", grid, producers)
    pl.pairs("cand", (grid, 32))
    pl.counters("ctr", 3)
    pl.error_record("err")
    pl.rows("tiny", 3, "bfloat16")          # 6 bytes: still gets a whole line
    return pl.build()


def test_regions_aligned_disjoint_and_line_exclusive():
    L = _plan()
    regs = sorted(L.regions, key=lambda r: r.offset)
    for r in regs:
        assert r.offset % LINE == 0, r
        assert r.padded % LINE == 0 and r.padded >= r.nbytes
    for a, b in zip(regs, regs[1:]):
        # each region's lines end before the next region starts: no sync word shares a line
        assert a.offset + a.padded <= b.offset, (a.name, b.name)
    assert regs[-1].offset + regs[-1].padded <= L.nbytes
    # every real region is followed by its own canary line
    names = [r.name for r in regs]
    for r in regs:
        if r.kind != "canary":
            assert names[names.index(r.name) + 1] == r.name + ".canary"


def test_box_and_counter_shapes():
    L = _plan(grid=5, producers=40)
    box = L["box"]
    assert box.shape == (5, 64) and box.meta["lines"] == 2      # 40 producers -> 2 lines per consumer
    assert (box.shape[1] * 4) % LINE == 0                        # a consumer's block is whole lines
    assert L["ctr"].shape == (3, 32)                              # one counter per line
    assert L["cand"].dtype == "int64" and L["cand"].shape == (5, 32)


def test_manifest_and_determinism():
    a, b = _plan(), _plan()
    assert a.manifest() == b.manifest() and a.fingerprint() == b.fingerprint()
    c = _plan(grid=6)
    assert c.fingerprint() != a.fingerprint()
    m = {d["name"]: d for d in a.manifest()}
    assert set(m["xn"]) >= {"name", "offset", "bytes", "kind", "shape", "dtype"}
    assert m["xn"]["bytes"] == 4 * 256 * 4 and m["xn"]["kind"] == "rows" and m["xn"]["shape"] == [4, 256]


def test_views_and_canaries():
    L = _plan()
    buf = L.alloc("cpu")
    assert buf.numel() * 4 == L.nbytes
    assert L.check_canaries(buf) == []
    v = L.view(buf, "xn")
    assert v.dtype == torch.float32 and v.shape == (4, 256)
    v.copy_(torch.randn(4, 256))
    assert L.view(buf, "cand").dtype == torch.int64
    assert L.check_canaries(buf) == []
    # an overflow of one word past the end of 'xn' lands in its canary line and is reported
    raw = buf.view(torch.uint8)
    end = L["xn"].offset + L["xn"].padded
    raw[end: end + 4] = 0
    assert L.check_canaries(buf) == ["xn"]
    assert int(buf[L["hdr.canary"].offset // 4]) & 0xFFFF0000 == CANARY_BASE


@pytest.mark.parametrize("call, match", [
    (lambda p: p.rows("xn", (2, 0)), "shape\\[1\\]=0"),
    (lambda p: p.rows("xn", (2, -3)), "shape\\[1\\]=-3"),
    (lambda p: p.rows("xn", 4, "float64"), "dtype='float64'"),
    (lambda p: p.region("x", "weird", (1,), "int32"), "kind='weird'"),
    (lambda p: p.box("b", 0, 3), "consumers=0"),
    (lambda p: p.rows("a b", 4), "without spaces"),
])
def test_errors_name_the_thing(call, match):
    p = Planner("t")
    with pytest.raises(LayoutError, match=match):
        call(p)
    assert p.build().regions == ()                                 # nothing was placed


def test_duplicate_name_refused_and_state_untouched():
    p = Planner("t")
    p.rows("xn", 4)
    before = p.build().manifest()
    with pytest.raises(LayoutError, match="'xn': already placed"):
        p.pairs("xn", 8)
    assert p.build().manifest() == before
    with pytest.raises(KeyError, match="no region 'nope'"):
        p.build()["nope"]
