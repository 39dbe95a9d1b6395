"""``--activation-checkpointing`` and ``--loader-workers``: less memory or more loading, the
same numbers.

The claim of sameness, bit for bit in float64: a model of blocks with dropout trains the
same steps -- every loss, every parameter -- with each block's activations recomputed in
backward, and with its micro-batches collated by DataLoader worker processes, under ddp
and zero3 (under ddp also when a worker is killed and the run restarts from its
checkpoint). The rest shows that each flag does what it says (a block's forward runs twice,
the batches come from other processes), and what is refused.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.train.task.build import build_task
from gradsync.train.task.recompute import checkpoint_blocks
from tests.cli_in_process import cli_here
from tests.train import factories
from tests.train.factories import RECORD_ENV, padded_arrays

pytestmark = pytest.mark.timeout(300)
FLAGS = dict(workers=2, steps=3, global_batch=8, micro_batch=2, lr=0.1, warmup=1,
             checkpoint_every=0, eval_every=3, no_report=True, timeout=60, drift_every=0,
             model="tests.train.factories:blocks64", data="tests.train.factories:teacher64")


def _run(out, faults=None, **kw):
    gs.train(gs.TrainConfig(**{**FLAGS, "out": str(out), **kw}), faults=faults)
    with open(out / "metrics.jsonl") as f:
        losses = [(r["loss"], r.get("eval_loss")) for r in map(json.loads, f) if "step" in r
                  and "event" not in r]
    return losses, torch.load(out / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_same_steps_with_either_flag(tmp_path, monkeypatch, strategy):
    plain = _run(tmp_path / "plain", strategy=strategy)
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv(RECORD_ENV, str(record))
    # ddp: and a worker killed in step 3, the run restarted from its checkpoint of step 2
    killed = gs.FaultInjector().fail_at(1, 3, "kill") if strategy == "ddp" else None
    both = _run(tmp_path / "both", killed, strategy=strategy, activation_checkpointing=True,
                loader_workers=2, checkpoint_every=1, max_restarts=1)
    assert [loss for loss, _ in both[0]] == [loss for loss, _ in plain[0]]
    assert both[0] == plain[0]  # every step's loss and the held-out loss, bit for bit
    assert all(torch.equal(both[1][k], plain[1][k]) for k in plain[1])
    # the training samples were read in processes other than the two training workers
    readers = {name.split("-")[0] for name in os.listdir(record)}
    assert len(readers) >= 3, readers


def test_a_block_runs_its_forward_again_in_backward():
    model = factories.blocks64()
    calls = []
    model.blocks[0].fc.register_forward_hook(lambda *a: calls.append(1))
    names = [n for n, _ in model.named_parameters()]
    assert checkpoint_blocks(model, "blocks64") == "3 _Block blocks"
    assert [n for n, _ in model.named_parameters()] == names  # nothing renamed
    x = torch.randn(4, factories.D_IN, dtype=torch.float64)
    model(x).sum().backward()
    assert len(calls) == 2  # once forward, once recomputed
    with torch.no_grad():
        model(x)
    assert len(calls) == 3  # nothing to keep under no_grad: not wrapped


def test_transformers_models_use_their_own_gradient_checkpointing():
    pytest.importorskip("transformers")
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = factories.tiny_gpt2()
        if recompute:
            assert "own gradient checkpointing" in checkpoint_blocks(model, "tiny_gpt2")
            assert getattr(model, "is_activation_checkpointing", None) or \
                model.is_gradient_checkpointing
        model.train()
        ids, mask, labels = padded_arrays(4, seed=1)
        out = model(input_ids=ids, attention_mask=mask).logits
        F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_the_built_in_gpt_and_a_model_without_blocks(tmp_path, capfd):
    task = build_task(gs.TrainConfig(activation_checkpointing=True, seq_len=16).resolved())
    assert task.model.cfg.checkpoint_activations
    cfg = gs.TrainConfig(activation_checkpointing=True, model="tests.train.factories:tiny64",
                         data="tests.train.factories:regression64").resolved()
    with pytest.raises(UsageError, match="--model tests.train.factories:tiny64 has no blocks"):
        build_task(cfg)
    r = cli_here("train", "--model", "mlp", "--activation-checkpointing", "--out",
                 str(tmp_path / "m"), "--steps", "1", "--no-report", capfd=capfd)
    assert r.returncode == 2 and "--model mlp has no blocks" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
