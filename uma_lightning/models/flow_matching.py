"""Flow matching for continuous action chunks, as pi0 trains its action expert.

Convention (pi0's): time 1 is pure noise and time 0 the data. A training sample draws
t ~ min_time + (1 - min_time) * Beta(alpha, beta), mixes x_t = t * noise + (1 - t) * actions, and
regresses the velocity u = noise - actions, the time derivative of x_t along the straight path.
Beta(1.5, 1) puts more weight on noisy times, where predicting the velocity is hardest. Sampling
integrates dx/dt = v(x, t) from t = 1 to t = 0 with K Euler steps.

Pure functions over tensors; the velocity model is whatever callable the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlowMatchingConfig:
    """Training-time distribution and inference steps of flow matching.

    Args:
        time_alpha: Alpha of the Beta distribution training times t are drawn from.
        time_beta: Beta of that distribution.
        min_time: Lower bound of t, away from 0 where x_t is the data itself and the target degenerates.
        sample_steps: Euler steps from noise to actions at inference.
        noise_scale: Scale of the starting noise at inference: 1 samples the learned distribution; 0 starts
            every chunk from the noise's mean, a deterministic policy.
    """

    time_alpha: float = 1.5
    time_beta: float = 1.0
    min_time: float = 0.001
    sample_steps: int = 10
    noise_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.time_alpha <= 0 or self.time_beta <= 0:
            raise ValueError(f"time_alpha and time_beta must be > 0, got {self.time_alpha}, {self.time_beta}")
        if not 0 <= self.min_time < 1:
            raise ValueError(f"min_time must be in [0, 1), got {self.min_time}")
        if self.sample_steps < 1:
            raise ValueError(f"sample_steps must be >= 1, got {self.sample_steps}")
        if self.noise_scale < 0:
            raise ValueError(f"noise_scale must be >= 0, got {self.noise_scale}")


def _time_distribution(cfg: FlowMatchingConfig) -> torch.distributions.Beta:
    """The Beta distribution of training times, in at least float32 whatever the default dtype: under
    Lightning's bf16-true and 16-true the default is a half type, for which torch has no Beta
    sampler on the CPU (float64 stays float64). The config has checked the parameters; checking them
    again would read tensor values, which a step counted on fake tensors has not (``modules/flops.py``)."""
    dtype = torch.promote_types(torch.get_default_dtype(), torch.float32)
    alpha, beta = torch.tensor(cfg.time_alpha, dtype=dtype), torch.tensor(cfg.time_beta, dtype=dtype)
    return torch.distributions.Beta(alpha, beta, validate_args=False)


def sample_time(n: int, cfg: FlowMatchingConfig, device=None) -> torch.Tensor:
    """Training times [n] in [min_time, 1], from torch's global generator (seeded per run)."""
    beta = _time_distribution(cfg).sample((n,))
    return (cfg.min_time + (1 - cfg.min_time) * beta).to(device)


def sample_noise_and_time(
    sample_ids: torch.Tensor,
    step: int,
    shape: tuple[int, ...],
    cfg: FlowMatchingConfig,
    seed: int,
    dtype=torch.float32,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise [B, *shape] and training times [B], each sample's drawn from its own generator, seeded by
    (seed, step, sample id). The draws of a sample do not depend on the batch it sits in, so
    data-parallel ranks that split a batch draw what one process on the whole batch draws."""
    time = _time_distribution(cfg)
    noises, times = [], []
    with torch.random.fork_rng(devices=[]):  # the global generator continues as if nothing was drawn
        for sample_id in sample_ids.tolist():
            torch.manual_seed(hash((seed, step, sample_id)) & (2**63 - 1))  # hashing ints is the same in every process
            times.append(time.sample())
            noises.append(torch.randn(shape, dtype=dtype))
    t = cfg.min_time + (1 - cfg.min_time) * torch.stack(times)
    return torch.stack(noises).to(device), t.to(device)


def noisy_sample(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, target velocity) for actions and noise [B, ...] at times t [B]."""
    t = t.view(-1, *([1] * (actions.dim() - 1))).to(actions.dtype)
    return t * noise + (1 - t) * actions, noise - actions


def velocity_loss(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared velocity error of [B, horizon, D] chunks over real steps (mask [B, horizon]).

    Averaged over each sample's real steps, then over samples, so the loss of a batch is the mean
    of the losses of its parts: data-parallel ranks train as one process on the whole batch.
    """
    dtype = torch.promote_types(predicted.dtype, torch.float32)  # at least float32; float64 stays float64
    squared = (predicted.to(dtype) - target.to(dtype)).pow(2).mean(dim=-1)  # [B, horizon]
    if mask is None:
        return squared.mean()
    mask = mask.to(squared.dtype)
    return ((squared * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()


def euler_sample(
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor, steps: int
) -> torch.Tensor:
    """Integrate from x = noise at t = 1 to t = 0 with ``steps`` Euler steps of velocity(x, t [B])."""
    x, dt = noise, -1.0 / steps
    for step in range(steps):
        t = torch.full((noise.shape[0],), 1.0 - step / steps, dtype=noise.dtype, device=noise.device)
        x = x + dt * velocity(x, t)
    return x


def time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """Sine-cosine features [B, dim] of times t [B] in [0, 1], periods geometric from min to max."""
    if dim % 2:
        raise ValueError(f"time embedding width must be even, got {dim}")
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = t.float()[:, None] * (2 * torch.pi / period)[None, :]
    return torch.cat((angles.sin(), angles.cos()), dim=-1)
