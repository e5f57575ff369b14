"""Environment factories for the RL tests (imported by worker processes by name)."""

import os
import time

import gymnasium as gym


class _HangOnce(gym.Wrapper):
    def __init__(self, env, marker: str):
        super().__init__(env)
        self.marker = marker

    def step(self, action):
        try:
            os.remove(self.marker)  # whoever removes the marker hangs; a restarted worker finds none
        except FileNotFoundError:
            return self.env.step(action)
        time.sleep(3600)
        raise AssertionError("unreachable")


def hanging_pendulum(marker: str):
    """Pendulum-v1 whose step hangs forever the first time it finds the file ``marker``."""
    return _HangOnce(gym.make("Pendulum-v1"), marker)


def discrete_env():
    return gym.make("CartPole-v1")
