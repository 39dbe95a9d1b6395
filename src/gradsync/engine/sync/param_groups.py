"""Optimizer parameter groups named by the model's own parameters, for every strategy.

Users give parameters different options -- no weight decay on biases and norms
(as GPT-2 and nanoGPT do), a lower learning rate for embeddings -- by building
the optimizer on parameter groups. Under ZeRO and FSDP the optimizer does not
step the model's parameters but this rank's *pieces* of them (``shard_view``),
which a user cannot group by hand. So groups are written against the model's
own parameter names (or, where the wrapper keeps them, the parameter objects),
and resolved here to the tensors the optimizer really steps:

    decay = [n for n, p in module.named_parameters() if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": 0.1},
              {"params": [n for n, _ in module.named_parameters() if n not in decay],
               "weight_decay": 0.0}]
    opt = gs.ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_groups=groups, lr=3e-4)
    opt = torch.optim.AdamW(fsdp_model.param_groups(groups), lr=3e-4)      # stage 3
    strategy = gs.build_strategy(module, "zero3", "bf16", torch.optim.AdamW,
                                 param_groups=groups, lr=3e-4)             # any strategy

Every strategy takes them (``build_strategy(..., param_groups=...)``): ZeRO 1/2 and
FSDP resolve them to this rank's pieces, the others to the module's own parameters or
to their fp32 masters (:func:`module_param_groups`); the optimizer class is then
called once, with the resolved groups. So an optimizer factory of groups
(``--optimizer pkg.module:factory``) is one call on every strategy.

A parameter may be named in one group at most; one named in none is not stepped
(as with a torch optimizer built on a subset); groups that name nothing at all are
an error. ``FullyShardedDataParallel`` replaces the module's parameters, so take
the names before wrapping (parameter objects are accepted only where the wrapper
keeps them: DataParallel and ZeRO 1/2). Group order is kept, so a checkpoint's
per-group options load back into the same groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...errors import UsageError


def check_param_groups(groups, names: Sequence[str], name_of: Mapping[int, str],
                       what: str) -> dict[str, int]:
    """Validate ``groups``; return {parameter name: its group's index}.

    Args:
        groups: a list of dicts, each with ``"params"``: parameter names, or parameter
            objects found in ``name_of``; the other keys are the group's options.
        names: every trainable parameter's name (the same on every rank, so groups are
            judged alike everywhere, whichever pieces a rank holds); tied weights are
            one name ``"a.weight = b.weight"``, either alias names them.
        name_of: id(parameter object) -> its name, for groups that list objects.
        what: the wrapper's name, for messages.
    """
    known = {alias: name for name in names for alias in name.split(" = ")}
    if isinstance(groups, Mapping) or not isinstance(groups, Sequence) or not groups:
        raise UsageError(f"{what}: param_groups must be a non-empty list of dicts with "
                         "'params', got " + type(groups).__name__)
    group_of: dict[str, int] = {}
    for gi, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise UsageError(f"{what}: param_groups[{gi}] must be a dict with 'params'")
        params = group["params"]
        if isinstance(params, (str, torch.Tensor)):
            params = [params]
        for p in params:
            name = known.get(p) if isinstance(p, str) else name_of.get(id(p))
            if name is None and not isinstance(p, str):
                raise UsageError(
                    f"{what}: param_groups[{gi}] holds a tensor that is not one of the "
                    "model's parameters; name parameters by their names in "
                    "module.named_parameters()")
            if name is None:
                raise UsageError(f"{what}: param_groups[{gi}] names {p!r}, which is not a "
                                 f"trainable parameter of the model")
            if name in group_of:
                raise UsageError(f"{what}: parameter {name!r} is in param_groups[{group_of[name]}] "
                                 f"and param_groups[{gi}]; a parameter belongs to one group")
            group_of[name] = gi
    if not group_of:
        raise UsageError(f"{what}: param_groups name no parameter (with stage 3 take the "
                         "names before wrapping: the wrapped module has no parameters)")
    return group_of


def assign_pieces(groups, group_of: Mapping[str, int],
                  pieces: Sequence[tuple[str | None, torch.Tensor]]) -> list[dict]:
    """``groups`` with their parameters replaced by the optimizer tensors of ``pieces``:
    (parameter name, tensor the optimizer steps), in the wrapper's order; a name of
    None is a placeholder (an empty piece) and joins the first group."""
    out = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
    for name, piece in pieces:
        gi = 0 if name is None else group_of.get(name)
        if gi is not None:
            out[gi]["params"].append(piece)
    return out


def resolve_param_groups(groups, names: Sequence[str],
                         pieces: Sequence[tuple[str | None, torch.Tensor]],
                         name_of: Mapping[int, str], what: str) -> list[dict]:
    """:func:`check_param_groups`, then :func:`assign_pieces`."""
    return assign_pieces(groups, check_param_groups(groups, names, name_of, what), pieces)


def module_param_groups(module: torch.nn.Module, groups, what: str,
                        tensors: Sequence[torch.Tensor] | None = None) -> list[dict]:
    """``groups`` resolved to ``module``'s own trainable parameters -- or, given ``tensors``,
    to the tensor that stands for each of them, one-to-one in ``module.parameters()`` order
    (fp32 master copies). For the strategies whose optimizer steps whole parameters
    (DataParallel, compressed buckets, local updates, mixed precision's masters); ZeRO and
    FSDP resolve groups to their shards themselves."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params = [p for p in module.parameters() if p.requires_grad]
    names = [" = ".join(aliases[id(p)]) for p in params]
    steps = list(tensors) if tensors is not None else params
    if len(steps) != len(params):
        raise UsageError(f"{what}: {len(steps)} tensors stand for {len(params)} trainable "
                         "parameters")
    return resolve_param_groups(groups, names, list(zip(names, steps)),
                                {id(p): n for p, n in zip(params, names)}, what)
