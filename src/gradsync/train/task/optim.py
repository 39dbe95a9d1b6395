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
  update must be elementwise (``engine/sharded/zero_shard.py``), which is checked
  on the optimizer the factory returns.
* ``--scheduler pkg.module:factory``: ``factory(optimizer, total_steps) ->
  torch.optim.lr_scheduler.LRScheduler``, stepped once after every optimizer
  step (a skipped step too: the schedule follows step numbers); it replaces
  ``--warmup``/``--schedule``. ``total_steps`` is the run's planned length
  (``schedule.planned_steps``: ``--schedule-steps``, by default ``--steps`` at
  the first launch, kept when the run is continued).

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

How the groups reach every strategy, through the engine's unchanged builders
(which call ``optimizer_class(params, **kwargs)``): :class:`FactoryOptimizer`
stands in for the class. ZeRO 1/2 resolve groups written with parameter names
to shard pieces themselves (``param_groups=``, ``engine/sync/param_groups.py``);
elsewhere the tensors are named by identity (the module's own parameters: ddp,
DiLoCo) or by position (bf16's fp32 masters, one per trainable parameter in
order); ZeRO-3's pieces, named only by the wrapper, get a placeholder that
:meth:`FactoryOptimizer.finish` replaces with the factory's optimizer over
``model.param_groups(...)`` before anything steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ...engine.sharded.zero_shard import check_elementwise
from ...engine.strategy.registry import FIXED_BUCKETS, build_strategy
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


class FactoryOptimizer:
    """An optimizer factory dressed as the optimizer class the strategy builders call.

    ``FactoryOptimizer(...)(params, param_groups=...)`` groups ``params`` (see the
    module docstring), calls the factory and checks what it returns. Pass
    :attr:`named_groups` to ``build_strategy(..., param_groups=...)`` and call
    :meth:`finish` on the strategy it returns.
    """

    gradsync_elementwise = True  # ZeroOptimizer's check: made on the factory's result instead

    def __init__(self, factory: Callable, name: str, lr: float, module: nn.Module, cfg,
                 sharded: bool):
        self.factory, self.__name__, self.lr, self.sharded = factory, name, lr, sharded
        self.options = group_options(cfg)
        self.kind = split_decay(module)
        self.name_of = {id(p): n for n, p in module.named_parameters()}
        self.trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.named_groups = [{**opts, "params": [n for n, p in self.trainable
                                                  if self.kind[n] == opts["name"]]}
                             for opts in self.options]
        self.placeholder: torch.optim.Optimizer | None = None

    def _names(self, tensors: list[torch.Tensor]) -> list[str] | None:
        names = [self.name_of.get(id(t)) for t in tensors]
        if all(n is not None for n in names):
            return names  # the module's own parameters (ddp, DiLoCo)
        if (len(tensors) == len(self.trainable) and not any(isinstance(t, nn.Parameter)
                                                             for t in tensors)
                and all(t.shape == p.shape for t, (_, p) in zip(tensors, self.trainable))):
            return [n for n, _ in self.trainable]  # bf16's fp32 masters, in order
        return None

    def __call__(self, params, param_groups=None, **kwargs):
        if kwargs:
            raise UsageError(f"optimizer factory {self.__name__}: the strategy passed options "
                             f"{sorted(kwargs)}; a factory takes only its parameter groups")
        params = list(params)
        if params and all(isinstance(g, Mapping) for g in params):
            groups = [dict(g) for g in params]  # resolved by the engine (ZeRO 1/2, finish)
        else:
            names = self._names(params)
            if names is None:  # pieces only the wrapper can name: see finish()
                self.placeholder = torch.optim.SGD(params, lr=self.lr)
                return self.placeholder
            groups = [{**opts, "params": [t for t, n in zip(params, names)
                                          if self.kind[n] == opts["name"]]}
                      for opts in self.options]
        return self._build(groups)

    def _build(self, groups: list[dict]) -> torch.optim.Optimizer:
        opt = self.factory(groups, self.lr)
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(f"optimizer factory {self.__name__} returned "
                             f"{type(opt).__name__}, not a torch.optim.Optimizer")
        given = {id(t) for g in groups for t in g["params"]}
        stepped = {id(t) for g in opt.param_groups for t in g["params"]}
        if stepped != given:
            raise UsageError(f"optimizer factory {self.__name__} built its optimizer on other "
                             "tensors than the param_groups it was given: build it on exactly "
                             "those (under ZeRO they are this rank's pieces of the parameters)")
        if self.sharded:
            check_elementwise(type(opt))
        return opt

    def finish(self, strategy) -> None:
        """Replace a placeholder with the factory's optimizer over the wrapper's pieces."""
        if self.placeholder is None:
            return
        if strategy.optimizer is not self.placeholder or not hasattr(strategy.model,
                                                                     "param_groups"):
            raise UsageError(f"--strategy {strategy.name} builds its optimizer on tensors "
                             "gradsync cannot name, so parameter groups (no weight decay on "
                             "biases and norms) cannot reach it; give its model a "
                             "param_groups(groups) method")
        strategy.optimizer = self._build(strategy.model.param_groups(self.named_groups))
        self.placeholder = None


def build_with_optimizer(task, cfg, device, planned: int, **strategy_options):
    """The strategy over ``task.model`` with the run's optimizer, and the user's
    scheduler over ``planned`` steps (None: the built-in ``--warmup``/``--schedule``,
    made by the caller). ``strategy_options``: what the step coordinator asks of the
    strategy (``build_strategy``'s ``outer_sync`` for a DiLoCo worker per replica group)."""
    module = task.model.to(device)  # parameters named before wrapping (zero3 replaces them)
    opt = FactoryOptimizer(task.optimizer_factory, cfg.optim.optimizer_name, cfg.optim.lr,
                           module, cfg, sharded=cfg.sync.strategy in FIXED_BUCKETS)
    strategy = build_strategy(module, cfg.sync.strategy, cfg.sync.precision, opt,
                              bucket_cap_mb=cfg.sync.bucket_cap_mb, sync=cfg.sync.options,
                              find_unused_parameters=cfg.sync.find_unused_parameters,
                              param_groups=opt.named_groups, **strategy_options)
    opt.finish(strategy)
    return strategy, own_scheduler(task.scheduler_factory, strategy.optimizer, cfg, planned)
