"""Dict inputs and -100 padding labels under `gradsync train`: the exact global token mean.

A user's dataset in the layout transformers' collators give -- ``({"input_ids",
"attention_mask"}, labels)`` with -100 where a position has no target -- trains
with no loss or item function given: the model is called as ``model(**inputs)``,
the loss is the cross-entropy over non-ignored targets and an item is such a
target. Sequences have random lengths and many have no target at all, so ranks
and micro-batches hold different token counts (some none). Every step's logged
loss and the final parameters must equal one process on each whole global batch
(float64 SGD with momentum, 1e-12), for a small model of ours and for
transformers' GPT-2 (whose output is a ModelOutput: the default loss reads its
``logits``), the latter also sharded (zero3, GPT-2 blocks as units).
"""

import pytest
import torch
import torch.nn.functional as F

import gradsync as gs
from gradsync.rundir import METRICS, read_metrics
from gradsync.train.task.schedule import lr_factor
from tests.train import factories
from tests.train.factories import PADDED_N, padded_arrays

STEPS, GB, MB, WORKERS = 4, 8, 2, 2


def _cfg(out, model="padded_lm", strategy="ddp"):
    return gs.TrainConfig(
        workers=WORKERS, steps=STEPS, global_batch=GB, micro_batch=MB, lr=0.5, warmup=1,
        optimizer="sgd", strategy=strategy, out=str(out), clip=0.0, checkpoint_every=0,
        eval_every=0,
        no_report=True, seed=0, timeout=60, model=f"tests.train.factories:{model}",
        data="tests.train.factories:padded_tokens")


def _order(length):
    out, epoch = [], 0
    while len(out) < length:
        out += torch.randperm(PADDED_N, generator=torch.Generator().manual_seed(epoch)).tolist()
        epoch += 1
    return out[:length]


@pytest.mark.parametrize("model,strategy", [("padded_lm", "ddp"), ("tiny_gpt2", "ddp"),
                                            ("tiny_gpt2", "zero3")])
def test_dict_inputs_and_padding_labels_train_on_the_global_token_mean(tmp_path, model,
                                                                       strategy):
    if model == "tiny_gpt2":
        pytest.importorskip("transformers", reason="transformers is not installed")
    out = tmp_path / "run"
    summary = gs.train(_cfg(out, model, strategy))
    assert summary["strategy"] == strategy

    ids, mask, labels = padded_arrays()
    order = _order(STEPS * GB)
    empty = 0  # micro-batches with no target at all: they must count for nothing
    for j in range(STEPS):
        block = order[j * GB:(j + 1) * GB]
        for r in range(WORKERS):
            share = block[r::WORKERS]
            for k in range(0, len(share), MB):
                empty += int((labels[share[k:k + MB]] != -100).sum() == 0)
    assert empty >= 1, "the data should hold a micro-batch of padding only"

    torch.manual_seed(0)
    net = getattr(factories, model)()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, _cfg("x").resolved()))
    ref = []
    for j in range(STEPS):
        block = order[j * GB:(j + 1) * GB]
        logits = net(input_ids=ids[block], attention_mask=mask[block])
        logits = getattr(logits, "logits", logits)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[block].reshape(-1))
        ref.append(loss.item())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    metrics = read_metrics(str(out / METRICS))[0]
    gaps = [abs(m["loss"] - r) for m, r in zip(metrics, ref)]
    assert len(gaps) == STEPS and max(gaps) <= 1e-12, gaps
    state = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    gap = max(float((state[k] - v).abs().max()) for k, v in net.state_dict().items())
    assert gap <= 1e-12, gap
