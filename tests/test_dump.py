"""`python -m glm53_flash dump / compare` (glm53_flash/dump.py) under the interpreter: two dumps of the same
build are identical, and a planted one-ulp difference, a missing tensor and a missing file are each
reported (and exit 1); bad input exits 2 with a message."""
import json
import os

import pytest
import torch

from glm53_flash.__main__ import main
from glm53_flash.dump import MANIFEST, compare, dump


@pytest.fixture(scope="module")
def two_dumps(tmp_path_factory):
    a, b = (str(tmp_path_factory.mktemp(n) / "d") for n in ("a", "b"))
    for d in (a, b):
        dump(d, ["dense", "tail"], 1, [1, 2], "bf16", "tiny", "cpu", log=lambda *_: None)
    return a, b


def test_same_build_is_identical(two_dumps, capsys):
    a, b = two_dumps
    assert compare(a, b) == []
    assert main(["compare", a, b]) == 0 and "identical" in capsys.readouterr().out
    man = json.load(open(os.path.join(a, MANIFEST)))
    assert sorted(man["files"]) == ["dense_w1.pt", "dense_w2.pt", "tail_w1.pt", "tail_w2.pt"]
    t = torch.load(os.path.join(a, "dense_w2.pt"))
    # outputs, the new state and every scratch region (the header, the boxes, the partial planes)
    assert {"out.X_out", "out.S_out", "scratch.hdr", "scratch.box_hp1", "scratch.yin_rows"} <= set(t)
    assert man["files"]["dense_w2.pt"]["tensors"]["out.X_out"]["shape"] == list(t["out.X_out"].shape)
    assert bool(torch.isfinite(t["out.X_out"]).all())


def test_planted_differences_are_reported(two_dumps, tmp_path, capsys):
    a, b = two_dumps
    c = str(tmp_path / "c")
    os.makedirs(c)
    for f in os.listdir(b):
        with open(os.path.join(b, f), "rb") as src, open(os.path.join(c, f), "wb") as dst:
            dst.write(src.read())
    t = torch.load(os.path.join(c, "dense_w2.pt"))
    x = t["out.X_out"]
    x[1, 2, 5] = torch.nextafter(x[1, 2, 5], torch.tensor(float("inf")))     # one ulp, one element
    flat = (1 * x.shape[1] + 2) * x.shape[2] + 5
    del t["scratch.box_a"]
    torch.save(t, os.path.join(c, "dense_w2.pt"))
    os.remove(os.path.join(c, "tail_w1.pt"))
    diffs = compare(a, c)
    assert f"dense_w2.pt out.X_out: 1 of {x.numel()} elements differ, first at (1, 2, 5) (flat {flat})" in \
        " | ".join(diffs)
    assert "dense_w2.pt scratch.box_a: only in A" in diffs
    assert "tail_w1.pt: in the manifest but missing from B" in diffs
    assert len(diffs) == 3
    assert main(["compare", a, c]) == 1 and "3 differences" in capsys.readouterr().out


def test_bad_input_errors(two_dumps, tmp_path, capsys):
    a, _ = two_dumps
    assert main(["compare", a, str(tmp_path)]) == 2 and "is not a dump" in capsys.readouterr().err
    assert main(["dump", "--out", a, "--kinds", "dense", "--widths", "1"]) == 2        # not empty: refused
    assert "not empty" in capsys.readouterr().err
    assert main(["dump", "--out", str(tmp_path / "x"), "--kinds", "bogus"]) == 2
    assert "unknown launch kind" in capsys.readouterr().err
    assert main(["dump", "--out", str(tmp_path / "y"), "--kinds", "dense", "--tp", "3", "--widths", "1"]) == 2
    assert not os.path.exists(tmp_path / "y") or not os.listdir(tmp_path / "y")


def test_fp8_at_tp2_repeats_and_differs_from_bf16(tmp_path):
    """An FP8 build at TP 2 (rank 0, loopback): its launches hold e4m3 weights, a re-run dumps the same
    bytes, and the bf16 build's dump differs from it."""
    from glm53_flash.config import preset
    from glm53_flash.dump import _run, source
    cfg = preset("tiny")
    src, scales = source(cfg, 0, "fp8")
    L, _ = _run("tail", cfg, src, 2, 1, "cpu", 0, 27, scales)
    assert L.fp8 and L.V_rank == cfg.vocab_size // 2
    d = [str(tmp_path / n) for n in ("f1", "f2", "b")]
    for out, w in zip(d, ("fp8", "fp8", "bf16")):
        dump(out, ["dense", "tail"], 2, [1], w, "tiny", "cpu", log=lambda *_: None)
    assert compare(d[0], d[1]) == []
    diffs = compare(d[0], d[2])
    assert any(x.startswith("dense_w1.pt out.X_out") for x in diffs), diffs
    assert any(x.startswith("tail_w1.pt out.logits") for x in diffs), diffs
