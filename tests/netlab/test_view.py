"""What the netlab run table says about each host: pure, no namespaces needed."""

import pytest

from gradsync.netlab import HostResult
from gradsync.netlab.view import telling_line

TORCHRUN_FAILURE = """\
[W1125 15:41:57.266699894 socket.cpp:207] [c10d] The hostname cannot be retrieved.
gradsync.train (rank 0): error: --global-batch 16 is not a multiple of --micro-batch 8 x 4 workers
E1125 15:42:05.257000 14297 elastic/multiprocessing/api.py:1002] failed (exitcode: 2)
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
gradsync.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_15:41:51
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 14235)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


@pytest.mark.no_root
def test_a_failed_host_shows_the_workers_error_not_torchruns_report():
    for out, err in ((TORCHRUN_FAILURE, ""), ("", TORCHRUN_FAILURE)):
        line = telling_line(HostResult(0, 1, out, err))
        assert line.startswith("gradsync.train (rank 0): error: --global-batch 16"), line


@pytest.mark.no_root
def test_a_host_that_finished_shows_its_last_output_line():
    r = HostResult(1, 0, "step 5/5\nsummary written\n\n", "[W1125 warning]\n")
    assert telling_line(r) == "summary written"
    assert telling_line(HostResult(1, 0, "", "[W1125 only a warning]\nfinished\n")) == "finished"
    assert telling_line(HostResult(1, None, "", "")) == ""
