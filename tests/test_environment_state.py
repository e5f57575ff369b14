"""The auxiliary environment-state objective: the generator records where the named target is, batches
carry it normalised, a head on the last observation token predicts it from the prefix alone, the
stage modules add its weighted error to their loss, and stages with and without the head start from
each other's checkpoints."""

import dataclasses
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from suite import random_inputs, small_config
from torch.utils.flop_counter import FlopCounterMode

from uma_lightning.checkpoint.weights import CheckpointWeights, load_weights
from uma_lightning.data import RobotDataModule
from uma_lightning.data.dataset import FrameDataset
from uma_lightning.data.generate import ensure_dataset
from uma_lightning.data.lerobot import ENV_STATE_KEY, DatasetError, LeRobotMetadata
from uma_lightning.data.writer import LeRobotWriter
from uma_lightning.kernels import KernelConfig
from uma_lightning.models import RobotModelConfig, RobotTransformer, count_parameters, training_flops_per_sample
from uma_lightning.models.flops import flow_training_flops_per_sample
from uma_lightning.models.flow import ActionExpertConfig, RobotFlowTransformer
from uma_lightning.modules import PosttrainModule, PretrainModule
from uma_lightning.sim import PlanarArmConfig

MICRO = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}


def with_head(cfg: RobotModelConfig) -> RobotModelConfig:
    return dataclasses.replace(
        cfg, spec=dataclasses.replace(cfg.spec, environment_state_dim=2), environment_state_head=True
    )


# ---- data -----------------------------------------------------------------------------------------


def test_generated_episodes_record_where_the_named_target_is(tmp_path):
    meta = LeRobotMetadata.load(ensure_dataset(n_episodes=4, image_size=32, seed=1, cache_dir=tmp_path))
    assert meta.environment_state_dim == 2 and meta.features[ENV_STATE_KEY]["names"] == ["goal_x", "goal_y"]
    goals = []
    for episode in range(4):
        data = meta.read_episode(episode)
        goal = data.environment_state[0]
        assert np.array_equal(data.environment_state, np.tile(goal, (len(data.state), 1)))  # the target does not move
        # The expert's demonstrations end with the gripper on the named target: the last recorded
        # end-effector position (state ee_x, ee_y) is next to it.
        assert np.linalg.norm(data.state[-1, 2:4] - goal) < 2 * PlanarArmConfig().success_radius
        goals.append(goal)
    assert len({tuple(g) for g in goals}) == 4


def test_batches_carry_the_normalised_environment_state(tmp_path):
    dm = RobotDataModule(
        generation={"n_episodes": 4, "image_size": 32, "cache_dir": str(tmp_path)},
        batch_size=6,
        loader={"num_workers": 0},
        val_episodes=1,
    )
    assert dm.spec.environment_state_dim == 2
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    meta = dm.metadata[0]
    mean, std = meta.stats[ENV_STATE_KEY]["mean"], meta.stats[ENV_STATE_KEY]["std"]
    assert batch["environment_state"].shape == (6, 2) and batch["environment_state"].dtype == torch.float32
    for sample, episode, frame in zip(batch["environment_state"], batch["episode_index"], batch["frame_index"]):
        raw = meta.read_episode(int(episode)).environment_state[int(frame)]
        np.testing.assert_allclose(sample.numpy(), (raw - mean) / std, rtol=1e-5, atol=1e-6)


def write_planar_dataset(root, environment_state_names=(), **episode):
    writer = LeRobotWriter(root, fps=10, cameras=("cam",), image_size=(8, 8), state_names=["a", "b"], action_names=["u"],
                           environment_state_names=environment_state_names)  # fmt: skip
    frames = {"cam": np.zeros((3, 8, 8, 3), dtype=np.uint8)}
    writer.add_episode(frames, np.zeros((3, 2)), np.zeros((3, 1)), "reach", **episode)
    return writer


def test_writer_checks_the_environment_state(tmp_path):
    with pytest.raises(
        ValueError, match=f"episode 0: {ENV_STATE_KEY} given, but the writer was created without its names"
    ):
        write_planar_dataset(tmp_path / "a", environment_state=np.zeros((3, 2)))
    with pytest.raises(ValueError, match=f"episode 0: {ENV_STATE_KEY} is missing"):
        write_planar_dataset(tmp_path / "b", environment_state_names=["x", "y"])
    with pytest.raises(ValueError, match=re.escape(f"episode 0: {ENV_STATE_KEY} must be [T >= 1, 2], got (3, 3)")):
        write_planar_dataset(tmp_path / "c", environment_state_names=["x", "y"], environment_state=np.zeros((3, 3)))
    with pytest.raises(ValueError, match=f"episode 0: 3 states but 2 rows of {ENV_STATE_KEY}"):
        write_planar_dataset(tmp_path / "d", environment_state_names=["x", "y"], environment_state=np.zeros((2, 2)))


def test_data_without_environment_state_cannot_feed_the_loss(tmp_path):
    root = write_planar_dataset(tmp_path / "plain").finalize()
    meta = LeRobotMetadata.load(root)
    assert meta.environment_state_dim == 0
    assert meta.read_episode(0).action.shape == (3, 1)  # a one-element vector, stored as a scalar column
    assert "environment_state" not in FrameDataset(meta, action_horizon=2)[0]
    with pytest.raises(DatasetError, match=f"{root}: no '{ENV_STATE_KEY}' feature with statistics"):
        FrameDataset(meta, environment_state=True)
    spec = RobotDataModule(root=str(root), loader={"num_workers": 0}, val_episodes=0, action_horizon=2).spec
    assert spec.environment_state_dim == 0
    with pytest.raises(
        ValueError, match="environment_state_weight 0.5 needs data that records observation.environment_state"
    ):
        PretrainModule(spec=spec, network={"size": MICRO, "environment_state_weight": 0.5})
    with pytest.raises(ValueError, match="environment_state_weight must be >= 0, got -1"):
        PretrainModule(
            spec=dataclasses.replace(spec, environment_state_dim=2),
            network={"size": MICRO, "environment_state_weight": -1},
        )


# ---- models ---------------------------------------------------------------------------------------


def test_the_head_reads_the_observations_only():
    torch.manual_seed(0)
    model = RobotTransformer(with_head(small_config())).eval()
    images, state, text_ids, text_mask, actions = random_inputs(model)
    with torch.no_grad():
        _, predicted = model(images, state, text_ids, text_mask, actions, with_environment_state=True)
        assert predicted.shape == (3, 2)
        # The same as from the prefix encoded alone: the actions after it do not leak in.
        hidden, _ = model.encode_prefix(images, state, text_ids, text_mask)
        torch.testing.assert_close(predicted, model.predict_environment_state(hidden[:, -1]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            model(images, state, text_ids, text_mask, actions.flip(1), with_environment_state=True)[1], predicted
        )
        garbage = text_ids.masked_fill(~text_mask, 17)
        torch.testing.assert_close(
            model(images, state, garbage, text_mask, actions, with_environment_state=True)[1], predicted
        )
        assert not torch.allclose(
            model(images.flip(0), state, text_ids, text_mask, actions, with_environment_state=True)[1], predicted
        )

    flow = RobotFlowTransformer(with_head(small_config()), ActionExpertConfig(dim=32)).eval()
    noisy, t = torch.randn(3, 4, 3), torch.rand(3)
    with torch.no_grad():
        velocity, predicted = flow(images, state, text_ids, text_mask, noisy, t, with_environment_state=True)
        torch.testing.assert_close(velocity, flow(images, state, text_ids, text_mask, noisy, t))
        torch.testing.assert_close(
            flow(images, state, text_ids, text_mask, -noisy, 1 - t, with_environment_state=True)[1], predicted
        )
    assert flow.backbone.norm.weight.requires_grad  # the head reads the final hidden states, through the final norm
    with pytest.raises(ValueError, match="environment_state_head needs data that records an environment state"):
        RobotModelConfig(backbone=small_config().backbone, spec=small_config().spec, environment_state_head=True)


def test_the_head_is_counted_in_parameters_and_training_flops():
    cfg = with_head(small_config())
    model = RobotTransformer(cfg)
    assert (
        count_parameters(cfg) == sum(p.numel() for p in model.parameters()) == count_parameters(small_config()) + 65 * 2
    )
    model.backbone.set_kernels(KernelConfig(attention="reference"))  # plain matmuls, which the counter sees one by one
    images, state, text_ids, text_mask, actions = random_inputs(model)
    with FlopCounterMode(display=False) as counter:
        logits, predicted = model(images, state, text_ids, text_mask, actions, with_environment_state=True)
        (F.cross_entropy(logits.flatten(0, 1), actions.flatten()) + predicted.square().mean()).backward()
    assert counter.get_total_flops() == 3 * training_flops_per_sample(cfg)

    flow = RobotFlowTransformer(cfg, ActionExpertConfig(dim=32, ffn_dim=48))
    flow.set_kernels(KernelConfig(attention="reference"))
    noisy, t = torch.randn(3, 4, 3), torch.rand(3)
    with FlopCounterMode(display=False) as counter:
        velocity, predicted = flow(images, state, text_ids, text_mask, noisy, t, with_environment_state=True)
        (F.mse_loss(velocity, noisy) + predicted.square().mean()).backward()
    assert counter.get_total_flops() == 3 * flow_training_flops_per_sample(cfg, flow.expert_config)


# ---- stage modules --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    dm = RobotDataModule(
        generation={"n_episodes": 4, "image_size": 32, "cache_dir": str(tmp_path_factory.mktemp("cache"))},
        batch_size=5,
        loader={"num_workers": 0},
        val_episodes=1,
    )
    dm.setup("fit")
    return dm, next(iter(dm.train_dataloader()))


@pytest.mark.parametrize("module_class", [PretrainModule, PosttrainModule])
def test_the_loss_adds_the_weighted_environment_state_error(embedded, module_class):
    dm, batch = embedded
    modules = {}
    for weight in (0.0, 0.5):
        torch.manual_seed(0)
        modules[weight] = module_class(
            spec=dm.spec, network={"size": MICRO, "environment_state_weight": weight}, normalization=dm.normalization()
        )
        modules[weight].configure_model()
    plain, weighted = modules[0.0], modules[0.5]
    plain.model.load_state_dict(weighted.model.state_dict(), strict=False)  # the same weights, less the head
    torch.manual_seed(1)
    without = plain.compute_loss(batch)
    torch.manual_seed(1)  # the same flow-matching noise and times
    out = weighted.compute_loss(batch)
    assert "environment_state_mse" not in without
    torch.testing.assert_close(out["action_loss"], without["loss"].detach())
    model = weighted.model
    text_ids, text_mask = model.text_tokenizer(batch["instruction"])
    hidden, _ = model.encode_prefix(batch["images"], batch["state"], text_ids, text_mask)
    expected = F.mse_loss(model.predict_environment_state(hidden[:, -1]), batch["environment_state"])
    torch.testing.assert_close(out["environment_state_mse"], expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], without["loss"] + 0.5 * expected, atol=1e-5, rtol=1e-5)
    out["loss"].backward()
    assert model.environment_state_head.weight.grad.abs().sum() > 0
    assert weighted.hparams.network["environment_state_weight"] == 0.5


def test_stages_with_and_without_the_head_start_from_each_other(embedded):
    dm, _ = embedded
    spec = dm.spec
    torch.manual_seed(0)
    pretrained = PretrainModule(spec=spec, network={"size": MICRO, "environment_state_weight": 1.0}).build_model()
    source = CheckpointWeights(
        "pretrain.ckpt", {}, {k: v.clone() for k, v in pretrained.state_dict().items()}, ema=False, module_class=None
    )
    for weight in (1.0, 0.0):
        module = PosttrainModule(spec=spec, network={"size": MICRO, "environment_state_weight": weight})
        model = module.build_model()
        load_weights(model, source, module.key_mapping)
        torch.testing.assert_close(model.backbone.layers[1].ffn.w2.weight, pretrained.backbone.layers[1].ffn.w2.weight)
        if weight:
            torch.testing.assert_close(model.environment_state_head.weight, pretrained.environment_state_head.weight)
        else:
            assert model.environment_state_head is None
    # And the other way: a head the checkpoint lacks starts fresh.
    plain = PretrainModule(spec=spec, network={"size": MICRO}).build_model()
    source = CheckpointWeights("pretrain.ckpt", {}, plain.state_dict(), ema=False, module_class=None)
    module = PretrainModule(spec=spec, network={"size": MICRO, "environment_state_weight": 1.0})
    load_weights(module.build_model(), source, module.key_mapping)
