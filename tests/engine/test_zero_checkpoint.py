"""Sharded checkpoints: re-sharding 2 -> 3 -> 1 workers continues the same trajectory;
damaged files, another model and interrupted saves give clear errors and lose nothing."""

import shutil

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.engine.sharded.checkpoint import CheckpointError, load_sharded, save_sharded
from tests.engine.sharded_models import Block, Net
from tests.helpers import dataset, max_gap, reference_train, sharded_train

PER_STEP = 12
SHARD = "shard-00001-of-00002.pt"


def _phase_schedule(first, steps, world):
    """Steps ``first..first+steps-1``; each step's 12 items split unevenly over ``world``."""
    sched = []
    for s in range(first, first + steps):
        items = [(s * PER_STEP + i) % 96 for i in range(PER_STEP)]
        cuts = [0] + sorted({(s + 5 * r) % PER_STEP for r in range(1, world)}) + [PER_STEP]
        cuts = cuts if len(cuts) == world + 1 else [PER_STEP * r // world for r in range(world + 1)]
        sched.append([[items[cuts[r]:cuts[r + 1]]] for r in range(world)])
    return sched


def _build(strategy, factory):
    if strategy == "fsdp":
        model = gs.FullyShardedDataParallel(factory(seed=gs.rank()), wrap={Block})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return model, opt, (model, opt)
    dp = gs.DataParallel(factory(seed=gs.rank()), bucket_cap_mb=0.0005, first_bucket_mb=0.0001)
    opt = gs.ZeroOptimizer(dp, torch.optim.AdamW, stage=int(strategy[-1]), lr=1e-2,
                           weight_decay=0.01)
    return dp, opt, (opt, None)


class _Step:
    def __init__(self, opt):
        self.opt = opt

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()


def _phase(strategy, path, load, schedule):
    x, y = dataset()
    model, opt, (target, topt) = _build(strategy, Net)
    if load:
        load_sharded(path, target, topt)
    sharded_train(model, _Step(opt), schedule, x, y, gs.rank())
    save_sharded(path, target, topt)
    if strategy == "fsdp":
        return model.full_state_dict()
    return dict(model.module.state_dict())


def test_resharding_2_to_3_to_1_workers_continues_the_trajectory(tmp_path):
    ck = tmp_path / "ckpt"
    phases = [("zero2", 2, 0, 5), ("fsdp", 3, 5, 5), ("zero1", 1, 10, 5)]
    full_sched = []
    for i, (strategy, world, first, steps) in enumerate(phases):
        sched = _phase_schedule(first, steps, world)
        full_sched += sched
        state = gs.spawn(_phase, world, strategy, ck, i > 0, sched)[0]
    x, y = dataset()
    ref_model = Net()
    ref = reference_train(ref_model, "adamw", full_sched, x, y)
    got = [state[n] for n, _ in ref_model.named_parameters()]
    assert max_gap(got, ref) <= 1e-9


def _damage(good, tmp):
    """Rank 0 makes a corrupted and a truncated copy of ``good``."""
    corrupt, trunc = tmp / "corrupt", tmp / "trunc"
    shutil.copytree(good, corrupt)
    shutil.copytree(good, trunc)
    data = bytearray((corrupt / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / SHARD).write_bytes(bytes(data))
    (trunc / SHARD).write_bytes((good / SHARD).read_bytes()[:100])
    return corrupt, trunc


def _save_damage_load(tmp):
    x, y = dataset()
    good = tmp / "good"
    model, opt, (target, _) = _build("zero2", Net)
    sharded_train(model, _Step(opt), _phase_schedule(0, 2, 2), x, y, gs.rank())
    save_sharded(good, target)
    saved = {k: v.clone() for k, v in model.module.state_dict().items()}
    sharded_train(model, _Step(opt), _phase_schedule(2, 1, 2), x, y, gs.rank())
    try:  # a save that dies after the shards, before its manifest
        save_sharded(good, target, _fail_before_manifest=True)
    except RuntimeError as e:
        assert "simulated" in str(e)
    if gs.rank() == 0:
        _damage(good, tmp)
    dist.barrier()
    errors = {}
    for name in (tmp / "corrupt", tmp / "trunc", tmp / "none"):
        try:
            load_sharded(name, target)
        except CheckpointError as e:
            errors[name.name] = str(e)
    wrong = gs.ZeroOptimizer(gs.DataParallel(Net(hidden=11)), torch.optim.AdamW, stage=2)
    try:
        load_sharded(good, wrong)
    except CheckpointError as e:
        errors["wrong model"] = str(e)
    fresh, _, (target2, _) = _build("zero2", Net)
    load_sharded(good, target2)  # the good checkpoint still loads after all of that
    return {"errors": errors, "saved": saved, "loaded": dict(fresh.module.state_dict())}


def test_damaged_files_other_model_and_interrupted_save(tmp_path):
    res = gs.spawn(_save_damage_load, 2, tmp_path)[0]
    errors, saved, loaded = res["errors"], res["saved"], res["loaded"]
    assert sorted(errors) == ["corrupt", "none", "trunc", "wrong model"], errors
    assert f"{tmp_path / 'corrupt' / SHARD}: checksum mismatch" in errors["corrupt"]
    assert f"{tmp_path / 'trunc' / SHARD}: truncated" in errors["trunc"]
    assert "no manifest" in errors["none"]
    assert ("tensor 'inp.weight' has shape [10, 6] in the checkpoint but [11, 6]"
            in errors["wrong model"])
    assert list(loaded) == list(saved) and saved
    for k in saved:  # the interrupted save left the previous checkpoint as it was
        assert torch.equal(saved[k], loaded[k]), k
