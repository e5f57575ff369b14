"""The ``uma`` command's subcommands: each name, what runs it and the line ``uma --help`` shows for it.

A leaf: the command (``uma_lightning.command``), LightningCLI's side (``uma_lightning.cli``) and the
shell completion all read these tables.
"""

# LightningCLI's subcommands, each with the line `uma --help` shows for it.
TRAINING: dict[str, str] = {
    "fit": "train from a recipe, or resume its run: uma fit --config RECIPE",
    "validate": "evaluate on the validation set (--ckpt_path: which weights)",
    "test": "evaluate on the test set (--ckpt_path: which weights)",
    "predict": "predict action chunks for the data (--ckpt_path: which weights)",
}

# Subcommands that are tools rather than training runs: name -> ("module:function(argv) -> exit code",
# the line `uma --help` shows). Each tool parses its own arguments with the parser its module's
# build_parser() returns (read by `uma completion` too); imported only when called, so `uma fit`
# pays nothing for them.
TOOLS: dict[str, tuple[str, str]] = {
    "data": ("uma_lightning.tools.data:main", "look at, convert, cache and generate LeRobot datasets"),
    "ckpt": ("uma_lightning.tools.ckpt:main", "inspect checkpoints, export their weights"),
    "rl": ("uma_lightning.tools.rl:main", "train an RL learner in simulation: uma rl --config RECIPE"),
    "plan": (
        "uma_lightning.tools.planner.tool:main",
        "rank a recipe's parallel layouts on a cluster",
    ),
    "parity": ("uma_lightning.tools.parity.cli:main", "check a recipe trains the same under each strategy"),
    "report": ("uma_lightning.tools.report:main", "draw what a finished run logged: uma report steptime RUN_DIR"),
    "completion": ("uma_lightning.tools.completion:main", "print the shell completion script for bash or zsh"),
}
