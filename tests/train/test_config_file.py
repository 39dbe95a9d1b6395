"""``gradsync train --config run.toml`` and ``--print-config``: the command line written down.

Nothing here launches a worker: ``--print-config`` resolves the flags and exits, which is
where the file's values, the command line's and the defaults meet.
"""

import sys

import pytest

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.train.__main__ import main as torchrun_main
from gradsync.train.launcher.api import _config
from tests.cli_in_process import cli_here

MANY = dict(workers=3, steps=40, global_batch=24, micro_batch=4, lr=0.01, warmup=0,
            schedule="constant", optimizer="sgd", weight_decay=0.01, bucket_cap_mb="auto",
            seed=7, out="runs/with \"quotes\" and \\ back", model="mlp", strategy="ddp",
            straggler="1:0.5@3", clip=0.5, checkpoint_every=10, eval_every=5, trace_steps="2:3",
            log="csv", keep_last=2, keep_best="eval_loss", early_stop="eval_loss:3:0.01",
            activation_checkpointing=True, loader_workers=2, find_unused_parameters=True)


def test_print_config_reads_back_to_the_same_run(tmp_path):
    cfg = gs.TrainConfig(**MANY)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    again = gs.TrainConfig.from_file(str(path))
    assert again.resolved() == cfg.resolved()  # every section, derived values included
    assert gs.TrainConfig.from_file(str(path), steps=5).resolved().run.steps == 5
    text = path.read_text()
    assert "weight-decay = 0.01" in text and 'bucket-cap-mb = "auto"' in text
    assert "trace = true" in text  # --trace-steps implies --trace: the resolved value


def test_the_command_line_wins_and_the_output_is_a_fixed_point(tmp_path, capfd):
    path = tmp_path / "run.toml"
    path.write_text('steps = 12\nlr = 1.0\nglobal_batch = 32\nkeep-best = "eval_loss"\n'
                    'out = "runs/x"\n')
    r = cli_here("train", "--config", str(path), "--lr", "0.003", "--glob", "64",
                 "--print-config", capfd=capfd)
    assert r.returncode == 0, r.stderr
    lines = set(r.stdout.splitlines())
    assert {"steps = 12", "lr = 0.003", "global-batch = 64", 'keep-best = "eval_loss"',
            "warmup = 20", 'data = "pysrc"', "clip = 1.0"} <= lines  # typed > file > default
    printed = tmp_path / "printed.toml"
    printed.write_text(r.stdout)
    r2 = cli_here("train", "--config", str(printed), "--print-config", capfd=capfd)
    assert r2.returncode == 0 and r2.stdout == r.stdout


@pytest.mark.parametrize("text,needle", [
    ("stpes = 3\n", "unknown key 'stpes' (did you mean steps?)"),
    ('steps = "ten"\n', 'steps = "ten": --steps takes a whole number'),
    ("lr = true\n", "lr = true: --lr takes a number"),
    ('strategy = "zero9"\n', "--strategy takes one of ddp, zero1, zero2, zero3"),
    ('model = "gpt2"\n', "unknown model 'gpt2'"),
    ("steps = = 3\n", "is not valid TOML (Invalid value (at line 1, column 9))"),
    ("[run]\nsteps = 3\n", "unknown key 'run'"),
    ("keep_last = 1\nkeep-last = 2\n", "keep-last is given twice"),
    ("print-config = true\n", "is an option of the command itself"),
    ('keep-best = "acc:up"\n', "--keep-best takes NAME[:min|:max]"),
    ("steps = 0\n", "--steps must be an integer >= 1"),
])
def test_a_bad_file_is_one_line(tmp_path, capfd, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    r = cli_here("train", "--config", str(path), "--print-config", capfd=capfd)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_files_that_are_not_a_config(tmp_path, capfd):
    cases = {"missing": (tmp_path / "nope.toml", "no such file"),
             "a directory": (tmp_path, "is not a regular file"),
             "binary": (tmp_path / "bin.toml", "is not UTF-8 text"),
             "huge": (tmp_path / "huge.toml", "a file of flags is a few KiB")}
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00steps")
    (tmp_path / "huge.toml").write_text("# x\n" * 300_000)
    for path, needle in cases.values():
        r = cli_here("train", "--config", str(path), capfd=capfd)
        assert r.returncode == 2 and needle in r.stderr and "--config" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_gs_train_takes_the_file_and_torchrun_too(tmp_path, capfd, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text('steps = 12\nmodel = "mlp"\nkeep-last = 3\n')
    cfg, _, _ = _config(str(path), None, None, {"steps": 4})  # gs.train(config=path, steps=4)
    assert (cfg.steps, cfg.model, cfg.keep_last, cfg.data) == (4, "mlp", 3, "teacher")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    capfd.readouterr()
    assert torchrun_main(["--config", str(path), "--steps", "9", "--print-config"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert "steps = 9" in out and "keep-last = 3" in out


def test_without_a_toml_reader_the_flag_says_so(tmp_path, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text("steps = 3\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10 without tomli
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(UsageError, match="Python 3.11 or later has one .tomllib.; on 3.10, "
                                         "pip install tomli"):
        gs.TrainConfig.from_file(str(path))
