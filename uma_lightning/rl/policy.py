"""The policy interface actors and learners share, and the small MLP policies for sanity runs.

A policy is an ``nn.Module`` whose ``forward(obs)`` takes raw observations ``float32 [B, obs_dim]``
and returns a ``PolicyOutput``: a ``torch.distributions.Distribution`` over actions (batch shape
``[B]``, event shape ``[action_dim]``) and, for actor-critic learners, a value estimate ``[B]``.
Everything the policy needs to act (weights, observation statistics) lives in its ``state_dict``,
because that is what is published to actors. A policy that standardises observations with running
statistics keeps a ``RunningNorm`` as ``obs_norm``; learners update it from the data they train on. A post-trained transformer policy is adapted by
wrapping it in a module with this ``forward``; the learners build theirs in ``build_policy()``.

Actors only need a sample, its log-probability and the value, batch after batch. A policy class may
define ``act(obs) -> (action, log_prob, value)`` that computes exactly that in few ops, drawing the
same random numbers, and ``numpy_act(batch)``, the same for numpy arrays on the CPU, written into
the caller's; ``fused_act`` returns either only while ``forward`` is that class's own, so a
subclass that changes ``forward`` is acted with through ``forward`` again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Distribution, Independent, Normal

from uma_lightning.rl.env import EnvSpec

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))  # as torch.distributions.Normal.log_prob writes it


class PolicyOutput(NamedTuple):
    distribution: Distribution
    value: Optional[torch.Tensor] = None


def check_policy(policy: nn.Module, spec: EnvSpec, needs_value: bool) -> None:
    """Fail early, naming the policy, if its outputs do not fit the environment."""
    name = type(policy).__name__
    with torch.no_grad():
        out = policy(torch.zeros(2, spec.obs_dim))
    if not isinstance(out, PolicyOutput):
        raise TypeError(f"{name}.forward must return a PolicyOutput(distribution, value), got {type(out).__name__}")
    action = out.distribution.sample()
    if tuple(action.shape) != (2, spec.action_dim):
        raise ValueError(
            f"{name}: actions have shape {tuple(action.shape)[1:]}, env {spec.env} needs ({spec.action_dim},)"
        )
    if tuple(out.distribution.log_prob(action).shape) != (2,):
        raise ValueError(
            f"{name}: log_prob must give one value per sample; wrap per-dimension distributions in Independent"
        )
    if needs_value and (out.value is None or tuple(out.value.shape) != (2,)):
        raise ValueError(f"{name}: this learner needs a value estimate of shape [B] from the policy")


def fused_act(policy: nn.Module, method: str = "act"):
    """``policy.act`` (or the ``method`` named) when the class that defines it also defines the
    ``forward`` in use, else None."""
    cls = type(policy)
    owner = next((klass for klass in cls.__mro__ if method in vars(klass)), None)
    if owner is None or vars(owner).get("forward") is not cls.forward:
        return None
    return getattr(policy, method)


class RunningNorm(nn.Module):
    """Running mean and variance of a stream of values, merged batch by batch (Chan et al.)."""

    def __init__(self, shape: Sequence[int] | int = (), clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """Divide by the running standard deviation, without centring (reward scaling)."""
        return x / torch.sqrt(self.var + self.eps)

    @staticmethod
    def moments(x: torch.Tensor, event_dims: int) -> torch.Tensor:
        """``[count, mean..., var...]`` of ``x`` over all but its last ``event_dims`` dimensions."""
        flat = x.reshape(-1, *x.shape[x.dim() - event_dims :]).double()
        count = torch.tensor([flat.shape[0]], dtype=torch.float64, device=x.device)
        return torch.cat([count, flat.mean(0).flatten(), flat.var(0, unbiased=False).flatten()])

    @torch.no_grad()
    def update(self, moments: torch.Tensor) -> None:
        """Merge batch moments (from ``moments``, or several stacked as ``[n, ...]`` from several ranks)."""
        for row in moments.reshape(-1, moments.shape[-1]):
            n = self.mean.numel()
            count, mean, var = row[0], row[1 : 1 + n].view_as(self.mean), row[1 + n :].view_as(self.var)
            total = self.count + count
            delta = mean - self.mean.double()
            new_mean = self.mean.double() + delta * count / total
            m2 = self.var.double() * self.count + var * count + delta**2 * self.count * count / total
            self.mean.copy_(new_mean)
            self.var.copy_(m2 / total)
            self.count.copy_(total)


def mlp(sizes: Sequence[int], activation: type[nn.Module], out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(n_in, n_out)
        last = index == len(sizes) - 2
        # Orthogonal init with a small output gain keeps the initial policy near its mean action (PPO practice).
        nn.init.orthogonal_(linear.weight, out_gain if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers += [linear] if last else [linear, activation()]
    return nn.Sequential(*layers)


_IN_PLACE = {nn.Tanh: torch.Tensor.tanh_, nn.ReLU: torch.Tensor.relu_}


def mlp_forward_(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``net(x)`` of an ``mlp`` for acting: the same ops, activations in place, no module calls."""
    for layer in net:
        if isinstance(layer, nn.Linear):
            x = F.linear(x, layer.weight, layer.bias)
        else:
            x = _IN_PLACE[type(layer)](x)
    return x


class GaussianMLPPolicy(nn.Module):
    """Actor-critic for PPO: a diagonal Gaussian whose mean is an MLP of the observation, a learned
    state-independent log standard deviation, and a separate MLP value head."""

    def __init__(
        self, spec: EnvSpec, hidden: Sequence[int] = (64, 64), normalize_obs: bool = True, init_log_std: float = 0.0
    ):
        super().__init__()
        self.obs_norm = RunningNorm(spec.obs_dim) if normalize_obs else nn.Identity()
        self.actor = mlp([spec.obs_dim, *hidden, spec.action_dim], nn.Tanh, out_gain=0.01)
        self.critic = mlp([spec.obs_dim, *hidden, 1], nn.Tanh, out_gain=1.0)
        self.log_std = nn.Parameter(torch.full((spec.action_dim,), float(init_log_std)))

    def forward(self, obs: torch.Tensor) -> PolicyOutput:
        x = self.obs_norm(obs)
        mean = self.actor(x)
        distribution = Independent(
            Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False), 1, validate_args=False
        )
        return PolicyOutput(distribution, self.critic(x).squeeze(-1))

    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sample of ``forward``'s distribution, its log-probability and the value, bitwise as the
        distribution objects compute them, with no objects built (about 25 ops per batch). For
        callers under ``torch.inference_mode`` (actors, inference servers)."""
        std, two_var, log_std, obs_scale = self._per_version()
        norm = self.obs_norm
        x = torch.sub(obs, norm.mean).div_(obs_scale).clamp_(-norm.clip, norm.clip) if obs_scale is not None else obs
        mean = mlp_forward_(self.actor, x)
        action = torch.normal(mean, std.expand_as(mean))  # Normal.sample's call: the same draws
        # Normal.log_prob's formula, op for op, then Independent's sum over the action dimensions.
        log_prob = (action - mean).square_().neg_().div_(two_var).sub_(log_std).sub_(_LOG_SQRT_2PI).sum(-1)
        return action, log_prob, mlp_forward_(self.critic, x).squeeze(-1)

    def numpy_act(self, batch: int) -> NumpyAct:
        """``act`` for batches of ``batch`` float32 numpy observations on the CPU, bound to the weights
        as they are now (see ``NumpyAct``); bind again after copying new weights in."""
        return NumpyAct(self, batch)

    def _per_version(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """What ``act`` derives from the weights alone (the std, twice the variance, the log-std, the
        observation scale), computed again only when they changed: copying new weights in, as actors
        do, moves the tensors' version counters."""
        norm = self.obs_norm if isinstance(self.obs_norm, RunningNorm) else None
        sources = (self.log_std,) if norm is None else (self.log_std, norm.var)
        key = tuple((id(t), t.data_ptr(), t._version) for t in sources)
        cached = self.__dict__.get("_act_constants")
        if cached is None or cached[0] != key:
            std = self.log_std.detach().exp()
            obs_scale = None if norm is None else torch.sqrt(norm.var + norm.eps)
            cached = self._act_constants = (key, std, 2 * std.square(), std.log(), obs_scale)
        return cached[1:]


class NumpyAct:
    """``GaussianMLPPolicy.act`` for one batch size, writing into the caller's numpy arrays: bitwise the
    same values and random draws. The element-wise parts run in numpy, which rounds them as torch
    does; the matrix products (``F.linear``'s ``addmm``), tanh, the draws and the log-probability's sum
    stay torch's, as numpy's differ in the last bit. Actors call it between simulator steps, where the
    caches are cold and every distinct torch or Python call costs several times what it costs in a
    tight loop, so what does not change between steps is done once, when it is bound: the per-version
    constants, the weights' transposed views, the buffers for the intermediates. There it costs about
    half of ``act``'s CPU (Humanoid-v5, 8 envs, 64x64)."""

    def __init__(self, policy: GaussianMLPPolicy, batch: int):
        std, two_var, log_std, obs_scale = policy._per_version()
        self.std, self.two_var, self.log_std = std.numpy(), two_var.numpy(), log_std.numpy()
        norm = policy.obs_norm
        self.obs_norm = None if obs_scale is None else (norm.mean.detach().numpy(), obs_scale.numpy(), norm.clip)
        self.obs = np.empty((batch, policy.actor[0].in_features), np.float32)
        self.obs_tensor = torch.from_numpy(self.obs)
        self.actor = _bound_layers(policy.actor, batch)
        self.critic = _bound_layers(policy.critic, batch)
        self.mean = self.actor[-1][2].numpy()
        self.value = self.critic[-1][2].numpy()[:, 0]
        self.log_prob_terms = np.empty_like(self.mean)
        self.log_prob_terms_tensor = torch.from_numpy(self.log_prob_terms)

    def __call__(self, obs: np.ndarray, action: np.ndarray, log_prob: np.ndarray, value: np.ndarray) -> None:
        """Act on ``obs [B, obs_dim]``, writing ``action [B, A]``, ``log_prob [B]`` and ``value [B]``."""
        if self.obs_norm is None:
            x = torch.from_numpy(obs)
        else:
            mean, scale, clip = self.obs_norm
            np.subtract(obs, mean, out=self.obs)
            np.divide(self.obs, scale, out=self.obs)
            np.clip(self.obs, -clip, clip, out=self.obs)
            x = self.obs_tensor
        _run_layers(self.actor, x)
        # torch.normal(mean, std) draws standard normals into its output, then multiplies by std and adds mean.
        torch.from_numpy(action).normal_()
        np.multiply(action, self.std, out=action)
        np.add(action, self.mean, out=action)
        terms = self.log_prob_terms  # Normal.log_prob's formula, op for op, as act computes it
        np.subtract(action, self.mean, out=terms)
        np.square(terms, out=terms)
        np.negative(terms, out=terms)
        np.divide(terms, self.two_var, out=terms)
        np.subtract(terms, self.log_std, out=terms)
        np.subtract(terms, np.float32(_LOG_SQRT_2PI), out=terms)
        torch.sum(self.log_prob_terms_tensor, -1, out=torch.from_numpy(log_prob))
        _run_layers(self.critic, x)
        value[...] = self.value


_BoundLayer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[Callable[[torch.Tensor], torch.Tensor]]]


def _bound_layers(net: nn.Sequential, batch: int) -> list[_BoundLayer]:
    """An ``mlp``'s linear layers as (bias, transposed weight view, output buffer, in-place activation or None)."""
    layers: list[_BoundLayer] = []
    for layer in net:
        if isinstance(layer, nn.Linear):
            weight = layer.weight.detach()
            layers.append((layer.bias.detach(), weight.t(), torch.empty(batch, layer.out_features), None))
        else:
            layers[-1] = (*layers[-1][:3], _IN_PLACE[type(layer)])
    return layers


def _run_layers(layers: list[_BoundLayer], x: torch.Tensor) -> None:
    """``mlp_forward_`` into the bound layers' buffers (``F.linear`` of a batch is this ``addmm``)."""
    for bias, weight_t, out, activation in layers:
        x = torch.addmm(bias, x, weight_t, out=out)
        if activation is not None:
            activation(x)


class SquashedNormal(Distribution):
    """A diagonal Gaussian squashed by tanh, then scaled into ``[loc - scale, loc + scale]``.

    ``log_prob`` of the sample this distribution drew last reuses the pre-squash value instead of
    inverting tanh, which is exact and avoids atanh's blow-up at the bounds."""

    arg_constraints: dict = {}
    has_rsample = True

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor):
        self.normal = Normal(mean, std, validate_args=False)
        self.loc, self.scale = loc, scale
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(batch_shape=mean.shape[:-1], event_shape=mean.shape[-1:], validate_args=False)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        x = self.normal.rsample(sample_shape)
        y = self.loc + self.scale * torch.tanh(x)
        self._last = (x, y)
        return y

    def sample(self, sample_shape: torch.Size = torch.Size()) -> torch.Tensor:
        with torch.no_grad():
            return self.rsample(sample_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._last is not None and value is self._last[1]:
            x = self._last[0]
        else:
            x = torch.atanh(((value - self.loc) / self.scale).clamp(-1 + 1e-6, 1 - 1e-6))
        # log|d tanh(x)/dx| = 2 * (log 2 - x - softplus(-2x)), stable for large |x|.
        log_det = 2 * (math.log(2) - x - F.softplus(-2 * x)) + torch.log(self.scale)
        return (self.normal.log_prob(x) - log_det).sum(-1)

    @property
    def mean(self) -> torch.Tensor:
        return self.loc + self.scale * torch.tanh(self.normal.mean)


class TanhGaussianMLPPolicy(nn.Module):
    """Actor for SAC: a Gaussian squashed by tanh into the action bounds; no value head (the learner's
    critics are not needed to act)."""

    def __init__(
        self,
        spec: EnvSpec,
        hidden: Sequence[int] = (256, 256),
        normalize_obs: bool = False,
        log_std_bounds: tuple[float, float] = (-5.0, 2.0),
    ):
        super().__init__()
        self.obs_norm = RunningNorm(spec.obs_dim) if normalize_obs else nn.Identity()
        self.net = mlp([spec.obs_dim, *hidden, 2 * spec.action_dim], nn.ReLU, out_gain=0.01)
        low, high = torch.tensor(spec.action_low), torch.tensor(spec.action_high)
        self.register_buffer("action_loc", (high + low) / 2)
        self.register_buffer("action_scale", (high - low) / 2)
        self.log_std_bounds = log_std_bounds

    def forward(self, obs: torch.Tensor) -> PolicyOutput:
        mean, log_std = self.net(self.obs_norm(obs)).chunk(2, dim=-1)
        low, high = self.log_std_bounds
        log_std = low + 0.5 * (high - low) * (torch.tanh(log_std) + 1)
        return PolicyOutput(SquashedNormal(mean, log_std.exp(), self.action_loc, self.action_scale))
