"""TrainConfig: every option of `gradsync train`, one flag per field -- the flag table.

The same parser serves ``gradsync train`` (which launches the workers) and
``torchrun -m gradsync.train`` (where torchrun already did), so the two can never
disagree about what a flag means. Choice lists come from the registries
(models, datasets, strategies, optimizers), so ``--help``, the parser and the
error for an unknown name always list the same things. The strategy registry is
read when a parser is built and when a config is checked, never copied at import,
so a strategy registered after this module was imported is accepted.

A ``TrainConfig`` is what a user writes (``gs.TrainConfig(steps=100)``, or the flags).
It is checked when it is made, by :func:`~gradsync.train.config.resolve.resolve` --
the one place every refusal lives -- and shows the defaults that resolving filled in
(``clip``, ``data``, ``out``, ...). The run itself never reads a ``TrainConfig``: it
reads the frozen :class:`~gradsync.train.config.resolve.RunConfig` that ``resolve``
returns, which also holds what follows from the flags (the optimizer ``auto`` stands
for, whether steps are balanced, the traced window, the parsed stragglers, ...).
Another run's flags derived from a run's -- ``--baseline``'s one worker -- are made here
too (:func:`baseline_config`), and resolved as that run's own.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields

from ...dist import BACKENDS
from ...engine.strategy.options import COLLECTIVES, SYNC_METHODS, SyncOptions
from ...engine.strategy.registry import PRECISIONS, STRATEGIES
from .file import read_toml, to_toml
from .resolve import bucket_cap, check_data, check_model, check_optimizer, resolve
from .run_config import (
    BALANCE_CHOICES,
    CLIP_RECIPE,  # noqa: F401 - the field's help names it; re-exported for readers
    NONFINITE_CHOICES,
    RESUME_CHOICES,
    SCHEDULES,
    RunConfig,
)


@dataclass
class TrainConfig:
    workers: int = field(default=2, metadata={"help": "worker processes on this node (gradsync train only; torchrun sets its own)"})
    steps: int = field(default=300, metadata={"help": "optimizer steps to run"})
    global_batch: int = field(default=16, metadata={"help": "samples per optimizer step over all workers = micro-batch x accumulation x workers; keep it when the number of workers changes, and the run continues exactly"})
    micro_batch: int = field(default=8, metadata={"help": "samples per forward/backward on one worker (may change on resume)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (linear warm-up, then --schedule)"})
    warmup: int = field(default=20, metadata={"help": "warm-up steps"})
    schedule: str = field(default="cosine", metadata={"help": "after warm-up: cosine decay to 10%% of --lr, reached where the plan ends (--schedule-steps: its last step trains just above 10%%, every step after it at 10%%, as torch's CosineAnnealingLR), or constant --lr to the end", "choices": SCHEDULES})
    schedule_steps: int = field(default=0, metadata={"help": "steps the learning-rate schedule is planned over (0: --steps at the run's first launch); recorded in the checkpoint and kept when the run is continued, also past it: the steps beyond train at the schedule's final rate"})
    optimizer: str = field(default="auto", metadata={"help": "adamw, sgd (momentum 0.9), auto (adamw for gpt and your own models, sgd for mlp), or your own: pkg.module:factory, called with the parameter groups and --lr", "type": check_optimizer})
    weight_decay: float | None = field(default=None, metadata={"help": "weight decay of the weight matrices and embeddings (never of biases or norm parameters, which get 0); default: the optimizer's own (adamw 0.1, sgd 0, your factory's)", "type": float})
    betas: str = field(default="", metadata={"help": "B1,B2 of adamw or of your own Adam-like factory (default: adamw's 0.9,0.95, or your factory's)"})
    scheduler: str = field(default="", metadata={"help": "your own learning-rate schedule, pkg.module:factory, called with the optimizer and the planned steps (--schedule-steps, default --steps), returning a torch LR scheduler stepped once per optimizer step (replaces --warmup/--schedule)"})
    bucket_cap_mb: float | str = field(default=25.0, metadata={"help": "gradient bucket cap in MiB (DDP's default is 25), or 'auto' to measure candidates during the first steps and keep the fastest", "type": bucket_cap})
    seed: int = field(default=0, metadata={"help": "seed for model initialisation and data order"})
    out: str = field(default="", metadata={"help": "run directory for metrics.jsonl, checkpoint.pt and summary.json (default runs/<date-time>)"})
    resume: str = field(default="auto", metadata={"help": "auto: continue the checkpoint in --out if it is of this configuration, start fresh if there is none; must (--resume alone): fail without one; never: fail if one exists", "choices": RESUME_CHOICES})
    overwrite: bool = field(default=False, metadata={"help": "write into --out although it holds files gradsync did not write (another tool's config.json, metrics.jsonl, ...): gradsync's files replace any of the same name, the others are left alone. Without it such a directory is refused; a new or empty one, or a gradsync run directory, needs no flag"})
    trust_checkpoint_code: bool = field(default=False, metadata={"help": "load --out's checkpoint with full pickle, which can run code the file names: only for a checkpoint you wrote yourself whose optimizer or scheduler state holds your own types. Without it a checkpoint is read as data only (tensors, numbers, strings, containers), as every checkpoint gradsync writes is, and one that names anything else is refused"})
    backend: str = field(default="auto", metadata={"help": "process-group backend: auto (nccl with CUDA, else gloo), gloo or nccl", "choices": BACKENDS})
    model: str = field(default="gpt", metadata={"help": "built-in model (gpt: small causal LM; mlp: 8x1024 GELU MLP) or your own, pkg.module:factory or path/to/file.py:factory (a function returning a torch.nn.Module)", "type": check_model})
    data: str = field(default="", metadata={"help": "built-in data (pysrc, random-tokens for gpt; teacher for mlp) or your own, pkg.module:factory or path/to/file.py:factory (returning a Dataset of (input, target) pairs or of dicts with 'labels', or a gradsync.TrainData); default follows --model", "type": check_data})
    strategy: str = field(default="ddp", metadata={"help": "ddp: replicate everything; zero1: shard optimizer state; zero2: also gradients; zero3: also parameters (FSDP)", "choices": lambda: tuple(STRATEGIES)})
    precision: str = field(default="fp32", metadata={"help": "fp32 (the model's own dtype), bf16: compute in bf16 with fp32 master weights, optimizer state and gradient reduction, or fp16: the same in fp16 with dynamic loss scaling (an overflowed step is skipped on every worker and the scale halved; see docs/train.md)", "choices": PRECISIONS})
    sync: str = field(default="exact", metadata={"help": "exact: every step's gradient is the exact mean over the global batch; diloco: --sync-every local steps, then an outer Nesterov step on the item-weighted average of where the workers went (arXiv 2311.08105); streaming-diloco: the same in --fragments staggered fragments, overlapped with the next --sync-delay steps (arXiv 2501.18512)", "choices": SYNC_METHODS})
    sync_every: int = field(default=25, metadata={"help": "H: local steps between syncs (diloco, streaming-diloco)"})
    fragments: int = field(default=2, metadata={"help": "F: fragments of streaming-diloco, synced at staggered steps (peak traffic per step drops F-fold)"})
    sync_delay: int = field(default=1, metadata={"help": "tau: local steps a streaming-diloco fragment's sync overlaps before it is applied"})
    sync_alpha: float = field(default=0.5, metadata={"help": "streaming-diloco: weight of the local parameters when a synced fragment is merged"})
    outer_lr: float = field(default=0.7, metadata={"help": "learning rate of diloco's outer SGD (Nesterov momentum --outer-momentum)"})
    outer_momentum: float = field(default=0.9, metadata={"help": "momentum of diloco's outer SGD (0 and --outer-lr 1: Local SGD, plain parameter averaging)"})
    sync_warmup: int = field(default=0, metadata={"help": "diloco, streaming-diloco: the first N steps are exact synchronous data parallelism (post-local SGD, arXiv 1808.07217), local steps after; syncs every --sync-every steps counted from N (0: local from the first step)"})
    outer_momentum_warmup: int = field(default=0, metadata={"help": "diloco, streaming-diloco: the outer momentum ramps linearly from 0 at the first outer step to --outer-momentum at outer step K+1 (0: full momentum from the first)"})
    sync_every_max: int = field(default=0, metadata={"help": "diloco: after each sync the next comes round(H * peak lr / current lr) steps later, between --sync-every and this M, so syncs thin out as the learning rate decays (0: every --sync-every steps)"})
    sync_eager: bool = field(default=False, metadata={"help": "streaming-diloco: eager updates (arXiv 2502.12996): when a fragment is sent, take its outer step at once on a stand-in for the sum in flight (own pseudo-gradient now plus the others' from the last sum), corrected when the sum arrives; needs --sync-delay >= 1"})
    find_unused_parameters: bool = field(default=False, metadata={"help": "allow parameters that get no gradient in a step (a layer the model skips), as torch DDP's find_unused_parameters: one no worker used keeps .grad None and is not stepped (costs one small all-reduce a step); without it such a parameter stops the run, naming it"})
    compress: str = field(default="none", metadata={"help": "gradient compression, spending exactness on purpose: none, bf16, fp16, powersgd:R (error feedback), int8 (blockwise, error feedback); with --collectives hierarchical (or auto on several hosts) only what crosses between hosts is compressed; with diloco: the pseudo-gradient (bf16, fp16, int8)"})
    collectives: str = field(default="auto", metadata={"help": "how gradients are summed: auto (hierarchical when torchrun runs several hosts of several workers each, else native; both exact; diloco and zero3 keep native unless named), native (the backend's all-reduce), hierarchical (inside each host first, then across hosts: for hosts joined by a slow link; with --compress the sums inside a host stay exact and only what crosses between hosts is compressed; zero3 becomes hybrid sharding; diloco and streaming-diloco run one worker per host, exact inside it), ring, tree or server (reference algorithms)", "choices": COLLECTIVES})
    probe_every: int = field(default=25, metadata={"help": "with --compress: every N steps also sum the exact gradient once and record the compressed one's cosine and relative error (0: never)"})
    compress_delay: int = field(default=0, metadata={"help": "with --compress: 1 applies each step's compressed gradient one step late, so its communication overlaps the next step's forward and backward (the first step applies nothing, the last also applies its own; metrics say which step's gradient each update applied, grad_steps); 0: no delay"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sample for the built-in token data"})
    balance: str = field(default="off", metadata={"help": "auto: split each step's global batch by each worker's measured speed, so a slow worker takes fewer samples and the update stays the exact mean (--sync exact only); the split then depends on timing, so runs are exact to float rounding but no longer bit-reproducible. off: the even split, bit-reproducible. See docs/stragglers.md", "choices": BALANCE_CHOICES})
    data_parts: int = field(default=1, metadata={"help": "non-IID data: cut the training set into P contiguous parts (different source files of pysrc), each read by its own block of K/P consecutive workers (a host's, with P hosts under torchrun) from its own stream of epochs; P must divide the workers and --global-batch; held-out loss stays on the whole held-out set. 1: every worker samples the whole set (IID). See docs/train.md"})
    straggler: str = field(default="", metadata={"help": "emulate slow workers, for trying --balance: RANK:SPEED[@STEP],... (e.g. 1:0.5@20: rank 1 at half speed from step 20); between each micro-batch's forward and its backward (before its gradient leaves, where a slow device is slow) the rank sleeps (1/SPEED - 1) times the micro-batch's compute"})
    clip: float | None = field(default=None, metadata={"help": "clip the global gradient norm to this value (0: off; the norm is measured and reported either way); default: off for your own models and mlp, as torch DDP, and 1.0 for the built-in gpt, the recipe it was tuned with (nanoGPT's)", "type": float})
    on_nonfinite: str = field(default="stop", metadata={"help": "a NaN/inf loss or gradient norm: stop (before any checkpoint is written, exit 1) or skip-step (skip that optimizer update on every rank)", "choices": NONFINITE_CHOICES})
    checkpoint_every: int = field(default=100, metadata={"help": "save a checkpoint every N steps (and always at the end; 0: only at the end)"})
    eval_every: int = field(default=50, metadata={"help": "evaluate the loss on held-out data every N steps and at the end (0: off)"})
    timeout: float = field(default=300.0, metadata={"help": "seconds a collective, or the workers' connection set-up, may wait before the run fails"})
    max_restarts: int = field(default=0, metadata={"help": "restart all workers from the last checkpoint up to N times after a failure (gradsync train only; under torchrun use its --max-restarts)"})
    port: int = field(default=0, metadata={"help": "rendezvous port on localhost (0: pick a free one)"})
    trace: bool = field(default=False, metadata={"help": "record a Chrome trace (trace.json: forward, backward, each bucket's all-reduce, waits, optimizer; one process per rank) for the --trace-steps window"})
    trace_steps: str = field(default="", metadata={"help": "steps to trace, FIRST:LAST (1-based, inclusive) or one step; implies --trace (default with --trace: 3:5, clipped to the run)"})
    drift_every: int = field(default=50, metadata={"help": "compare a checksum of every parameter across workers every N steps and at the end; a mismatch or a NaN/inf parameter stops the run naming it (0: off)"})
    baseline: bool = field(default=False, metadata={"help": "first run a short 1-worker baseline with the same micro-batch and accumulation (in OUT/baseline) to report scaling efficiency (gradsync train only)"})
    baseline_steps: int = field(default=8, metadata={"help": "steps of the --baseline run"})
    log: str = field(default="", metadata={"help": "also write the metrics through these trackers, comma-separated: tensorboard, csv, wandb, mlflow (each library's own writer, in the run directory; wandb and mlflow offline/local, and sent each step once a checkpoint holds it: docs/logging-and-export.md)"})
    override: str = field(default="", metadata={"help": "on resume, flags that may differ from the checkpoint's run, comma-separated (lr, warmup, schedule, schedule-steps, optimizer, weight-decay, betas, scheduler, clip): without it a change to any of them is refused, naming the flag; schedule-steps plans the schedule over the new --steps"})
    no_report: bool = field(default=False, metadata={"help": "do not write report.html and its figures at the end of the run"})
    ft_groups: int = field(default=0, metadata={"help": "fault tolerance across N replica groups (torchft; docs/fault_tolerance.md): every step goes through a quorum, survivors keep training, a restarted group heals from a live peer; alone: start a lighthouse and N groups of --workers on this machine; with --ft-group: the number of groups in the job"})
    ft_group: int = field(default=-1, metadata={"help": "this job's replica group, 0..N-1 (a cluster: one torchrun per group with --ft-groups N and --ft-lighthouse)"})
    ft_lighthouse: str = field(default="", metadata={"help": "the torchft lighthouse's address, HOST:PORT (torchft_lighthouse --min_replicas M; default: TORCHFT_LIGHTHOUSE)"})
    ft_timeout: float = field(default=5.0, metadata={"help": "seconds a cross-group collective waits for a silent group before the step is redone without it (a dead process is seen at once; a partitioned link after this)"})
    # checkpoints kept, early stopping, where a run starts, memory (issue 37; docs/train.md)
    keep_last: int = field(default=0, metadata={"help": "keep the last N checkpoints (every save: --checkpoint-every, each new --keep-best, the end) as whole units a run can continue from, in OUT/checkpoints/step-N (0: only checkpoint.pt, the newest)"})
    keep_best: str = field(default="", metadata={"help": "keep the checkpoint of the best held-out figure, NAME[:min|:max]: eval_loss, or a metric of your TrainData.metrics (accuracy:max); a new best is saved when it is evaluated (OUT/checkpoints/best names it); needs --eval-every"})
    early_stop: str = field(default="", metadata={"help": "stop when a held-out figure has not improved in PATIENCE evaluations in a row, NAME[:min|:max]:PATIENCE[:MIN_DELTA] (e.g. eval_loss:5, accuracy:max:3:0.001); the run then ends with a checkpoint and its summary says where and why; needs --eval-every"})
    resume_from: str = field(default="", metadata={"help": "continue the checkpoint PATH in a new --out: a run directory, a kept one (OUT/checkpoints/step-N) or OUT/checkpoints/best; the source is left as it is"})
    init_from: str = field(default="", metadata={"help": "start a fresh run from these weights (not a resume: step 1, a fresh optimizer and schedule): a gradsync export directory, a .safetensors file, a transformers directory (from_pretrained, when --model is a transformers model), a run or kept checkpoint (its trained weights) or a .pt state dict; read as data only"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute each block's activations in backward instead of keeping them (the built-in gpt's blocks; your model's largest ModuleList/Sequential of same-typed blocks; a transformers model's own gradient checkpointing): less memory, about a third more compute, the same numbers"})
    loader_workers: int = field(default=0, metadata={"help": "collate each micro-batch in N torch DataLoader worker processes, ahead of the step that needs it, in the step sampler's order (pinned memory on a GPU); 0: in the training process"})

    def __post_init__(self) -> None:
        resolved = resolve(self)  # every check, once; raises one UsageError
        for name, value in resolved.to_dict().items():  # the defaults it filled in
            setattr(self, name, value)
        self._resolved = (asdict(self), resolved)

    def resolved(self) -> RunConfig:
        """The frozen config the run reads (:func:`resolve`): the one made when this config
        was, unless a field has been set since (then resolved, and checked, again)."""
        flags, resolved = getattr(self, "_resolved", (None, None))
        if flags != asdict(self):
            resolved = resolve(self)
            self._resolved = (asdict(self), resolved)
        return resolved

    # Readings for Python users of a TrainConfig; the run reads them from its RunConfig.
    def sync_options(self) -> SyncOptions:
        return self.resolved().sync.options

    @property
    def balanced(self) -> bool:
        """Whether steps are split by measured speed: only where the gradient is exact."""
        return self.resolved().batch.balanced

    @property
    def optimizer_name(self) -> str:
        """The built-in optimizer ``auto`` stands for, or the user's ``pkg.module:factory``."""
        return self.resolved().optim.optimizer_name

    @property
    def betas_pair(self) -> tuple[float, float] | None:
        return self.resolved().optim.betas_pair

    def trace_window(self) -> tuple[int, int] | None:
        return self.resolved().observe.trace_window

    def accumulation(self, world_size: int, resuming: bool = False) -> int:
        """Micro-steps per optimizer step on ``world_size`` workers (``plan.accumulation``)."""
        from .plan import accumulation

        return accumulation(self.resolved(), world_size, resuming)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_file(cls, path: str, **overrides) -> TrainConfig:
        """The flags of a TOML file (``gradsync train --config``; ``config/file.py``),
        ``overrides`` replacing its values."""
        return cls(**{**read_toml(path, list(fields(cls))), **overrides})

    def to_toml(self) -> str:
        """The resolved flags as a config file (``--print-config``): ``from_file`` of it
        is the same run."""
        return to_toml(self.resolved().to_dict(), list(fields(self)))


def baseline_config(cfg: RunConfig, accumulation: int) -> RunConfig:
    """One worker, the same micro-batch and accumulation: the per-worker work of the real run.

    Scaling efficiency is throughput with K workers over K times this; only the
    global batch shrinks (micro-batch x accumulation), so per-worker compute per
    step is identical and the difference is communication and waiting. Another run's
    flags, so resolved (and checked) as its own.
    """
    steps = cfg.observe.baseline_steps
    return TrainConfig(**{
        **cfg.to_dict(), "workers": 1, "global_batch": cfg.batch.micro_batch * accumulation,
        "steps": steps, "warmup": min(cfg.optim.warmup, steps),
        "out": os.path.join(cfg.run.out, "baseline"), "trace": False, "trace_steps": "",
        "drift_every": 0, "baseline": False, "no_report": True, "checkpoint_every": 0,
        "eval_every": 0, "resume": "auto", "port": 0, "max_restarts": 0, "log": "",
        "baseline_steps": TrainConfig.baseline_steps,  # its default: no --baseline here
        "keep_last": 0, "keep_best": "", "early_stop": "", "resume_from": "",  # a measurement
        "data_parts": 1}).resolved()  # one worker reads the whole set; the work per step alike
