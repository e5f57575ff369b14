"""A 2-link planar arm reaching for one of several coloured targets named by a language instruction.

Pure numpy and deterministic given the reset seed, so the same scene can be regenerated for data
generation and for closed-loop evaluation of a trained policy.

Coordinates: the arm's base sits at the world origin, +y points up in the rendered image, and targets
lie in the upper half-plane so the shoulder angle never has to wrap around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 205, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square")
INSTRUCTION_TEMPLATES: tuple[str, ...] = ("reach the {} {}", "move to the {} {}", "grab the {} {}")

STATE_NAMES: tuple[str, ...] = ("q1", "q2", "ee_x", "ee_y", "gripper")
ACTION_NAMES: tuple[str, ...] = ("dq1", "dq2", "gripper")
ENVIRONMENT_STATE_NAMES: tuple[str, ...] = ("goal_x", "goal_y")

BACKGROUND = (205, 205, 205)
LINK_COLOUR = (70, 70, 70)
BASE_COLOUR = (20, 20, 20)


@dataclass(frozen=True)
class PlanarArmConfig:
    """Physical, task and rendering parameters of the planar-arm environment."""

    image_size: int = 64
    fps: float = 10.0
    link_lengths: tuple[float, float] = (0.55, 0.45)
    max_joint_speed: float = 0.5  # rad/s at |action| = 1
    gripper_rate: float = 0.25  # gripper closure change per step at |action| = 1
    max_steps: int = 100
    min_targets: int = 3
    max_targets: int = 4
    target_half_size: float = 0.08
    target_radius_range: tuple[float, float] = (0.35, 0.9)
    target_angle_range: tuple[float, float] = (np.radians(20.0), np.radians(160.0))
    min_target_separation: float = 0.3
    success_radius: float = 0.08
    gripper_closed: float = 0.99  # closure above which the gripper counts as closed
    expert_gain: float = 0.8  # 1/s; with the speed above, expert episodes last ~20-75 steps at 10 fps
    # The rendered square window of the world: centre and half side length.
    view_center: tuple[float, float] = (0.0, 0.45)
    view_half_extent: float = 1.0
    link_width: float = 0.06
    end_effector_radius: float = 0.05

    def __post_init__(self) -> None:
        if self.image_size < 8 or self.image_size % 2:
            raise ValueError(f"image_size must be an even number >= 8, got {self.image_size}")
        if not 1 <= self.min_targets <= self.max_targets <= len(COLOURS):
            raise ValueError(
                f"need 1 <= min_targets <= max_targets <= {len(COLOURS)}, got {self.min_targets}, {self.max_targets}"
            )
        if self.fps <= 0:
            raise ValueError(f"fps must be positive, got {self.fps}")

    @property
    def joint_limits(self) -> np.ndarray:
        """[[q1_min, q2_min], [q1_max, q2_max]]: wide enough for every IK solution of an upper-half-plane target."""
        return np.array([[-0.5 * np.pi, -0.95 * np.pi], [1.5 * np.pi, 0.95 * np.pi]])


@dataclass(frozen=True)
class Target:
    """A coloured shape the arm can be asked to reach."""

    colour: str
    shape: str
    position: tuple[float, float]


def forward_kinematics(q: np.ndarray, link_lengths: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Elbow and end-effector positions of joint angles q = (q1, q2)."""
    l1, l2 = link_lengths
    elbow = l1 * np.array([np.cos(q[0]), np.sin(q[0])])
    end_effector = elbow + l2 * np.array([np.cos(q[0] + q[1]), np.sin(q[0] + q[1])])
    return elbow, end_effector


def inverse_kinematics(point: np.ndarray, link_lengths: tuple[float, float]) -> np.ndarray:
    """Both joint solutions (elbow up and down), shape [2, 2], reaching `point` (clamped to the reachable annulus)."""
    l1, l2 = link_lengths
    x, y = point
    cos_q2 = np.clip((x * x + y * y - l1 * l1 - l2 * l2) / (2 * l1 * l2), -1.0, 1.0)
    q2 = np.arccos(cos_q2) * np.array([1.0, -1.0])
    q1 = np.arctan2(y, x) - np.arctan2(l2 * np.sin(q2), l1 + l2 * np.cos(q2))
    return np.stack([q1, q2], axis=1)


def _segment_distance(px: np.ndarray, py: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance from every pixel centre (px, py) to the segment a-b."""
    d = b - a
    t = ((px - a[0]) * d[0] + (py - a[1]) * d[1]) / max(float(d @ d), 1e-12)
    t = np.clip(t, 0.0, 1.0)
    return np.hypot(px - a[0] - t * d[0], py - a[1] - t * d[1])


class PlanarArmEnv:
    """Gymnasium-style environment: `reset(seed)` -> obs, info; `step(action)` -> obs, reward, terminated, truncated, info.

    Observations are dicts with "image" (uint8 [H, W, 3]), "state" (float32 [5]: q1, q2, ee_x, ee_y,
    gripper closure in [0, 1]) and "instruction" (str). Actions are float [3] in [-1, 1]: two joint
    velocity commands (scaled by `max_joint_speed`) and a gripper command (> 0 closes). Reward is 1.0 on
    the step that succeeds: the gripper closed within `success_radius` of the named target; that step
    terminates the episode.
    """

    state_names = STATE_NAMES
    action_names = ACTION_NAMES
    environment_state_names = ENVIRONMENT_STATE_NAMES
    state_dim = len(STATE_NAMES)
    action_dim = len(ACTION_NAMES)
    action_low = -1.0
    action_high = 1.0

    def __init__(self, config: PlanarArmConfig | None = None) -> None:
        self.config = config or PlanarArmConfig()
        self.fps = self.config.fps
        self.dt = 1.0 / self.config.fps
        size = self.config.image_size
        centre = np.asarray(self.config.view_center)
        pixel = 2.0 * self.config.view_half_extent / size
        coords = (np.arange(size) + 0.5) * pixel - self.config.view_half_extent
        # Pixel-centre world coordinates; row 0 is the top of the image, hence the flipped y.
        self._px, self._py = np.meshgrid(centre[0] + coords, centre[1] - coords)
        self._rng: np.random.Generator | None = None
        self._expert_rng: np.random.Generator | None = None
        self.q = np.zeros(2)
        self.gripper = 0.0
        self.targets: tuple[Target, ...] = ()
        self.goal: Target | None = None
        self.instruction = ""
        self.steps = 0
        self._done = True
        self._background = self._render_background()

    # ------------------------------------------------------------------ episode control
    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode with a new random scene; the same seed always gives the same scene."""
        if seed is not None or self._rng is None:
            # Separate streams, so whether or not the expert is queried never changes later scenes.
            scene_seed, expert_seed = np.random.SeedSequence(seed).spawn(2)
            self._rng = np.random.default_rng(scene_seed)
            self._expert_rng = np.random.default_rng(expert_seed)
        cfg = self.config
        n_targets = int(self._rng.integers(cfg.min_targets, cfg.max_targets + 1))
        colours = self._rng.choice(list(COLOURS), size=n_targets, replace=False)
        self.targets = tuple(
            Target(str(colour), str(self._rng.choice(SHAPES)), position)
            for colour, position in zip(colours, self._sample_target_positions(n_targets))
        )
        self.goal = self.targets[int(self._rng.integers(n_targets))]
        template = INSTRUCTION_TEMPLATES[int(self._rng.integers(len(INSTRUCTION_TEMPLATES)))]
        self.instruction = template.format(self.goal.colour, self.goal.shape)
        self.q = np.array([self._rng.uniform(0.2 * np.pi, 0.8 * np.pi), self._rng.uniform(-2.0, 2.0)])
        self.gripper = 0.0
        self.steps = 0
        self._done = False
        self._background = self._render_background()
        return self._observation(), self._info(success=False)

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one action for 1/fps seconds; actions outside [-1, 1] are clipped."""
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset() first")
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (self.action_dim,):
            raise ValueError(f"action must have shape ({self.action_dim},), got {action.shape}")
        if not np.all(np.isfinite(action)):
            raise ValueError(f"action must be finite, got {action.tolist()}")
        action = np.clip(action, self.action_low, self.action_high)
        cfg = self.config
        limits = cfg.joint_limits
        self.q = np.clip(self.q + action[:2] * cfg.max_joint_speed * self.dt, limits[0], limits[1])
        self.gripper = float(np.clip(self.gripper + action[2] * cfg.gripper_rate, 0.0, 1.0))
        self.steps += 1
        success = self.gripper >= cfg.gripper_closed and self.goal_distance() <= cfg.success_radius
        truncated = not success and self.steps >= cfg.max_steps
        self._done = success or truncated
        return self._observation(), float(success), success, truncated, self._info(success)

    # ------------------------------------------------------------------ geometry
    def arm_points(self) -> np.ndarray:
        """Base, elbow and end-effector positions, shape [3, 2]."""
        elbow, end_effector = forward_kinematics(self.q, self.config.link_lengths)
        return np.stack([np.zeros(2), elbow, end_effector])

    def environment_state(self) -> np.ndarray:
        """What the robot does not observe directly: the named target's position, float32 [2]."""
        return np.asarray(self.goal.position, dtype=np.float32)

    def goal_distance(self) -> float:
        """Distance from the end effector to the named target."""
        return float(np.linalg.norm(self.arm_points()[2] - np.asarray(self.goal.position)))

    def world_to_pixel(self, point: Any) -> tuple[int, int]:
        """(row, col) of the pixel containing a world point."""
        cfg = self.config
        pixel = 2.0 * cfg.view_half_extent / cfg.image_size
        x, y = np.asarray(point, dtype=np.float64) - np.asarray(cfg.view_center)
        return int((cfg.view_half_extent - y) // pixel), int((x + cfg.view_half_extent) // pixel)

    # ------------------------------------------------------------------ expert
    def expert_action(self, noise_std: float = 0.05) -> np.ndarray:
        """Scripted expert: proportional control towards the nearest IK solution for the named target,
        closing the gripper once the end effector is within half the success radius."""
        if self._done:
            raise RuntimeError("expert_action() needs a running episode; call reset() first")
        cfg = self.config
        solutions = inverse_kinematics(np.asarray(self.goal.position), cfg.link_lengths)
        q_goal = solutions[np.argmin(np.abs(solutions - self.q).sum(axis=1))]
        velocity = np.clip(cfg.expert_gain * (q_goal - self.q) / cfg.max_joint_speed, -1.0, 1.0)
        close = self.goal_distance() < 0.5 * cfg.success_radius
        action = np.append(velocity, 1.0 if close else -1.0)
        action += self._expert_rng.normal(0.0, noise_std, size=action.shape)
        return np.clip(action, self.action_low, self.action_high)

    # ------------------------------------------------------------------ rendering
    def render(self) -> np.ndarray:
        """The scene as uint8 RGB [H, W, 3]: targets, then the arm on top of them."""
        cfg = self.config
        image = self._background.copy()
        base, elbow, end_effector = self.arm_points()
        half_width = cfg.link_width / 2
        for start, end in ((base, elbow), (elbow, end_effector)):
            window = self._window(np.minimum(start, end) - half_width, np.maximum(start, end) + half_width)
            distance = _segment_distance(self._px[window], self._py[window], start, end)
            image[window][distance <= half_width] = LINK_COLOUR
        self._paint_disc(image, base, cfg.link_width, BASE_COLOUR)
        # White when open, black when closed: the gripper state is visible in the image.
        shade = round(255 * (1.0 - self.gripper))
        self._paint_disc(image, end_effector, cfg.end_effector_radius, (shade, shade, shade))
        return image

    def _render_background(self) -> np.ndarray:
        """Background and targets: static within an episode, so drawn once per reset."""
        cfg = self.config
        image = np.empty(self._px.shape + (3,), dtype=np.uint8)
        image[:] = BACKGROUND
        for target in self.targets:
            if target.shape == "circle":
                self._paint_disc(image, target.position, cfg.target_half_size, COLOURS[target.colour])
                continue
            centre = np.asarray(target.position)
            window = self._window(centre - cfg.target_half_size, centre + cfg.target_half_size)
            inside = np.maximum(np.abs(self._px[window] - centre[0]), np.abs(self._py[window] - centre[1]))
            image[window][inside <= cfg.target_half_size] = COLOURS[target.colour]
        return image

    def _paint_disc(self, image: np.ndarray, centre: Any, radius: float, colour: tuple[int, int, int]) -> None:
        centre = np.asarray(centre)
        window = self._window(centre - radius, centre + radius)
        inside = np.hypot(self._px[window] - centre[0], self._py[window] - centre[1]) <= radius
        image[window][inside] = colour

    def _window(self, low: np.ndarray, high: np.ndarray) -> tuple[slice, slice]:
        """Pixel rows and columns covering the world box [low, high]: drawing only there keeps rendering cheap."""
        top_row, left_col = self.world_to_pixel((low[0], high[1]))
        bottom_row, right_col = self.world_to_pixel((high[0], low[1]))
        size = self.config.image_size
        rows = slice(min(max(top_row, 0), size), min(max(bottom_row + 1, 0), size))
        cols = slice(min(max(left_col, 0), size), min(max(right_col + 1, 0), size))
        return rows, cols

    # ------------------------------------------------------------------ internals
    def _sample_target_positions(self, n_targets: int) -> list[tuple[float, float]]:
        cfg = self.config
        positions: list[np.ndarray] = []
        while len(positions) < n_targets:
            radius = self._rng.uniform(*cfg.target_radius_range)
            angle = self._rng.uniform(*cfg.target_angle_range)
            candidate = radius * np.array([np.cos(angle), np.sin(angle)])
            if all(np.linalg.norm(candidate - p) >= cfg.min_target_separation for p in positions):
                positions.append(candidate)
        return [(float(p[0]), float(p[1])) for p in positions]

    def _observation(self) -> dict[str, Any]:
        end_effector = self.arm_points()[2]
        state = np.array([self.q[0], self.q[1], end_effector[0], end_effector[1], self.gripper], dtype=np.float32)
        return {"image": self.render(), "state": state, "instruction": self.instruction}

    def _info(self, success: bool) -> dict[str, Any]:
        return {"success": bool(success), "goal_distance": self.goal_distance(), "steps": self.steps}
