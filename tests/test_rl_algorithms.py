"""RL building blocks without processes: advantages, normalisation, distributions, env specs."""

import math

import pytest
import torch
from torch.distributions import AffineTransform, Independent, Normal, TanhTransform, TransformedDistribution

from uma_lightning.rl.advantages import gae, vtrace
from uma_lightning.rl.env import EnvSpec, probe_env
from uma_lightning.rl.policy import (
    GaussianMLPPolicy,
    RunningNorm,
    SquashedNormal,
    TanhGaussianMLPPolicy,
    check_policy,
    fused_act,
)

SPEC = EnvSpec("test", obs_dim=3, action_dim=2, action_low=(-2.0, -1.0), action_high=(2.0, 3.0))


def random_trajectory(steps=12, width=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    terminated = torch.rand(steps, width, generator=g) < 0.1
    truncated = (torch.rand(steps, width, generator=g) < 0.1) & ~terminated
    return dict(
        rewards=torch.randn(steps, width, generator=g),
        values=torch.randn(steps, width, generator=g),
        next_values=torch.randn(steps, width, generator=g),
        terminated=terminated,
        done=terminated | truncated,
    )


def reference_returns(t, gamma, lam, log_rhos=None, rho_bar=1.0, c_bar=1.0):
    """Direct sums of the definitions, one env and one start step at a time."""
    steps, width = t["rewards"].shape
    rhos = torch.ones(steps, width) if log_rhos is None else log_rhos.exp()
    targets = torch.zeros(steps, width, dtype=torch.float64)
    for b in range(width):
        for s in range(steps):
            total, discount, trace = 0.0, 1.0, 1.0
            for k in range(s, steps):
                bootstrap = 0.0 if t["terminated"][k, b] else float(t["next_values"][k, b])
                delta = float(t["rewards"][k, b]) + gamma * bootstrap - float(t["values"][k, b])
                total += discount * trace * min(rho_bar, float(rhos[k, b])) * delta
                if t["done"][k, b]:
                    break
                discount *= gamma
                trace *= lam * min(c_bar, float(rhos[k, b]))
            targets[s, b] = float(t["values"][s, b]) + total
    return targets


def test_gae_matches_the_direct_sum_and_respects_termination_and_time_limits():
    t = random_trajectory()
    advantages, returns = gae(t["rewards"], t["values"], t["next_values"], t["terminated"], t["done"], 0.9, 0.8)
    assert torch.allclose(returns.double(), reference_returns(t, 0.9, 0.8), atol=1e-5)
    assert torch.allclose(advantages, returns - t["values"])
    # A terminal step's target is its reward; a truncated step's bootstraps from the final observation.
    k, b = t["terminated"].nonzero()[0].tolist()
    assert returns[k, b] == pytest.approx(float(t["rewards"][k, b]))
    k, b = (t["done"] & ~t["terminated"]).nonzero()[0].tolist()
    assert returns[k, b] == pytest.approx(float(t["rewards"][k, b] + 0.9 * t["next_values"][k, b]))


def test_vtrace_with_equal_policies_gives_gae_targets():
    t = random_trajectory(seed=1)
    _, gae_returns = gae(t["rewards"], t["values"], t["next_values"], t["terminated"], t["done"], 0.99, 0.95)
    _, targets = vtrace(
        torch.zeros(12, 5), t["rewards"], t["values"], t["next_values"], t["terminated"], t["done"], 0.99, 0.95
    )
    assert torch.allclose(targets, gae_returns, atol=1e-5)


def test_vtrace_clips_importance_weights_as_defined():
    t = random_trajectory(seed=2)
    log_rhos = torch.randn(12, 5, generator=torch.Generator().manual_seed(3))
    advantages, targets = vtrace(
        log_rhos,
        t["rewards"],
        t["values"],
        t["next_values"],
        t["terminated"],
        t["done"],
        0.9,
        0.7,
        rho_bar=1.0,
        c_bar=0.8,
    )
    expected = reference_returns(t, 0.9, 0.7, log_rhos, rho_bar=1.0, c_bar=0.8)
    assert torch.allclose(targets.double(), expected, atol=1e-5)
    # Policy-gradient advantage: rho_s (r_s + gamma v_{s+1} - V(x_s)) with v_{s+1} the next target.
    s, b = 3, 1
    assert not t["done"][s, b]
    rho = min(1.0, math.exp(float(log_rhos[s, b])))
    want = rho * (float(t["rewards"][s, b]) + 0.9 * float(targets[s + 1, b]) - float(t["values"][s, b]))
    assert float(advantages[s, b]) == pytest.approx(want, rel=1e-5)


def test_running_norm_merges_batches_and_ranks_like_one_big_batch():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(300, 4, generator=g) * 3 + 1
    norm = RunningNorm(4)
    norm.update(RunningNorm.moments(data[:100], 1))
    # Two "ranks" at once, stacked as all_gather returns them.
    norm.update(torch.stack([RunningNorm.moments(data[100:250], 1), RunningNorm.moments(data[250:], 1)]))
    assert norm.count == 300
    assert torch.allclose(norm.mean, data.mean(0), atol=1e-5)
    assert torch.allclose(norm.var, data.var(0, unbiased=False), atol=1e-4)
    assert norm(data).abs().max() <= norm.clip


def test_squashed_normal_matches_torch_transformed_distribution_and_stays_in_bounds():
    g = torch.Generator().manual_seed(0)
    mean, std = torch.randn(64, 2, generator=g), torch.rand(64, 2, generator=g) + 0.1
    loc, scale = torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0])
    ours = SquashedNormal(mean, std, loc, scale)
    reference = Independent(
        TransformedDistribution(Normal(mean, std), [TanhTransform(), AffineTransform(loc, scale)]), 1
    )
    action = ours.rsample()
    assert ((action >= loc - scale) & (action <= loc + scale)).all()
    assert torch.allclose(ours.log_prob(action), reference.log_prob(action), atol=1e-3)
    # From a value it did not sample, it inverts tanh.
    assert torch.allclose(ours.log_prob(action.clone()), reference.log_prob(action), atol=1e-2)


def test_policies_fit_the_spec_and_a_wrong_policy_is_named():
    check_policy(GaussianMLPPolicy(SPEC), SPEC, needs_value=True)
    check_policy(TanhGaussianMLPPolicy(SPEC), SPEC, needs_value=False)
    with pytest.raises(ValueError, match="TanhGaussianMLPPolicy: this learner needs a value estimate"):
        check_policy(TanhGaussianMLPPolicy(SPEC), SPEC, needs_value=True)
    wider = EnvSpec("test", 3, 5, (-1.0,) * 5, (1.0,) * 5)
    with pytest.raises(ValueError, match=r"actions have shape \(2,\), env test needs \(5,\)"):
        check_policy(GaussianMLPPolicy(SPEC), wider, needs_value=True)


def test_env_spec_from_gymnasium_id_and_factory_and_clear_errors():
    spec = probe_env("Pendulum-v1")
    assert (spec.obs_dim, spec.action_dim, spec.action_low, spec.action_high, spec.max_episode_steps) == (
        3,
        1,
        (-2.0,),
        (2.0,),
        200,
    )
    assert probe_env("rl_envs:hanging_pendulum", {"marker": "/nonexistent"}).obs_dim == 3
    with pytest.raises(ValueError, match="env 'Pendulumm-v1'.*Did you mean"):
        probe_env("Pendulumm-v1")
    with pytest.raises(ValueError, match="only continuous actions"):
        probe_env("rl_envs:discrete_env")
    with pytest.raises(ValueError, match="rl_envs has no callable 'nothing'"):
        probe_env("rl_envs:nothing")


# ---- acting: the fused path and the chunk writes --------------------------------------------------


class _ForwardChanged(GaussianMLPPolicy):
    def forward(self, obs):
        return super().forward(obs * 2)


def acted_into_chunk_rows(actor, obs):
    """(action, log_prob, value) of a ``PolicyActor``, written into the middle rows of larger arrays,
    as actors write into a chunk."""
    import numpy as np

    batch, action_dim = obs.shape[0], actor.policy.log_std.shape[0]
    rows = (
        np.zeros((3, batch, action_dim), np.float32),
        np.zeros((3, batch), np.float32),
        np.zeros((3, batch), np.float32),
    )
    actor(obs.numpy(), *(array[1] for array in rows))
    return tuple(torch.from_numpy(array[1]) for array in rows)


def test_fused_act_draws_and_scores_bitwise_as_the_distribution_it_replaces():
    """``act`` and ``numpy_act`` (numpy element-wise parts, through a ``PolicyActor`` as actors use it)
    against the distribution objects: the same values, the same draws, the generator left in the same
    state, also after new weights are copied in."""
    from uma_lightning.rl.rollout import PolicyActor, sample_actions, sample_from_distribution

    spec = EnvSpec("test", obs_dim=11, action_dim=5, action_low=(-1.0,) * 5, action_high=(1.0,) * 5)
    g = torch.Generator().manual_seed(0)
    for normalize_obs in (True, False):
        policy = GaussianMLPPolicy(spec, hidden=(16, 16), normalize_obs=normalize_obs)
        actor = PolicyActor(policy, version=0)
        samplers = (sample_from_distribution, sample_actions, lambda _, obs: acted_into_chunk_rows(actor, obs))
        with torch.no_grad():  # weights, log-std and statistics away from their initial values
            for tensor in policy.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(torch.rand(tensor.shape, generator=g, dtype=tensor.dtype) + 0.5)
        for batch in (1, 8, 33):  # torch's normal sampler takes another path from 16 values on
            for _ in range(2):  # the second time with new weights, for the same batch size
                obs = torch.randn(batch, spec.obs_dim, generator=g) * 30  # some beyond the clip of the normalisation
                results = []
                for sample in samplers:
                    torch.manual_seed(batch)
                    with torch.inference_mode():
                        results.append((*sample(policy, obs), torch.rand(3)))  # the last: the generator moved alike
                for reference, *fused in zip(*results):
                    assert all(torch.equal(reference, other) for other in fused), (normalize_obs, batch)
                with torch.no_grad():  # new weights copied in, as actors load them: acting must not keep the old ones
                    for tensor in policy.state_dict().values():
                        if tensor.is_floating_point():
                            tensor.mul_(1.5)
                actor.version += 1
    # Only the class whose forward act mirrors gets the fused paths.
    for method in ("act", "numpy_act"):
        assert fused_act(policy, method) is not None and fused_act(TanhGaussianMLPPolicy(spec), method) is None
    changed = PolicyActor(_ForwardChanged(spec, hidden=(16, 16)))
    assert fused_act(changed.policy) is None and changed.numpy_act is None
    torch.manual_seed(0)
    reference = sample_from_distribution(changed.policy, obs)
    for sample in (lambda obs: sample_actions(changed.policy, obs), lambda obs: acted_into_chunk_rows(changed, obs)):
        torch.manual_seed(0)
        assert all(torch.equal(a, b) for a, b in zip(reference, sample(obs)))


def test_runner_chunks_hold_what_the_envs_returned_for_the_recorded_actions():
    """The runner's own env stepping, bitwise as gymnasium's vector env: each row matches one replayed
    with the chunk's actions, terminated and truncated episodes keep their final observation and reset
    unseeded, the running returns and lengths add up the replayed float64 rewards, and chunks join
    seamlessly. The actions, log-probabilities and values are the distribution objects' for the same
    random draws."""
    import numpy as np

    from uma_lightning.rl.env import make_vector_env
    from uma_lightning.rl.rollout import EnvRunner, PolicyActor, chunk_layout, sample_from_distribution

    spec = probe_env("InvertedPendulum-v5")
    torch.manual_seed(0)
    time_limit = {"max_episode_steps": 10}
    runner = EnvRunner(spec, time_limit, 4, seed=3, return_discount=0.9)
    act = PolicyActor(GaussianMLPPolicy(spec, hidden=(8,), init_log_std=1.0), version=7)
    layout = chunk_layout(spec, 16, 4)
    chunks, rng_before_filling = [], torch.get_rng_state()
    for _ in range(2):
        chunk = {
            name: np.zeros(shape, torch.empty((), dtype=dtype).numpy().dtype) for name, (shape, dtype) in layout.items()
        }
        runner.fill(chunk, act)
        chunks.append(chunk)
    runner.close()
    data = {name: np.concatenate([c[name] for c in chunks]) for name in layout}
    torch.set_rng_state(rng_before_filling)
    with torch.no_grad():
        for t in range(32):
            reference = sample_from_distribution(act.policy, torch.from_numpy(data["obs"][t]))
            for name, expected in zip(("action", "log_prob", "value"), reference):
                assert torch.equal(torch.from_numpy(data[name][t]), expected), (name, t)
    replay = make_vector_env(spec.env, time_limit, 4)
    obs, _ = replay.reset(seed=[3 + i for i in range(4)])
    discounted, episode_return, episode_length = np.zeros(4), np.zeros(4), np.zeros(4, np.int64)
    for t in range(32):
        assert np.array_equal(data["obs"][t], obs.astype(np.float32))
        obs, reward, terminated, truncated, info = replay.step(
            np.clip(data["action"][t], spec.action_low, spec.action_high)
        )
        final = obs.copy()
        if (terminated | truncated).any():
            final[terminated | truncated] = np.stack(info["final_obs"][terminated | truncated])
        assert np.array_equal(data["next_obs"][t], final.astype(np.float32))
        assert np.array_equal(data["reward"][t], reward.astype(np.float32))
        assert np.array_equal(data["terminated"][t], terminated) and np.array_equal(data["truncated"][t], truncated)
        discounted, episode_return, episode_length = (
            0.9 * discounted + reward,
            episode_return + reward,
            episode_length + 1,
        )
        assert np.array_equal(data["discounted_return"][t], discounted.astype(np.float32))
        assert np.array_equal(data["episode_return"][t], episode_return.astype(np.float32))
        assert np.array_equal(data["episode_length"][t], episode_length)
        for running in (discounted, episode_return, episode_length):
            running[terminated | truncated] = 0
    replay.close()
    assert data["terminated"].any() and data["truncated"].any() and (data["version"] == 7).all()
