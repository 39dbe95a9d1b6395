"""`gradsync plan ...` and `gradsync simulate` in-process: exit codes and outputs."""

import json

import pytest

from gradsync.cli import main
from gradsync.plan.profile import PROFILE_VERSION, profile_to_json, synthetic_profile


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_memory_worked_numbers_json(capsys):
    code, out, _ = run(capsys, "plan", "memory", "7.5e9", "--workers", "64", "--precision",
                       "bf16", "--device-memory", "80GB", "--json")  # the paper's accounting
    assert code == 0
    plan = json.loads(out)
    totals = [round(s["total"] / 1e9, 1) for s in plan["stages"]]
    assert totals == [120.0, 31.4, 16.6, 1.9]
    assert [s["fits"] for s in plan["stages"]] == [False, True, True, True]


def test_memory_table_and_png(capsys, tmp_path):
    png = tmp_path / "m.png"
    code, out, _ = run(capsys, "plan", "memory", "7B", "--workers", "8", "--seq-len", "4096",
                       "--hidden", "4096", "--layers", "32", "--heads", "32",
                       "--checkpointing", "full", "--device-memory", "24GiB", "--png", str(png))
    assert code == 0
    assert "ZeRO-3" in out and "does not fit" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_module_factory(capsys):
    code, out, _ = run(capsys, "plan", "memory", "tests.plan.factories:tiny_mlp", "--json")
    assert code == 0 and json.loads(out)["num_params"] == 212


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["plan", "memory", "7B", "--device-memory", "24XB"], "unknown unit 'XB'"),
        (["plan", "memory", "7B", "--workers", "0"], "--workers"),
        (["plan", "memory", "--", "-5B"], "parameter count"),
        (["plan", "memory", "0"], "must be > 0"),
        (["plan", "memory", "no_such_mod_xyz:build"], "cannot import"),
        (["plan", "memory", "tests.plan.factories:not_a_module"], "not a torch.nn.Module"),
        (["plan", "memory", "7B", "--seq-len", "1024"], "needs --seq-len"),
        (["plan", "batch", "--tokens", "4M", "--seq-len", "4096", "--micro-batch", "2",
          "--workers", "0,8"], "--workers must be >= 1"),
        (["plan", "batch", "--tokens", "0", "--seq-len", "4096", "--micro-batch", "2",
          "--workers", "8"], "--tokens must be > 0"),
        (["plan", "comm", "2e9", "--bandwidth", "25XB/s"], "unknown unit"),
        (["plan", "comm", "2e9", "--workers", "0"], "--workers"),
        (["plan", "comm", "2e9", "--latency", "5 parsecs"], "latency"),
        (["simulate", "--bucket-mb", "0"], "--bucket-mb"),
        (["simulate", "--layers", "0"], "--layers"),
        (["simulate", "--workers", "0"], "--workers"),
        (["simulate", "--profile", "/nonexistent/p.json"], "cannot read profile"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 2
    line = one_line_error(err)
    assert fragment in line
    prefix = "gradsync simulate" if argv[0] == "simulate" else f"gradsync plan {argv[1]}"
    assert line.startswith(prefix + ": error: ")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "memory", "7B", "--workers", "many"])
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["plan"], ["plan", "memory"], ["plan", "batch"],
                                  ["plan", "comm"], ["simulate"]])
def test_every_command_has_help(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--help"])
    assert e.value.code == 0
    assert "usage: gradsync" in capsys.readouterr().out


def test_batch_4m_token_table(capsys):
    code, out, _ = run(capsys, "plan", "batch", "--tokens", "4M", "--seq-len", "4096",
                       "--micro-batch", "2", "--workers", "128,512,1024", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["samples"] == 1024 and int(plan["samples_exact"]) == 976
    assert [r["grad_accum"] for r in plan["rows"]] == [4, 1, 0.5]
    assert [r["below_one"] for r in plan["rows"]] == [False, False, True]
    code, out, _ = run(capsys, "plan", "batch", "--tokens", "4M", "--seq-len", "4096",
                       "--micro-batch", "2", "--workers", "128,512,1024")
    assert "accumulation < 1" in out


def test_batch_table_says_micro_steps_per_worker_not_steps_to_run():
    """Issue 37: the column was "steps to run", read as optimizer steps; it is each
    worker's micro-steps per optimizer step (grad_acc rounded up)."""
    from gradsync.observe.plan_tables import batch_table
    from gradsync.plan.batch import plan_batch

    table = batch_table(plan_batch(4_000_000, 4096, 2, [128, 512, 1024]))
    heads = [c.header for c in table.columns]
    assert "steps to run" not in heads
    col = table.columns[heads.index("micro-steps per worker per step")]
    assert list(col.cells) == ["4", "1", "1"]
    assert "per optimizer step" in str(table.caption)


def test_comm_ps_vs_ring_exercise(capsys, tmp_path):
    code, out, _ = run(capsys, "plan", "comm", "2e9", "--itemsize", "2", "--bandwidth",
                       "25GB/s", "--workers", "8,64,512", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["ps_ingress_s"] for r in rows] == pytest.approx([1.28, 10.24, 81.92])
    assert [r["ring_s"] for r in rows] == pytest.approx([0.28, 0.315, 0.319375])
    png = tmp_path / "c.png"
    code, out, _ = run(capsys, "plan", "comm", "2e9", "--per-node", "8", "--intra-bandwidth",
                       "300GB/s", "--png", str(png))
    assert code == 0 and "hier 8/node" in out and png.stat().st_size > 0


def _links_file(tmp_path):
    """A links file as `gradsync netlab calibrate` writes it: 2 hosts x 2 ranks, 100 Mbit/s."""
    from gradsync.calibrate.links import (
        LinkCalibration,
        LinkTiming,
        calibration_to_json,
    )
    from gradsync.plan.calibrate_fit import fit_alpha_beta

    sizes = [4096, 65536, 1 << 20, 16 << 20]

    def timing(name, pair, alpha, rate):
        medians = [alpha + n * 8 / rate for n in sizes]
        return LinkTiming(name, pair, tuple(sizes), tuple(medians), fit_alpha_beta(sizes, medians))

    cal = LinkCalibration(2, 2, 5, timing("inter", (0, 2), 3e-4, 100e6),
                          timing("intra", (0, 1), 2e-5, 10e9), "100mbit")
    path = tmp_path / "links.json"
    path.write_text(calibration_to_json(cal))
    return path


def test_comm_with_measured_links_prices_the_two_level_algorithms(capsys, tmp_path):
    """`netlab calibrate` writes links.json; `plan comm --links` prices a model's all-reduce
    on those two links, hosts of the measured size unless --per-node says otherwise."""
    links = _links_file(tmp_path)
    png = tmp_path / "two.png"
    code, out, _ = run(capsys, "plan", "comm", "8e6", "--itemsize", "4", "--links", str(links),
                       "--workers", "4,8", "--png", str(png))
    assert code == 0 and png.stat().st_size > 0
    assert "hosts of 2 ranks" in out and "100 Mbit/s" in out and "hierarchical" in out
    code, out, _ = run(capsys, "plan", "comm", "8e6", "--itemsize", "4", "--links", str(links),
                       "--workers", "4,8", "--json")
    plan = json.loads(out)
    assert plan["nbytes"] == 32e6 and plan["ranks_per_host"] == 2
    assert [(r["workers"], r["hosts"]) for r in plan["rows"]] == [(4, 2), (8, 4)]
    ring, _, server, hier = (c["seconds"] for c in plan["rows"][0]["costs"])
    assert ring == pytest.approx(6 * (3e-4 + 32e6 / 4 * 8 / 100e6), rel=1e-3)
    assert hier < ring < server
    code, out, _ = run(capsys, "plan", "comm", "8e6", "--links", str(links), "--per-node", "4",
                       "--workers", "8", "--json")
    assert json.loads(out)["rows"][0]["hosts"] == 2
    for argv, fragment in (([str(tmp_path / "none.json")], "No such file"),
                           ([str(links), "--workers", "3"], "[3] do not fill hosts of 2"),
                           ([str(png)], "is not a links file")):
        code, _, err = run(capsys, "plan", "comm", "8e6", "--links", *argv)
        assert code == 2 and fragment in one_line_error(err), err


def test_simulate_synthetic_outputs(capsys, tmp_path):
    files = {k: tmp_path / f"{k}.{ext}" for k, ext in
             (("timeline", "png"), ("sweep", "png"), ("page", "html"))}
    code, out, _ = run(capsys, "simulate", "--layers", "12", "--timeline-png",
                       str(files["timeline"]), "--sweep-png", str(files["sweep"]),
                       "--html", str(files["page"]))
    assert code == 0
    assert "scaling efficiency" in out and "optimal bucket" in out
    for f in files.values():
        assert f.stat().st_size > 1000
    assert "<script" in files["page"].read_text()


def test_simulate_profile_and_version_check(capsys, tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(profile_to_json(synthetic_profile(layers=4)))
    code, out, _ = run(capsys, "simulate", "--profile", str(prof), "--json",
                       "--bandwidth", "2GB/s", "--accum", "2")
    assert code == 0
    result = json.loads(out)["result"]
    assert result["accum_steps"] == 2 and result["step_s"] >= result["backward_s"]
    data = json.loads(prof.read_text())
    data["version"] = PROFILE_VERSION + 1
    prof.write_text(json.dumps(data))
    code, _, err = run(capsys, "simulate", "--profile", str(prof))
    assert code == 2 and "version" in one_line_error(err)
    prof.write_text("{not json")
    code, _, err = run(capsys, "simulate", "--profile", str(prof))
    assert code == 2 and "not JSON" in one_line_error(err)


def test_memory_counts_train_s_activation_checkpointing_and_loader(capsys):
    """`gradsync plan memory` with train's --activation-checkpointing and --loader-workers:
    each block's input plus one block recomputed; the loader's micro-batches in host memory."""
    shape = ["--seq-len", "128", "--hidden", "128", "--layers", "4", "--heads", "4",
             "--micro-batch", "8"]
    code, out, _ = run(capsys, "plan", "memory", "gpt", *shape, "--json")
    plain = json.loads(out)
    code, out, _ = run(capsys, "plan", "memory", "gpt", *shape, "--activation-checkpointing",
                       "--loader-workers", "2", "--json")
    assert code == 0
    plan = json.loads(out)
    s, b, h, a, L, i = 128, 8, 128, 4, 4, 4  # fp32: 4-byte activations
    one_layer = (16 * i + 2) * s * b * h + (2 * i + 1) * a * s * s * b
    assert plain["activations"] == L * one_layer
    assert plan["activations"] == L * i * s * b * h + one_layer and plan["checkpointing"] == "block"
    assert plan["loader"] == {"workers": 2, "prefetch": 2, "batch_bytes": 16 * s * b,
                              "batches": 5, "host": 5 * 16 * s * b, "pinned": 5 * 16 * s * b}
    code, out, _ = run(capsys, "plan", "memory", "gpt", *shape, "--activation-checkpointing",
                       "--loader-workers", "2")
    text = " ".join(out.split())  # the caption wraps to the table's width
    assert "one block's whole set while it is recomputed" in text
    assert "2 loader workers x 2 ahead + 1 in use = 5 micro-batches of 16.38 KB" in text
    code, _, err = run(capsys, "plan", "memory", "gpt", "--loader-workers", "2")
    assert code == 2 and "give --sample-bytes SIZE, or --seq-len" in one_line_error(err)
