"""`python -m glm53_flash build --report` (glm53_flash/build_report.py): the residency verdict on planted
stats (a build that no longer fits is reported and fails the command), one real offline sm_90 compile through
the command, and its input errors."""
import json

import pytest

from glm53_flash import build_report as br
from glm53_flash.__main__ import main
from glm53_flash.launches.layer_host import DEFAULT_MAXNREG


def _bld(kind, warps=4):
    return dict(kind=kind, tp="8", fmt="bf16", widths=(1, 2, 4, 8), spec=["m", "k", {}, {}, warps])


def test_residency_verdict_on_planted_stats():
    blds = [_bld("kda"), _bld("kda"), _bld("tail"), _bld("sparse")]
    stats = [dict(regs=128, spill=0, shared=72 * 1024,        # 4 by registers, 3 by shared memory: 2 fit
                  code_instructions=5000, functions={"k": [1, 300], "_wait_box": [15, 2900], "f": [1, 1800]}),
             dict(regs=255, spill=900, shared=120 * 1024),    # 2 by registers, 1 by shared memory
             dict(regs=255, spill=0, shared=200 * 1024),      # the tail fits its grid to what is resident
             dict(regs=255, spill=0, shared=240 * 1024)]      # more shared memory than an SM has
    rows = br.report_rows(blds, stats)
    assert [r["ctas_per_sm"] for r in rows] == [3, 1, 1, 0]
    assert [r["fits"] for r in rows] == [True, False, True, False]
    table = br.format_table(rows)
    assert table.count("| NO") == 2 and "<= 4" in table
    assert rows[0]["code"] == 5000 and rows[0]["copies"] == {"_wait_box": [15, 2900]} and "| 5000 | _wait_box x15" in table
    assert rows[1]["code"] is None and table.splitlines()[3].endswith("| - | - | ok")
    assert [br.passes(r) for r in rows] == [True, False, True, False]


def test_a_serialised_spin_fails_the_report():
    """The wait-in-loop build of 2026-12-06: _wait_box's 8 line loads in one register set (8 round trips a poll
    cycle, every hop slower). The report names it and the command fails, as for a build that does not fit."""
    stats = [dict(regs=244, spill=0, shared=72 * 1024, spins={"_wait_box": [8, 1], "_wait_box2": [8, 8]}),
             dict(regs=244, spill=0, shared=72 * 1024, spins={"_wait_box": [8, 8], "_wait_in_loop": [4, 4]})]
    rows = br.report_rows([_bld("kda"), _bld("kda")], stats)
    assert rows[0]["serial_spins"] == {"_wait_box": [8, 1]} and rows[1]["serial_spins"] == {}
    assert [br.passes(r) for r in rows] == [False, True]
    table = br.format_table(rows).splitlines()
    assert table[2].endswith("| SERIAL _wait_box 8 loads / 1 registers") and table[3].endswith("| ok")


def test_builds_share_widths_except_the_tail():
    from glm53_flash.launches.kda_layer import kda_layer_kernel
    blds = br.builds(("dense", "tail"), (1, 8), ("bf16",))
    assert [(b["kind"], b["tp"], b["widths"]) for b in blds] == [
        ("dense", "1", (1, 2, 4, 8)), ("dense", "8", (1, 2, 4, 8)), ("tail", "1,8", (1, 2, 4)), ("tail", "1,8", (8,))]
    spec = blds[1]["spec"]
    assert list(spec[2]) == kda_layer_kernel.arg_names and spec[6] == {"maxnreg": DEFAULT_MAXNREG}
    assert spec[3]["I"] == 12288 // 8 and spec[3]["NH"] == 8
    assert blds[2]["spec"][3]["XR"] == 4 and blds[3]["spec"][3]["XR"] == 8 and blds[3]["spec"][6] == {}
    from glm53_flash.launches import tail
    assert blds[2]["spec"][6] == {"maxnreg": tail.DEFAULT_MAXNREG}       # the tail's own cap, not the layers'


def test_nextn_builds_follow_its_norm_folds(monkeypatch):
    # nextn's kernel differs by its norm folds (folded at width 1 only): a build a fold class, its constexprs the
    # launch's; sparse keeps one build for every width
    monkeypatch.delenv("GLM53_EH_FOLD", raising=False)
    monkeypatch.delenv("GLM53_AIN_FOLD", raising=False)
    assert br._fold_classes("nextn") == [(1,), (2, 4, 8)] and br._fold_classes("sparse") == [(1, 2, 4, 8)]
    monkeypatch.setenv("GLM53_EH_FOLD", "0")
    assert br._fold_classes("nextn") == [(1,), (2, 4, 8)]                  # the ain fold still splits them
    monkeypatch.setenv("GLM53_AIN_FOLD", "0")
    assert br._fold_classes("nextn") == [(1, 2, 4, 8)]


def test_layer_register_cap_follows_residency(monkeypatch):
    from glm53_flash.launches.layer_host import maxnreg_for
    monkeypatch.delenv("GLM53_MAXNREG", raising=False)
    assert [maxnreg_for(n) for n in (1, 2, 3, 4, 8)] == [255, 255, 168, 128, 64]
    assert maxnreg_for(2, num_warps=8) == 128 and DEFAULT_MAXNREG == 255
    for n in (1, 2, 3, 4, 8):           # what the cap allows is resident: 65536 registers per SM, 8 per thread a unit
        assert n * 4 * 32 * (-(-maxnreg_for(n) // 8) * 8) <= 65536
    monkeypatch.setenv("GLM53_MAXNREG", "128")
    assert maxnreg_for(2) == 128


def test_build_report_command_compiles(tmp_path, capsys):
    from glm53_flash.sm90_regs import ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's bundled ptxas is missing")
    out = tmp_path / "r.jsonl"
    assert main(["build", "--report", "--kinds", "dense", "--tp", "8", "--weights", "bf16", "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["kind"] == "dense" and row["tp"] == "8" and row["fits"]
    assert 0 < row["regs"] <= DEFAULT_MAXNREG and row["shared"] > 0 and row["ctas_per_sm"] >= 2
    assert row["code"] > 1000 and "_wait_box" not in row["copies"]        # one compiled copy of the spin
    assert row["serial_spins"] == {}                                       # its polls pipelined
    assert "dense | 8 | bf16 | 1,2,4,8" in capsys.readouterr().out


@pytest.mark.parametrize("args, msg", [(["--weights", "int8"], "--weights"), (["--tp", "3"], "tp=3")])
def test_build_report_bad_input(args, msg, capsys):
    assert main(["build", "--report", "--kinds", "dense"] + args) == 2
    assert msg in capsys.readouterr().err
