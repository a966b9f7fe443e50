"""MONO_CHECK (check.py): clean decode gives 0 violations; planted faults are counted (positive controls)."""
import pytest
import torch

import check
from glm53_flash.checkpoint import make_random_checkpoint
from glm53_flash.config import preset
from glm53_flash.runner import Runner


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chk") / "tiny"
    make_random_checkpoint(preset("tiny"), d, seed=5, progress=False)
    return str(d)


@pytest.fixture(scope="module")
def runner(ckpt_dir):
    return Runner(ckpt_dir, kinds=["tail"])


def test_clean_decode_has_no_violations(ckpt_dir):
    r = Runner(ckpt_dir)                       # every launch kind the runner drives
    c = check.MonoCheck()
    r.hooks.append(check.hook(c))
    r.generate([3, 17], 1)
    assert c.checks > 50 and c.violations == [], c.violations
    rep = c.report()
    assert "0 violations" in rep and all(k in rep for k in ("embed", "dense", "kda", "tail"))
    for m in c.metrics:                        # bf16 hand-offs in the layers, fp32-exact tail
        assert m.rel_err < (1e-3 if m.launch == "tail" else 1e-2), m


def test_planted_faults_are_counted(runner):
    c = check.MonoCheck()
    runner.hooks[:] = []
    runner.generate([3, 17], 1)
    tail = runner.kernels["tail"]
    c.scratch(tail)
    assert c.violations == []
    # a word of the candidate mailbox with a tag from the future, and an overwritten canary
    cand = tail.layout.view(tail.scratch, "cand").view(-1)
    cand[0] = (cand[0] & ~0xFFFFFFFF) | (int(cand[0] & 0xFFFFFFFF) + 7)
    canary = next(r for r in tail.layout.regions if r.kind == "canary")
    tail.scratch[canary.offset // 4] ^= 1
    c.scratch(tail)
    assert any("newer" in v for v in c.violations)
    assert any("canar" in v for v in c.violations)
    c.output("tail", "logits", torch.tensor([1.0, float("nan")]), None)
    c.output("tail", "logits", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    c.ids("tail", torch.tensor([3]), torch.tensor([4]))
    assert len(c.violations) >= 5
    tail.scratch[canary.offset // 4] ^= 1          # restore for other tests


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_command_on_a_random_checkpoint(weights, capsys):
    """`python check.py --preset tiny --steps N`: makes the checkpoint itself, prints the count line and the
    metrics table, exit 0 when clean."""
    assert check.main(["--preset", "tiny", "--weights", weights, "--steps", "1", "--prompt", "3,17",
                       "--kernels", "tail"]) == 0
    out = capsys.readouterr().out
    assert "checks, 0 violations" in out and "tail       logits" in out


def test_command_bad_input(capsys):
    with pytest.raises(SystemExit):                     # argparse: TP 1, 2, 4 or 8
        check.main(["--tp", "3"])
    assert "invalid choice" in capsys.readouterr().err
    assert check.main(["--tp", "2", "--kernels", "tail"]) == 2 and "--kernels goes with --rows 1 --tp 1" in \
        capsys.readouterr().err
    assert check.main(["--rows", "0"]) == 2 and "--rows 0" in capsys.readouterr().err
    assert check.main(["--rows", "2", "--kernels", "tail"]) == 2 and "--kernels goes with --rows 1" in \
        capsys.readouterr().err
    assert check.main(["--steps", "0"]) == 2 and "--steps 0" in capsys.readouterr().err


def test_command_batched_rows(capsys):
    """`python check.py --preset tiny --rows 2 --steps 2`: the batched ModelRunner over 2 slots, every launch of
    the decode step checked against the reference's step of the same layer (and the tail's logits and ids):
    exit 0, 0 violations, every launch kind in the metrics table."""
    assert check.main(["--preset", "tiny", "--rows", "2", "--steps", "2", "--prompt", "3"]) == 0
    out = capsys.readouterr().out
    assert "row 1 tokens:" in out and "checks, 0 violations" in out
    for kind in ("embed", "dense", "kda", "sparse", "tail"):
        assert f"  {kind:<10}" in out, kind
