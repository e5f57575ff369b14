"""The ``uma`` tools beside training: parity, the planner, and the data, checkpoint, RL and tracking commands.

With ``uma_lightning.command`` (the ``uma`` command, which hands a training subcommand over), the only
importers of ``uma_lightning.cli``: the runtime (models, modules, data, parallel, checkpoint,
tracking, callbacks) never imports a tool.
"""
