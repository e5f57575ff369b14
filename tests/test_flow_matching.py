"""Flow matching on a toy problem: a small network trained with our loss and sampled with our Euler
sampler must reproduce a known 2-D Gaussian mixture (mode weights, means and spreads)."""

import pytest
import torch
from torch import nn

from uma_lightning.models.flow_matching import (
    FlowMatchingConfig,
    euler_sample,
    noisy_sample,
    sample_time,
    time_embedding,
    velocity_loss,
)

MEANS = torch.tensor([[-2.0, 0.0], [2.0, 0.0], [0.0, 2.5]])
WEIGHTS = torch.tensor([0.5, 0.3, 0.2])
STD = 0.3


def sample_mixture(n: int, generator: torch.Generator) -> torch.Tensor:
    modes = torch.multinomial(WEIGHTS, n, replacement=True, generator=generator)
    return MEANS[modes] + STD * torch.randn(n, 2, generator=generator)


class VelocityNet(nn.Module):
    def __init__(self, width: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 + 32, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 2)
        )

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat((x, time_embedding(t, 32)), dim=-1))


def test_time_distribution_is_the_configured_beta():
    torch.manual_seed(0)
    cfg = FlowMatchingConfig(time_alpha=1.5, time_beta=1.0, min_time=0.001)
    t = sample_time(200_000, cfg)
    assert t.min() >= 0.001 and t.max() <= 1.0
    # Beta(1.5, 1) has mean 0.6 and P(t < 0.5) = 0.5^1.5.
    assert abs(float(t.mean()) - (0.001 + 0.999 * 0.6)) < 0.005
    assert abs(float((t < 0.5).float().mean()) - 0.5**1.5) < 0.005


def test_interpolation_and_velocity_follow_the_straight_path():
    actions, noise = torch.randn(4, 3, 2), torch.randn(4, 3, 2)
    x_t, velocity = noisy_sample(actions, noise, torch.tensor([0.0, 1.0, 0.25, 0.5]))
    torch.testing.assert_close(x_t[0], actions[0])
    torch.testing.assert_close(x_t[1], noise[1])
    torch.testing.assert_close(x_t[2], 0.25 * noise[2] + 0.75 * actions[2])
    torch.testing.assert_close(velocity, noise - actions)
    # Euler integration of the exact velocity field of one pair recovers its data point from its noise.
    recovered = euler_sample(lambda x, t: velocity, noise, steps=7)
    torch.testing.assert_close(recovered, actions)


def test_velocity_loss_ignores_padded_steps_and_averages_per_sample():
    predicted, target = torch.zeros(2, 3, 1), torch.ones(2, 3, 1)
    target[0, 2] = 100.0  # a padded step: must not count
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(velocity_loss(predicted, target, mask)) == 1.0


def test_sampling_recovers_a_known_2d_mixture():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    cfg = FlowMatchingConfig(sample_steps=20)  # pi0's Beta(1.5, 1) time distribution
    model = VelocityNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small run faster on one thread than on a shared machine's two
    try:
        for _ in range(1000):
            data = sample_mixture(512, generator)
            t = sample_time(len(data), cfg)
            noisy, target = noisy_sample(data, torch.randn_like(data), t)
            loss = velocity_loss(model(noisy, t)[:, None], target[:, None])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        with torch.no_grad():
            samples = euler_sample(model, torch.randn(6000, 2, generator=generator), steps=cfg.sample_steps)
            one_step = euler_sample(model, torch.randn(6000, 2, generator=generator), steps=1)
    finally:
        torch.set_num_threads(threads)

    nearest = torch.cdist(samples, MEANS).argmin(dim=1)
    weights = torch.bincount(nearest, minlength=3).float() / len(samples)
    print("mode weights", [round(w, 3) for w in weights.tolist()], "expected", WEIGHTS.tolist())
    assert torch.allclose(weights, WEIGHTS, atol=0.03), weights
    for mode in range(3):
        members = samples[nearest == mode]
        mean_error = float((members.mean(0) - MEANS[mode]).norm())
        spread = float(members.std(0).mean())
        print(f"mode {mode}: mean off by {mean_error:.3f}, std {spread:.3f} (expected {STD})")
        assert mean_error < 0.2
        assert 0.25 < spread < 0.5
    # Few samples fall between the modes; a single Euler step, by contrast, lands near the data mean.
    off_modes = float((torch.cdist(samples, MEANS).min(dim=1).values > 4 * STD).float().mean())
    off_modes_one_step = float((torch.cdist(one_step, MEANS).min(dim=1).values > 4 * STD).float().mean())
    print(
        f"samples off every mode: {off_modes:.3f} with {cfg.sample_steps} steps, {off_modes_one_step:.3f} with 1 step"
    )
    assert off_modes < 0.1 and off_modes_one_step > 0.5


def test_noise_and_time_of_a_sample_do_not_depend_on_its_batch():
    """Data-parallel ranks that split a batch draw what one process on the whole batch draws."""
    from uma_lightning.models.flow_matching import sample_noise_and_time

    cfg = FlowMatchingConfig()
    ids = torch.tensor([5, 9, 2, 7])
    state = torch.get_rng_state()
    noise, t = sample_noise_and_time(ids, 3, (4, 2), cfg, seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was
    halves = [sample_noise_and_time(ids[part], 3, (4, 2), cfg, seed=0) for part in (slice(0, 2), slice(2, 4))]
    assert torch.equal(torch.cat([h[0] for h in halves]), noise) and torch.equal(torch.cat([h[1] for h in halves]), t)
    assert noise.shape == (4, 4, 2) and ((t >= cfg.min_time) & (t <= 1)).all()
    # Another step or seed draws anew; distinct samples draw distinct noise.
    assert not torch.equal(sample_noise_and_time(ids, 4, (4, 2), cfg, seed=0)[0], noise)
    assert not torch.equal(sample_noise_and_time(ids, 3, (4, 2), cfg, seed=1)[0], noise)
    assert not torch.equal(noise[0], noise[1])


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16])
def test_times_are_drawn_in_float32_under_a_half_default_dtype(default):
    """Lightning's bf16-true and 16-true make a half type the default dtype, for which torch has no
    Beta sampler on the CPU: the times are drawn as under float32, the same values."""
    from uma_lightning.models.flow_matching import sample_noise_and_time, sample_time

    cfg, ids = FlowMatchingConfig(), torch.tensor([5, 9])
    expected = sample_noise_and_time(ids, 3, (4, 2), cfg, seed=0)[1]
    torch.manual_seed(0)
    expected_global = sample_time(3, cfg)
    torch.set_default_dtype(default)
    try:
        t = sample_noise_and_time(ids, 3, (4, 2), cfg, seed=0)[1]
        torch.manual_seed(0)
        t_global = sample_time(3, cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    assert t.dtype == t_global.dtype == torch.float32
    assert torch.equal(t, expected) and torch.equal(t_global, expected_global)
