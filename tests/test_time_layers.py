"""scripts/time_layers.py layer kinds on the CPU: the dry run of every kind at the tiny preset (each
launch built, run once under the interpreter and compared with its torch baseline), the byte
accounting against a hand count, and the timed path walked with a fake timer (GPU-only calls stubbed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

import layer_bytes as lb                       # noqa: E402
import rank_source                             # noqa: E402
from glm53_flash.config import preset          # noqa: E402
from glm53_flash.weights import weight_specs   # noqa: E402

TOL = 2e-2          # launch vs the torch baseline (bf16 hand-offs on both sides)


def dry(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "time_layers.py"), "--dry-run", *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    print(p.stdout)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_dry_run_step_every_kind():
    rec = dry("--kind", "step")
    cfg = preset("tiny")
    acc = rec["accounting"]
    assert set(acc) == {"embed", "dense", "kda", "sparse", "tail"}
    for r in rec["rows"]:
        if "err" in r:
            assert float(r["err"]) < TOL, r
    judged = {r["kind"]: r for r in rec["rows"] if r["judged"]}
    step = rec["step"]
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    assert step["launches"] == len(plan) and step["counts"] == {k: plan.count(k) for k in acc}
    assert step["bytes"] == sum(n * judged[k]["bytes"] for k, n in step["counts"].items())
    for k in ("embed", "dense", "kda", "sparse"):
        assert judged[k]["bytes"] == sum(acc[k]["bytes"].values())
    assert acc["kda"]["n_routed"] == cfg.num_experts_per_tok        # rows 1: top-k distinct experts
    # a torch baseline beside every kind
    assert sum(r["case"].startswith("  torch ops") for r in rec["rows"]) == 5


@pytest.mark.parametrize("args", [("--kind", "nextn", "--tp", "2", "--rows", "2", "--weights", "fp8"),
                                  ("--kind", "sparse", "--rows", "4", "--pos", "26", "--experts", "4"),
                                  ("--kind", "kda", "--block-k", "256", "--num-stages", "3"),
                                  ("--kind", "dense", "--block-v", "16")],
                         ids=["nextn-tp2-rows2-fp8", "sparse-rows4-pos26-e4", "kda-bk256-s3", "dense-bv16"])
def test_dry_run_options(args):
    rec = dry(*args)
    rows = [r for r in rec["rows"] if "err" in r]
    assert rows and all(float(r["err"]) < TOL for r in rows), rows
    if "--block-v" in args:             # the launch took it (a kda_norm stage of 4 blocks a head at head dim 64)
        assert all(r["block_v"] == 16 for r in rows), rows
    if "--experts" in args:
        assert rec["experts"] == 4 and rec["accounting"]["sparse"]["n_routed"] <= 4


def test_block_v_refused_without_a_kda_mixer():
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "time_layers.py"), "--kind", "sparse", "--block-v", "16",
                        "--dry-run"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1"))
    assert p.returncode == 2 and "--kind sparse has no KDA mixer" in p.stderr, p.stderr[-2000:]


def test_kda_bytes_hand_count():
    """kda launch, tiny preset, TP 2, 2 rows, bf16, 3 distinct routed experts, counted by hand."""
    cfg = preset("tiny")          # H 256, 4 KDA heads x 64 (D 256), conv 4, 8 experts of 128, top 2, hc 4
    got = lb.launch_bytes("kda", cfg, tp=2, rows=2, fmt="bf16", n_routed=3)
    weights = sum([
        2 * 256 * 2,              # input / post_attention layernorm, bf16, replicated
        2 * 24 * 1024 * 4,        # hc_attn_fn, hc_ffn_fn [24, 4 H] fp32
        2 * 24 * 4 + 2 * 3 * 4,   # hc base [24], scale [3]
        3 * 128 * 256 * 2,        # q, k, v proj: this rank's 128 of 256 rows
        3 * 128 * 4 * 4,          # q, k, v conv1d [128, 1, 4] fp32
        2 * 64 * 256 * 2,         # f_a, g_a [64, 256] replicated
        2 * 128 * 64 * 2,         # f_b, g_b: 128 of 256 rows
        2 * 256 * 2,              # b_proj: 2 of 4 heads
        2 * 4 + 128 * 4,          # A_log (2 heads), dt_bias (128) fp32
        64 * 2,                   # o_norm
        256 * 128 * 2,            # o_proj: 128 of 256 input columns
        8 * 256 * 4 + 8 * 4,      # router weight and correction bias, fp32
    ])
    expert = 3 * 64 * 256 * 2     # gate, up [64 of 128, 256] and down [256, 64 of 128]
    want = {
        "weights": weights,
        "shared expert": expert,
        "routed experts (3)": 3 * expert,
        "kda state r+w": 2 * 2 * 2 * 64 * 64 * 4,          # read + write, 2 rows x 2 heads x 64 x 64 fp32
        "conv window r+w": 2 * 2 * 3 * 384 * 4,            # 2 rows x 3 past inputs x (q|k|v 3 x 128) fp32
        "X in + X' out": 2 * 2 * 4 * 256 * 4,
    }
    assert got == want


def test_sparse_cache_bytes_hand_count():
    cfg = preset("tiny")          # index_topk 16 = 4 pools of 4; latent C 64 bf16; index dim 64
    assert lb.selected_tokens(cfg, 10) == 11                    # 2 complete pools <= 4: everything
    assert lb.selected_tokens(cfg, 26) == 16 + 3                # 6 pools > 4: top 4 pools + the open pool
    got = lb.launch_bytes("sparse", cfg, tp=1, rows=1, fmt="bf16", pos=27, n_routed=2)
    assert got["latent rows selected"] == 16 * 64 * 2           # pos 27: 7 complete pools, no open tail
    assert got["pool keys scored"] == 7 * 64 * 2
    assert got["cache writes"] == 64 * 2 + 128 * 4 + 64 * 2     # latent row, ring row, pool key 6
    assert lb.launch_bytes("sparse", cfg, 1, 1, "bf16", pos=10)["pool keys scored"] == 0   # dense regime


def test_fp8_pieces_follow_tp_rule():
    cfg = preset("glm53-flash")
    spec = weight_specs(cfg)["model.language_model.layers.1.mlp.gate_proj.weight"]    # [12288, 4096]
    assert rank_source.piece_bytes(spec, 8, "fp8") == 1536 * 4096 + 12 * 32 * 4
    tiny = weight_specs(preset("tiny"))["model.language_model.layers.1.mlp.gate_proj.weight"]   # [512, 256]
    assert not rank_source.piece_fp8(tiny, 8, "fp8") and rank_source.piece_bytes(tiny, 8, "fp8") == 64 * 256 * 2     # dequantized


def test_timed_path_with_fake_timer(monkeypatch, capsys, tmp_path):
    """The GPU-only flow (copies from free memory, rotation vs flush, subtraction, report) on the CPU."""
    import triton
    if not triton.knobs.runtime.interpret:
        pytest.skip("needs TRITON_INTERPRET=1 (CPU)")
    import bench_timing as bt
    import time_layers as tl
    calls = []

    def fake_time(cases, reps, windows):
        for c in cases:
            for f in c.fns[:2]:
                f()
            calls.append((c.name, len(c.fns)))
            assert c.checks or not c.floor              # every judged launch is checked after its timing
        bt.check_launches(cases)
        return {c.name: (5.0 if "flush" in c.name else 20.0) for c in cases}

    monkeypatch.setattr(tl, "DEVICE", "cpu")
    flushes = []
    # the flush is the GPU-proven pure-read kernel (measure_read_bw); the interpreter cannot run its loop
    monkeypatch.setattr(tl, "_flush_fn", lambda device: (lambda: flushes.append(device)))
    monkeypatch.setattr(tl, "time_interleaved", fake_time)
    monkeypatch.setattr(tl, "measure_read_bw", lambda: (4.0e12, {"fake": 4000.0}))
    monkeypatch.setattr(tl, "env_card", lambda: {"gpu": "fake"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * 2 ** 30, 140 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    torch.set_num_threads(1)
    assert tl.main(["--kind", "kda", "--preset", "tiny", "--max-copies", "1"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    launch = rec["rows"][0]
    assert launch["timing"] == "flush" and launch["us"] == 15.0             # 20 - the flush alone
    assert any("flush alone" in r["case"] and r["us"] == 5.0 for r in rec["rows"])
    assert launch["bytes"] == sum(rec["accounting"]["kda"]["bytes"].values())
    assert flushes                                                         # every timed launch flushed first
    assert tl.main(["--kind", "sparse", "--preset", "tiny", "--max-copies", "2", "--pos", "27"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["rows"][0]["timing"] == "rotate" and rec["rows"][0]["us"] == 20.0
    assert ("sparse launch tp1 rows1 bf16", 2) in calls
    # the step: every kind timed in turn, then the same sums again from the saved JSON line (--from)
    assert tl.main(["--kind", "step", "--preset", "tiny", "--max-copies", "1", "--pos", "27"]) == 0
    out = capsys.readouterr().out
    rec = json.loads(out.strip().splitlines()[-1])
    step = rec["step"]
    assert step["launches"] == 9 and step["us"] == sum(
        n * next(r["us"] for r in rec["rows"] if r["judged"] and r["kind"] == k) for k, n in step["counts"].items())
    (tmp_path / "step.txt").write_text(out)
    assert tl.main(["--kind", "step", "--preset", "tiny", "--from", str(tmp_path / "step.txt")]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"]
    assert again == step


def test_check_launches_refuses_a_stalled_timed_launch(tiny_cfg, gen):
    """A timed launch that recorded a stall makes the timing fail instead of reporting its (short) time."""
    import bench_timing as bt
    from glm53_flash.launches.tail import TailLaunch
    from sync import HandoffTimeout
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    L = TailLaunch(tiny_cfg, torch.randn(V, H, generator=gen).bfloat16(), torch.ones(H).bfloat16(), width=1)
    X = torch.randn(1, 4, H, generator=gen)
    L.run(X)
    case = bt.BenchCase("tail", [L.enqueue], 1, checks=[L.check])
    bt.check_launches([case])                                    # clean: nothing raised
    L.set_input(X)
    L.enqueue(L.fault_id(list(L.sites)[0]))                      # a timed launch that stalls
    with pytest.raises(HandoffTimeout):
        bt.check_launches([case])


def test_time_matrix_cases_and_records(tmp_path, capsys):
    """time_matrix.py: the case list (positions only for the DSA kinds), one JSON record per case with its
    argv, a failing case recorded and the matrix going on, and the deadline leaving cases unstarted."""
    import argparse

    import time_matrix as tm
    ns = argparse.Namespace(kinds=["dense", "sparse"], weights=["bf16", "fp8"], tp=[1, 8], rows=[1], pos=[640, 8191],
                            windows=3, reps=2, experts=None, max_copies=None, dry_run=False, variants=[""])
    cases = tm.matrix(ns)
    assert len(cases) == 2 * 2 + 2 * 2 * 2
    assert all(("--pos" in c) == (c[1] == "sparse") for c in cases)
    ns.variants = ["", "--block-n 32", "--ctas-per-sm 2 --num-warps 8"]          # each case once per variant
    v = tm.matrix(ns)
    assert len(v) == 3 * len(cases) and v[0] == cases[0] and v[1] == cases[0] + ["--block-n", "32"]
    assert v[2][-4:] == ["--ctas-per-sm", "2", "--num-warps", "8"]
    out = tmp_path / "t.jsonl"
    assert tm.main(["--kinds", "dense,nope", "--dry-run", "--json-out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0]["argv"][:2] == ["--kind", "dense"] and "error" not in recs[0] and recs[0]["rows"]
    assert "error" in recs[1]                                     # argparse refused the unknown kind
    assert tm.main(["--kinds", "dense", "--dry-run", "--deadline", "-1"]) == 0
    assert "not started (deadline)" in capsys.readouterr().out


def test_dry_run_model_kind():
    """--kind model --dry-run --rows 1,2: one ModelRunner (widths 1 and 2) on the tiny preset, 2 prompt tokens a slot
    through decode steps, then one checked step per batch size through its step program: a record per B with
    finite logits and the floor = the launch plan's bytes at that B; a row list refused for other kinds."""
    import layer_bytes as lbytes
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "time_layers.py"), "--dry-run", "--kind", "model",
                        "--rows", "2,1"], capture_output=True, text=True, env=env, timeout=1500)   # a hang guard: the
    # whole model step under the interpreter took ~9.5 min alone on CI's 2 cores (600 s failed once under load)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    cfg = preset("tiny")
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    assert [r["rows"] for r in recs] == [1, 2]                     # sorted, one record per batch size
    for r in recs:
        B = r["rows"]
        assert r["launches"] == len(plan) and r["logits_finite"] and "us" not in r          # untimed
        assert r["counts"] == {k: plan.count(k) for k in sorted(set(plan), key=plan.index)}
        assert r["pos"] == (2 if B == 1 else 3)       # slot 0 took B = 1's checked step before B = 2's
        assert r["floor_bytes"] == sum(sum(lbytes.launch_bytes(k, cfg, 1, B, "bf16", pos=r["pos"]).values())
                                       for k in plan)
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "time_layers.py"), "--dry-run", "--kind", "kda",
                        "--rows", "1,2"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "a list goes with --kind model" in p.stderr


def test_dry_run_model_kind_tp2():
    """--kind model --tp 2 --dry-run: rank 0's step in loopback, every kind's launch built (no baselines) and the
    launch plan run once through the interpreter in plan order, each launch checked clean; the record counts the
    plan's launches per kind and its floor is the plan's per-launch bytes summed."""
    import layer_bytes as lbytes
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "time_layers.py"), "--dry-run", "--kind", "model",
                        "--tp", "2", "--rows", "1"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    cfg = preset("tiny")
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    assert len(recs) == 1 and recs[0]["tp"] == 2 and recs[0]["launches"] == len(plan) and "us" not in recs[0]
    assert recs[0]["counts"] == {k: plan.count(k) for k in sorted(set(plan), key=plan.index)}
    layer_bytes = sum(sum(lbytes.launch_bytes(k, cfg, 2, 1, "bf16", pos=recs[0]["pos"]).values())
                      for k in plan if k != "tail")
    assert recs[0]["floor_bytes"] > layer_bytes > 0              # + the tail's lm_head shard


def _plot_records():
    """A --kind model record at rows 1 and 2, a kda record at widths 1 and 8 (a later width-8 run replacing an
    earlier one), a dry-run record and a failed case (no time), and a non-JSON table line."""
    kda = lambda w, us: {"kind": "kda", "tp": 8, "width": w, "weights": "bf16",  # noqa: E731
                         "rows": [{"case": "kda launch", "us": us, "floor_us": 23.2, "judged": True, "fmt": "bf16"},
                                  {"case": "  torch ops kda", "us": 740.0, "floor_us": 23.2, "judged": False}]}
    model = lambda r, us: {"title": "time_layers --kind model", "preset": "glm53-flash-e80", "weights": "fp8",  # noqa
                           "rows": r, "us": us, "floor_us": 900.0 * r}
    return [kda(1, 131.0), kda(8, 320.0), kda(8, 300.0), model(1, 2500.0), model(2, 2700.0),
            {"title": "time_layers --kind model --dry-run", "rows": 1, "floor_us": 1.0},
            {"kind": "dense", "tp": 1, "width": 1, "rows": [{"case": "x", "us": float("nan"), "floor_us": 1.0,
                                                             "judged": True}]}]


def test_plot_from_records(tmp_path, capsys):
    """--from FILE --plot PNG draws the timed records only (us and floor per label and rows, later runs
    winning), writes a PNG, and needs no GPU; records with nothing timed are refused with a clear error. matplotlib
    is in the test extra (CI has it); only a machine run from the tree without it (the GPU machine's
    `make gpu-test`) reports this test skipped."""
    pytest.importorskip("matplotlib", reason="the optional plotting dependency (pip install '.[plot]')")
    import plot_layers
    import time_layers
    f = tmp_path / "runs.jsonl"
    f.write_text("kda launch tp8 rows1 bf16   131.0 ...\n" + "\n".join(json.dumps(r) for r in _plot_records()) + "\n")
    ser = plot_layers.series(plot_layers.load_records([str(f)]))
    assert ser == {"kda TP8 bf16": {1: (131.0, 23.2), 8: (300.0, 23.2)},
                   "step glm53-flash-e80 TP1 fp8": {1: (2500.0, 900.0), 2: (2700.0, 1800.0)}}
    png = tmp_path / "out.png"
    assert time_layers.main(["--kind", "model", "--from", str(f), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "2 series" in capsys.readouterr().out
    empty = tmp_path / "dry.jsonl"
    empty.write_text(json.dumps(_plot_records()[-2]) + "\n")
    with pytest.raises(SystemExit) as e:
        time_layers.main(["--kind", "kda", "--from", str(empty), "--plot", str(tmp_path / "no.png")])
    assert e.value.code == 2 and not (tmp_path / "no.png").exists()
    assert "no timed time_layers records" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                # --from without --plot: still step only
        time_layers.main(["--kind", "kda", "--from", str(f)])
    with pytest.raises(SystemExit) as e:                           # gemv timings have no launch kind to draw
        time_layers.main(["--kind", "gemv", "--plot", str(tmp_path / "g.png")])
    assert e.value.code == 2 and "nothing to draw" in capsys.readouterr().err


def test_plot_needs_matplotlib_before_timing(monkeypatch, capsys):
    """Without matplotlib, --plot is refused at once (before any weights or timing), saying what to do."""
    import time_layers
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit) as e:
        time_layers.main(["--kind", "model", "--plot", "x.png"])
    assert e.value.code == 2 and "needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("n,k,bn,bk,ks", [(128, 512, 64, 128, 2), (256, 512, 128, 64, 4), (128, 512, 64, 256, 2)])
def test_bench_gemv_stage_kernel_matches_reference(n, k, bn, bk, ks):
    """scripts/bench_gemv_stage.py's stage kernel (the launches' gemv_stream, a (tile, K slice) per program,
    partial planes) on fresh random inputs under the interpreter: the planes' sum is x @ W^T, every element of
    the row's planes written (poisoned first). The bench's shapes are the launches' (64 x 128 / 128 x 64 / bk256)."""
    from bench_gemv_stage import CASES, stage_kernel
    assert {(c[3], c[4]) for c in CASES} >= {(bn, bk)}
    g = torch.Generator().manual_seed(n + bk)
    x = torch.randn(1, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    y = torch.full((ks, 8, n), float("nan"))
    nt = n // bn
    stage_kernel[(nt * ks,)](x, w, y, 1, n, k, k // ks, nt, ROWS_PAD=8, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=3)
    assert not torch.isnan(y[:, 0]).any()
    ref = x.double() @ w.double().T
    got = y[:, :1].double().sum(0)
    assert float((got - ref).norm() / ref.norm()) < 1e-5
