"""The `uma` command: recipe composition, overrides, printing, and clear errors for bad configs."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from suite import QUICK, RECIPE, REPO, assert_short_error, recipe, run_main

from uma_lightning.cli import UmaCLI, expand_includes
from uma_lightning.data.generate import RealisticPreset, generate_realistic


def resolved_config(args, capsys) -> dict:
    code, out, err = run_main(["fit", "--config", RECIPE, *args, "--print_config"], capsys)
    assert code in (0, None), err
    return yaml.safe_load(out)


# ---- composition and overrides ------------------------------------------------------------------


def test_recipe_composes_its_fragments_in_order():
    args = expand_includes(["fit", "--config", RECIPE, "--trainer.max_steps", "5"])
    configs = [Path(args[i + 1]).resolve() for i, a in enumerate(args) if a == "--config"]
    assert configs == [
        REPO / "configs/trainer/default.yaml",
        REPO / "configs/trainer/diagnostics.yaml",
        REPO / "configs/data/planar_arm.yaml",
        REPO / "configs/tracking/mlflow.yaml",
        REPO / "recipes/pretrain.yaml",
    ]
    assert args[-2:] == ["--trainer.max_steps", "5"]


def test_print_config_is_fully_resolved(capsys):
    config = resolved_config([], capsys)
    assert "include" not in config
    # From the fragments...
    assert config["trainer"]["gradient_clip_val"] == 1.0
    assert config["data"]["class_path"] == "uma_lightning.data.RobotDataModule"
    assert config["trainer"]["logger"]["class_path"] == "uma_lightning.tracking.MLflowLogger"
    # ...the recipe's own keys on top, merged into the fragment's logger rather than replacing it...
    assert config["trainer"]["max_steps"] == 300
    assert config["trainer"]["logger"]["init_args"]["experiment_name"] == "pretrain"
    # ...and the size preset expanded to its dimensions.
    assert config["model"]["init_args"]["network"]["size"] == {
        "dim": 192,
        "n_layers": 4,
        "n_heads": 6,
        "n_kv_heads": 2,
        "ffn_dim": 512,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "name": "tiny",
        "moe": None,
    }


@pytest.mark.parametrize("stage", ["pretrain", "midtrain", "posttrain"])
def test_grounded_vision_fragment_adds_to_every_stage_recipe(stage, capsys):
    code, out, err = run_main(
        [
            "fit",
            "--config",
            str(REPO / f"recipes/{stage}.yaml"),
            "--config",
            str(REPO / "configs/vision/grounded.yaml"),
            "--print_config",
        ],
        capsys,
    )
    assert code in (0, None), err
    model, data = (yaml.safe_load(out)[key]["init_args"] for key in ("model", "data"))
    network = model["network"]
    assert (
        network["vision"]["tokenizer"] == "keypoints"
        and network["vision"]["film"]
        and network["environment_state_weight"] == 10.0
    )
    assert model["optimizer"]["lr"] == 1e-3 and data["generation"]["n_episodes"] == 2000
    assert (
        model["optimizer"]["warmup_steps"] == {"pretrain": 30, "midtrain": 30, "posttrain": 50}[stage]
    )  # the recipe's, kept


def test_any_key_can_be_overridden_on_the_command_line(capsys):
    config = resolved_config(
        ["--model.network.size", "small", "--trainer.max_steps", "50", "--data.batch_size", "8"], capsys
    )
    assert config["model"]["init_args"]["network"]["size"]["dim"] == 768
    assert config["model"]["init_args"]["network"]["size"]["name"] == "small"
    assert config["trainer"]["max_steps"] == 50
    assert config["data"]["init_args"]["batch_size"] == 8


def test_size_dict_overrides_one_dimension_of_a_preset(capsys):
    config = resolved_config(["--model.network.size", '{"name": "small", "n_layers": 6}'], capsys)
    assert config["model"]["init_args"]["network"]["size"]["n_layers"] == 6
    assert config["model"]["init_args"]["network"]["size"]["dim"] == 768


# ---- bad configs: exit status 2, one short message naming the key or file -----------------------


def write_recipe(tmp_path, body: dict) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"include": [RECIPE], **body}))
    return str(path)


def test_unknown_key_in_a_recipe_names_the_file_and_suggests(tmp_path, capsys):
    recipe = write_recipe(tmp_path, {"trainer": {"max_stepz": 10}})
    code, _, err = run_main(["fit", "--config", recipe], capsys)
    assert_short_error(code, err, f"{recipe}: unknown key 'trainer.max_stepz'", "did you mean 'trainer.max_steps'?")


def test_unknown_key_on_the_command_line_suggests(capsys):
    code, _, err = run_main(["fit", "--config", RECIPE, "--data.batch_sise", "3"], capsys)
    assert_short_error(code, err, "command line: unknown key", "batch_sise", "did you mean", "batch_size")


def test_unknown_init_arg_of_the_model_suggests(tmp_path, capsys):
    recipe = write_recipe(tmp_path, {"model": {"init_args": {"n_action_binz": 16}}})
    code, _, err = run_main(["fit", "--config", recipe], capsys)
    assert_short_error(code, err, recipe, "takes no argument 'n_action_binz'", "did you mean 'n_action_bins'?")


def test_a_setting_that_moved_into_a_section_says_where_it_went(tmp_path, capsys):
    code, _, err = run_main(["fit", "--config", RECIPE, "--model.size", "small"], capsys)
    assert_short_error(code, err, "command line: 'model.size' is now 'model.network.size'")
    code, _, err = run_main(["fit", "--config", RECIPE, "--data.num_workers", "0"], capsys)
    assert_short_error(code, err, "command line: 'data.num_workers' is now 'data.loader.num_workers'")
    recipe = write_recipe(tmp_path, {"model": {"init_args": {"vision": {"tokenizer": "keypoints"}}}})
    code, _, err = run_main(["fit", "--config", recipe], capsys)
    assert_short_error(code, err, f"{recipe}: 'model.vision.tokenizer' is now 'model.network.vision.tokenizer'")


def test_unknown_key_of_a_dataclass_argument_names_it_and_suggests(tmp_path, capsys):
    recipe = write_recipe(tmp_path, {"model": {"init_args": {"network": {"vision": {"tokenizr": "keypoints"}}}}})
    code, _, err = run_main(["fit", "--config", recipe], capsys)
    assert_short_error(
        code,
        err,
        recipe,
        "unknown key 'model.network.vision.tokenizr': model.network.vision takes no key 'tokenizr'",
        "did you mean 'tokenizer'?",
    )
    code, _, err = run_main(["fit", "--config", RECIPE, "--model.optimizer", '{"lrr": 1}'], capsys)
    assert_short_error(code, err, "model.optimizer takes no key 'lrr'", "did you mean 'lr'?")


def test_wrong_type_names_key_and_value(capsys):
    code, _, err = run_main(["fit", "--config", RECIPE, "--trainer.max_steps", "ten"], capsys)
    assert_short_error(code, err, "trainer.max_steps: expected int, got 'ten'")


def test_missing_config_file_suggests_the_close_one(capsys):
    missing = str(REPO / "recipes" / "pretrian.yaml")
    code, _, err = run_main(["fit", "--config", missing], capsys)
    assert_short_error(code, err, "config file not found", "pretrian.yaml", "did you mean", "pretrain.yaml")


def test_missing_included_fragment_names_both_files(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("include: [nope/trainer.yaml]\n")
    code, _, err = run_main(["fit", "--config", str(recipe)], capsys)
    assert_short_error(code, err, str(recipe), "included file not found: nope/trainer.yaml")


def test_unknown_class_suggests_the_close_one(capsys):
    code, _, err = run_main(["fit", "--config", RECIPE, "--model", "uma_lightning.modules.PretrainModul"], capsys)
    assert_short_error(
        code,
        err,
        "command line: model: unknown class 'uma_lightning.modules.PretrainModul'",
        "did you mean 'uma_lightning.modules.PretrainModule'?",
    )


def test_unknown_model_size_suggests(capsys):
    code, _, err = run_main(["fit", "--config", RECIPE, "--model.network.size", "smal"], capsys)
    assert_short_error(code, err, "unknown model size 'smal'", "did you mean 'small'?")


def test_unknown_subcommand_suggests(capsys):
    code, _, err = run_main(["fitt"], capsys)
    assert_short_error(code, err, "unknown command 'fitt'", "did you mean 'fit'?")


def test_bad_value_found_while_building_objects_is_a_config_error(tmp_path, capsys):
    code, _, err = run_main(["fit", "--config", RECIPE, "--data.root", str(tmp_path / "no_such_dataset")], capsys)
    assert_short_error(code, err, "no_such_dataset")


# ---- training through the CLI -------------------------------------------------------------------


def test_research_subclass_trains_through_class_path(tmp_path):
    cli = UmaCLI(
        [
            "fit",
            "--config",
            RECIPE,
            *QUICK,
            "--model",
            "research_module.LabelSmoothedPretrain",
            "--model.smoothing",
            "0.2",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger",
            "false",
        ]
    )
    from research_module import LabelSmoothedPretrain

    assert type(cli.model) is LabelSmoothedPretrain
    assert cli.model.loss_calls >= 4  # every training step went through the override
    assert cli.trainer.global_step == 4
    metrics = cli.trainer.callback_metrics
    assert float(metrics["train/plain_loss"]) < float(metrics["train/loss"])  # smoothing adds a penalty
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (
        tmp_path / "run" / "checkpoints" / "step-000000004" / "manifest.json"
    ).is_file()  # saved when training ended


@pytest.mark.slow  # a new interpreter
def test_console_script_runs(tmp_path):
    result = subprocess.run(
        [Path(sys.executable).parent / "uma", "fit", "--config", RECIPE, "--print_config"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["trainer"]["max_steps"] == 300


def test_post_training_on_several_cameras_is_refused_before_a_step_when_it_evaluates_in_the_one_camera_simulator(
    tmp_path, capsys
):
    preset = RealisticPreset(n_episodes=2, seconds=8 / 30, image_size=32, n_cameras=2, codec="h264", gop=2)
    root = generate_realistic(tmp_path / "two-cameras", preset)
    code, out, err = run_main(
        [
            "fit",
            "--config",
            recipe("posttrain"),
            "--data.init_args.root",
            str(root),
            "--data.init_args.val_episodes",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger",
            "false",
        ],
        capsys,
    )
    assert_short_error(
        code, err, "trainer.callbacks: ClosedLoopEval", "2 cameras (observation.images.cam_0, observation.images.cam_1)"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
