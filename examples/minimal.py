"""The shortest complete data-parallel training script with gradsync.

    torchrun --standalone --nproc-per-node 2 examples/minimal.py

Every rank holds a full replica and a disjoint shard of the data; after each
synchronised backward every rank holds the gradient of the mean loss over the
whole global batch, so all replicas take the identical step.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync as gs

device = gs.init().device  # torchrun's environment: NCCL on this rank's GPU, else gloo on CPU
torch.manual_seed(0)
x = torch.randn(1000, 10)
y = x @ torch.randn(10, 1) + 0.1 * torch.randn(1000, 1)
dataset = TensorDataset(x, y)

# the model on the communication device before wrapping (a CPU model under NCCL is refused)
model = gs.DataParallel(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sampler = gs.DistributedSampler(dataset, mode="exact")  # every sample once per epoch
loader = DataLoader(dataset, batch_size=50, sampler=sampler)

for epoch in range(5):
    sampler.set_epoch(epoch)  # same shuffle on every rank, new each epoch
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        loss = nn.functional.mse_loss(model(xb), yb)  # mean over this rank's items
        model.backward(loss, num_items=len(xb))  # exact mean over the global batch
        opt.step()
        opt.zero_grad()
    if gs.rank() == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}")

gs.shutdown()
