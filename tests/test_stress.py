"""scripts/stress.py --launches (launch kinds at every width, random replay order, bitwise checks): on the CPU a
few replays; the --flip-bit positive control must be caught, and a planted bad output word must fail the run."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import stress  # noqa: E402


def _run(capsys, *args):
    rc = stress.main(["--launches", "tail", "--widths", "1,2", "--replays", "3", *args])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_launch_stress_clean_with_control(capsys, one_thread):
    rc, out = _run(capsys, "--flip-bit")
    assert rc == 0 and out["ok"] and out["launch_builds"] == 2 and out["launch_replays"] == 3
    assert out["launch_wrong"] == 0 and out["launch_error_records"] == 0
    assert out["control_detected"] and out["flip_control_bad"] > 0


def test_launch_stress_catches_a_planted_bad_word(capsys, one_thread, monkeypatch):
    from glm53_flash.launches.tail import TailLaunch
    calls = {"n": 0}
    enqueue = TailLaunch.enqueue

    def corrupting(self, *a, **k):                 # after the two clean runs, every replay's logits[0] is off
        enqueue(self, *a, **k)
        calls["n"] += 1
        if calls["n"] > 2:
            self.logits.view(-1)[0] += 1.0
    monkeypatch.setattr(TailLaunch, "enqueue", corrupting)
    rc, out = _run(capsys)
    assert rc == 1 and not out["ok"] and out["launch_wrong"] == 3


def test_launch_stress_rejects_unknown_kinds():
    with pytest.raises(SystemExit):
        stress.main(["--launches", "tail,mla"])
