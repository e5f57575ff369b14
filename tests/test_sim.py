"""The planar-arm simulator: determinism, the scripted expert, rendering and input checks."""

import numpy as np
import pytest

from uma_lightning.sim import COLOURS, PlanarArmConfig, PlanarArmEnv, forward_kinematics, inverse_kinematics
from uma_lightning.sim.planar_arm import BACKGROUND


def run_expert(env: PlanarArmEnv, seed: int) -> tuple[dict, int]:
    env.reset(seed=seed)
    steps, done, info = 0, False, {}
    while not done:
        _, _, terminated, truncated, info = env.step(env.expert_action())
        steps += 1
        done = terminated or truncated
    return info, steps


def test_reset_is_deterministic_per_seed():
    first, second = PlanarArmEnv(), PlanarArmEnv()
    obs_a, _ = first.reset(seed=7)
    obs_b, _ = second.reset(seed=7)
    assert np.array_equal(obs_a["image"], obs_b["image"])
    assert np.array_equal(obs_a["state"], obs_b["state"])
    assert obs_a["instruction"] == obs_b["instruction"]
    assert first.targets == second.targets
    # Expert noise is seeded too, so whole trajectories repeat.
    assert np.array_equal(first.expert_action(), second.expert_action())

    obs_c, _ = second.reset(seed=8)
    assert not np.array_equal(obs_a["state"], obs_c["state"])


def test_observation_layout():
    env = PlanarArmEnv(PlanarArmConfig(image_size=32))
    obs, info = env.reset(seed=0)
    assert obs["image"].dtype == np.uint8 and obs["image"].shape == (32, 32, 3)
    assert obs["state"].dtype == np.float32 and obs["state"].shape == (env.state_dim,)
    q1, q2, ee_x, ee_y, gripper = obs["state"]
    _, end_effector = forward_kinematics(np.array([q1, q2]), env.config.link_lengths)
    assert np.allclose(end_effector, [ee_x, ee_y], atol=1e-6)
    assert gripper == 0.0
    assert env.goal.colour in obs["instruction"] and env.goal.shape in obs["instruction"]
    assert 3 <= len(env.targets) <= 4
    assert len({t.colour for t in env.targets}) == len(env.targets)  # the named colour is unambiguous
    assert info == {"success": False, "goal_distance": env.goal_distance(), "steps": 0}


def test_expert_succeeds_in_most_episodes():
    env = PlanarArmEnv()
    results = [run_expert(env, seed) for seed in range(20)]
    successes = [info for info, _ in results if info["success"]]
    assert len(successes) >= 18
    assert all(info["goal_distance"] <= env.config.success_radius for info in successes)
    lengths = [steps for _, steps in results]
    assert 30 <= np.mean(lengths) <= 60, lengths


def test_success_needs_the_gripper_closed_at_the_named_target():
    env = PlanarArmEnv()
    env.reset(seed=3)
    assert env.goal_distance() > env.config.success_radius  # precondition: the arm starts away from the goal
    for _ in range(6):
        _, reward, terminated, _, info = env.step([0.0, 0.0, 1.0])
    assert env.gripper == 1.0
    assert not info["success"] and not terminated and reward == 0.0


def test_inverse_kinematics_reaches_the_point():
    links = PlanarArmConfig().link_lengths
    rng = np.random.default_rng(0)
    for _ in range(20):
        radius, angle = rng.uniform(0.2, 0.95), rng.uniform(0, np.pi)
        point = radius * np.array([np.cos(angle), np.sin(angle)])
        for q in inverse_kinematics(point, links):
            assert np.allclose(forward_kinematics(q, links)[1], point, atol=1e-9)


def test_renderer_draws_each_target_in_its_colour_where_it_is():
    env = PlanarArmEnv()
    checked = 0
    for seed in range(10):
        obs, _ = env.reset(seed=seed)
        arm = env.arm_points()
        for target in env.targets:
            centre = np.asarray(target.position)
            # Skip targets the arm may cover: it is drawn on top.
            clearance = min(_segment_distance(centre, arm[i], arm[i + 1]) for i in range(2))
            if clearance < env.config.target_half_size + env.config.end_effector_radius + 0.05:
                continue
            row, col = env.world_to_pixel(centre)
            assert tuple(obs["image"][row, col]) == COLOURS[target.colour]
            checked += 1
    assert checked >= 20
    # A corner of the image is far from every target and from the arm.
    assert tuple(obs["image"][0, 0]) == BACKGROUND


def test_renderer_shows_gripper_closure_at_the_end_effector():
    env = PlanarArmEnv()
    obs, _ = env.reset(seed=1)
    row, col = env.world_to_pixel(env.arm_points()[2])
    assert tuple(obs["image"][row, col]) == (255, 255, 255)  # open
    for _ in range(4):
        obs, *_ = env.step([0.0, 0.0, 1.0])
    assert tuple(obs["image"][row, col]) == (0, 0, 0)  # closed


def test_step_clips_actions_to_the_action_space():
    clipped, exact = PlanarArmEnv(), PlanarArmEnv()
    clipped.reset(seed=0)
    exact.reset(seed=0)
    obs_clipped, *_ = clipped.step([5.0, -5.0, 0.0])
    obs_exact, *_ = exact.step([1.0, -1.0, 0.0])
    assert np.array_equal(obs_clipped["state"], obs_exact["state"])


@pytest.mark.parametrize(
    "action, message",
    [([0.0, 0.0], r"shape \(3,\), got \(2,\)"), ([[0.0, 0.0, 0.0]], r"got \(1, 3\)"), ([0.0, np.nan, 0.0], "finite")],
)
def test_step_rejects_bad_actions(action, message):
    env = PlanarArmEnv()
    env.reset(seed=0)
    with pytest.raises(ValueError, match=message):
        env.step(action)


def test_step_needs_a_running_episode():
    env = PlanarArmEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step([0.0, 0.0, 0.0])


def _segment_distance(point: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    t = np.clip((point - a) @ (b - a) / ((b - a) @ (b - a)), 0.0, 1.0)
    return float(np.linalg.norm(point - a - t * (b - a)))
