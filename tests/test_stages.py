"""The stage modules under a real Trainer on the embedded data: starting one stage from another's
checkpoint, freezing, LoRA and EMA in post-training, the Policy rebuilt from a checkpoint, evaluation
metrics (including closed-loop rollouts in the simulator) and ``predict`` output."""

import logging

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from suite import quiet_trainer, small_data

from uma_lightning import Policy
from uma_lightning.callbacks import ClosedLoopEval, PredictionWriter, ShardedCheckpoint
from uma_lightning.checkpoint.weights import read_checkpoint
from uma_lightning.models.lora import LoRALinear
from uma_lightning.modules import MidtrainModule, PosttrainModule, PretrainModule

MICRO = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
LORA_TARGETS = ["backbone.layers.*.attn.wq", "backbone.layers.*.attn.wv"]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """A pretrained micro model, and a post-trained one started from it with freezing, LoRA and EMA."""
    root = tmp_path_factory.mktemp("stages")
    torch.manual_seed(0)
    pre_data = small_data()
    pretrain = PretrainModule(spec=pre_data.spec, network={"size": MICRO}, normalization=pre_data.normalization())
    run = quiet_trainer(root / "pretrain", 3)
    run.fit(pretrain, pre_data)
    run.save_checkpoint(root / "pretrain.ckpt")

    post_data = small_data(n_obs_steps=2, action_horizon=6, state_norm="quantile", action_norm="quantile")
    posttrain = PosttrainModule(
        spec=post_data.spec,
        network={"size": MICRO},
        normalization=post_data.normalization(),
        init_from=str(root / "pretrain.ckpt"),
        expert={"dim": 16, "ffn_dim": 32},
        freeze=["image_tokenizer.*"],
        lora={"targets": LORA_TARGETS, "rank": 2},
        ema_decay=0.5,
        optimizer={"lr": 1e-2, "warmup_steps": 1},
    )
    # Also written as the recipes write checkpoints: sharded, in the background, at the end of training.
    run = quiet_trainer(root / "posttrain", 4, enable_checkpointing=True, callbacks=[ShardedCheckpoint()])
    run.fit(posttrain, post_data)
    run.save_checkpoint(root / "posttrain.ckpt")
    return {"root": root, "pretrain": pretrain, "pre_data": pre_data, "posttrain": posttrain, "post_data": post_data}


def test_posttraining_freezes_adapts_and_keeps_an_average(stages):
    pretrained = read_checkpoint(stages["root"] / "pretrain.ckpt").weights
    model = stages["posttrain"].model
    # Frozen by pattern, and the base weights under LoRA: unchanged since the pretraining checkpoint.
    torch.testing.assert_close(model.image_tokenizer.proj.weight, pretrained["image_tokenizer.proj.weight"])
    torch.testing.assert_close(model.backbone.layers[0].attn.wq.weight, pretrained["backbone.layers.0.attn.wq.weight"])
    # Trained: the adapters (B starts at zero), the unfrozen backbone, the fresh expert.
    assert isinstance(model.backbone.layers[0].attn.wq, LoRALinear)
    assert model.backbone.layers[0].attn.wq.lora_b.abs().sum() > 0
    assert not torch.allclose(model.backbone.layers[0].ffn.w1.weight, pretrained["backbone.layers.0.ffn.w1.weight"])
    # The average lags the weights; evaluation and export use it.
    ema = stages["posttrain"].ema_model
    assert not torch.allclose(ema.expert.layers[0].ffn.w1.weight, model.expert.layers[0].ffn.w1.weight)
    assert stages["posttrain"].inference_model is ema
    policy = Policy.from_checkpoint(str(stages["root"] / "posttrain.ckpt"))
    torch.testing.assert_close(policy.model.expert.layers[0].ffn.w1.weight, ema.expert.layers[0].ffn.w1.weight)
    merged = ema.backbone.layers[0].attn.wq
    torch.testing.assert_close(
        policy.model.backbone.layers[0].attn.wq.weight, merged.weight + merged.scale * merged.lora_b @ merged.lora_a
    )


@pytest.mark.parametrize(
    "module_name, argument", [("LabelSmoothedPretrain", {"smoothing": 0.3}), ("DeeperPretrain", {"extra_layers": 2})]
)
def test_a_research_subclass_round_trips_through_its_checkpoint_with_its_own_argument(tmp_path, module_name, argument):
    """Checkpoints keep every constructor argument of the class trained, a subclass's own included: a
    loss-only subclass is rebuilt by the stage's network builder, one that changes the network through
    its class, with the argument's value (two more layers here, whose weights must load)."""
    import research_module

    module_class = getattr(research_module, module_name)
    dm = small_data()
    module = module_class(spec=dm.spec, network={"size": MICRO}, normalization=dm.normalization(), **argument)
    run = quiet_trainer(tmp_path, 2)
    run.fit(module, dm)
    run.save_checkpoint(tmp_path / "research.ckpt")
    source = read_checkpoint(tmp_path / "research.ckpt")
    name, value = next(iter(argument.items()))
    assert source.hparams[name] == value and source.module_class == f"research_module.{module_name}"
    assert getattr(module_class(**source.hparams), name) == value
    assert (source.network_builder is None) == (module_name == "DeeperPretrain")
    policy = Policy.from_checkpoint(str(tmp_path / "research.ckpt"))
    assert len(policy.model.backbone.layers) == MICRO["n_layers"] + argument.get("extra_layers", 0)
    batch = next(iter(dm.val_dataloader()))
    trained = module.policy().eval()
    torch.testing.assert_close(
        policy.predict_normalized(batch["images"], batch["state"], batch["instruction"]),
        trained.predict_normalized(batch["images"], batch["state"], batch["instruction"]),
    )


def test_a_checkpoint_with_its_settings_saved_flat_still_loads(stages, tmp_path):
    """Checkpoints written before the settings were grouped keep the network's at the top level
    (``size``, ``vision``, ...) and name no network builder: the Policy is the same."""
    checkpoint = torch.load(stages["root"] / "pretrain.ckpt", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    checkpoint["hyper_parameters"] = {**{k: v for k, v in hparams.items() if k != "network"}, **hparams["network"]}
    del checkpoint["network_builder"]
    torch.save(checkpoint, tmp_path / "flat.ckpt")
    flat, grouped = (
        Policy.from_checkpoint(str(path)).state_dict()
        for path in (tmp_path / "flat.ckpt", stages["root"] / "pretrain.ckpt")
    )
    assert flat.keys() == grouped.keys() and all(torch.equal(flat[k], grouped[k]) for k in flat)
    # Lightning's own loading rebuilds the module with the settings in their section.
    module = PretrainModule.load_from_checkpoint(tmp_path / "flat.ckpt")
    assert module.hparams.network == hparams["network"] and "size" not in module.hparams
    loaded = module.policy().state_dict()
    assert loaded.keys() == grouped.keys() and all(torch.equal(loaded[k], grouped[k]) for k in loaded)


def test_sharded_checkpoint_reads_as_the_checkpoint_file(stages):
    from_file = read_checkpoint(stages["root"] / "posttrain.ckpt")
    from_run = read_checkpoint(stages["root"] / "posttrain" / "checkpoints")  # the run's newest valid checkpoint
    assert from_run.path.endswith("step-000000004") and from_run.ema and from_run.module_class == from_file.module_class
    assert from_run.weights.keys() == from_file.weights.keys()
    for name, value in from_file.weights.items():
        assert torch.equal(from_run.weights[name], value), name
    # Hyperparameters and module class rebuild the same Policy.
    policy, reference = Policy.from_checkpoint(from_run.path), Policy.from_checkpoint(from_file.path)
    obs = {
        "images": torch.zeros(2, 2, 1, 64, 64, 3, dtype=torch.uint8),
        "state": torch.zeros(2, 2, 5),
        "instruction": ["go", "reach"],
    }
    noise = torch.randn(2, 6, 3)
    torch.testing.assert_close(policy(obs, noise=noise), reference(obs, noise=noise))
    with pytest.raises(ValueError, match="a directory without checkpoints"):
        read_checkpoint(stages["root"])


def test_policy_acts_in_robot_units_batched(stages):
    policy = Policy.from_checkpoint(str(stages["root"] / "posttrain.ckpt"))
    assert not policy.training and policy.options == {"steps": 10, "noise_scale": 1.0}
    dataset = stages["post_data"]
    dataset.setup()
    samples = [dataset.val_sets[0][i] for i in (0, 5, 9)]
    raw_state = torch.stack([dataset.state_normalizer.denormalize(s["state"]) for s in samples])
    obs = {
        "images": torch.stack([s["images"] for s in samples]),
        "state": raw_state,
        "instruction": [s["instruction"] for s in samples],
    }
    noise = torch.randn(3, 6, 3)
    actions = policy(obs, noise=noise)
    assert actions.shape == (3, 6, 3)
    # Each sample's chunk does not depend on what else is in the batch.
    single = policy({key: value[1:2] for key, value in obs.items()}, noise=noise[1:2])
    torch.testing.assert_close(single[0], actions[1], atol=1e-5, rtol=1e-5)
    # The same as the model's normalised prediction with the dataset's quantile normalisation undone.
    with torch.no_grad():
        text_ids, text_mask = policy.model.text_tokenizer(obs["instruction"])
        normalized = policy.model.predict_actions(
            obs["images"], dataset.normalize_state(raw_state), text_ids, text_mask, steps=10, noise=noise
        )
    torch.testing.assert_close(actions, dataset.denormalize_actions(normalized), atol=1e-5, rtol=1e-5)
    with pytest.raises(
        ValueError, match=r"images must be uint8 \[B, 2, 1, 64, 64, 3\], got torch.uint8 \[3, 1, 1, 64, 64, 3\]"
    ):
        policy({**obs, "images": obs["images"][:, :1]})


def test_validation_reports_action_errors_token_accuracy_and_closed_loop_success(stages):
    metrics = quiet_trainer(
        stages["root"] / "validate", 1, callbacks=[ClosedLoopEval(n_episodes=3, execute_steps=6)]
    ).validate(stages["posttrain"], stages["post_data"], verbose=False)[0]
    for name in (
        "val/loss",
        "val/action_mse",
        "val/action_l1",
        "val/action_mse/gripper",
        "val/action_mse/step_5",
        "val/success_rate",
        "val/goal_distance",
    ):
        assert name in metrics, sorted(metrics)
    assert metrics["val/success_rate"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert 0.0 < metrics["val/goal_distance"] < 2.0
    tokens = quiet_trainer(stages["root"] / "test", 1).test(stages["pretrain"], stages["pre_data"], verbose=False)[0]
    assert 0.0 <= tokens["test/token_accuracy"] <= 1.0 and "test/action_mse/dq1" in tokens


@pytest.mark.parametrize("stage", ["pretrain", "posttrain"])
def test_closed_loop_evaluation_runs_under_bf16_true_and_a_policy_acts_in_its_models_dtype(stages, stage):
    """bf16-true makes bfloat16 the default dtype around the forward only; the closed-loop
    evaluation calls the Policy outside it, with float32 observations. Both model families."""
    import copy

    module, dataset = copy.deepcopy(stages[stage]), stages["pre_data" if stage == "pretrain" else "post_data"]
    metrics = quiet_trainer(
        stages["root"] / f"bf16-{stage}", 1, precision="bf16-true", callbacks=[ClosedLoopEval(n_episodes=1)]
    ).validate(module, dataset, verbose=False)[0]
    assert next(module.parameters()).dtype == torch.bfloat16
    assert metrics["val/success_rate"] in (0.0, 1.0) and 0.0 < metrics["val/goal_distance"] < 2.0

    # A Policy moved to bfloat16 takes the same float32 observations and returns float32 actions,
    # near the float32 policy's.
    policy = stages[stage].policy().eval()
    dataset.setup()
    samples = [dataset.val_sets[0][i] for i in (0, 5)]
    obs = {
        "images": torch.stack([s["images"] for s in samples]),
        "instruction": [s["instruction"] for s in samples],
        "state": torch.stack([dataset.state_normalizer.denormalize(s["state"]) for s in samples]),
    }
    noise = {"noise": torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(0))} if stage == "posttrain" else {}
    expected = policy(obs, **noise)
    actions = copy.deepcopy(policy).to(torch.bfloat16)(obs, **noise)
    assert actions.dtype == torch.float32 and actions.shape == expected.shape
    assert (actions - expected).abs().mean() < 0.1 * expected.abs().mean()


def test_predict_writes_every_frame_of_the_split(stages, tmp_path):
    module, dataset = stages["pretrain"], stages["pre_data"]
    quiet_trainer(tmp_path, 1, callbacks=[PredictionWriter(str(tmp_path / "out"))]).predict(
        module, dataset, return_predictions=False
    )
    table = pq.read_table(tmp_path / "out" / "val-rank0.parquet").to_pydict()
    frames = sum(dataset.metadata[0].episodes[e].length for e in dataset.val_episodes)
    assert len(table["frame_index"]) == frames
    assert sorted(set(table["episode_index"])) == dataset.val_episodes
    # Row 7 holds what the checkpoint's Policy (greedy decoding, deterministic) predicts for that frame.
    dataset.setup()
    sample = dataset.val_sets[0][7]
    policy = Policy.from_checkpoint(str(stages["root"] / "pretrain.ckpt"))
    obs = {
        "images": sample["images"][None],
        "state": dataset.state_normalizer.denormalize(sample["state"])[None],
        "instruction": [sample["instruction"]],
    }
    np.testing.assert_allclose(np.array(table["predicted_actions"][7]), policy(obs)[0].numpy(), atol=1e-4)
    np.testing.assert_allclose(
        np.array(table["target_actions"][7]), dataset.denormalize_actions(sample["actions"]).numpy(), atol=1e-5
    )


def test_midtraining_extends_the_context_from_a_pretrained_checkpoint(stages, caplog):
    longer = small_data(n_obs_steps=3, action_horizon=10)
    module = MidtrainModule(
        spec=longer.spec,
        network={"size": MICRO},
        normalization=longer.normalization(),
        init_from=str(stages["root"] / "pretrain.ckpt"),
    )
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        module.configure_model()
    assert "context: 1 -> 3 observation steps, 8 -> 10-step action chunks; backbone RoPE positions 0.." in caplog.text
    assert module.model.backbone.max_seq_len == module.model.cfg.seq_len > stages["pretrain"].model.backbone.max_seq_len
    torch.testing.assert_close(module.model.action_head.weight, stages["pretrain"].model.action_head.weight)
    with pytest.raises(ValueError, match="set model.init_from"):
        MidtrainModule(spec=longer.spec, network={"size": MICRO}).setup("fit")
