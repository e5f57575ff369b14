"""The model contract (``models/contract.py``), checked when a run is set up, on a network that is not
ours; and the FLOPs every tool reports, counted by torch's flop counter rather than written by hand."""

import json
import logging
import math
import random
import re
import time
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch
from research_module import TemporalConvNet, TemporalConvPolicy
from suite import QUICK, RECIPE, assert_short_error, run_main
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from uma_lightning.callbacks import ThroughputLogger, peak_flops
from uma_lightning.callbacks.peak_flops import keep_achieved_rate, resolve_peak
from uma_lightning.cli import UmaCLI
from uma_lightning.cli_errors import ConfigError
from uma_lightning.data.spec import DataSpec, example_batch
from uma_lightning.models.contract import FEATURES, PolicyNetwork, contract_problems
from uma_lightning.models.flops import flow_training_flops_per_sample, training_flops_per_sample
from uma_lightning.models.network import robot_model_config
from uma_lightning.modules import PosttrainModule, PretrainModule
from uma_lightning.modules.flops import count_training_flops

SPEC = DataSpec(
    cameras=("front",), image_size=(32, 32), state_dim=5, action_dim=3, n_obs_steps=2, action_horizon=4, fps=10
)
SIZE = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
FOREIGN = "research_module.TemporalConvPretrain"
WITHOUT_POLICY = "research_module.TemporalConvWithoutPolicy"
MISSING_PREDICT = "TemporalConvNet has no predict_actions(images, state, text_ids, text_mask, **options)"


def fit(tmp_path, module: str, *args: str, run: bool = True) -> UmaCLI:
    return UmaCLI(
        [
            *(["fit"] if run else []),
            "--config",
            RECIPE,
            *QUICK,
            "--model",
            module,
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger",
            "false",
            *args,
        ],
        run=run,
    )


def counted_on_real_tensors(module, batch) -> float:
    """FLOPs per sample of one real forward and backward of the module's loss, as torch counts them."""
    with FlopCounterMode(display=False) as counter:
        module.compute_loss(batch)["loss"].backward()
    module.model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(batch["sample_id"])


# ---- the contract, checked before the first step ------------------------------------------------


def test_a_network_without_predict_actions_stops_the_run_before_its_first_step(tmp_path, capsys):
    code, _, err = run_main(
        [
            "fit",
            "--config",
            RECIPE,
            *QUICK,
            "--model",
            WITHOUT_POLICY,
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.logger",
            "false",
        ],
        capsys,
    )
    assert_short_error(code, err, "uma: error: model: " + MISSING_PREDICT, "which validation")
    assert len([line for line in err.splitlines() if line.startswith("uma: error:")]) == 1
    assert not (tmp_path / "run" / "checkpoints").exists()  # no step ran, so nothing was saved


def test_without_validation_the_same_network_trains_and_says_once_that_policy_is_off(tmp_path, caplog):
    cli = fit(tmp_path, WITHOUT_POLICY, "--trainer.limit_val_batches", "0", run=False)
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        cli.check_network_contract(["training"])  # what before_fit asks when nothing validates
    off = [record.getMessage() for record in caplog.records if "off for this network" in record.getMessage()]
    assert off == [
        f"Policy (Policy.from_checkpoint, uma predict, RL actors): off for this network ({MISSING_PREDICT} -> "
        "normalised actions [B, horizon, action_dim])",
        "tokens per second: off for this network (TemporalConvNet has no tokens_per_sample (an int))",
    ]


@pytest.mark.parametrize(
    "feature", ["closed-loop evaluation", "prediction", "test (errors of predicted action chunks)"]
)
def test_every_feature_that_acts_names_the_missing_piece_and_is_quiet_where_it_is_there(tmp_path, feature):
    without = fit(tmp_path, WITHOUT_POLICY, run=False)
    with pytest.raises(ConfigError, match=f"^model: {re.escape(MISSING_PREDICT)}.*, which {re.escape(feature)} needs "):
        without.check_network_contract(["training", feature])
    fit(tmp_path, FOREIGN, run=False).check_network_contract(["training", feature])


def test_a_network_with_the_pieces_trains_validates_and_logs_its_counted_flops(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        cli = fit(tmp_path, FOREIGN)
    assert cli.trainer.global_step == 4
    metrics = cli.trainer.callback_metrics
    assert "val/action_mse" in metrics and torch.isfinite(metrics["val/action_mse"])  # evaluation went through Policy
    off = [r.getMessage() for r in caplog.records if "off for this network" in r.getMessage()]
    assert off == ["tokens per second: off for this network (TemporalConvPolicy has no tokens_per_sample (an int))"]
    # The FLOPs throughput divided by are the network's own, as torch counts a real step of it.
    batch = next(iter(cli.datamodule.train_dataloader()))
    counted = counted_on_real_tensors(cli.model, batch)
    assert cli.model.flops_per_sample == pytest.approx(counted, rel=0.10)
    logged = float(metrics["throughput/tflops_per_device"]) * 1e12 / float(metrics["throughput/samples_per_sec"])
    assert logged == pytest.approx(counted, rel=0.10)
    inherited = training_flops_per_sample(robot_model_config(cli.model.hparams))  # the transformer's figure
    assert counted < 0.1 * inherited
    assert sum("FLOPs: " in r.getMessage() for r in caplog.records) == 1  # counted once per run


def test_the_contract_names_a_predict_actions_that_cannot_be_called_as_policy_calls_it():
    class Network(nn.Module):
        def __init__(self):
            super().__init__()
            self.text_tokenizer = lambda instructions, device=None: None

        def forward(self, x):
            return x

        def predict_actions(self, images, state):
            return state

    problems = contract_problems(Network(), {"prediction": FEATURES["prediction"]}, {"steps": 4})
    assert list(problems.values()) == [["prediction"]]
    (problem,) = problems
    assert problem.startswith("Network.predict_actions(images, state) cannot be called as predict_actions(")
    assert isinstance(Network(), PolicyNetwork)
    assert isinstance(TemporalConvPolicy(SPEC), PolicyNetwork) and not isinstance(TemporalConvNet(SPEC), PolicyNetwork)


@pytest.mark.parametrize("module_class", [PretrainModule, PosttrainModule])
def test_our_networks_meet_every_feature_of_the_contract(module_class):
    module = module_class(spec=SPEC, network={"size": SIZE})
    assert module.network_problems(list(FEATURES)) == {}


# ---- FLOPs counted on fake tensors ------------------------------------------------------------------


def small_batch(size: int = 3) -> dict:
    batch = example_batch(SPEC, size)
    gen = torch.Generator().manual_seed(0)
    batch["actions"] = torch.rand(batch["actions"].shape, generator=gen) * 2 - 1
    batch["state"] = torch.randn(batch["state"].shape, generator=gen)
    batch["instruction"] = ["reach the red square", "go", "touch blue"][:size]
    batch["sample_id"] = torch.arange(size)
    return batch


def test_the_analytical_formulas_match_the_counted_flops_of_our_transformer(caplog):
    """The hand-written formulas that remain (the pipeline split and the planner's recompute use
    them) agree exactly with torch's count; attention counts as the dense S x S products SDPA runs,
    the flop counter's convention, not half of them for the causal part."""
    pretrain = PretrainModule(spec=SPEC, network={"size": SIZE})
    pretrain.configure_model()
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        assert pretrain.count_flops_per_sample(small_batch()) == training_flops_per_sample(pretrain.model.cfg)
    assert "counted by torch's flop counter on fake tensors" in caplog.text
    posttrain = PosttrainModule(spec=SPEC, network={"size": SIZE})
    posttrain.configure_model()
    expert = posttrain.expert_config.transformer_config(posttrain.model.cfg.backbone)
    assert posttrain.count_flops_per_sample(small_batch()) == flow_training_flops_per_sample(
        posttrain.model.cfg, expert
    )


def test_uma_plan_sizes_the_step_with_the_counted_flops():
    from uma_lightning.tools.planner.model import facts_of_stage
    from uma_lightning.tools.planner.tool import resolve

    stage, _, _ = resolve(RECIPE, ["--model.network.size", json.dumps(SIZE), "--data.generation.n_episodes", "6"])
    facts = facts_of_stage(stage)  # counted on a batch of the data's shapes: no data is read
    assert facts.flops_per_sample == training_flops_per_sample(facts.model.cfg)
    assert facts.tokens_per_sample == facts.model.cfg.seq_len


def test_a_network_in_float64_is_counted_in_its_own_dtype(caplog):
    """As ``uma parity`` runs it: the rebuilt network takes the live one's dtype, so the step runs."""
    module = PretrainModule(spec=SPEC, network={"size": SIZE})
    module.configure_model()
    module.model.double()
    batch = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in small_batch().items()}
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        assert module.count_flops_per_sample(batch) == training_flops_per_sample(module.model.cfg)
    assert "counted by torch's flop counter on fake tensors" in caplog.text


def noisy(compute_loss):
    """A loss that draws from python's and numpy's generators, as noise augmentation would."""

    def loss(batch):
        out = compute_loss(batch)
        return {**out, "loss": out["loss"] + 1e-3 * (random.random() + float(np.random.rand()))}

    return loss


@pytest.mark.parametrize("module_class", [PretrainModule, PosttrainModule])
def test_counting_leaves_the_module_its_network_and_the_random_generators_as_they_were(module_class):
    module = module_class(spec=SPEC, network={"size": SIZE})
    module.configure_model()
    network, state = module.model, (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with patch.object(module, "compute_loss", noisy(module.compute_loss)):
        assert count_training_flops(module, small_batch())[1] == "on fake tensors"
    assert module.model is network and torch.equal(torch.get_rng_state(), state[0])
    assert random.getstate() == state[1] and np.array_equal(np.random.get_state()[1], state[2])
    assert all(not p.is_meta and p.grad is None for p in network.parameters())
    # A real step after the count: no fake tensor left behind (e.g. in the attention masks' cache).
    loss = module.compute_loss(small_batch())["loss"]
    assert math.isfinite(loss.item())  # a fake loss has no value to read
    loss.backward()


def test_a_step_that_reads_values_is_counted_on_real_tensors_and_one_that_fails_is_said_once(caplog):
    experts = {**SIZE, "moe": {"n_experts": 4, "top_k": 2, "n_shared": 1, "expert_dim": 32}}
    moe = PretrainModule(spec=SPEC, network={"size": experts})
    moe.configure_model()
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        assert moe.count_flops_per_sample(small_batch()) == training_flops_per_sample(moe.model.cfg)
    assert "counted by torch's flop counter on real tensors, since the step cannot run on fake ones" in caplog.text

    class Broken(PretrainModule):
        def compute_loss(self, batch):
            raise RuntimeError("a loss that never runs")

    broken = Broken(spec=SPEC, network={"size": SIZE})
    caplog.clear()
    assert broken.count_flops_per_sample(small_batch()) is None and broken.count_flops_per_sample(small_batch()) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "FLOPs off for this network: its training step cannot be counted (RuntimeError: a loss that never runs); no MFU"
    ]


def test_the_example_batch_has_the_layout_of_a_real_batch(tmp_path):
    cli = fit(tmp_path, FOREIGN, run=False)
    cli.datamodule.setup("fit")
    real = next(iter(cli.datamodule.train_dataloader()))
    example = example_batch(cli.datamodule.spec, len(real["sample_id"]))
    assert example.keys() == real.keys()
    for key, value in real.items():
        if torch.is_tensor(value):
            assert (example[key].shape, example[key].dtype) == (value.shape, value.dtype), key
        else:
            assert len(example[key]) == len(value)


# ---- the CPU peak: never below a rate achieved on the host ------------------------------------------


def test_a_rate_achieved_above_the_probed_peak_raises_it_for_later_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_flops, "probe_tflops", lambda device, dtype: 0.5)
    cpu = torch.device("cpu")
    assert resolve_peak(cpu, "32-true")[0] == 0.5
    assert keep_achieved_rate(cpu, "32-true", 0.75) == 0.75
    assert keep_achieved_rate(cpu, "32-true", 0.6) == 0.75  # the best figure is kept
    assert resolve_peak(cpu, "32-true")[0] == 0.75
    assert resolve_peak(cpu, "bf16-true")[0] == 0.5  # another dtype keeps its own
    assert sorted(json.loads((tmp_path / "peak_tflops.json").read_text()).values()) == [0.5, 0.75]


def test_a_peak_below_the_achieved_rate_is_raised_once_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_flops, "probe_tflops", lambda device, dtype: 1e-9)  # a probe on a very busy machine
    logger, logged = ThroughputLogger(), []
    module = SimpleNamespace(
        count_flops_per_sample=lambda batch: 10**9,
        tokens_per_sample=None,
        device=torch.device("cpu"),
        log_dict=lambda rates, batch_size: logged.append(rates),
    )
    trainer = SimpleNamespace(
        world_size=1, global_rank=0, strategy=None, precision="32-true", is_global_zero=True, loggers=[], logger=None
    )
    logger.on_train_start(trainer, module)
    batch = {"sample_id": torch.arange(4)}
    for step in range(5):
        logger.on_train_batch_start(trainer, module, batch, step)
        time.sleep(0.003 * (5 - step))  # faster every step: each one is above the peak the one before set
        logger.on_train_batch_end(trainer, module, None, batch, step)
    assert len(logged) == 4 and all(rates["throughput/mfu_percent"] <= 100.0 + 1e-9 for rates in logged)
    above = [r.getMessage() for r in caplog.records if "above the peak" in r.getMessage()]
    assert len(above) == 1 and "the best rate achieved is the peak from now on, kept for later runs" in above[0]
    best = max(rates["throughput/tflops_per_device"] for rates in logged)
    assert resolve_peak(torch.device("cpu"), "32-true")[0] == 1e-9  # kept when training ends, not between steps
    logger.on_train_end(trainer, module)
    assert resolve_peak(torch.device("cpu"), "32-true")[0] == pytest.approx(best)  # what the next run starts from
