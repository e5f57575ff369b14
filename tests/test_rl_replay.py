"""Replay buffer: capacity, uniform and prioritized sampling, sharing between processes, checkpoints."""

import time

import pytest
import torch

from uma_lightning.rl.local import process_context
from uma_lightning.rl.replay import ReplayBuffer

LAYOUT = {
    "obs": ((3,), torch.float32),
    "action": ((1,), torch.float32),
    "reward": ((), torch.float32),
    "done": ((), torch.bool),
}


def rows(start: int, n: int) -> dict:
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return {
        "obs": ids[:, None].expand(n, 3).clone(),
        "action": ids[:, None].clone(),
        "reward": ids.clone(),
        "done": (ids.long() % 2).bool(),
    }


def test_ring_keeps_the_newest_capacity_transitions():
    buffer = ReplayBuffer(10, LAYOUT)
    buffer.add(rows(0, 7))
    buffer.add(rows(7, 6))  # wraps around
    assert len(buffer) == 10
    assert sorted(buffer.storage["reward"].tolist()) == list(range(3, 13))
    buffer.add(rows(100, 25))  # more than fits at once: only the newest 10 survive
    assert sorted(buffer.storage["reward"].tolist()) == list(range(115, 125))
    sample, indices, weights = buffer.sample(64)
    assert (sample["obs"][:, 0] == sample["reward"]).all() and (sample["action"][:, 0] == sample["reward"]).all()
    assert (sample["done"] == (sample["reward"].long() % 2).bool()).all()
    assert (weights == 1).all() and indices.max() < 10


def test_prioritized_sampling_follows_priorities_and_weights_correct_for_it():
    buffer = ReplayBuffer(8, LAYOUT, prioritized=True, alpha=1.0, beta=1.0, eps=0.0, seed=0)
    buffer.add(rows(0, 6))
    priorities = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 10.0])
    buffer.update_priorities(torch.arange(6), priorities)
    # Sum-tree invariant: every inner node is the sum of its children.
    inner = torch.arange(1, buffer.leaves)
    assert torch.equal(buffer.tree[inner], buffer.tree[2 * inner] + buffer.tree[2 * inner + 1])
    _, indices, weights = buffer.sample(20_000)
    frequency = torch.bincount(indices, minlength=6).double() / len(indices)
    expected = priorities.double() / priorities.sum()
    assert torch.allclose(frequency, expected, atol=0.01)
    assert (indices != 4).all()  # zero priority, never drawn
    # w_i = (N P(i))^-beta / max_j w_j: with beta = 1, inversely proportional to the priority.
    by_index = {int(i): float(w) for i, w in zip(indices, weights)}
    assert by_index[0] == pytest.approx(1.0) and by_index[5] == pytest.approx(0.1)
    # New transitions enter with the highest priority seen so far.
    buffer.add(rows(6, 1))
    assert buffer.tree[buffer.leaves + 6] == 10.0
    # An index drawn several times in one batch keeps its last priority, and the sums stay exact.
    buffer.update_priorities(torch.tensor([2, 5, 2, 2, 5]), torch.tensor([7.0, 1.0, 9.0, 0.5, 3.0]))
    assert buffer.tree[buffer.leaves + 2] == 0.5 and buffer.tree[buffer.leaves + 5] == 3.0
    assert torch.equal(buffer.tree[inner], buffer.tree[2 * inner] + buffer.tree[2 * inner + 1])
    assert buffer.tree[1] == 1.0 + 2.0 + 0.5 + 4.0 + 0.0 + 3.0 + 10.0


def test_alpha_zero_samples_uniformly_whatever_the_priorities():
    buffer = ReplayBuffer(4, LAYOUT, prioritized=True, alpha=0.0, seed=1)
    buffer.add(rows(0, 4))
    buffer.update_priorities(torch.arange(4), torch.tensor([1.0, 100.0, 0.5, 3.0]))
    _, indices, weights = buffer.sample(8000)
    assert torch.allclose(
        torch.bincount(indices).double() / 8000, torch.full((4,), 0.25, dtype=torch.float64), atol=0.02
    )
    assert torch.allclose(weights, torch.ones_like(weights))


@pytest.mark.parametrize("prioritized", [False, True])
def test_checkpoint_round_trip_is_bitwise_and_sampling_continues_identically(tmp_path, prioritized):
    buffer = ReplayBuffer(50, LAYOUT, prioritized=prioritized, seed=3)
    for start in range(0, 70, 7):  # wraps: write position is not at the end
        buffer.add(rows(start, 7))
        _, indices, _ = buffer.sample(16)
        buffer.update_priorities(indices, torch.rand(16))
    torch.save(buffer.state_dict(), tmp_path / "buffer.pt")
    expected = [buffer.sample(16) for _ in range(3)]

    restored = ReplayBuffer(50, LAYOUT, prioritized=prioritized, seed=999)
    restored.load_state_dict(torch.load(tmp_path / "buffer.pt", weights_only=True))
    assert int(restored.meta[0]) == 70 % 50 and len(restored) == 50
    for name in LAYOUT:
        assert torch.equal(restored.storage[name], buffer.storage[name])
    if prioritized:
        assert torch.equal(restored.tree, buffer.tree) and torch.equal(restored.max_priority, buffer.max_priority)
    for want in expected:
        got = restored.sample(16)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert all(torch.equal(got[0][k], want[0][k]) for k in LAYOUT)


def test_loading_a_checkpoint_of_another_shape_names_the_difference():
    state = ReplayBuffer(50, LAYOUT).state_dict()
    with pytest.raises(ValueError, match="capacity=50, this buffer has 60"):
        ReplayBuffer(60, LAYOUT).load_state_dict(state)
    with pytest.raises(ValueError, match="holds fields"):
        ReplayBuffer(50, {**LAYOUT, "obs": ((4,), torch.float32)}).load_state_dict(state)


def _writer(buffer: ReplayBuffer, start: int, count: int) -> None:
    for offset in range(0, count, 5):
        buffer.add(rows(start + offset, 5))
        buffer.update_priorities(torch.arange(5), torch.full((5,), float(start + 1)))


@pytest.mark.slow  # writer processes
def test_processes_writing_and_sampling_concurrently_never_see_torn_transitions():
    buffer = ReplayBuffer(64, LAYOUT, prioritized=True)
    buffer.add(rows(0, 5))
    ctx = process_context()  # the actors' forkserver: torch is already imported there
    writers = [ctx.Process(target=_writer, args=(buffer, start, 400)) for start in (1000, 5000)]
    for w in writers:
        w.start()
    while any(w.is_alive() for w in writers):
        sample, _, _ = buffer.sample(32)
        # Every field of a transition comes from the same write.
        assert (sample["obs"] == sample["reward"][:, None]).all() and (sample["action"][:, 0] == sample["reward"]).all()
        time.sleep(0.001)
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert len(buffer) == 64 and int(buffer.meta[0]) == (5 + 800) % 64
    written = set(buffer.storage["reward"].long().tolist())
    assert written <= set(range(1000, 1400)) | set(range(5000, 5400))
    inner = torch.arange(1, buffer.leaves)
    assert torch.allclose(buffer.tree[inner], buffer.tree[2 * inner] + buffer.tree[2 * inner + 1])
