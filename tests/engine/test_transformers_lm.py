"""A Hugging Face causal LM under every strategy against one process on the whole batch.

The model is what users bring: ``transformers``' GPT-2 (2 layers, hidden 32,
vocabulary 64, eager attention, tied embeddings, no dropout), built from its
config (no download), in float64. Not Llama: its RMSNorm and eager softmax
compute in float32 even for float64 inputs, so after one step every strategy sat
1.5e-8 (SGD) from one process, float32 rounding amplifying 4e-17 differences in
the gradient; GPT-2 computes in the parameters' dtype throughout.

Sequences have different lengths, right-padded to one length with ``-100``
labels, so ranks and micro-steps hold different numbers of target tokens. The
loss is the mean token cross-entropy over every target of the global batch --
what one process computes on the whole batch -- and each rank passes its
micro-step's mean with ``num_items`` = its targets that are not ``-100`` after the
shift. Two micro-steps per step accumulate under ``no_sync``.

Strategies: DataParallel (ddp), ZeroOptimizer stage 1 and 2, FullyShardedDataParallel
with the GPT-2 block as the unit (zero3). Claim: after 3 steps every strategy's
parameters are within 1e-12 of one process's, with SGD-momentum and with AdamW
(measured on this machine, every strategy alike: 1.7e-16 with SGD, 5.3e-14 with
AdamW, whose division by sqrt(v) + eps amplifies rounding where v is tiny).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import gradsync as gs
from tests.helpers import SharedSpawn, job_table

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[dev]')")

WORLD, STEPS, MICRO, SEQS, LENGTH, VOCAB = 2, 3, 2, 2, 12, 64  # SEQS: per rank and micro-step
SGD_TOL, ADAMW_TOL = 1e-12, 1e-12
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double()


def batches():
    """[step][micro][rank] -> (input_ids, attention_mask, labels), right-padded to LENGTH."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(MICRO):
            micro = []
            for _ in range(WORLD):
                lengths = torch.randint(3, LENGTH + 1, (SEQS,), generator=g)
                ids = torch.randint(1, VOCAB, (SEQS, LENGTH), generator=g)
                mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
                ids = ids * mask  # pad id 0
                labels = ids.masked_fill(mask == 0, -100)
                micro.append((ids, mask, labels))
            step.append(micro)
        out.append(step)
    return out


def token_loss(model, ids, mask, labels):
    """Mean next-token cross-entropy over targets that are not -100; and their number."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    target = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target, ignore_index=-100,
                            reduction="sum")
    n = int((target != -100).sum())
    return total / n, n


def optimizer(kind):
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}


def reference(kind):
    """One process, each step's whole batch: every rank's and micro-step's sequences."""
    model = tiny_gpt2()
    cls, kw = optimizer(kind)
    opt = cls(model.parameters(), **kw)
    for step in batches():
        seqs = [b for micro in step for b in micro]
        ids, mask, labels = (torch.cat([s[i] for s in seqs]) for i in range(3))
        loss, _ = token_loss(model, ids, mask, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy, kind):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    module = tiny_gpt2()
    cls, kw = optimizer(kind)
    if strategy == "zero3":
        model = gs.FullyShardedDataParallel(module, wrap={GPT2Block})
        opt = cls(model.parameters(), **kw)
    else:
        model = gs.DataParallel(module, bucket_cap_mb=0.02, first_bucket_mb=0.005)
        opt = (cls(model.parameters(), **kw) if strategy == "ddp"
               else gs.ZeroOptimizer(model, cls, stage=int(strategy[-1]), **kw))
    counts = []
    for step in batches():
        for k, micro in enumerate(step):
            with model.no_sync() if k < MICRO - 1 else contextlib.nullcontext():
                loss, n = token_loss(model, *micro[gs.rank()])
                model.backward(loss, num_items=n)
                counts.append(n)
        opt.step()
        opt.zero_grad()
    if strategy == "zero3":
        state = model.full_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"state": state, "token_counts": counts}


RUNS = [(s, k) for s in STRATEGIES for k in ("sgd", "adamw")]
JOBS = job_table(*[(f"{s}-{k}", train, (s, k)) for s, k in RUNS])
SPAWN = SharedSpawn(JOBS)


def _results(name):
    return SPAWN.results(name, WORLD)


@pytest.mark.parametrize("strategy,kind", RUNS, ids=[f"{s}-{k}" for s, k in RUNS])
def test_gpt2_matches_one_process_on_the_whole_batch(strategy, kind):
    results = _results(f"{strategy}-{kind}")
    assert len(results) == WORLD == 2
    state0, counts0, counts1 = (results[0]["state"], results[0]["token_counts"],
                                results[1]["token_counts"])
    assert len(counts0) == len(counts1) > 0
    assert counts0 != counts1  # ranks really hold different numbers of target tokens
    for r, res in enumerate(results[1:], start=1):
        assert list(res["state"]) == list(state0), f"rank {r}"
        assert all(torch.equal(state0[k], res["state"][k]) for k in state0), f"rank {r} drifted"
    ref = reference(kind)
    assert list(state0) == list(ref)
    gap = max(float((state0[k] - ref[k]).abs().max()) for k in ref)
    tol = SGD_TOL if kind == "sgd" else ADAMW_TOL
    assert gap <= tol, f"{strategy} with {kind}: gap to one process {gap:.3e} > {tol:g}"
