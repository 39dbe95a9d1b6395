"""Device discipline: every strategy and mode runs on a device that is not the host.

There is no GPU here, so the emulated accelerator of ``GRADSYNC_NCCL_RULES=meta``
stands in for one (``tests/engine/device_modes.py`` says what it catches). Each mode
is run once on the CPU with real values (its checkpoint), then on the emulated
device: construction, steps, a resume from the CPU's checkpoint, a step more, and a
census of every tensor the strategy holds. Found on the way (issue 33): ZeRO-3's
flat buffers allocated without a device, ``HostTopology.from_env`` all-gathering
host tensors, a sharded resume leaving optimizer state on the host.
"""

import pytest

import gradsync as gs
from tests.engine import device_modes
from tests.engine.device_modes import MODES

pytestmark = pytest.mark.slow


def _where(message: str) -> str:
    """The failure's first line and the last frames in gradsync that raised it."""
    lines = message.splitlines()
    frames = [ln.strip() for ln in lines if ln.strip().startswith("File") and "gradsync" in ln
              and "launch.py" not in ln]
    return " | ".join([lines[0], *frames[-3:]])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    saved, out = {}, {}
    for world in sorted({w for *_, w in MODES.values()}):
        modes = [m for m, (*_, w) in MODES.items() if w == world]
        for m in modes:
            saved[m] = gs.spawn(device_modes.save_job, world, m, str(tmp), timeout_s=60)[0]
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADSYNC_NCCL_RULES", "meta")
    try:
        for m, (*_, world) in MODES.items():
            try:
                out[m] = gs.spawn(device_modes.device_job, world, m, saved[m], timeout_s=60)
            except gs.WorkerFailedError as e:
                out[m] = _where(str(e))
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_runs_on_the_device_and_keeps_nothing_on_the_host(results, mode):
    res = results[mode]
    assert not isinstance(res, str), res
    for rank, r in enumerate(res):
        assert r["off_device"] == [], f"rank {rank} holds host tensors: {r['off_device'][:5]}"


def test_a_model_on_another_device_is_refused_in_one_line(monkeypatch):
    """A CPU model under NCCL failed inside torch ("No backend type associated with device
    type cpu", examples/minimal.py on an H100); now each wrapper names the tensor and
    the fix before anything is built."""
    monkeypatch.setenv("GRADSYNC_NCCL_RULES", "meta")
    res = gs.spawn(device_modes.wrong_device_job, 2, timeout_s=60)
    for r in res:
        for what, msg in r.items():
            assert msg is not None, f"{what}: a host model was accepted"
            assert "'inp.weight' is on cpu" in msg and "communicates on meta" in msg, msg
            assert "model.to(gs.init().device)" in msg and "\n" not in msg, msg
