"""`gradsync calibrate`: end to end on a tiny model, and one-line errors for bad input."""

import json

import pytest

from gradsync.cli import main
from gradsync.plan.profile import load_profile

TINY = "tests.calibrate.factories:tiny"


def test_end_to_end_profile_png_and_simulate(tmp_path, capsys, monkeypatch):
    import gradsync.calibrate.collectives as coll

    monkeypatch.setattr(coll, "default_sizes", lambda quick: [4096, 65536, 1 << 20])
    monkeypatch.setattr("gradsync.calibrate.session.default_sizes", coll.default_sizes)
    out, png = tmp_path / "p.json", tmp_path / "fit.png"
    assert main(["calibrate", "--model", TINY, "--quick", "--out", str(out),
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "all_reduce" in text and "R²" in text and "backward" in text
    prof = load_profile(str(out))
    assert prof.world_size == 2 and len(prof.params) == 6
    assert 0 <= prof.overlap_compute_penalty < 1 and 0 <= prof.overlap_comm_penalty < 1
    assert prof.alpha_s >= 0 and prof.beta_s_per_byte >= 0
    assert json.loads(out.read_text())["version"] == 1
    assert png.stat().st_size > 1000
    assert main(["simulate", "--profile", str(out)]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--model", "resnet"], "unknown model"),
    (["--workers", "0"], "--workers must be >= 2"),
    (["--model", "no_such_module_xyz:build"], "cannot import"),
    (["--model", "tests.calibrate.factories:missing"], "no callable"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--model", "tests.calibrate.factories:not_a_module"], "not a torch.nn.Module"),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, words):
    code = main(["calibrate", *argv, "--out", str(tmp_path / "p.json")])
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("gradsync calibrate: error:") and words in lines[0]
