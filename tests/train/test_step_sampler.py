"""StepSampler: a global position in a stream of epochs, so any number of ranks continues it.

Pure (no processes): ranks are simulated. Over any sequence of world sizes, with
a checkpoint (state_dict -> a new sampler) between segments, the union of what
the ranks draw in each step is the stream's next block, and every epoch of the
stream holds every sample exactly once.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.data.sampler import DistributedSampler, StepSampler


def _stream(n, seed, length):
    out, epoch = [], 0
    while len(out) < length:
        g = torch.Generator().manual_seed(seed + epoch)
        out += torch.randperm(n, generator=g).tolist()
        epoch += 1
    return out[:length]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), batch_per_rank=st.integers(1, 4),
       worlds=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4),
       steps=st.lists(st.integers(1, 7), min_size=4, max_size=4), seed=st.integers(0, 5))
def test_any_world_sizes_use_every_sample_once_per_epoch(n, batch_per_rank, worlds, steps,
                                                          seed):
    gb = 12 * batch_per_rank  # divisible by every world size drawn
    drawn, state = [], None
    for world, count in zip(worlds, steps):
        ranks = [StepSampler(n, gb, seed=seed) for _ in range(world)]
        for s in ranks:
            if state is not None:
                s.load_state_dict(state)
        for _ in range(count):
            shares = [StepSampler.share(s.next_block(), r, world) for r, s in enumerate(ranks)]
            assert {len(x) for x in shares} == {gb // world}
            block = [shares[i % world][i // world] for i in range(gb)]  # un-interleave
            drawn += block
        state = ranks[0].state_dict()
        assert all(s.state_dict() == state for s in ranks)
    assert drawn == _stream(n, seed, len(drawn))
    for e in range(len(drawn) // n):
        assert sorted(drawn[e * n:(e + 1) * n]) == list(range(n))


def test_within_an_epoch_ranks_draw_what_distributed_sampler_exact_gives():
    n, world, gb = 50, 2, 10
    ranks = [StepSampler(n, gb, seed=3) for _ in range(world)]
    mine = [[], []]
    for _ in range(n // gb):
        for r, s in enumerate(ranks):
            mine[r] += StepSampler.share(s.next_block(), r, world)
    for r in range(world):
        ds = DistributedSampler(range(n), num_replicas=world, rank=r, seed=3, mode="exact")
        assert mine[r] == list(ds)


def test_a_step_across_the_epoch_boundary_takes_the_end_and_the_next_start():
    s = StepSampler(5, 4, shuffle=False)
    assert s.next_block() == [0, 1, 2, 3]
    assert s.next_block() == [4, 0, 1, 2]  # the end of epoch 0, the start of epoch 1
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 3


def test_state_from_older_per_rank_checkpoints():
    states = [DistributedSampler(range(20), 2, r, seed=1, mode="exact").state_dict(consumed=4)
              for r in range(2)]
    for st_ in states:
        st_["epoch"] = 0
    g = StepSampler.from_rank_states(states, 4)
    assert (g["epoch"], g["position"]) == (0, 8)
