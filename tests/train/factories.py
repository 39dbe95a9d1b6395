"""Models and data for `gradsync train --model/--data tests.train.factories:NAME`.

Tiny on purpose: the train tests are about resuming, world sizes and guards, so
each step should cost nothing next to starting the workers. The recording
dataset appends every index it serves to ``$GRADSYNC_TEST_RECORD/<pid>-rank<r>.txt``,
which is how the world-size tests see what each worker trained on.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import gradsync as gs

N, D_IN, D_OUT, HIDDEN = 42, 6, 3, 8
RECORD_ENV = "GRADSYNC_TEST_RECORD"


def _record(obj, name: str, line: str) -> None:
    """Append ``line`` to ``$RECORD_ENV/name`` when that is set, through ``obj._file``
    (opened once per process, line-buffered: a killed worker loses no whole line)."""
    where = os.environ.get(RECORD_ENV)
    if where:
        if obj._file is None:
            obj._file = open(os.path.join(where, name), "a", buffering=1)
        obj._file.write(line + "\n")


def tiny64() -> nn.Module:
    """A float64 tanh MLP (for exactness to 1e-12)."""
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                         nn.Tanh(), nn.Linear(HIDDEN, D_OUT)).double()


class _SkipsALayer(nn.Module):
    """tiny64's layers plus one the forward never uses (an unused head, a skipped branch)."""

    def __init__(self):
        super().__init__()
        self.body = tiny64()
        self.unused = nn.Linear(D_IN, D_OUT).double()

    def forward(self, x):
        return self.body(x)


def skips_a_layer() -> nn.Module:
    return _SkipsALayer()


def tiny32() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D_OUT))


def wide32() -> nn.Module:
    """About 1 MiB of float32 parameters: a checkpoint of ~2 MiB with SGD momentum."""
    return nn.Sequential(nn.Linear(D_IN, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                         nn.Linear(512, D_OUT))


def tensors(n: int = N, dtype=torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=dtype)
    y = torch.randn(n, D_OUT, generator=g, dtype=dtype)
    return x, y


class Recording(Dataset):
    """(x[i], y[i]); records i when $GRADSYNC_TEST_RECORD names a directory."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self._file = None

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        _record(self, f"{os.getpid()}-rank{os.environ.get('RANK', '0')}.txt", f"{i}")
        return self.x[i], self.y[i]

    def __getstate__(self):
        return {"x": self.x, "y": self.y, "_file": None}


def samples(x, y) -> int:
    return len(x)


def regression64() -> gs.TrainData:
    """Float64 regression, recorded, with a held-out set; loss and items given explicitly
    (so nothing probes the training set outside a step)."""
    x, y = tensors()
    hx, hy = tensors(10, seed=2)
    return gs.TrainData(train=Recording(x, y), eval=torch.utils.data.TensorDataset(hx, hy),
                        loss_fn=F.mse_loss, items_fn=samples, item_name="samples")


def regression32() -> torch.utils.data.TensorDataset:
    """A plain Dataset of float32 (input, target): the loss defaults to MSE."""
    x, y = tensors(dtype=torch.float32)
    return torch.utils.data.TensorDataset(x, y)


class _Slow(nn.Module):
    """tiny64 whose forward takes ``$GRADSYNC_TEST_FORWARD_S`` seconds (default 0.03): a
    run long enough for a second torchrun agent to join it in the middle. Once the file
    ``$GRADSYNC_TEST_FORWARD_FILE`` exists, its content is the delay instead: a test sets
    it to 0 when the slow part has done its job, and the rest of the run goes at speed."""

    def __init__(self):
        super().__init__()
        self.net = tiny64()

    def forward(self, x):
        import time

        delay = os.environ.get("GRADSYNC_TEST_FORWARD_S", "0.03")
        control = os.environ.get("GRADSYNC_TEST_FORWARD_FILE")
        if control:
            try:
                with open(control) as f:
                    delay = f.read().strip() or delay
            except FileNotFoundError:
                pass
        time.sleep(float(delay))
        return self.net(x)


def slow64() -> nn.Module:
    return _Slow()


class _PerSample(nn.Module):
    """tiny64 whose forward takes 20 ms per sample (``$GRADSYNC_TEST_SAMPLE_S``): compute
    that grows with the share, as a real model's does, so a smaller share is faster."""

    def __init__(self):
        super().__init__()
        self.net = tiny64()

    def forward(self, x):
        import time

        time.sleep(float(os.environ.get("GRADSYNC_TEST_SAMPLE_S", "0.02")) * len(x))
        return self.net(x)


def per_sample64() -> nn.Module:
    return _PerSample()


VOCAB, SEQ = 11, 6
PADDED_N = 24


class PaddedLM(nn.Module):
    """A transformers-style causal LM in float64: keyword inputs (``input_ids``,
    ``attention_mask``), logits out; position t sees tokens 0..t (prefix sums)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)
        self.double()

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1).to(torch.float64)
        return self.head(torch.tanh(self.mix(torch.cumsum(h, dim=1))))


def padded_lm() -> nn.Module:
    return PaddedLM()


def padded_arrays(n: int = PADDED_N, seed: int = 3):
    """Right-padded sequences of random lengths (many of length 1: no target at all);
    labels are the next token, -100 wherever there is none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (n,), generator=g)
    lengths[torch.rand(n, generator=g) < 0.4] = 1
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    ids = ids * mask
    labels = torch.full_like(ids, -100)
    nxt = mask[:, 1:].bool()
    labels[:, :-1] = torch.where(nxt, ids[:, 1:], labels[:, :-1])
    return ids, mask, labels


class PaddedTokens(Dataset):
    """({"input_ids", "attention_mask"}, labels): the layout transformers' collators give."""

    def __init__(self):
        self.ids, self.mask, self.labels = padded_arrays()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}, self.labels[i]


def padded_tokens() -> Dataset:
    """A plain Dataset: loss and items follow from the integer targets (-100 ignored)."""
    return PaddedTokens()


def tiny_gpt2() -> nn.Module:
    """transformers' GPT-2 from a config (no download), float64, eager attention, no
    dropout; its output is a ModelOutput whose ``logits`` the default loss reads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True, attn_implementation="eager")
    return GPT2LMHeadModel(config).double()


class DictSamples(Dataset):
    """Samples as one dict whose targets are under a key no convention names (transformers'
    are "labels", which train accepts: tests/train/test_conventions.py)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": torch.zeros(SEQ, dtype=torch.long), "targets": torch.zeros(SEQ)}


def dict_samples() -> Dataset:
    return DictSamples()


class _Normed(nn.Module):
    """tiny64 with a LayerNorm: biases and the norm's gain and bias are not decayed."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, D_OUT)
        self.double()

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def normed64() -> nn.Module:
    return _Normed()


def user_adamw(param_groups, lr):
    """An optimizer factory (``--optimizer``): AdamW with its own betas and decay, which
    the groups' options (set by --weight-decay/--betas when given) override."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=(0.8, 0.99), weight_decay=0.5)


def halving(optimizer, total_steps):
    """A scheduler factory (``--scheduler``): the learning rate halves every 2 steps."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def abs_error(output, target):
    """An eval metric: (sum of |error|, elements) -> the mean absolute error."""
    return (output - target).abs().sum(), target.numel()


def positive(output, target):
    """An eval metric: the share of outputs with the target's sign."""
    return int(((output > 0) == (target > 0)).sum()), target.numel()


def regression64_metrics() -> gs.TrainData:
    """regression64 with two metrics beside the held-out loss."""
    data = regression64()
    data.metrics = {"mae": abs_error, "sign": positive}
    return data


def _teacher(n: int, seed: int):
    """Inputs and the outputs of a fixed random tanh layer (seed 7): learnable, so the
    held-out loss falls, then levels off (what --keep-best and --early-stop watch)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(D_IN, D_OUT, generator=g, dtype=torch.float64)
    x = torch.randn(n, D_IN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, torch.tanh(x @ w)


def teacher64() -> gs.TrainData:
    """Float64 regression on a teacher, with a held-out set of the same teacher and the
    two metrics of regression64_metrics."""
    x, y = _teacher(48, 1)
    hx, hy = _teacher(16, 2)
    return gs.TrainData(train=Recording(x, y), eval=torch.utils.data.TensorDataset(hx, hy),
                        loss_fn=F.mse_loss, items_fn=samples, item_name="samples",
                        metrics={"mae": abs_error, "sign": positive})


INIT_ENV = "GRADSYNC_TEST_INIT"


def tiny64_from_env() -> nn.Module:
    """tiny64 holding the weights of the safetensors file ``$GRADSYNC_TEST_INIT``, loaded
    by the factory itself: what ``--init-from`` of that file must train exactly like."""
    from safetensors.torch import load_model

    model = tiny64()
    if not next(model.parameters()).is_meta:  # the free-space estimate builds it on meta
        load_model(model, os.environ[INIT_ENV])
    return model


def teacher32() -> gs.TrainData:
    """teacher64 in float32 (for bf16 runs): samples a float32 model reads, the loss default."""
    x, y = _teacher(48, 1)
    hx, hy = _teacher(16, 2)
    return gs.TrainData(train=torch.utils.data.TensorDataset(x.float(), y.float()),
                        eval=torch.utils.data.TensorDataset(hx.float(), hy.float()),
                        metrics={"mae": abs_error})


class _Block(nn.Module):
    """A residual tanh block with dropout (the recomputed forward must draw the same mask)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class _Blocks(nn.Module):
    """tiny64's shape with its hidden layers as a ModuleList of blocks: what
    --activation-checkpointing (and zero3's default wrap) finds."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.out = nn.Linear(HIDDEN, D_OUT)
        self.double()

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def blocks64() -> nn.Module:
    return _Blocks()


WORDS = ["[PAD]", "[UNK]", "a", "b", "c", "d", "e", "f", "g", "h", "i"]  # VOCAB == 11


def word_tokenizer():
    """A transformers tokenizer built offline: one id per word of :data:`WORDS`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def tokenized_lm() -> gs.TrainData:
    """padded_tokens' samples with the tokenizer that (notionally) made them: what an hf
    export saves beside the model (``gradsync export --format hf --data``)."""
    return gs.TrainData(train=PaddedTokens(), tokenizer=word_tokenizer())


def dropout_per_rank64() -> nn.Module:
    """tiny64 with dropout whose random stream differs per rank (seeded with the rank
    after the build, as users do for per-replica noise): a resume must restore each
    rank's own stream, not rank 0's on every rank."""
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Dropout(0.3),
                          nn.Linear(HIDDEN, D_OUT)).double()
    torch.manual_seed(1000 + gs.rank())
    return model


class _Timed(nn.Module):
    """tiny64 whose forward takes 20 ms a sample and that notes, per rank, when each
    forward ended and when its backward reached the output (``$GRADSYNC_TEST_RECORD``):
    where an emulated straggler sleeps, as the workers ran it."""

    def __init__(self):
        super().__init__()
        self.net = tiny64()
        self._file = None

    def _note(self, what: str) -> None:
        import time

        _record(self, f"times-rank{os.environ.get('RANK', '0')}-{os.getpid()}.txt",
                f"{what} {time.perf_counter()!r}")

    def forward(self, x):
        import time

        self._note("forward")
        time.sleep(0.02 * len(x))
        out = self.net(x)
        if out.requires_grad:
            out.register_hook(lambda g: self._note("backward") or g)
        self._note("forwarded")
        return out


def timed64() -> nn.Module:
    return _Timed()
