"""Small deterministic simulators for data generation and closed-loop evaluation."""

from uma_lightning.sim.planar_arm import (
    ACTION_NAMES,
    COLOURS,
    SHAPES,
    STATE_NAMES,
    PlanarArmConfig,
    PlanarArmEnv,
    Target,
    forward_kinematics,
    inverse_kinematics,
)

__all__ = [
    "ACTION_NAMES",
    "COLOURS",
    "SHAPES",
    "STATE_NAMES",
    "PlanarArmConfig",
    "PlanarArmEnv",
    "Target",
    "forward_kinematics",
    "inverse_kinematics",
]
