"""Advantage and value targets over time-major trajectories ``[T, B]``.

Episode ends inside a trajectory are marked by ``done`` (terminated or truncated): the recursion
does not cross them. ``terminated`` removes the bootstrap value; a truncated step (time limit)
bootstraps from ``next_values``, the value of the true final observation.
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016): ``(advantages, value targets)``."""
    deltas = rewards + gamma * next_values * (~terminated) - values
    carry = (gamma * lam) * (~done)
    advantages = torch.empty_like(deltas)
    running = torch.zeros_like(deltas[0])
    for t in range(deltas.shape[0] - 1, -1, -1):
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    return advantages, advantages + values


def vtrace(
    log_rhos: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace (Espeholt et al. 2018) for data from an older policy: ``(policy-gradient advantages,
    value targets)``. ``log_rhos`` are log(pi_current / pi_behaviour) of the taken actions; ``lam``
    scales the traces as in the paper's remark 2, so with equal policies the value targets are the
    GAE(lam) returns."""
    rhos = log_rhos.exp()
    clipped_rhos = rhos.clamp(max=rho_bar)
    traces = lam * rhos.clamp(max=c_bar)
    not_terminal = ~terminated
    deltas = clipped_rhos * (rewards + gamma * next_values * not_terminal - values)
    carry = gamma * traces * (~done)
    corrections = torch.empty_like(deltas)  # v_s - V(x_s)
    running = torch.zeros_like(deltas[0])
    for t in range(deltas.shape[0] - 1, -1, -1):
        running = deltas[t] + carry[t] * running
        corrections[t] = running
    targets = values + corrections
    # v_{s+1}: the target of the next step inside an episode, the bootstrap value at its end or the trajectory's.
    next_targets = next_values.clone()
    inside = ~done[:-1]
    next_targets[:-1] = torch.where(inside, targets[1:], next_values[:-1])
    advantages = clipped_rhos * (rewards + gamma * next_targets * not_terminal - values)
    return advantages, targets
