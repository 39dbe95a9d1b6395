"""The optimizer and learning-rate schedule of a run: the built-in ones or your own factories.

Why a factory and not a class and its keyword arguments: a user's recipe is
more than a class (parameter groups with their own options, a wrapper such as
Lookahead, a schedule bound to the optimizer), and a factory says all of it in
the form torch users already write. The contracts (docs/training_choices.md):

* ``--optimizer pkg.module:factory``: ``factory(param_groups, lr) ->
  torch.optim.Optimizer``, built over exactly the tensors of ``param_groups``
  (torch's format: a list of dicts with ``"params"`` and per-group options).
  The tensors are what this rank's optimizer steps: whole parameters under
  ``ddp``/DiLoCo, this rank's pieces of them under ``zero1``/``zero2``/``zero3``,
  fp32 master copies with ``--precision bf16``. So the factory is called once on
  every rank, by the strategy, after the model is wrapped; it must not look the
  parameters up in the model itself. Under a sharding strategy the optimizer's
  update must be elementwise (``engine/sharded/zero.py``), which is checked
  on the optimizer the factory returns.
* ``--scheduler pkg.module:factory``: ``factory(optimizer, total_steps) ->
  torch.optim.lr_scheduler.LRScheduler``, stepped once after every optimizer
  step (a skipped step too: the schedule follows step numbers); it replaces
  ``--warmup``/``--schedule``. ``total_steps`` is the run's planned length
  (``--schedule-steps``, by default ``--steps`` at the first launch, kept when the
  run is continued: ``config/plan.RunPlan.schedule_steps``).

The groups (:func:`split_decay`): always two, in this order, each with a
``"name"``. ``"decay"`` holds weight matrices and embeddings; ``"no_decay"`` holds
biases, norm gains and every other parameter with fewer than 2 dimensions, and
every parameter of a normalisation layer (a module whose class name contains
"Norm": LayerNorm, RMSNorm, BatchNorm, GroupNorm and the transformers variants),
as GPT-2, nanoGPT and transformers' Trainer do. ``no_decay`` always carries
``weight_decay=0.0``; ``decay`` carries ``--weight-decay`` when it is given (else
the optimizer's own default holds: 0.1 for the built-in adamw); both carry
``--betas`` when given. Two groups even when one is empty, so a checkpoint's
group options load back alike on every rank and every number of workers.

How the groups reach every strategy: written with the module's parameter names
(:func:`named_groups`, taken before wrapping) and handed to the engine's
``build_strategy(..., param_groups=...)``, which every strategy resolves to what its
optimizer steps (``engine/sync/param_groups.py``); the factory is then called once,
on the resolved groups (:func:`factory_optimizer`), and what it returns is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ...engine.sharded.zero import check_elementwise
from ...engine.strategy.registry import FIXED_BUCKETS, build_strategy
from ...engine.sync.param_groups import module_param_groups
from ...errors import UsageError
from ...factory import load_factory
from .builtins import OPTIMIZERS

DECAY, NO_DECAY = "decay", "no_decay"


def _normalises(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


def split_decay(module: nn.Module) -> dict[str, str]:
    """{parameter name: DECAY | NO_DECAY} for every parameter (frozen ones too)."""
    norm_params = {id(p) for m in module.modules() if _normalises(m)
                   for p in m.parameters(recurse=False)}
    return {n: NO_DECAY if p.ndim < 2 or id(p) in norm_params else DECAY
            for n, p in module.named_parameters()}


def group_options(cfg) -> tuple[dict, dict]:
    """The options the flags give (decay group, no-decay group); unset flags add none."""
    optim = cfg.optim
    both = {"betas": optim.betas_pair} if optim.betas_pair else {}
    decay = {"weight_decay": float(optim.weight_decay)} if optim.weight_decay is not None else {}
    return {"name": DECAY, **both, **decay}, {"name": NO_DECAY, **both, "weight_decay": 0.0}


def optimizer_factory(cfg, given: Mapping[str, Callable] | None = None) -> Callable:
    """The factory ``--optimizer`` names: a built-in's, one given from Python (``given``:
    ``gs.train(optimizer=fn)``, by its recorded name), or the user's, loaded and checked
    by the one factory loader (``gradsync/factory.py``: module or file path)."""
    name = cfg.optim.optimizer_name
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    return (given or {}).get(name) or load_factory(name, "--optimizer", ("param_groups", "lr"))


def scheduler_factory(cfg, given: Mapping[str, Callable] | None = None) -> Callable | None:
    """The ``--scheduler`` factory (or the one ``given`` from Python); None: the built-in
    schedule."""
    name = cfg.optim.scheduler
    if not name:
        return None
    return (given or {}).get(name) or load_factory(name, "--scheduler",
                                                   ("optimizer", "total_steps"))


def own_scheduler(factory: Callable | None, optimizer, cfg, planned: int):
    """The user's scheduler over ``optimizer`` (None without ``--scheduler``), planned over
    ``planned`` steps (the run's plan, kept on resume)."""
    if factory is None:
        return None
    sched = factory(optimizer, planned)
    name = cfg.optim.scheduler
    if not isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
        raise UsageError(f"scheduler factory {name} returned {type(sched).__name__}, "
                         "not a torch.optim.lr_scheduler.LRScheduler")
    if sched.optimizer is not optimizer:
        raise UsageError(f"scheduler factory {name} built its scheduler on another "
                         "optimizer: build it on the one it is given")
    return sched


def named_groups(module: nn.Module, cfg) -> list[dict]:
    """The run's two parameter groups (:func:`split_decay`) by parameter name, with the
    options the flags give: what every strategy resolves to its own tensors."""
    kind = split_decay(module)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    return [{**opts, "params": [n for n in trainable if kind[n] == opts["name"]]}
            for opts in group_options(cfg)]


def factory_optimizer(factory: Callable, name: str, lr: float, sharded: bool,
                      module: nn.Module | None = None, groups: list[dict] | None = None
                      ) -> Callable:
    """An optimizer factory as the optimizer class a strategy calls: once, on the groups
    the strategy resolved (``build_strategy(..., param_groups=...)``). What the factory
    returns is checked: an optimizer, over exactly those tensors, and elementwise when
    the strategy shards (ZeRO's own check is made on the result, not on the factory).

    A strategy registered by a user may build its optimizer on the module's own
    parameters and pass the named groups on unresolved (``param_groups=``, as every
    keyword of ``build_strategy`` reaches a builder): with ``module`` and the run's
    ``groups`` they are resolved here, by parameter name, as the built-in ``ddp`` does.
    """

    def build(params, **kwargs) -> torch.optim.Optimizer:
        named = kwargs.pop("param_groups", None)
        if kwargs:
            raise UsageError(f"optimizer factory {name}: the strategy passed options "
                             f"{sorted(kwargs)}; a factory takes only its parameter groups")
        params = list(params)
        if params and all(isinstance(g, Mapping) for g in params):
            resolved = [dict(g) for g in params]  # by the strategy (every built-in one)
        else:
            resolved = _own(params, named if named is not None else groups)
        opt = factory(resolved, lr)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(f"optimizer factory {name} returned {type(opt).__name__}, not a "
                             "torch.optim.Optimizer")
        given = {id(t) for g in resolved for t in g["params"]}
        stepped = {id(t) for g in opt.param_groups for t in g["params"]}
        if stepped != given:
            raise UsageError(f"optimizer factory {name} built its optimizer on other tensors "
                             "than the param_groups it was given: build it on exactly those "
                             "(under ZeRO they are this rank's pieces of the parameters)")
        if sharded:
            check_elementwise(type(opt))
        return opt

    def _own(params: list, named) -> list[dict]:
        """``named`` resolved to ``params`` when they are the module's own parameters."""
        own = {id(p) for p in module.parameters()} if module is not None else set()
        if named is None or not params or any(id(p) not in own for p in params):
            if named is None:
                return [{"params": params}]
            raise UsageError(f"optimizer factory {name}: the strategy built its optimizer on "
                             "tensors gradsync cannot name, so the parameter groups (no "
                             "weight decay on biases and norms) cannot reach it; resolve "
                             "build_strategy's param_groups= in its builder")
        return module_param_groups(module, named, f"optimizer factory {name}")

    build.__name__ = name
    build.gradsync_elementwise = True  # ZeroOptimizer's check: made on the result instead
    return build


def build_with_optimizer(task, cfg, device, planned: int, **strategy_options):
    """The strategy over ``task.model`` with the run's optimizer, and the user's
    scheduler over ``planned`` steps (None: the built-in ``--warmup``/``--schedule``,
    made by the caller). ``strategy_options``: what the step coordinator asks of the
    strategy (``build_strategy``'s ``outer_sync`` for a DiLoCo worker per replica group)."""
    module = task.model.to(device)
    groups = named_groups(module, cfg)  # named before wrapping (zero3 replaces them)
    sync = cfg.sync
    opt = factory_optimizer(task.optimizer_factory, cfg.optim.optimizer_name, cfg.optim.lr,
                            sync.strategy in FIXED_BUCKETS, module, groups)
    strategy = build_strategy(module, sync.strategy, sync.precision, opt,
                              bucket_cap_mb=sync.bucket_cap_mb, sync=sync.options,
                              find_unused_parameters=sync.find_unused_parameters,
                              param_groups=groups, **strategy_options)
    return strategy, own_scheduler(task.scheduler_factory, strategy.optimizer, cfg, planned)
