"""The documentation site: it builds in strict mode, and a broken link fails that build."""

import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from suite import QUICK, REPO, TINY

mkdocs_build = pytest.importorskip("mkdocs.commands.build", reason="mkdocs-material is in the dev extra")


def build_site(config_file, site_dir) -> None:
    """``mkdocs build --strict`` of ``config_file`` into ``site_dir``, in this process."""
    from mkdocs.config import load_config

    mkdocs_build.build(load_config(str(config_file), strict=True, site_dir=str(site_dir)))


def copy_of_site_sources(tmp_path):
    """mkdocs.yml, docs/ and the recipes the pages' pictures are drawn from, copied under ``tmp_path``;
    returns the copy's mkdocs.yml."""
    for folder in ("docs", "recipes", "configs"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path / "mkdocs.yml"


def test_site_builds_in_strict_mode(tmp_path):
    build_site(REPO / "mkdocs.yml", tmp_path / "site")
    assert (tmp_path / "site" / "index.html").is_file()
    # The layout tutorial shows the chart uma plan drew during the build.
    assert (tmp_path / "site" / "tutorials" / "layout.png").read_bytes().startswith(b"\x89PNG")
    assert 'src="../layout.png"' in (tmp_path / "site" / "tutorials" / "choose-a-layout" / "index.html").read_text()
    # The precision tutorial shows the per-layer error uma parity drew during the build.
    assert (tmp_path / "site" / "tutorials" / "precision.png").read_bytes().startswith(b"\x89PNG")
    assert 'src="../precision.png"' in (tmp_path / "site" / "tutorials" / "precision" / "index.html").read_text()
    # The first-run tutorial shows the step time of a short run trained during the build.
    assert (tmp_path / "site" / "tutorials" / "steps.png").read_bytes().startswith(b"\x89PNG")
    assert 'src="../steps.png"' in (tmp_path / "site" / "tutorials" / "first-run" / "index.html").read_text()
    # The pipeline guide shows the schedules drawn during the build.
    pipeline_page = (tmp_path / "site" / "guides" / "pipeline" / "index.html").read_text()
    for image in ("schedule-1f1b.png", "schedule-interleaved.png"):
        assert (tmp_path / "site" / "guides" / image).read_bytes().startswith(b"\x89PNG")
        assert f'src="../{image}"' in pipeline_page


def test_a_broken_link_fails_the_strict_build(tmp_path, caplog):
    config = copy_of_site_sources(tmp_path)
    # Added to the navigation, so only its link is wrong.
    (tmp_path / "docs" / "broken.md").write_text("# Broken\n\nSee [the missing page](no-such-page.md).\n")
    settings = yaml.safe_load(config.read_text())
    settings["nav"].append({"Broken": "broken.md"})
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    from mkdocs.exceptions import Abort

    with caplog.at_level(logging.WARNING, logger="mkdocs"), pytest.raises(Abort, match="strict mode"):
        build_site(config, tmp_path / "site")
    assert "no-such-page.md" in caplog.text


# ---- the reference pages, generated from the code ------------------------------------------------


def reference_generator():
    """docs/gen_reference.py, the mkdocs hook that writes the reference pages."""
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_and_callback_argument_has_a_description():
    generator = reference_generator()
    keys = [(prefix, key) for prefix, _, _, section in generator.all_keys() for key in section]
    keys += [(f"callbacks.{key.section}", key) for key in generator.callback_keys()]
    assert len(keys) > 150  # every section was read, nested dataclass sections included
    undescribed = [f"{prefix}.{key.name} ({key.section})" for prefix, key in keys if not key.description]
    assert not undescribed, "describe these settings in the Args: section of their class's docstring: " + ", ".join(
        undescribed
    )


def test_a_key_without_a_description_is_found():
    @dataclass
    class Section:
        """A section whose second key is not described.

        Args:
            described: What it is.
        """

        described: int = 1
        undescribed: int = 2

    keys = {key.name: key for key in reference_generator().section_keys(Section)}
    assert keys["described"].description == "What it is." and keys["described"].default == "`1`"
    assert keys["undescribed"].description == ""


def test_the_reference_pages_hold_every_subcommand_key_and_callback():
    pages = reference_generator().reference_pages()
    cli, config, callbacks = pages["reference/cli.md"], pages["reference/config.md"], pages["reference/callbacks.md"]
    for command in ("fit", "validate", "test", "predict", "rl", "plan", "parity", "data info", "ckpt export"):
        assert f"## `uma {command}`" in cli
    assert "--trainer.max_steps" in cli and "--emit-config" in cli
    assert "| `loader.num_workers` | int | `1` | DataLoader worker processes. |" in config
    assert "| `lr` | float | `0.0003` | Peak learning rate, reached after the warmup. |" in config
    import uma_lightning.callbacks as shipped

    for name in shipped.__all__:
        assert (f"## {name}\n" in callbacks) == (name != "TrainingHalted"), name


# ---- the tutorials, run as written ---------------------------------------------------------------

TESTED_BLOCK = re.compile(r"^<!-- test -->\n```bash\n(.*?)\n```$", re.M | re.S)
# Appended to every training command of a tutorial: the tiny backbone of the suite on a six-episode
# dataset, so a tutorial's runs take seconds; 60 steps leave a preempted run time to receive its signal.
SMALL_TRAINING = [*QUICK, "--trainer.max_steps", "60", "--trainer.val_check_interval", "30"]
TRAINING_COMMANDS = ("fit", "validate", "test", "predict")
# uma plan reads the recipe's data for its shapes; the model it plans is the tutorial's.
SMALL_DATA = ["--data.generation.n_episodes", "6"]
# uma parity trains its steps on the suite's tiny model and data.
SMALL_PARITY = ["--model.network.size", json.dumps(TINY), "--data.generation.n_episodes", "6", "--data.batch_size", "4",
                "--data.loader.num_workers", "0"]  # fmt: skip
# uma rl collects two iterations' worth of the pendulum with one actor process.
SMALL_RL = ["--data.total_env_steps", "1024", "--data.n_workers", "1"]


def blocks_marked_for_test(page: str) -> list[str]:
    """The ```bash blocks of ``docs/<page>`` marked ``<!-- test -->``, in order."""
    return TESTED_BLOCK.findall((REPO / "docs" / page).read_text())


def small_uma(bin_dir, training: list[str]) -> None:
    """An ``uma`` first on PATH that runs this interpreter's uma with small settings, ``training`` for
    its training commands."""
    bin_dir.mkdir()
    script = bin_dir / "uma"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$1" in {"|".join(TRAINING_COMMANDS)}) exec {sys.executable} -m uma_lightning.command "$@" {shlex.join(training)};;\n'
        f'  plan) exec {sys.executable} -m uma_lightning.command "$@" {shlex.join(SMALL_DATA)};;\n'
        f'  parity) exec {sys.executable} -m uma_lightning.command "$@" {shlex.join(SMALL_PARITY)};;\n'
        f'  rl) exec {sys.executable} -m uma_lightning.command "$@" {shlex.join(SMALL_RL)};; esac\n'
        f'exec {sys.executable} -m uma_lightning.command "$@"\n'
    )
    script.chmod(0o755)


def walk_tutorial(page: str, tmp_path, training: list[str] = SMALL_TRAINING) -> str:
    """Run the tested blocks of a tutorial as one bash script, from a copy of the recipes and
    configs, with small settings (``training`` for its training commands); returns its output."""
    blocks = blocks_marked_for_test(page)
    assert blocks, f"docs/{page} has no block marked <!-- test -->"
    cwd = tmp_path / "work"
    shutil.copytree(REPO / "recipes", cwd / "recipes")
    shutil.copytree(REPO / "configs", cwd / "configs")
    small_uma(tmp_path / "bin", training)
    path = os.pathsep.join([str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]])
    script = "set -e\n" + "\n".join(blocks) + "\n"
    result = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env={**os.environ, "PATH": path}, capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"docs/{page} failed (exit {result.returncode}):\n{output[-4000:]}"
    return output


@pytest.mark.slow(seconds=130)
def test_the_tutorials_run_as_written(tmp_path):
    first_run = walk_tutorial("tutorials/first-run.md", tmp_path / "first-run")
    assert "final token accuracy:" in first_run and "step-000000060" in first_run
    assert re.search(r"^   forward: median \d+\.\d ms over \d+ steps$", first_run, re.M), first_run[-3000:]
    assert (tmp_path / "first-run" / "work" / "steps.png").read_bytes().startswith(b"\x89PNG")
    layout = walk_tutorial("tutorials/choose-a-layout.md", tmp_path / "layout")
    assert "recommended: " in layout and (tmp_path / "layout" / "work" / "layout.yaml").is_file()
    assert (tmp_path / "layout" / "work" / "layout.png").stat().st_size > 0
    precision = walk_tutorial("tutorials/precision.md", tmp_path / "precision")
    assert "bf16-mixed against fp32 for recipes/pretrain.yaml (one process): 4 steps" in precision
    assert re.search(r"^  model\.backbone\.layers\.0\.\S+ +\d\.\d\de-\d\d", precision, re.M), precision[-3000:]
    preempted = walk_tutorial("tutorials/preemption.md", tmp_path / "preemption")
    assert "exit status 143" in preempted
    # Stopped at the first step boundary after the signal, sent once step 10 was logged, and before the
    # end (60): the resumed run starts where the signal stopped it. Step 10 itself where the signal came
    # before the run had passed that step's boundary (its last hooks); the recipe saves no checkpoint
    # of its own before step 60, so the one resumed from is the preemption's.
    resumed = re.search(r"resumed from \S+/step-0*(\d+): step (\d+)", preempted)
    assert resumed and resumed[1] == resumed[2] and 10 <= int(resumed[1]) < 60, preempted[-3000:]
    # The seeded loss bug is found, named and located; after the fix the same command passes.
    found, fixed = walk_tutorial("tutorials/parity.md", tmp_path / "parity").split("exit status 1\n")
    assert re.search(r"^ddp +2 .* DIVERGED$", found, re.M), found[-3000:]
    assert re.search(r"^ddp: gradients diverge at step \d in 20 of 20 parameters", found, re.M), found[-3000:]
    assert re.search(r"^ddp +2 .* ok$", fixed, re.M) and "DIVERGED" not in fixed, fixed[-3000:]
    rl = walk_tutorial("tutorials/rl.md", tmp_path / "rl")
    assert "iteration 4 | env steps 1024/1024" in rl and "env steps: 1024" in rl
    assert re.search(r"^step   3: mean return +\d+\.\d$", rl, re.M), rl[-3000:]


def test_the_your_network_tutorial_shows_the_example_it_runs():
    """The code on the page is the shipped example's file, whole, so the page cannot drift from what runs."""
    shown = re.search(r"^```python\n(.*?)^```$", (REPO / "docs/tutorials/your-network.md").read_text(), re.M | re.S)
    assert shown and shown[1] == (REPO / "uma_lightning/examples/chunk_mlp.py").read_text()


@pytest.mark.slow(seconds=90)
def test_the_your_network_tutorial_runs_as_written(tmp_path):
    """One process, FSDP on two, parity, plan and Policy, each on the example network (four training steps)."""
    out = walk_tutorial("tutorials/your-network.md", tmp_path, training=QUICK)
    assert "parallel plan generic on ChunkMLP: units: 2 x ResidualBlock in blocks" in out
    assert "returned a view tensor" not in out  # FSDP's warning: the example's forward returns a flat chunk
    assert re.search(r"^ddp +2 .* ok$", out, re.M) and re.search(r"^fsdp +2 .* ok$", out, re.M), out[-3000:]
    assert "model: ChunkMLP (2 data-parallel units; no registered plan" in out and "recommended: " in out
    assert "ChunkMLP actions (1, 8, 3)" in out


@pytest.mark.slow(seconds=60)
def test_the_pretrained_vlm_tutorial_runs_as_written(tmp_path, tiny_vlms):
    """Post-training, planning and the stage chain, with a tiny SmolVLM (Idefics3) where the tutorial
    puts SmolVLM-256M, and PaliGemma 3B's config and tokenizer alone where it puts PaliGemma."""
    from hf_models import paligemma_3b_config_dir

    from uma_lightning.checkpoint.weights import read_checkpoint

    models = tmp_path / "work" / "models"
    models.mkdir(parents=True)
    (models / "SmolVLM-256M-Instruct").symlink_to(tiny_vlms["idefics3"])
    paligemma_3b_config_dir(models)
    out = walk_tutorial("tutorials/pretrained-vlm.md", tmp_path, training=[*QUICK, "--model.network.max_text_len", "8"])
    assert "FLOPs off" not in out, out[-3000:]  # the VLM's FLOPs are counted: MFU is logged
    runs = tmp_path / "work" / "runs"
    posttrained = read_checkpoint(runs / "posttrain_vlm" / "checkpoints")
    assert posttrained.path.rstrip("/").endswith("step-000000004"), out[-3000:]
    assert posttrained.hparams["network"]["pretrained"] == "models/SmolVLM-256M-Instruct"
    assert any(name.startswith("vlm.model.vision_model.") for name in posttrained.weights)
    assert re.search(r"^model: VLMFlowModel .*, 3\.2 B parameters,", out, re.M), out[-3000:]
    assert re.search(r"^recommended: dp_shard 64 \| .*\(fsdp\)", out, re.M), out[-3000:]
    # The chain: post-training started from the pretraining run's weights, in a folder of its own.
    pretrained = read_checkpoint(runs / "pretrain" / "checkpoints").weights
    chained = read_checkpoint(runs / "posttrain_vlm-from-pretrain" / "checkpoints")
    assert chained.hparams["init_from"] == "runs/pretrain/checkpoints"
    name = "vlm.model.vision_model.embeddings.patch_embedding.weight"  # frozen: the pretraining run's, bit for bit
    assert torch.equal(chained.weights[name], pretrained[name]), out[-3000:]


def test_every_tutorial_is_walked():
    """Each tutorial page has bash blocks marked for test, and a test here walks it."""
    walked = set(re.findall(r'walk_tutorial\(\s*"(tutorials/[\w-]+\.md)"', Path(__file__).read_text()))
    pages = {f"tutorials/{page.name}" for page in (REPO / "docs" / "tutorials").glob("*.md") if page.name != "index.md"}
    assert walked == pages
    assert all(blocks_marked_for_test(page) for page in pages)
