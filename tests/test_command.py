"""The `uma` command as a whole: its help, versions, every subcommand's own help, shell completion
driven in real bash and zsh, a distributed run's output, and run names."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
from suite import run_main

from uma_lightning.parallel.strategy import PRESETS
from uma_lightning.subcommands import TOOLS, TRAINING
from uma_lightning.tools.completion import script, uma_commands
from uma_lightning.tracking.run_name import MAX_NAME_LENGTH, changed_settings, describe_overrides, run_name

SUBCOMMANDS = ["fit", "validate", "test", "predict", "data", "ckpt", "rl", "plan", "parity", "report", "completion"]


def test_help_lists_every_subcommand_on_one_line(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    lines = out.splitlines()
    for name in SUBCOMMANDS:
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        assert len(line.split()) > 2, line  # its summary, on the same line
    assert list(TRAINING) + list(TOOLS) == SUBCOMMANDS
    # Without a subcommand: the usage and one error line.
    code, _, err = run_main([], capsys)
    assert code == 2 and err.splitlines()[-1] == "uma: error: the following arguments are required: COMMAND"


def test_training_subcommands_are_lightnings():
    from lightning.pytorch.cli import LightningCLI

    assert set(TRAINING) == set(LightningCLI.subcommands())


def test_version_names_the_package_torch_and_lightning(capsys):
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0
    assert out.startswith(f"uma-lightning {importlib.metadata.version('uma-lightning')} ")
    assert f"torch {torch.__version__}" in out and f"lightning {lightning.__version__}" in out


@pytest.mark.slow  # new interpreters
def test_the_command_hands_over_without_importing_what_the_subcommand_does_not_need():
    """The console script as installed: its help and the tools that need no model start without
    Lightning (five seconds of imports) or torch; `uma ckpt` without Lightning; `uma fit` with it."""
    uma = Path(sys.executable).with_name("uma")
    expected = {("--help",): set(), ("report", "--help"): set(), ("data", "--help"): set(),
                ("ckpt", "--help"): {"torch"}, ("fit", "--help"): {"torch", "lightning"}}  # fmt: skip
    for argv, heavy in expected.items():
        result = subprocess.run(
            [uma, *argv], capture_output=True, text=True, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
        )
        assert result.returncode == 0, result.stderr[-2000:]
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
        }
        assert imported & {"torch", "lightning", "mlflow"} == heavy, argv
        assert result.stdout.startswith("usage: uma"), result.stdout[:200]
    # The module that was the command before says where the command is, instead of doing nothing.
    old = subprocess.run([sys.executable, "-m", "uma_lightning.cli", "fit"], capture_output=True, text=True)
    assert old.returncode == 1 and "python -m uma_lightning.command" in old.stderr, old.stderr[-2000:]


@pytest.mark.parametrize("tool", ["data", "ckpt", "rl", "plan", "parity", "report", "completion"])
def test_every_tool_has_its_own_help(tool, capsys):
    code, out, _ = run_main([tool, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: uma {tool} "), out[:200]
    if tool == "rl":  # uma fit's keys, over the learner's rollouts
        assert "--trainer.max_steps" in out and "[options] fit" not in out


# ---- shell completion ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def completion_scripts(tmp_path_factory):
    """`uma completion bash` and `uma completion zsh`, written to files (one parser build for both)."""
    commands = uma_commands()
    folder = tmp_path_factory.mktemp("completion")
    scripts = {}
    for shell in ("bash", "zsh"):
        scripts[shell] = folder / f"uma.{shell}"
        scripts[shell].write_text(script(commands, shell))
    return scripts


# Words typed before <TAB>, and what completion must offer.
CASES = [
    (["uma", "f"], ["fit"]),
    (["uma", "c"], ["ckpt", "completion"]),
    (["uma", "fit", "--trainer.max_st"], ["--trainer.max_steps"]),
    (["uma", "fit", "--config", "r.yaml", "--model.network.si"], ["--model.network.size"]),
    (["uma", "fit", "--model.sp"], []),  # model.spec comes from the data module, not the config
    (["uma", "fit", "--trainer.strategy", "f"], sorted(p for p in PRESETS if p.startswith("f"))),
    (["uma", "rl", "--trainer.strategy", "e"], ["ep", "ep_fsdp"]),
    (["uma", "fit", "--model.network.size", "t"], ["tiny", "tiny_moe"]),
    (["uma", "fit", "--data.loader.on_bad_data", ""], ["error", "skip"]),  # a Literal's values
    (["uma", "data", "--cache-dir", "x", "co"], ["convert"]),
    (["uma", "data", "convert", "--t"], ["--to"]),
    (["uma", "completion", ""], ["bash", "zsh"]),
]


def bash_candidates(script_path, words: list[str]) -> list[str]:
    """COMPREPLY after a real bash runs the completion function on ``words`` (the last one at the cursor)."""
    program = (
        f"source {script_path}\n"
        f"COMP_WORDS=({' '.join(json.dumps(w) for w in words)}); COMP_CWORD={len(words) - 1}; COMPREPLY=()\n"
        '_uma; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    result = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not result.stderr, result.stderr
    return sorted(line for line in result.stdout.splitlines() if line)


@pytest.mark.parametrize("words, expected", CASES)
def test_bash_completes_subcommands_keys_and_presets(completion_scripts, words, expected):
    assert bash_candidates(completion_scripts["bash"], words) == expected


def test_bash_completes_the_value_after_an_equals_sign(completion_scripts):
    # bash splits `--trainer.strategy=t` into three words at the '='.
    assert bash_candidates(completion_scripts["bash"], ["uma", "fit", "--trainer.strategy", "=", "t"]) == ["tp"]
    assert "tiny" in bash_candidates(completion_scripts["bash"], ["uma", "fit", "--model.network.size", "=", ""])


ZSH_DRIVER = r"""
zmodload zsh/zpty
zpty shell zsh -f -i
zpty -w shell "source ${0:h}/setup.zsh; print '<rea''dy>'"
zpty -r -m shell out '*<ready>*'
for line in "$@"; do
  zpty -w -n shell "$line"$'\t\x18'
  zpty -r -m shell out '*<end>*'
  print -r -- "<line>$line"
  print -r -- "$out" | tr -d '\r' | grep -a -o '<match>[^[:space:]]*'
  zpty -w -n shell $'\x15'
done
zpty -d shell
"""
# An interactive zsh with the completion system and uma's script; every match its completion adds
# is also printed (compadd -O lists what the builtin's own filtering keeps), and ^X marks the end.
ZSH_SETUP = """
PROMPT='> '
autoload -Uz compinit && compinit -u -D
source {script}
compadd() {{
  local -a hits
  builtin compadd -O hits "$@"
  print -l -- "<match>"${{^hits}}
  builtin compadd "$@"
}}
_mark_end() {{ print "<end>" }}
zle -N _mark_end
bindkey '^X' _mark_end
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed (.ci/run installs it where apt works)")
def test_zsh_completes_subcommands_keys_and_presets(completion_scripts, tmp_path):
    (tmp_path / "setup.zsh").write_text(ZSH_SETUP.format(script=completion_scripts["zsh"]))
    (tmp_path / "drive.zsh").write_text(ZSH_DRIVER)
    lines = [" ".join(words) for words, _ in CASES] + ["uma fit --trainer.strategy=t"]
    result = subprocess.run(
        ["zsh", "-f", str(tmp_path / "drive.zsh"), *lines], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("<line>"):
            typed = found.setdefault(line.removeprefix("<line>"), [])
        elif line.startswith("<match>"):
            typed.append(line.removeprefix("<match>"))
    expected = {" ".join(words): sorted(candidates) for words, candidates in CASES}
    assert {line: sorted(set(matches)) for line, matches in found.items()} == {
        **expected,
        "uma fit --trainer.strategy=t": ["tp"],
    }


def test_completion_refuses_an_unknown_shell(capsys):
    code, _, err = run_main(["completion", "fish"], capsys)
    assert code == 2 and "invalid choice: 'fish'" in err


# ---- run names -------------------------------------------------------------------------------------


def test_names_of_runs_on_different_strategies_differ_readably_within_the_limit():
    recipe = {
        "trainer": {"strategy": "auto", "max_steps": 300, "default_root_dir": "runs/pretrain"},
        "model": {"init_args": {"network": {"size": "tiny"}, "optimizer": {"lr": 3e-3, "warmup_steps": 30}}},
        "data": {"init_args": {"batch_size": 32, "root": None, "generation": {"n_episodes": 2000}}},
    }
    names = {}
    for strategy in ("ddp", "fsdp", "tp"):
        resolved = json.loads(json.dumps(recipe))
        resolved["trainer"].update(max_steps=40, default_root_dir=f"runs/sweep_{strategy}", strategy=strategy)
        resolved["model"]["init_args"]["network"]["size"] = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}
        resolved["model"]["init_args"]["optimizer"].update(lr=1e-4, warmup_steps=5)
        resolved["data"]["init_args"].update(batch_size=4, root="/datasets/a/very/long/path/to/a/dataset_name")
        resolved["data"]["init_args"]["generation"]["n_episodes"] = 6
        # The strategy flag last of a long list: the overrides alone run past the limit.
        args = ["--model.network.size", "--model.optimizer.lr", "--data.batch_size", "--trainer.strategy"]
        changed = changed_settings(recipe, resolved, args)
        assert len(describe_overrides(changed)) > MAX_NAME_LENGTH
        names[strategy] = run_name("recipes/pretrain.yaml", "pretrain", "fit", changed)
        body, suffix = names[strategy].rsplit(" #", 1)
        assert re.fullmatch("[0-9a-f]{6}", suffix) and len(body) <= MAX_NAME_LENGTH, names[strategy]
        # The strategy right after the recipe, then whole settings in the flags' order, and a count of those left out.
        match = re.fullmatch(r"pretrain (.+) \(\+(\d+) more\)", body)
        assert match, body
        shown, every = match.group(1).split(" "), describe_overrides(changed).split(" ")
        assert shown[:3] == [f"strategy={strategy}", "dim=32", "n_layers=1"], body
        assert shown[1:] == [setting for setting in every if setting in shown[1:]], body
        assert len(shown) + int(match.group(2)) == len(every)
    assert len(set(names.values())) == 3
