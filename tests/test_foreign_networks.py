"""Networks unlike ours (``foreign_networks.py``), with no plan code, under every data-parallel
strategy: the units the generic plan wraps, tp/pp/ep refused without a layout, a plan that leaves a
dimension unsharded refused, and ``uma parity`` right both ways, or naming a float32-only network."""

import json
import logging
import re

import pytest
import torch
from foreign_networks import DenoiserMLP, MixtureOfMLPs, MixturePretrain, TemporalConvPolicy
from lightning.pytorch import Trainer
from suite import QUICK, RECIPE, SPEC, assert_short_error, parity_case, run_main
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from uma_lightning.parallel import MeshShape, MeshStrategy, ParallelConfig, register_plan, register_strategies
from uma_lightning.parallel.apply import apply_ac
from uma_lightning.parallel.mesh import build_mesh
from uma_lightning.parallel.plans.generic import data_parallel_units

register_strategies()


def test_units_are_the_largest_group_of_repeated_blocks_or_those_the_network_names():
    denoiser = DenoiserMLP(4, 6)
    units, why = data_parallel_units(denoiser)
    assert units == list(denoiser.blocks) and why.startswith("3 x ResidualMLP in blocks")
    mixture = MixtureOfMLPs(8, 6)  # its experts, not the two linear layers inside each expert
    assert data_parallel_units(mixture)[0] == list(mixture.experts)
    temporal = TemporalConvPolicy(8, 6)
    units, why = data_parallel_units(temporal)
    assert units == list(temporal.blocks) and "TemporalConvPolicy._no_split_modules names (TemporalBlock)" in why

    class Named(DenoiserMLP):
        def fsdp_units(self):
            return [self.embed, self.out]

    named = Named(4, 6)
    assert data_parallel_units(named) == ([named.embed, named.out], "2 unit(s) named by Named.fsdp_units()")
    units, why = data_parallel_units(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Conv1d(3, 3, 1)))
    assert units == [] and "no repeated blocks" in why


def test_activation_checkpointing_on_found_units_keeps_the_gradients():
    torch.manual_seed(0)
    plain = DenoiserMLP(4, 6)
    checkpointed = DenoiserMLP(4, 6)
    checkpointed.load_state_dict(plain.state_dict())
    assert "on 3 of 3 blocks" in apply_ac(
        data_parallel_units(checkpointed)[0], ParallelConfig(activation_checkpointing="full")
    )
    inputs = (torch.randn(5, 4), torch.randn(5, 6), torch.rand(5))
    for model in (plain, checkpointed):
        model(*inputs).square().sum().backward()
    for (name, expected), actual in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(actual.grad, expected.grad, msg=name)


def _strategy(name: str, devices: int = 2) -> MeshStrategy:
    return Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False).strategy


def test_tp_pp_and_ep_without_a_layout_are_refused_before_any_work_naming_what_to_declare():
    module = MixturePretrain(spec=SPEC)  # built on the meta device for the check
    for name, devices in (("ddp", 2), ("fsdp", 2), ("hsdp", 4)):
        _strategy(name, devices).check_module(module)
    refusals = {
        "tp": r"^tp 2: MixtureOfMLPs has no registered plan and declares no tensor-parallel layout; give it tp_plan = ",
        "pp": r"^pp 2: the generic plan of MixtureOfMLPs has no pipeline split; register a plan with one",
        "ep": r"^ep 2: MixtureOfMLPs has no registered plan, and expert parallelism has no layout as data",
    }
    for name, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            _strategy(name).check_module(module, batch_size=4)


def test_a_declared_tensor_layout_is_checked_against_the_network():
    strategy = _strategy("tp")
    strategy.check_module(nn.ModuleDict({"model": DenoiserMLP(4, 6)}))

    class Odd(DenoiserMLP):
        tp_plan = {"blocks.*.fc1": "colwise", "embed": "rowwise"}

    with pytest.raises(
        ValueError, match=r"^tp 2 does not divide the 11 input features of embed \(rowwise in Odd.tp_plan\)"
    ):
        strategy.check_module(nn.ModuleDict({"model": Odd(4, 6)}))

    class Misspelt(DenoiserMLP):
        tp_plan = {"block.*.fc1": "colwise"}

    with pytest.raises(ValueError, match=r"^Misspelt.tp_plan\['block.\*.fc1'\] matches no module of Misspelt$"):
        strategy.check_module(nn.ModuleDict({"model": Misspelt(4, 6)}))


class IgnoresTensorParallel(DenoiserMLP):
    """A network whose registered plan lays nothing out (it ignores tp)."""


def _parallelize_nothing(model, mesh, config) -> list[str]:
    return []


register_plan(IgnoresTensorParallel, _parallelize_nothing, lambda model, shape, config: None, name="tp-ignoring")


@pytest.fixture
def two_rank_mesh():
    """A world of two ranks in this process (torch's fake process group: collectives do nothing),
    enough to lay parameters out on a tp 2 mesh and look at them."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        shape = MeshShape(dp_replicate=1, dp_shard=1, tp=2)
        yield shape, build_mesh(shape, "cpu")
    finally:
        dist.destroy_process_group()


def test_a_plan_that_leaves_tp_unsharded_is_refused(two_rank_mesh, caplog):
    shape, mesh = two_rank_mesh
    strategy = MeshStrategy()
    strategy.shape, strategy._device_mesh = shape, mesh
    with pytest.raises(ValueError, match=r"^the tp-ignoring plan left IgnoresTensorParallel unsharded on tp 2 of mesh"):
        strategy._parallelize(nn.ModuleDict({"model": IgnoresTensorParallel(4, 6)}), bf16_params=False)
    # Quiet on a plan that lays tp out: the generic one, from the network's tp_plan.
    with caplog.at_level(logging.INFO, logger="uma_lightning"):
        strategy._parallelize(nn.ModuleDict({"model": DenoiserMLP(4, 6)}), bf16_params=False)
    assert "parallel plan generic on DenoiserMLP: units: 3 x ResidualMLP in blocks" in caplog.text
    assert "tensor parallel over 2 ranks: 6 linear layers from DenoiserMLP.tp_plan" in caplog.text


def test_parity_names_a_network_that_cannot_run_in_float64(capsys):
    args = ["parity", "--config", RECIPE, "--strategies", "ddp", "--steps", "1",
            "--model", "foreign_networks.FloatCastingPretrain", "--model.network.size", "tiny",
            "--data.generation.n_episodes", "6", "--data.loader.num_workers", "0", "--data.batch_size", "4"]  # fmt: skip
    code, _, err = run_main(args, capsys)
    assert_short_error(
        code,
        err,
        "uma parity: error: ",
        "FloatCastingPretrain cannot run in float64",
        "mat1 and mat2 must have the same dtype",
        "at foreign_networks.py:",
        "(forward)",
        "cast to the parameters' dtype instead",
    )


FOREIGN = {
    "denoiser": "foreign_networks.DenoiserPretrain",
    "mixture": "foreign_networks.MixturePretrain",
    "temporal": "foreign_networks.TemporalConvPretrain",
}
# A parameter of each whose gradient the seeded bug drops.
SKIPPED = {
    "denoiser": "model.blocks.1.fc2.weight",
    "mixture": "model.experts.2.0.weight",
    "temporal": "model.blocks.0.conv.weight",
}
TEMPORAL_STEPS = ("--data.n_obs_steps", "3")  # convolutions over three observation steps


def _foreign_case(label: str, strategies: str, *overrides: str, **strategy_args):
    network = label.split()[0]
    extra = TEMPORAL_STEPS if network == "temporal" else ()
    return parity_case(label, strategies, *extra, *overrides, module=FOREIGN[network], **strategy_args)


@pytest.mark.slow(seconds=45)
@pytest.mark.crowd
def test_foreign_networks_match_one_process_under_every_data_parallel_strategy_and_a_seeded_bug_is_located():
    """One launch of two processes and one of four: each network under ddp, fsdp and hsdp (the
    denoiser also under tp, from its declared layout; the convolution also with checkpointed,
    compiled blocks), and for each a dropped gradient, named."""
    from uma_lightning.tools.parity import check_parity

    switches = ParallelConfig(activation_checkpointing="full", compile="blocks", compile_backend="aot_eager")
    cases = [
        _foreign_case("denoiser", "ddp,fsdp,tp,hsdp"),
        _foreign_case("mixture", "ddp,fsdp,hsdp"),
        _foreign_case("temporal", "ddp,fsdp,hsdp"),
        _foreign_case("temporal switches", "fsdp", wrapping=switches),
        *(
            _foreign_case(
                f"{network} bug",
                "ddp,fsdp,hsdp",
                "--model.init_args.skip_gradient",
                SKIPPED[network],
            )  # fmt: skip
            for network in FOREIGN
        ),
        _foreign_case("denoiser tp bug", "tp", "--model.init_args.skip_gradient", "model.blocks.0.fc1.weight"),
    ]
    results = check_parity(cases)
    for label in ("denoiser", "mixture", "temporal", "temporal switches"):
        for strategy, result in results[label].items():
            assert result["ok"], (label, strategy, result)
            assert result["margin"] > 1e3, (label, strategy, result["margin"])
    for network, parameter in SKIPPED.items():
        for strategy, result in results[f"{network} bug"].items():
            assert not result["ok"] and result["parts_ways_at"] == parameter, (network, strategy, result)
    tp_bug = results["denoiser tp bug"]["tp"]
    assert not tp_bug["ok"] and tp_bug["parts_ways_at"] == "model.blocks.0.fc1.weight"


def test_plan_sizes_a_network_outside_the_robot_family_for_the_data_parallel_strategies(capsys):
    from uma_lightning.tools.planner.tool import resolve

    recipe = ["--model", "foreign_networks.MixturePretrain", "--data.generation.n_episodes", "6"]
    code, out, _ = run_main(
        ["plan", "--config", RECIPE, *recipe, "--gpu", "cpu", "--gpus-per-node", "2", "--json"], capsys
    )
    plan = json.loads(out)
    network = resolve(RECIPE, recipe)[0].build_model()
    assert code == 0 and plan["model"]["network"] == "MixtureOfMLPs"
    assert plan["model"]["parameters"] == sum(p.numel() for p in network.parameters())
    layouts = {(e["layout"]["dp_replicate"], e["layout"]["dp_shard"], e["layout"]["ac"]) for e in plan["ranked"]}
    assert layouts == {(2, 1, "none"), (1, 2, "none")}  # ddp and fsdp; tp refused for want of a tp_plan
    assert any("declares no tensor-parallel layout" in e["reason"] for e in plan["rejected"] if e["layout"]["tp"] == 2)
    memory = plan["recommended"]["memory_bytes"]
    assert plan["recommended"]["strategy"] == "ddp" and memory["parameters"] == 4 * plan["model"]["parameters"]
    assert memory["activations"] > 0
    # The network has no tokens: its throughput is counted in samples, and said so.
    assert plan["model"]["tokens_per_sample"] is None and plan["model"]["throughput_unit"] == "samples"
    recommended = plan["recommended"]
    assert "tokens_per_s" not in recommended
    assert recommended["samples_per_s"] == plan["settings"]["global_batch"] / recommended["step_s"]


def test_plan_of_a_network_without_tokens_reports_samples_per_second(capsys):
    recipe = ["--model", "foreign_networks.MixturePretrain", "--data.generation.n_episodes", "6"]
    code, out, _ = run_main(["plan", "--config", RECIPE, *recipe, "--gpu", "cpu", "--gpus-per-node", "2"], capsys)
    assert code == 0
    assert "B parameters, no tokens_per_sample (throughput in samples/s), " in out
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["#", "layout"])
    assert header[-1] == "samples/s"
    assert re.search(r"^recommended: .* est\. [\d,]+ samples/s, ", out, re.M), out
    assert "tokens" not in out.replace("no tokens_per_sample", ""), out


@pytest.mark.slow(seconds=20)
def test_plan_predictions_for_networks_outside_the_robot_family_match_a_real_gloo_step():
    """One launch of two gloo processes: each foreign network under ddp and fsdp, and the denoiser
    under tp from its tp_plan, each rank's state bytes exact, its collectives within 5 % and its saved
    activations (traced at other batch sizes, on fake tensors where the step runs on them) within 20 %."""
    from foreign_networks import DenoiserPretrain, TemporalConvPretrain

    from uma_lightning.tools.planner.check import compare
    from uma_lightning.tools.planner.layout import Layout

    modules = {"denoiser": DenoiserPretrain, "mixture": MixturePretrain, "temporal": TemporalConvPretrain}
    layouts = {"ddp": Layout(dp_replicate=2), "fsdp": Layout(dp_shard=2)}
    cases = {f"{name} {strategy}": (module(spec=SPEC), layout) for name, module in modules.items() for strategy, layout in layouts.items()}  # fmt: skip
    cases["denoiser tp"] = (DenoiserPretrain(spec=SPEC), Layout(tp=2))
    results = compare(cases, global_batch=8, world_size=2)
    for name, ranks in results.items():
        for rank, result in enumerate(ranks):
            measured, predicted = result["measured"], result["predicted"]
            for part in ("params", "grads", "optimizer"):
                assert measured[part] == predicted[part], (name, rank, part, measured[part], predicted[part])
            assert measured["collectives"].keys() == predicted["collectives"].keys(), (name, measured, predicted)
            for kind, size in measured["collectives"].items():
                assert predicted["collectives"][kind] == pytest.approx(size, rel=0.05), (name, kind)
            assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.2), (name, rank)


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("network, strategy", [("denoiser", "hsdp"), ("mixture", "ddp"), ("temporal", "fsdp")])
def test_each_network_trains_through_uma_fit_on_two_processes_logs_its_flops_and_acts_through_policy(
    tmp_path, network, strategy
):
    """``uma fit`` on two gloo processes (hsdp shards within the node: two processes are one node), its
    MLflow run's FLOPs per sample within 10 % of torch's count of a real step, and its checkpoint
    rebuilt by ``Policy.from_checkpoint`` with the trained weights, acting bit for bit as the module."""
    import foreign_networks
    import forked_cli
    from mlflow.tracking import MlflowClient
    from rank_digest import digest_of

    from uma_lightning.checkpoint.weights import load_weights, read_checkpoint
    from uma_lightning.data.spec import example_batch
    from uma_lightning.policy import Policy

    digests = {"class_path": "rank_digest.RankDigest", "init_args": {"out_dir": str(tmp_path / "digests")}}
    argv = ["fit", "--config", RECIPE, *QUICK, "--model", FOREIGN[network], *(TEMPORAL_STEPS if network == "temporal" else ()),
            "--trainer.devices", "2", "--trainer.strategy", strategy, "--trainer.accelerator", "cpu",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.callbacks+", json.dumps(digests),
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]  # fmt: skip
    codes = forked_cli.run_as_ranks(argv, tmp_path / "job.log", tmp_path, timeout=300)
    assert codes == [0, 0], (tmp_path / "job.log").read_text()[-3000:]
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-000000002")
    source = read_checkpoint(checkpoint)
    module = getattr(foreign_networks, FOREIGN[network].rpartition(".")[2])(**source.hparams)
    module.model = module.build_model()
    load_weights(module.model, source)
    # FLOPs: what MLflow logged, against torch's count of a real step of the same network.
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs(client.get_experiment_by_name("pretrain").experiment_id)
    tflops, samples = (run.data.metrics[f"throughput/{name}"] for name in ("tflops_per_device", "samples_per_sec"))
    batch = example_batch(module.spec, 4)
    with FlopCounterMode(display=False) as counter:
        module.compute_loss(batch)["loss"].backward()
    assert tflops * 1e12 * 2 / samples == pytest.approx(counter.get_total_flops() / 4, rel=0.10)
    # Policy: the trained weights (as both ranks held them at the end), acting as the module does.
    policy = Policy.from_checkpoint(checkpoint)
    trained = json.loads((tmp_path / "digests" / "rank0.json").read_text())["digest"]
    assert digest_of((f"model.{name}", p) for name, p in policy.model.named_parameters()) == trained
    generator = torch.Generator().manual_seed(0)
    spec = module.spec
    observation = {
        "images": torch.randint(0, 256, (3, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3), dtype=torch.uint8, generator=generator),
        "state": torch.randn(3, spec.n_obs_steps, spec.state_dim, generator=generator),
        "instruction": ["reach the red square"] * 3,
    }  # fmt: skip
    assert torch.equal(policy(observation), module.policy().eval()(observation))
