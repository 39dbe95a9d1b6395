"""The model of ``benchmarks/fault_tolerance.py``: the built-in GPT, its steps made seconds long.

Issue 35 is about steps of seconds, which large models have and this machine's
GPT (0.5 s a step across three emulated hosts) does not. Each forward first sleeps
``GRADSYNC_BENCH_FORWARD_S`` (default 1.5 s), as a bigger model's compute would
take, so a step lasts about 2 s; everything else (the 10.2 MB state a heal
transfers, the start-up a restart pays) is the real GPT's. Named on the command
line as ``--model fault_tolerance_model:slow_gpt`` with ``benchmarks/`` on the path.
"""

from __future__ import annotations

import os
import time

from torch import nn

from gradsync.models import build_model

SEQ_LEN = 128  # gradsync train's --seq-len default, which the built-in data follows


class SlowGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = build_model("gpt", seq_len=SEQ_LEN)
        self.delay = float(os.environ.get("GRADSYNC_BENCH_FORWARD_S", "1.5"))

    def forward(self, x):
        time.sleep(self.delay)
        return self.net(x)


def slow_gpt() -> nn.Module:
    return SlowGPT()
