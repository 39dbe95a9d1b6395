"""What is being calibrated: a model, one worker's micro-batch, its loss and optimizer.

Calibration must time the step the user will run, so the built-in models use
the shapes ``gradsync train`` and ``benchmarks/ddp_vs_torch.py`` use (gpt:
micro-batch 8 x 128 tokens, cross-entropy, AdamW; mlp: 64 x 1024, MSE, SGD with
momentum). A ``module:factory`` names a function returning an ``nn.Module``; its
batch comes from the module's ``example_batch(micro_batch, seq_len)`` method if it
has one, otherwise from its first parameterised layer (``nn.Linear`` -> random
features, ``nn.Embedding`` -> random token ids), and its loss is the mean square
of the output's logits (any scalar works: only time is measured); the logits are
read as ``gradsync train``'s default loss reads them, so Hugging Face
transformers models (whose forward returns a ``ModelOutput``) work as they are.
If the model's first forward fails on that batch (e.g. ``--seq-len`` longer than
its position table) the error is a one-line UsageError naming the input shape.
It is rebuilt from the spec string inside each worker, so only the string
crosses process boundaries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import GradsyncError, UsageError
from ..plan.memory import load_factory

BUILTIN = ("gpt", "mlp")
DEFAULT_MICRO_BATCH = {"gpt": 8, "mlp": 64}
DEFAULT_SEQ_LEN = 128


@dataclass
class Workload:
    """A model and a closure computing its loss on a fixed micro-batch."""

    spec: str
    model: object  # torch.nn.Module (torch is imported lazily)
    loss: Callable  # loss(model) -> scalar tensor
    make_optimizer: Callable  # make_optimizer(params) -> torch.optim.Optimizer
    micro_batch: int
    seq_len: int


def check_spec(spec: str) -> None:
    """Fail early (before spawning anything) on a spec that cannot work."""
    if spec in BUILTIN:
        return
    if ":" not in spec:
        raise UsageError(f"unknown model {spec!r}; choose from {', '.join(BUILTIN)} "
                         "or pass module:factory")
    load_factory(spec)


def _example_batch(model, micro_batch: int, seq_len: int):
    import torch
    from torch import nn

    if hasattr(model, "example_batch"):
        return model.example_batch(micro_batch, seq_len)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return torch.randn(micro_batch, m.in_features)
        if isinstance(m, nn.Embedding):
            return torch.randint(0, m.num_embeddings, (micro_batch, seq_len))
    raise UsageError(f"cannot tell the input shape of {type(model).__name__}: give it an "
                     "example_batch(micro_batch, seq_len) method")


def output_logits(output):
    """The tensor the generic loss reads from a model's output.

    Mirrors ``gradsync train``'s default loss (``gradsync.train.task.build._logits``),
    implemented here so the engine does not import train's machinery: a Mapping
    (a transformers ``ModelOutput`` is one) through its ``"logits"``, an object
    with a ``logits`` attribute through it, a tuple or list through its first
    element, anything else as it is. A Mapping without ``"logits"`` (e.g. a base
    model's ``last_hidden_state`` output) gives its first value, as
    ``ModelOutput.to_tuple()[0]`` would.
    """
    if isinstance(output, Mapping):
        if "logits" in output:
            return output["logits"]
        for value in output.values():
            return value
        raise UsageError("the model returned an empty mapping; calibration needs a tensor")
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        if not output:
            raise UsageError("the model returned an empty sequence; calibration needs a tensor")
        return output[0]
    return output


def describe_batch(batch) -> str:
    """Shapes of a calibration batch, e.g. ``8x128 int64`` or ``(8x16 float32, 8x16 int64)``."""
    def one(x):
        shape = getattr(x, "shape", None)
        if shape is None:
            return type(x).__name__
        dtype = str(getattr(x, "dtype", "")).replace("torch.", "")
        return " ".join(filter(None, ["x".join(str(d) for d in shape) or "scalar", dtype]))

    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {one(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        return "(" + ", ".join(one(x) for x in batch) + ")"
    return one(batch)


def first_forward_error(spec: str, batch, seq_len: int, error: BaseException) -> UsageError:
    """The one-line UsageError for a user model that fails on its calibration batch."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    detail = f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__
    return UsageError(f"{spec} failed on the calibration input (shape {describe_batch(batch)}, "
                      f"--seq-len {seq_len}); if the model takes fewer positions, pass a "
                      f"smaller --seq-len (or give it an example_batch method): {detail}")


def build_workload(spec: str, micro_batch: int | None = None, seq_len: int | None = None,
                   seed: int = 0, device=None) -> Workload:
    """Build the model (seeded) and its micro-batch on ``device`` (default the CPU: under
    workers, the communication device); all failures are one-line UsageErrors."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    check_spec(spec)
    mb = micro_batch or DEFAULT_MICRO_BATCH.get(spec, 8)
    seq = seq_len or DEFAULT_SEQ_LEN
    if mb < 1 or seq < 1:
        raise UsageError(f"micro-batch and sequence length must be >= 1, got {mb} and {seq}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 100)
    if spec == "gpt":
        from ..models import build_model

        model = build_model("gpt", seq_len=seq).to(device)
        x = torch.randint(0, 256, (mb, seq), generator=g).to(device)
        y = torch.randint(0, 256, (mb, seq), generator=g).to(device)

        def loss(m):
            logits = m(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        return Workload(spec, model, loss, lambda p: torch.optim.AdamW(p, lr=1e-4), mb, seq)
    if spec == "mlp":
        from ..models import build_model

        model = build_model("mlp").to(device)
        x = torch.randn(mb, 1024, generator=g).to(device)
        y = torch.randn(mb, 1024, generator=g).to(device)
        return Workload(spec, model, lambda m: F.mse_loss(m(x), y),
                        lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), mb, seq)
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as e:
        raise UsageError(f"{spec} raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError(f"{spec} has no trainable parameters")
    model = model.to(device)
    batch = _example_batch(model, mb, seq)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                 for a in (batch if isinstance(batch, tuple) else (batch,)))

    checked = False

    def generic_loss(m):
        nonlocal checked
        if checked:
            out = m(*args)
        else:  # the first forward on the user's model: a failure here is bad input
            try:
                out = m(*args)
            except GradsyncError:
                raise
            except Exception as e:
                raise first_forward_error(spec, batch, seq, e) from None
            checked = True
        return output_logits(out).float().square().mean()

    return Workload(spec, model, generic_loss, lambda p: torch.optim.SGD(p, lr=1e-3), mb, seq)
