"""Intra-/inter-host link calibration: the fit from a payload, and a real run on netlab."""

import json

import pytest

from gradsync.calibrate.links import (
    calibration_from_json,
    calibration_to_json,
    summarise,
)
from gradsync.errors import UsageError
from gradsync.netlab import unavailable_reason
from gradsync.plan.two_level import predict


def payload(alpha_i, beta_i, alpha_e, beta_e, sizes=(4096, 65536, 1 << 20)):
    def rows(a, b):  # 3 reps; one outlier per size that the median must ignore
        return [[a + b * n, 9.0, a + b * n] for n in sizes]

    return {"version": 1, "hosts": 2, "ranks_per_host": 2, "sizes": list(sizes), "reps": 3,
            "intra": {"pair": [0, 1], "seconds": rows(alpha_i, beta_i)},
            "inter": {"pair": [0, 2], "seconds": rows(alpha_e, beta_e)}}


def test_fit_round_trip_and_planner_view():
    cal = summarise(payload(1e-4, 1e-10, 5e-4, 8e-8), rate="100mbit")
    assert cal.intra.fit.alpha_s == pytest.approx(1e-4, rel=1e-6)
    assert cal.inter.fit.beta_s_per_byte == pytest.approx(8e-8, rel=1e-6)
    assert calibration_from_json(calibration_to_json(cal)) == cal
    topo = cal.topology(hosts=4)
    assert (topo.hosts, topo.ranks_per_host) == (4, 2)
    assert topo.inter.beta_s_per_byte == pytest.approx(8e-8, rel=1e-6)
    assert predict("hierarchical", 1e6, topo).seconds < predict("ring", 1e6, topo).seconds
    one = payload(1e-4, 1e-10, 5e-4, 8e-8)
    del one["intra"]
    assert summarise(one).intra is None and summarise(one).topology().intra.alpha_s == 0
    with pytest.raises(UsageError, match="version"):
        summarise({**one, "version": 0})


def test_a_links_file_that_is_not_an_object_is_one_line():
    """Issue 34: ``--links`` holding a JSON list was an AttributeError traceback at 4ab900c."""
    with pytest.raises(UsageError, match="it holds a JSON list, not a links file's object"):
        calibration_from_json("[1, 2]")


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_netlab_calibrate_end_to_end(tmp_path, capsys):
    from gradsync.cli import main

    out, png = tmp_path / "links.json", tmp_path / "links.png"
    code = main(["netlab", "calibrate", "--hosts", "2", "--procs-per-host", "2", "--rate",
                 "400mbit", "--quick", "--reps", "2", "--out", str(out), "--png", str(png),
                 "--timeout", "120"])
    text = capsys.readouterr().out
    assert code == 0, text[-3000:]
    assert "intra" in text and "inter" in text and "hierarchical" in text
    cal = calibration_from_json(out.read_text())
    assert cal.rate == "400mbit" and cal.hosts == 2 and cal.ranks_per_host == 2
    assert cal.inter.nbytes[-1] == 4 << 20 and cal.intra is not None
    assert len(cal.inter.median_s) == len(cal.inter.nbytes)  # a time for every size
    # the limited link is the slow one: 4 MB cannot cross 400 Mbit/s in under 84 ms (a
    # floor the limiter guarantees, not a speed claim), and loopback takes a few ms
    assert cal.inter.median_s[-1] > (4 << 20) / 50e6
    assert cal.inter.median_s[-1] > 3 * cal.intra.median_s[-1]
    assert png.stat().st_size > 1000
    assert json.loads(out.read_text())["version"] == 1
