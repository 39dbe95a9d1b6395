"""One intra-op thread: the machine has 2 cores shared by everyone's tests."""

import torch

torch.set_num_threads(1)
