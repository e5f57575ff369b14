"""The ``uma`` tools beside training: parity, the planner, and the data, checkpoint, RL and tracking commands.

The only package that imports ``uma_lightning.cli``: the runtime (models, modules, data, parallel,
checkpoint, tracking, callbacks) never imports a tool.
"""
