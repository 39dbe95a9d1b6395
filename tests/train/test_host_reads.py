"""Host reads per training step stay where they are (``GRADSYNC_HOST_READS=1``).

On a GPU every read of a device value stops the host until the device catches up.
A step reads its figures once at its end (and the engine its item header once per
synchronised backward); nothing per micro-batch. ``observe/host_reads.py`` counts
the reads of a step on the CPU path and the metrics line records them; these
numbers are held here, so a read added to the hot path fails this test.

Measured with the same counter (2 workers, micro-batch 4, steps 2 and later):
before issue 33's hot-path work 22 reads a step at 2 micro-batches and 26 at 4
(``float(loss)`` and the item count read from the device per micro-batch, the
figures read element by element); after it 9 and 11. The 1 per micro-batch left
is the item count of the batch taken on the host before its copy (no device read;
the counter cannot tell host tensors from device ones on the CPU).
"""

import json

import pytest

from tests.cli_in_process import cli_here

pytestmark = pytest.mark.slow


def _reads(tmp_path, capfd, global_batch: int) -> list[int]:
    out = tmp_path / f"run{global_batch}"
    res = cli_here("train", "--workers", "2", "--steps", "3", "--global-batch",
                   str(global_batch), "--micro-batch", "4", "--eval-every", "0",
                   "--no-report", "--drift-every", "0", "--out", str(out), capfd=capfd,
                   env={"GRADSYNC_HOST_READS": "1"})
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [rec["host_reads"] for rec in lines]


def test_a_step_reads_device_values_once_not_per_micro_batch(tmp_path, capfd):
    two = _reads(tmp_path, capfd, 16)  # 2 micro-batches per worker
    four = _reads(tmp_path, capfd, 32)  # 4
    assert two[1:] == [9, 9], two  # the first step also builds the buckets' order
    assert four[1:] == [11, 11], four
    # per micro-batch: the host-side item count only (a float(loss) per micro-batch
    # would make this 4, and each of the numbers above 2 and 4 higher)
    assert four[1] - two[1] == 2
