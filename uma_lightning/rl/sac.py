"""Soft actor-critic (Haarnoja et al. 2018) with twin critics, automatic entropy tuning and a replay buffer.

Every batch of trajectories goes into the replay buffer; then the learner takes ``updates_per_step``
optimizer steps per new environment step, each on a batch sampled from the buffer (uniformly or by
TD-error priority). One optimizer with a parameter group per part (critics, actor, temperature)
takes one step on the sum of the three losses: the actor's loss sees the critics through detached
parameters and the temperature's loss sees detached log-probabilities, so each part is moved by
its own loss only, as with three optimizers, and ``global_step`` counts updates.

The buffer is saved in the learner's checkpoint: contents, write position and sampler state.
"""

# No `from __future__ import annotations`: LightningCLI reads the real annotations of __init__.
import copy
import math
from typing import Any, Optional

import torch
from torch import nn
from torch.func import functional_call

from uma_lightning.rl.learner import RLLearner
from uma_lightning.rl.policy import TanhGaussianMLPPolicy
from uma_lightning.rl.replay import ReplayBuffer


class TwinQ(nn.Module):
    """Two independent Q-network MLPs evaluated together as batched matrix products; ``forward``
    returns both estimates, ``[2, B]``."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: tuple[int, ...]):
        super().__init__()
        sizes = [obs_dim + action_dim, *hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            bound = 1 / math.sqrt(n_in)  # nn.Linear's default initialisation, per network
            self.weights.append(nn.Parameter(torch.empty(2, n_in, n_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(2, 1, n_out).uniform_(-bound, bound)))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, action], dim=-1).expand(2, -1, -1)
        for index, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if index < len(self.weights) - 1:
                x = torch.relu(x)
        return x.squeeze(-1)


class SACLearner(RLLearner):
    def __init__(
        self,
        buffer_size: int = 1_000_000,
        batch_size: int = 256,
        learning_starts: int = 5000,
        updates_per_step: float = 1.0,
        tau: float = 0.005,
        critic_lr: float = 1e-3,
        actor_lr: float = 3e-4,
        alpha_lr: float = 1e-3,
        init_alpha: float = 1.0,
        target_entropy: Optional[float] = None,
        hidden: tuple[int, ...] = (256, 256),
        normalize_obs: bool = False,
        prioritized: bool = False,
        priority_alpha: float = 0.6,
        priority_beta: float = 0.4,
        **kwargs,
    ):
        """
        Args:
            buffer_size: Replay buffer capacity in transitions.
            batch_size: Transitions per optimizer step.
            learning_starts: Transitions in the buffer before the first update.
            updates_per_step: Optimizer steps per new environment step (the update-to-data ratio).
            tau: Polyak factor of the target critics.
            critic_lr: Learning rate of the critics.
            actor_lr: Learning rate of the actor.
            alpha_lr: Learning rate of the entropy temperature.
            init_alpha: Initial entropy temperature.
            target_entropy: Entropy the temperature steers to; None means -action_dim.
            hidden: Hidden layer sizes of actor and critics.
            normalize_obs: Standardise observations with running statistics (part of the policy's state).
            prioritized: Sample by TD-error priority instead of uniformly.
            priority_alpha: Priority exponent.
            priority_beta: Importance-weight exponent.
            **kwargs: ``RLLearner``'s: env, gamma, seed (of the replay sampler).
        """
        super().__init__(**kwargs)
        spec = self.env_spec
        self.target_entropy = -float(spec.action_dim) if target_entropy is None else target_entropy
        self.policy = self.build_policy()
        self.critic = TwinQ(spec.obs_dim, spec.action_dim, tuple(hidden))
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(float(init_alpha)).log())
        self.buffer = ReplayBuffer(
            buffer_size,
            {
                "obs": ((spec.obs_dim,), torch.float32),
                "action": ((spec.action_dim,), torch.float32),
                "reward": ((), torch.float32),
                "next_obs": ((spec.obs_dim,), torch.float32),
                "terminated": ((), torch.bool),
            },
            prioritized=prioritized,
            alpha=priority_alpha,
            beta=priority_beta,
            seed=self.seed,
        )
        self._update_credit = 0.0  # fractional updates carried between iterations

    def build_policy(self) -> nn.Module:
        return TanhGaussianMLPPolicy(
            self.env_spec, tuple(self.hparams.hidden), normalize_obs=self.hparams.normalize_obs
        )

    def configure_optimizers(self):
        groups = [
            {"params": list(self.critic.parameters()), "lr": self.hparams.critic_lr},
            {"params": list(self.policy.parameters()), "lr": self.hparams.actor_lr},
            {"params": [self.log_alpha], "lr": self.hparams.alpha_lr},
        ]
        return torch.optim.Adam(groups, fused=True)

    def update(self, trajectories: dict[str, torch.Tensor]) -> dict[str, float]:
        data = {
            name: trajectories[name].flatten(0, 1).cpu()
            for name in ("obs", "action", "reward", "next_obs", "terminated")
        }
        self.buffer.add(data)
        self.update_observation_stats(trajectories["obs"])
        if len(self.buffer) < self.hparams.learning_starts:
            return {"replay/size": float(len(self.buffer))}
        self._update_credit += self.hparams.updates_per_step * data["reward"].shape[0]
        n_updates = int(self._update_credit)
        self._update_credit -= n_updates
        optimizer = self.optimizers()
        totals = torch.zeros(4, device=self.device)  # critic loss, actor loss, alpha, entropy
        for _ in range(n_updates):
            sample, indices, weights = self.buffer.sample(self.hparams.batch_size)
            sample = {name: value.to(self.device, non_blocking=True) for name, value in sample.items()}
            losses, td_error = self._losses(sample, weights.to(self.device))
            optimizer.zero_grad()
            self.manual_backward(losses[0] + losses[1] + losses[2])
            optimizer.step()
            with torch.no_grad():
                torch._foreach_lerp_(
                    list(self.critic_target.parameters()), list(self.critic.parameters()), self.hparams.tau
                )
                totals += torch.stack([losses[0], losses[1], self.log_alpha.exp(), losses[3]]).detach()
            self.buffer.update_priorities(indices, td_error)
        means = (totals / max(n_updates, 1)).tolist()
        return {
            "train/critic_loss": means[0],
            "train/actor_loss": means[1],
            "train/alpha": means[2],
            "train/entropy": means[3],
            "replay/size": float(len(self.buffer)),
            "learner/samples": float(n_updates * self.hparams.batch_size),
        }

    def _losses(
        self, batch: dict[str, torch.Tensor], weights: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            next_dist = self.policy(batch["next_obs"]).distribution
            next_action = next_dist.sample()
            next_q = self.critic_target(batch["next_obs"], next_action).min(dim=0).values - alpha * next_dist.log_prob(
                next_action
            )
            target = batch["reward"] + self.gamma * (~batch["terminated"]) * next_q
        q = self.critic(batch["obs"], batch["action"])
        td = q - target
        critic_loss = (weights * td.pow(2)).mean(dim=1).sum()
        dist = self.policy(batch["obs"]).distribution
        action = dist.rsample()
        log_prob = dist.log_prob(action)
        frozen = {name: p.detach() for name, p in self.critic.named_parameters()}
        q_policy = functional_call(self.critic, frozen, (batch["obs"], action)).min(dim=0).values
        actor_loss = (alpha * log_prob - q_policy).mean()
        alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
        return (critic_loss, actor_loss, alpha_loss, -log_prob.mean().detach()), td.detach().abs().mean(dim=0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["replay_buffer"] = self.buffer.state_dict()
        checkpoint["update_credit"] = self._update_credit

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "replay_buffer" in checkpoint:
            self.buffer.load_state_dict(checkpoint["replay_buffer"])
        self._update_credit = checkpoint.get("update_credit", 0.0)
