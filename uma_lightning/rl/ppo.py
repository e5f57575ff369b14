"""PPO (Schulman et al. 2017) with GAE, and V-trace for chunks collected by an older policy version.

Per iteration: value estimates and log-probabilities of the whole batch under the current policy;
advantages from GAE for chunks the current policy collected, from V-trace (truncated importance
weights current / acting policy) for lagged ones; then ``epochs`` passes of clipped-surrogate
minibatch updates. The ratio is taken against the policy at the start of the iteration, which for
on-policy data is the acting policy. Observation statistics are updated after the update, so data
collected by version v is always evaluated with exactly the weights and statistics version v had.
"""

# No `from __future__ import annotations`: LightningCLI reads the real annotations of __init__.
import torch

from uma_lightning.rl.advantages import gae, vtrace
from uma_lightning.rl.learner import RLLearner
from uma_lightning.rl.policy import GaussianMLPPolicy, RunningNorm


class PPOLearner(RLLearner):
    needs_value = True

    def __init__(
        self,
        gae_lambda: float = 0.95,
        lr: float = 3e-4,
        anneal_lr: bool = True,
        epochs: int = 10,
        minibatch_size: int = 64,
        clip_ratio: float = 0.2,
        value_coef: float = 0.5,
        entropy_coef: float = 0.0,
        max_grad_norm: float = 0.5,
        normalize_advantages: bool = True,
        normalize_rewards: bool = True,
        normalize_obs: bool = True,
        hidden: tuple[int, ...] = (64, 64),
        init_log_std: float = 0.0,
        rho_bar: float = 1.0,
        c_bar: float = 1.0,
        **kwargs,
    ):
        """
        Args:
            gae_lambda: GAE lambda (also scales V-trace's traces).
            lr: Adam learning rate.
            anneal_lr: Decay the learning rate linearly to 0 over the run's env-step budget.
            epochs: Passes over each batch.
            minibatch_size: Transitions per optimizer step.
            clip_ratio: PPO's probability-ratio clip.
            value_coef: Weight of the value loss.
            entropy_coef: Weight of the entropy bonus.
            max_grad_norm: Gradients are clipped to this norm.
            normalize_advantages: Standardise advantages per minibatch.
            normalize_rewards: Divide rewards by the running standard deviation of the discounted return.
            normalize_obs: Standardise observations with running statistics (part of the policy's state).
            hidden: Hidden layer sizes of the actor and critic MLPs.
            init_log_std: Initial log standard deviation of the Gaussian policy.
            rho_bar: V-trace's importance-weight clip for the value targets and advantages.
            c_bar: V-trace's trace clip.
            **kwargs: ``RLLearner``'s: env, gamma, seed (of the minibatch order).
        """
        super().__init__(**kwargs)
        self.return_norm = RunningNorm() if normalize_rewards else None
        self.policy = self.build_policy()

    def build_policy(self) -> torch.nn.Module:
        return GaussianMLPPolicy(
            self.env_spec,
            tuple(self.hparams.hidden),
            normalize_obs=self.hparams.normalize_obs,
            init_log_std=self.hparams.init_log_std,
        )

    def configure_optimizers(self):
        return torch.optim.Adam(self.policy.parameters(), lr=self.hparams.lr, eps=1e-5, fused=True)

    def update(self, trajectories: dict[str, torch.Tensor]) -> dict[str, float]:
        data = trajectories
        steps, width = data["reward"].shape
        flat = lambda x: x.flatten(0, 1)  # noqa: E731
        rewards = data["reward"]
        if self.return_norm is not None:
            self.update_running_norm(self.return_norm, data["discounted_return"], event_dims=0)
            rewards = self.return_norm.scale(rewards)
        terminated = data["terminated"]
        done = terminated | data["truncated"]
        with torch.no_grad():
            out = self.policy(flat(data["obs"]))
            values = out.value.view(steps, width)
            log_probs = out.distribution.log_prob(flat(data["action"])).view(steps, width)
            next_values = self.policy(flat(data["next_obs"])).value.view(steps, width)
            advantages, returns = gae(
                rewards, values, next_values, terminated, done, self.gamma, self.hparams.gae_lambda
            )
            lagged = (data["version"] < self.policy_version).any(dim=0)  # per env column
            if lagged.any():
                v_advantages, v_returns = vtrace(
                    log_probs - data["log_prob"],
                    rewards,
                    values,
                    next_values,
                    terminated,
                    done,
                    self.gamma,
                    self.hparams.gae_lambda,
                    self.hparams.rho_bar,
                    self.hparams.c_bar,
                )
                advantages = torch.where(lagged, v_advantages, advantages)
                returns = torch.where(lagged, v_returns, returns)

        optimizer = self.optimizers()
        lr = self.hparams.lr * (1.0 - self.experience.progress) if self.hparams.anneal_lr else self.hparams.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        obs, actions = flat(data["obs"]), flat(data["action"])
        old_log_probs, advantages, returns = flat(log_probs), flat(advantages), flat(returns)
        n = obs.shape[0]
        size = min(self.hparams.minibatch_size, n)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.policy_version)
        totals = torch.zeros(
            6, device=obs.device
        )  # policy loss, value loss, entropy, approx kl, clip fraction, grad norm
        n_steps = 0
        for _ in range(self.hparams.epochs):
            order = torch.randperm(n, generator=generator).to(obs.device)
            for start in range(0, n - size + 1, size):
                index = order[start : start + size]
                out = self.policy(obs[index])
                log_prob = out.distribution.log_prob(actions[index])
                log_ratio = log_prob - old_log_probs[index]
                ratio = log_ratio.exp()
                advantage = advantages[index]
                if self.hparams.normalize_advantages:
                    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
                policy_loss = torch.max(
                    -advantage * ratio,
                    -advantage * ratio.clamp(1 - self.hparams.clip_ratio, 1 + self.hparams.clip_ratio),
                ).mean()
                value_loss = 0.5 * (out.value - returns[index]).pow(2).mean()
                entropy = out.distribution.entropy().mean()
                loss = policy_loss + self.hparams.value_coef * value_loss - self.hparams.entropy_coef * entropy
                optimizer.zero_grad()
                self.manual_backward(loss)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.hparams.max_grad_norm)
                optimizer.step()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - log_ratio).mean()
                    clipped = ((ratio - 1).abs() > self.hparams.clip_ratio).float().mean()
                    totals += torch.stack([policy_loss, value_loss, entropy, approx_kl, clipped, grad_norm]).detach()
                n_steps += 1

        self.update_observation_stats(data["obs"])
        means = (totals / max(n_steps, 1)).tolist()
        explained = 1 - (returns - flat(values)).var() / returns.var().clamp(min=1e-8)
        return {
            "train/policy_loss": means[0],
            "train/value_loss": means[1],
            "train/entropy": means[2],
            "train/approx_kl": means[3],
            "train/clip_fraction": means[4],
            "grad_norm": means[5],
            "train/explained_variance": float(explained),
            "lr": lr,
            "train/lagged_fraction": float(lagged.float().mean()),
            "learner/samples": float(n_steps * size),
        }
