"""Per-device memory of data-parallel training: plain DP and ZeRO stages 1-3.

Model states (ZeRO paper, arXiv 1910.02054, section 3.1): with P parameters,
mixed-precision Adam keeps 2P bytes of 16-bit parameters, 2P of 16-bit gradients
and K = 12P of optimizer state (fp32 master copy, Adam m and v), 16P in all.
ZeRO shards what each stage owns across the N data-parallel ranks:

* DP:     params + grads + K                 (16P)
* ZeRO-1: params + grads + K/N               (4P + 12P/N)
* ZeRO-2: params + (grads + K)/N             (2P + 14P/N)
* ZeRO-3: (params + grads + K)/N             (16P/N)

With fp32 gradient accumulation the gradient block is 2P + 4P = 6P (20P in all).

``gradsync plan memory`` defaults to what ``gradsync train`` runs, not to the paper:
``--precision fp32`` (4-byte parameters and gradients, which are their own master
copy: Adam 4 + 4 + 8 = 16P, the same total split differently, and ZeRO-1/2 shard
less of it) and the optimizer ``--optimizer auto`` stands for (AdamW; SGD with
momentum 0.9 for the built-in mlp). ``--precision bf16`` is the paper's accounting, and
``--precision fp16`` counts the same 2-byte parameters and gradients (it also keeps
the fp32 sum of the gradient from the end of backward to the step, where bf16 rounds
it into its 2-byte gradient: a transient the paper's count leaves out, like
DeepSpeed's fp32 partition below; ``--fp32-grad-accum`` adds it to the gradients).
The optimizer names are train's: ``sgd`` keeps a momentum buffer (4 B), as train's
``sgd`` does; ``sgd-plain`` (no momentum) keeps none.

Why DeepSpeed's estimator prints 2P + 18P/N for stage 2.
``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/stage_1_and_2.py,
current deepspeedai/DeepSpeed) returns ``2P + int(18P/N)`` without CPU offload, its
comment reading "18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
8_optimizer_states_32bit". The extra 4 bytes over the paper's 14P/N are the
**fp32 gradient partition** the optimizer step reads: DeepSpeed accumulates and
reduces gradients into an fp32 buffer for the shard each rank owns (its
``gradient_accumulation_dtype`` defaults to fp32), and the paper's count leaves
that buffer out. This planner gives the same number with ``fp32_grad_accum=True``
(gradient block 2 + 4 bytes, sharded at stage 2): 2P + (2 + 4 + 12)P/N. Older
DeepSpeed releases returned ``4P + 16P/N`` instead (full 16-bit gradients kept
unsharded); :func:`deepspeed_zero2_estimate` returns either. Note also that
DeepSpeed prints with GB = 2^30 bytes while this planner uses 10^9.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, section 4.1): per transformer layer
in 16-bit, ``s*b*h*(34 + 5*a*s/h)`` bytes = 34sbh + 5as^2b; with selective
recomputation (attention scores recomputed) 34sbh; with full activation
checkpointing only the layer input is kept, 2sbh per layer (the paper's count;
the one layer being recomputed briefly needs its full working set on top, which
the paper, and so this estimate, leaves out). ZeRO cannot shard
activations: each rank's micro-batch is its own. The paper's 34 is 16 stored
tensors of sbh 2-byte values plus two 1-byte dropout masks, and its 5 two such
as^2b tensors plus one mask, so with i-byte activations (``itemsize``; fp32
training stores 4-byte ones) a layer holds (16i + 2)sbh + (2i + 1)as^2b, selective
(16i + 2)sbh, full checkpointing i*sbh. Without a shape the activations are *not
estimated* (None, shown as such), never 0: a plan that fits on model states alone
says so.

``block`` is what ``gradsync train --activation-checkpointing`` does (each block's forward
under ``torch.utils.checkpoint``, ``train/task/recompute.py``): every block keeps its input,
i*sbh, and during backward the block being recomputed holds its whole working set again,
one layer of ``none`` -- the term the paper's "full" leaves out, counted here because it
is what the peak of a step holds: L*i*sbh + (16i + 2)sbh + (2i + 1)as^2b.

The data loader (``gradsync train --loader-workers N``, ``train/task/loader.py``) holds
host memory, not device memory: each worker keeps up to ``prefetch`` (2) collated
micro-batches ahead in shared memory, and the step holds the one it uses, (N x 2 + 1)
micro-batches; on a GPU each is pinned too (a page-locked copy beside it, which is what
makes the copy to the device asynchronous), twice that. Without workers the training
process holds one micro-batch (and its pinned copy on a GPU). :func:`loader_memory`
counts it from a sample's bytes (token data: input and target, 8 bytes a token each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from ..factory import load_factory  # noqa: F401 - re-exported: calibrate imports it here

STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "sgd-plain")
STATE_BYTES = {"adamw": 8.0, "adam": 8.0, "sgd": 4.0, "sgd-momentum": 4.0, "sgd-plain": 0.0}
"""Optimizer state per parameter in fp32: Adam's m and v; SGD's momentum buffer (train's
``sgd`` is momentum 0.9, so ``sgd`` here keeps one too; ``sgd-plain`` has none)."""
CHECKPOINTING = ("none", "selective", "full", "block")
"""``block``: what ``gradsync train --activation-checkpointing`` does (see the docstring)."""
PRECISIONS = ("fp32", "bf16", "fp16")
"""``gradsync train --precision``'s choices (a test holds the two lists equal; the planner
does not import the engine's registry, which imports torch)."""
ACTIVATION_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each model-state block, before sharding."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(
    optimizer: str = "adam", mixed_precision: bool = True, fp32_grad_accum: bool = False
) -> BytesPerParam:
    """Bytes per parameter (ZeRO, arXiv 1910.02054, section 3.1: 2 + 2 + 12 for
    mixed-precision Adam): Adam keeps m and v (8 B); mixed precision adds a 4 B fp32
    master copy.

    SGD with momentum (``sgd``, as train's) keeps one fp32 buffer (4 B), ``sgd-plain``
    none. In fp32 training the parameters are their own master copy, so no extra 4 B.
    """
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    state = STATE_BYTES[optimizer]
    if mixed_precision:
        grads = 2.0 + (4.0 if fp32_grad_accum else 0.0)
        return BytesPerParam(params=2.0, grads=grads, optimizer=state + 4.0)
    return BytesPerParam(params=4.0, grads=4.0, optimizer=state)


def train_optimizer(optimizer: str, model: str) -> str:
    """The optimizer ``gradsync train --optimizer auto`` builds for ``model`` (its rule:
    SGD with momentum for the built-in mlp, AdamW otherwise, a count included)."""
    if optimizer != "auto":
        return optimizer
    return "sgd" if str(model).strip() == "mlp" else "adamw"


@dataclass(frozen=True)
class ActivationShape:
    """Transformer shape for the activation estimate (per rank, per micro-batch)."""

    micro_batch: int
    seq_len: int
    hidden: int
    layers: int
    heads: int
    checkpointing: str = "none"
    itemsize: int = 2  # bytes per stored activation value: 2 in bf16, 4 in fp32

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "hidden", "layers", "heads", "itemsize"):
            if getattr(self, name) <= 0:
                flag = name.replace("_", "-")
                raise UsageError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.checkpointing not in CHECKPOINTING:
            choices = ", ".join(CHECKPOINTING)
            raise UsageError(f"unknown checkpointing {self.checkpointing!r} (one of {choices})")


def activation_bytes(shape: ActivationShape) -> float:
    """Korthikanti et al. 2022 per-layer coefficients (34 and 5 at 2 bytes; see the
    module docstring for ``itemsize``), no TP/SP."""
    s, b, h, a, L = shape.seq_len, shape.micro_batch, shape.hidden, shape.heads, shape.layers
    i = shape.itemsize
    per_sbh = 16 * i + 2  # 34 at 2 bytes
    if shape.checkpointing == "none":
        return float(L * (per_sbh * s * b * h + (2 * i + 1) * a * s * s * b))
    if shape.checkpointing == "selective":
        return float(L * per_sbh * s * b * h)
    if shape.checkpointing == "block":  # every block's input, and one block recomputed
        return float(L * i * s * b * h + per_sbh * s * b * h + (2 * i + 1) * a * s * s * b)
    return float(L * i * s * b * h)


@dataclass(frozen=True)
class LoaderMemory:
    """Host bytes the data loader holds (see the module docstring)."""

    workers: int
    prefetch: int
    batch_bytes: float  # one micro-batch: micro_batch x a sample's bytes
    batches: int  # micro-batches held at once: workers x prefetch + the one in use
    host: float  # batches x batch_bytes (shared memory with workers)
    pinned: float  # the page-locked copies on a GPU (0 on the CPU)


def loader_memory(workers: int, micro_batch: int, sample_bytes: float, prefetch: int = 2,
                  gpu: bool = True) -> LoaderMemory:
    """What ``--loader-workers`` holds in host memory for micro-batches of ``micro_batch``
    samples of ``sample_bytes`` each."""
    if workers < 0 or micro_batch < 1 or sample_bytes <= 0:
        raise UsageError("--loader-workers must be >= 0, --micro-batch >= 1 and a sample's "
                         "bytes > 0")
    batch = float(micro_batch * sample_bytes)
    n = workers * prefetch + 1
    return LoaderMemory(workers, prefetch, batch, n, n * batch, n * batch if gpu else 0.0)


@dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one strategy."""

    stage: str
    params: float
    grads: float
    optimizer: float
    activations: float | None  # None: not estimated (no shape given), not 0 bytes
    total: float  # model states + activations where estimated
    fits: bool | None


@dataclass(frozen=True)
class MemoryPlan:
    """Result of :func:`plan_memory`; render with ``gradsync.observe.plan_render``."""

    num_params: int
    world_size: int
    per_param: BytesPerParam
    activations: float | None  # None: not estimated
    device_memory: float | None
    stages: tuple[StageMemory, ...] = field(default_factory=tuple)
    optimizer: str = "adam"
    precision: str = "bf16"  # "bf16"/"fp16": 16-bit params/grads + fp32 master copy; "fp32"
    loader: LoaderMemory | None = None  # host memory of --loader-workers (None: not asked)
    checkpointing: str = "none"  # the activations' recomputation, as ActivationShape says

    def stage(self, name: str) -> StageMemory:
        return next(s for s in self.stages if s.stage == name)


def plan_memory(
    num_params: int,
    world_size: int,
    optimizer: str = "adam",
    mixed_precision: bool = True,
    fp32_grad_accum: bool = False,
    activation: ActivationShape | None = None,
    device_memory: float | None = None,
    precision: str | None = None,
    loader: LoaderMemory | None = None,
) -> MemoryPlan:
    """Per-device bytes of DP and ZeRO-1/2/3, activations and a fits verdict.

    ``precision`` names the plan (default "bf16" with ``mixed_precision``, else "fp32");
    "fp16" is counted as "bf16" (2-byte parameters and gradients, fp32 masters)."""
    if num_params <= 0:
        raise UsageError(f"parameter count must be > 0, got {num_params}")
    if world_size <= 0:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    if device_memory is not None and device_memory <= 0:
        raise UsageError(f"device memory must be > 0, got {device_memory}")
    bpp = bytes_per_param(optimizer, mixed_precision, fp32_grad_accum)
    P, N = float(num_params), float(world_size)
    act = activation_bytes(activation) if activation is not None else None
    shard = {  # which blocks each stage divides by N
        "DP": (1, 1, 1), "ZeRO-1": (1, 1, N), "ZeRO-2": (1, N, N), "ZeRO-3": (N, N, N),
    }
    stages = []
    for name in STAGES:
        dp, dg, do = shard[name]
        p, g, o = bpp.params * P / dp, bpp.grads * P / dg, bpp.optimizer * P / do
        total = p + g + o + (act or 0.0)
        fits = None if device_memory is None else total <= device_memory
        stages.append(StageMemory(name, p, g, o, act, total, fits))
    return MemoryPlan(int(num_params), int(world_size), bpp, act, device_memory, tuple(stages),
                      optimizer, precision or ("bf16" if mixed_precision else "fp32"), loader,
                      activation.checkpointing if activation is not None else "none")


def deepspeed_zero2_estimate(num_params: float, world_size: int, legacy: bool = False) -> float:
    """DeepSpeed's stage-2 GPU bytes without offload: 2P + 18P/N (legacy: 4P + 16P/N)."""
    if legacy:
        return 4 * num_params + int(16 * num_params / world_size)
    return 2 * num_params + int(18 * num_params / world_size)


def count_module_params(module) -> int:
    """Unique parameters of an nn.Module (shared weights counted once)."""
    return sum(p.numel() for p in module.parameters())


def build_on_meta(factory):
    """Call ``factory()`` under the meta device: shapes only, no memory allocated."""
    import torch

    with torch.device("meta"):
        return factory()


def resolve_param_count(spec: str) -> tuple[int, str]:
    """A count ('7e9', '7B', '125M'), a built-in model ('gpt', 'mlp') or 'module:factory'.

    Returns (count, description). Every failure is a one-line UsageError.
    """
    from .units import parse_count

    text = str(spec).strip()
    if ":" in text:
        return _count_from_factory(text)
    if text.lower() in ("gpt", "mlp"):
        return _count_builtin(text.lower())
    return parse_count(text), "given count"


def _check_module(obj, what: str) -> int:
    import torch.nn as nn

    if not isinstance(obj, nn.Module):
        raise UsageError(f"{what} returned {type(obj).__name__}, not a torch.nn.Module")
    n = count_module_params(obj)
    if n <= 0:
        raise UsageError(f"{what} has no parameters")
    return n


def _count_from_factory(text: str) -> tuple[int, str]:
    mod_name, _, attr = text.partition(":")
    factory = load_factory(text)
    try:
        obj = build_on_meta(factory)
    except Exception as e:
        raise UsageError(f"{text} failed on the meta device: {type(e).__name__}: {e}") from None
    return _check_module(obj, text), text


def _count_builtin(name: str) -> tuple[int, str]:
    try:
        from ..models import build_model  # written with the engine; may not exist yet
    except ImportError:
        raise UsageError(
            f"built-in model {name!r} is not available in this build; "
            "pass a count (7B) or module:factory"
        ) from None
    try:
        obj = build_on_meta(lambda: build_model(name))
    except Exception as e:
        raise UsageError(f"building {name!r} on the meta device failed: {e}") from None
    return _check_module(obj, f"built-in model {name!r}"), f"built-in {name}"
