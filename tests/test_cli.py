"""The command line: every subcommand's --help, make-checkpoint, generate (text and --json), demo,
sites, fault injection with retry, and clear errors on bad input."""
import json

import pytest

from glm53_flash.__main__ import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(d), "--seed", "3"]) == 0
    return d


@pytest.mark.parametrize("cmd", ["make-checkpoint", "generate", "demo", "sites"])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--" in out


def test_make_checkpoint_layout(tiny_dir):
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) >= 3


def _generate_json(tiny_dir, capsys, *extra, prompt="3,17,42,5", n=3):
    # the tail alone as a kernel by default: every layer launch under the interpreter costs ~1 s a step
    kernels = [] if "--kernels" in extra or "--path" in extra else ["--kernels", "tail"]
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", prompt, "--max-new-tokens", str(n),
               "--json", *kernels, *extra])
    assert rc == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(line)


def test_generate_json_matches_reference_path(tiny_dir, capsys):
    auto = _generate_json(tiny_dir, capsys)
    ref = _generate_json(tiny_dir, capsys, "--path", "reference")
    assert set(auto) == {"tokens", "last_logits_top5"}
    assert len(auto["tokens"]) == 3 and all(0 <= t < 1024 for t in auto["tokens"])
    assert len(auto["last_logits_top5"]) == 5
    ids = [i for i, _ in auto["last_logits_top5"]]
    vals = [v for _, v in auto["last_logits_top5"]]
    assert vals == sorted(vals, reverse=True) and len(set(ids)) == 5
    assert auto["tokens"] == ref["tokens"]
    for (i1, v1), (i2, v2) in zip(auto["last_logits_top5"], ref["last_logits_top5"]):
        assert i1 == i2 and abs(v1 - v2) <= 2e-2 * max(1.0, abs(v2))


def test_generate_bad_token(tiny_dir, capsys):
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3,5000", "--max-new-tokens", "2"])
    assert rc == 2
    assert "5000" in capsys.readouterr().err


def test_generate_missing_checkpoint(tmp_path, capsys):
    rc = main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "1", "--max-new-tokens", "1"])
    assert rc == 2
    assert "nope" in capsys.readouterr().err


def test_bad_prompt_syntax(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", "x", "--prompt", "3,a", "--max-new-tokens", "1"])
    assert "comma-separated" in capsys.readouterr().err


def test_sites_tail(capsys):
    assert main(["sites", "--launch", "tail"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines, "the tail launch has wait sites"


def test_inject_fault_retries_and_matches(tiny_dir, capsys):
    from glm53_flash.launches import sites
    clean = _generate_json(tiny_dir, capsys)
    for site in sites("tail"):
        rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3,17,42,5", "--max-new-tokens", "3",
                   "--json", "--kernels", "tail", "--inject-fault", f"tail:{site}"])
        cap = capsys.readouterr()
        assert rc == 0
        assert "HandoffTimeout" in cap.err and site in cap.err
        assert json.loads(cap.out.strip().splitlines()[-1])["tokens"] == clean["tokens"]


def test_all_layer_kernels_match_reference_and_survive_a_fault(tiny_dir, capsys):
    """Every layer kind + the tail as kernels; a fault in the first dense launch is reported, the launch
    retried, and the tokens equal the reference path's."""
    ref = _generate_json(tiny_dir, capsys, "--path", "reference", prompt="3,17", n=2)
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3,17", "--max-new-tokens", "2", "--json",
               "--kernels", "embed,dense,kda,sparse,tail", "--inject-fault", "dense:dense.a_in"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "HandoffTimeout" in cap.err and "dense.a_in" in cap.err
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert out["tokens"] == ref["tokens"]
    for (i1, v1), (i2, v2) in zip(out["last_logits_top5"], ref["last_logits_top5"]):
        assert i1 == i2 and abs(v1 - v2) <= 5e-2 * max(1.0, abs(v2))


def test_default_kernels_are_the_gpu_checked_kinds(tiny_dir):
    from glm53_flash.runner import DEFAULT_KINDS, Runner
    r = Runner(str(tiny_dir))
    assert set(r.kernels) == set(DEFAULT_KINDS) == {"tail", "embed", "dense", "kda", "sparse"}
    assert r.paths["sparse"] == "kernel" and r.paths["kda"] == "kernel"
    r = Runner(str(tiny_dir), kinds=("tail", "kda"))
    assert r.paths["sparse"] == "reference" and r.paths["dense"] == "reference"


def test_unknown_kernel_kind(tiny_dir, capsys):
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3", "--max-new-tokens", "1",
               "--kernels", "tail,warp"])
    assert rc == 2 and "warp" in capsys.readouterr().err


def test_inject_fault_unknown_site(tiny_dir, capsys):
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3", "--max-new-tokens", "1",
               "--kernels", "tail", "--inject-fault", "tail:no_such_site"])
    assert rc == 2
    assert "no_such_site" in capsys.readouterr().err


def test_demo(tiny_dir, capsys):
    rc = main(["demo", "--checkpoint", str(tiny_dir), "--max-new-tokens", "3", "--kernels", "tail"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "decode agrees with prefill: yes" in out and "tokens/s" in out


def test_inject_fault_by_site_number(tiny_dir, capsys):
    """The number `sites` prints beside a site is accepted for its name; one past the last is refused."""
    from glm53_flash.launches import sites
    names = sites("tail")
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3,17", "--max-new-tokens", "1", "--json",
               "--kernels", "tail", "--inject-fault", "tail:1"])
    cap = capsys.readouterr()
    assert rc == 0 and "HandoffTimeout" in cap.err and names[1] in cap.err
    rc = main(["generate", "--checkpoint", str(tiny_dir), "--prompt", "3", "--max-new-tokens", "1",
               "--kernels", "tail", "--inject-fault", f"tail:{len(names)}"])
    assert rc == 2 and f"has {len(names)} wait sites" in capsys.readouterr().err


def test_sites_into_a_closed_pipe_exits_quietly():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-m", "glm53_flash", "sites", "--launch", "kda"], cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": root})
    p.stdout.close()                                 # the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_generate_batched_on_a_preset(capsys):
    """generate --preset tiny --random-weights (ModelRunner, no files): each row's tokens, the TPOT line, and
    the same first decoded step for row 0 as ModelRunner gives it; the flags that go with --checkpoint or with
    --preset are refused on the other form."""
    rc = main(["generate", "--preset", "tiny", "--random-weights", "--batch", "2", "--max-new-tokens", "2",
               "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    lines = cap.out.strip().splitlines()
    assert lines[0].startswith("row 0: ") and lines[1].startswith("row 1: ") and lines[2].startswith("TPOT ")
    out = json.loads(lines[-1])
    assert len(out["tokens"]) == 2 and all(len(t) == 2 for t in out["tokens"]) and out["tpot_ms"] > 0
    assert main(["generate", "--preset", "tiny", "--max-new-tokens", "2"]) == 2
    assert "--preset needs --random-weights" in capsys.readouterr().err
    assert main(["generate", "--preset", "tiny", "--random-weights", "--path", "reference",
                 "--max-new-tokens", "2"]) == 2
    assert "drop --path" in capsys.readouterr().err
