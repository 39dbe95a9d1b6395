"""Built-in models and a name registry for the CLI (``--model``).

A registry keeps the CLI's choices and the constructors in one place, so the
``--help`` text and the error for an unknown name list the same models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from torch import nn

from ..errors import UsageError
from .gpt import GPT, GPTConfig
from .mlp import DeepMLP, TanhMLP


def _build_gpt(**overrides) -> nn.Module:
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UsageError(f"unknown GPT option(s) {unknown}; choose from {sorted(known)}")
    return GPT(GPTConfig(**overrides))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "gpt": _build_gpt,
    "mlp": DeepMLP,
}


def build_model(name: str, **overrides) -> nn.Module:
    """Construct a built-in model by name; ``overrides`` go to its constructor."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise UsageError(
            f"unknown model {name!r}; choose from {', '.join(sorted(MODELS))}"
        ) from None
    return factory(**overrides)


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements, each shared (tied) Parameter counted once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


__all__ = [
    "GPT",
    "MODELS",
    "DeepMLP",
    "GPTConfig",
    "TanhMLP",
    "build_model",
    "count_parameters",
]
