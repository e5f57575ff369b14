"""Hugging Face weights in and out (``checkpoint/hf.py``): a directory ``save_pretrained`` wrote, in
several shard files, streamed into a network holding the ``transformers`` model, bitwise, under every
layout (plain, FSDP, tensor parallel) and within the memory of this rank's parameters and one shard
file; a directory that does not fit stopped in one line naming the key; and a run's checkpoint
exported back to a directory ``from_pretrained`` loads, with the logits of our model."""

import ctypes
import gc
import json
import os
import shutil
from pathlib import Path

import forked_cli
import pytest
import torch
from safetensors.torch import load_file, save_file
from suite import QUICK, RECIPE, assert_short_error, free_port, recipe, run_main, small_config
from torch import nn

from uma_lightning.checkpoint.hf import (
    INDEX_FILE,
    check_hf_weights,
    export_hf_directory,
    load_hf_weights,
    read_hf_directory,
)
from uma_lightning.cli import UmaCLI
from uma_lightning.models import RobotTransformer
from uma_lightning.models.vlm import import_transformers
from uma_lightning.policy import Policy

transformers = import_transformers()


class Holder(nn.Module):
    """A network holding a ``transformers`` model below the top, beside a parameter of its own."""

    hf_prefix = "backbone.vlm"

    def __init__(self, config):
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.vlm = transformers.AutoModelForImageTextToText.from_config(config)
        self.state_proj = nn.Linear(3, 8)


def holder_of(directory: Path, meta: bool = False) -> Holder:
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta" if meta else "cpu"):
        return Holder(config)


def sharded_copy(directory: Path, output: Path, max_shard_size: str = "100KB") -> Path:
    """``directory``'s model saved again by transformers in shard files of at most ``max_shard_size``."""
    if not output.exists():
        model = transformers.AutoModelForImageTextToText.from_pretrained(directory)
        model.save_pretrained(output, max_shard_size=max_shard_size)
    return output


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {key: value for file in sorted(directory.glob("*.safetensors")) for key, value in load_file(file).items()}


@pytest.mark.parametrize("family", ["idefics3", "paligemma"])
def test_each_family_streams_in_shard_by_shard_as_from_pretrained_loads_it(tiny_vlms, tmp_path, family):
    directory = sharded_copy(tiny_vlms[family], tmp_path / family)
    assert len(list(directory.glob("*.safetensors"))) >= 3
    torch.manual_seed(1)
    network = holder_of(directory)
    own = network.state_proj.weight.clone()
    load_hf_weights(network, read_hf_directory(directory))

    reference = transformers.AutoModelForImageTextToText.from_pretrained(tiny_vlms[family]).state_dict()
    loaded = network.backbone.vlm.state_dict()
    assert loaded.keys() == reference.keys()
    assert [key for key in reference if not torch.equal(loaded[key], reference[key])] == []
    assert torch.equal(network.state_proj.weight, own)  # not the transformers model's: its initialisation stays


# ---- what does not fit: one line, naming the key and the file -----------------------------------


def rewritten(directory: Path, output: Path, change) -> Path:
    """A copy of ``directory`` with its shard file holding the first language-model layer's query
    projection changed by ``change(tensors, key)``; the index is rewritten to match."""
    shutil.copytree(directory, output)
    index = json.loads((output / INDEX_FILE).read_text())
    key = next(k for k in index["weight_map"] if "layers.0.self_attn.q_proj.weight" in k and "vision" not in k)
    file = output / index["weight_map"][key]
    tensors = load_file(file)
    change(tensors, key)
    save_file(tensors, file, metadata={"format": "pt"})
    index["weight_map"] = {
        k: f for k, f in index["weight_map"].items() if k in tensors or f != file.name
    } | dict.fromkeys(tensors, file.name)
    (output / INDEX_FILE).write_text(json.dumps(index))
    return output


def drop(tensors, key):
    del tensors[key]


def add(tensors, key):
    tensors[key.replace("q_proj", "extra_proj")] = tensors[key].clone()


def reshape(tensors, key):
    tensors[key] = tensors[key][:-1].contiguous()


@pytest.mark.parametrize(
    "case, change, fragments",
    [
        ("missing", drop, ["q_proj.weight is missing from", "(the model's backbone.vlm."]),
        ("unexpected", add, ["extra_proj.weight of", ".safetensors is not in Holder"]),
        ("reshaped", reshape, ["q_proj.weight of", ".safetensors has shape [63, 64], the model's backbone.vlm."]),
    ],
)
def test_a_directory_that_does_not_fit_stops_in_one_line_naming_the_key_and_file(
    tiny_vlms, tmp_path, case, change, fragments
):
    directory = sharded_copy(tiny_vlms["idefics3"], tmp_path / "sharded")
    network = holder_of(directory, meta=True)
    check_hf_weights(network, read_hf_directory(directory))  # the directory as saved fits: nothing said
    broken = rewritten(directory, tmp_path / case, change)
    with pytest.raises(ValueError) as error:
        check_hf_weights(network, read_hf_directory(broken))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{broken}: cannot initialise Holder from it: ")
    assert all(fragment in message for fragment in fragments), message


def test_a_network_without_a_transformers_model_is_told_so(tiny_vlms):
    with torch.device("meta"):
        network = RobotTransformer(small_config())
    with pytest.raises(ValueError, match=r"^RobotTransformer holds no Hugging Face model \(it has no hf_prefix"):
        check_hf_weights(network, read_hf_directory(tiny_vlms["idefics3"]))


def test_another_familys_directory_stops_init_from_before_training(tiny_vlms, tmp_path, capsys):
    common = ["fit", "--config", RECIPE, *QUICK, "--trainer.logger", "false",
              "--model.network.pretrained", str(tiny_vlms["idefics3"]), "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    code, _, err = run_main([*common, "--model.init_from", str(tiny_vlms["paligemma"])], capsys)
    assert_short_error(
        code, err, "uma: error: model.init_from: ", "config.json: model_type 'paligemma'", "holds a 'idefics3' model"
    )
    assert not (tmp_path / "checkpoints").exists()


# ---- memory and layouts: two processes -----------------------------------------------------------


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _memory_kb(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(field)).split()[1])


def _sharded_load(rank: int, world_size: int, port: int, directory: str, results: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    directory = Path(directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    source = read_hf_directory(directory)

    class LanguageHolder(nn.Module):
        hf_prefix = "lm"

        def __init__(self):
            super().__init__()
            self.lm = transformers.LlamaForCausalLM(config)

    def expect_saved(network: nn.Module, layout: str) -> None:
        saved = saved_tensors(directory)
        with torch.no_grad():
            loaded = {key.removeprefix("lm."): whole(value) for key, value in network.state_dict().items()}
        assert loaded.keys() == saved.keys(), layout
        assert [key for key in saved if not torch.equal(loaded[key], saved[key])] == [], layout

    # Tensor parallel: each rank reads its column or row block of the attention and MLP projections.
    # First, so that what the first load imports and caches is not counted under FSDP below.
    with torch.device("meta"):
        network = LanguageHolder()
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}  # fmt: skip
    for layer in network.lm.model.layers:
        parallelize_module(layer, mesh, plan)
    network.to_empty(device="cpu")
    load_hf_weights(network, source)
    expect_saved(network, "tp")  # the projections as DTensors, the embeddings and norms as plain tensors
    # FSDP: the model built on the meta device, sharded, then given this rank's memory only; measured
    # from the memory before it, with what the allocator kept of the tensor-parallel model handed back.
    del network
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    before = _memory_kb("VmRSS")
    with torch.device("meta"):
        network = LanguageHolder()
    for layer in network.lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(network, mesh=mesh)
    network.to_empty(device="cpu")
    load_hf_weights(network, source)
    peak = _memory_kb("VmHWM") - before
    held = _memory_kb("VmRSS") - before  # this rank's parameters, every page of them written by the load
    expect_saved(network, "fsdp")
    whole_read = None
    if rank == 0:  # what the bound rules out: the whole directory read at once beside this rank's shards
        Path("/proc/self/clear_refs").write_text("5")
        start = _memory_kb("VmRSS")
        everything = {key: value.clone() for key, value in saved_tensors(directory).items()}
        whole_read = _memory_kb("VmHWM") - start + held
        del everything

    Path(results, f"rank{rank}.json").write_text(
        json.dumps({"peak_kb": peak, "held_kb": held, "whole_read_kb": whole_read})
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow(seconds=25)
def test_fsdp_and_tp_ranks_load_their_own_blocks_within_their_shards_plus_one_shard_file(tmp_path):
    config = transformers.LlamaConfig(vocab_size=4000, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    directory = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="4MB")
    files = sorted(directory.glob("*.safetensors"))
    model_kb = sum(value.nbytes for value in saved_tensors(directory).values()) / 1024
    largest_file_kb = max(file.stat().st_size for file in files) / 1024
    assert len(files) >= 6 and largest_file_kb < model_kb / 4

    forked_cli.run_ranks(_sharded_load, 2, free_port(), str(directory), str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    bound = model_kb + largest_file_kb
    assert all(rank["peak_kb"] < bound for rank in ranks), (ranks, bound)
    assert ranks[0]["whole_read_kb"] > bound, (ranks, bound)  # the measure tells a whole read from a streamed one


# ---- out: a run's checkpoint as a Hugging Face directory ----------------------------------------


@pytest.mark.parametrize("family", ["idefics3", "paligemma"])
def test_each_family_exports_to_a_directory_from_pretrained_loads_bitwise(tiny_vlms, tmp_path, family):
    model = transformers.AutoModelForImageTextToText.from_pretrained(tiny_vlms[family])
    with torch.no_grad():  # other weights than the source directory's
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    written = export_hf_directory(model.state_dict(), tiny_vlms[family], tmp_path / "out", max_shard_size="100KB")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) >= 3 and not (tmp_path / "out.partial").exists()
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out").state_dict()
    expected = model.state_dict()
    assert written == len({value.data_ptr() for value in expected.values()}) and loaded.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(loaded[key], expected[key])] == []
    with pytest.raises(ValueError, match=f"^{tmp_path / 'out'}: exists and is not empty"):
        export_hf_directory(model.state_dict(), tiny_vlms[family], tmp_path / "out")


#: Per family: the stage whose run is exported, its recipe's extra settings, the processor's prompt
#: and images of a batch, and the family's other directory.
EXPORTED_RUNS = {
    "paligemma": (RECIPE, [], lambda images: {"text": ["pick up the red cube"] * 2, "images": list(images)}, "idefics3"),
    "idefics3": (
        recipe("posttrain_vlm"),
        ["--model.expert", json.dumps({"dim": 64, "ffn_dim": 64}), "--model.network.max_text_len", "8",
         "--data.action_horizon", "4", "--data.n_obs_steps", "1", "--model.ema_decay", "null"],
        lambda images: {"text": ["<image>pick up the red cube"] * 2, "images": [[image] for image in images]},
        "paligemma",
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["paligemma", "idefics3"])
def test_a_run_started_from_a_hf_directory_exports_back_to_one_with_our_logits(tiny_vlms, tmp_path, capsys, family):
    """Pretraining on PaliGemma, post-training with the flow expert on Idefics3 (SmolVLM): the run's
    checkpoint exported by ``uma ckpt export --format hf``, loaded by ``from_pretrained``, gives our logits."""
    config, settings, prompt, other = EXPORTED_RUNS[family]
    source = sharded_copy(tiny_vlms[family], tmp_path / "sharded")
    for file in tiny_vlms[family].iterdir():  # the tokenizer and processor beside the weights
        if not (source / file.name).exists():
            shutil.copy(file, source / file.name)
    args = ["fit", "--config", config, *QUICK, *settings, "--trainer.logger", "false",
            "--model.network.pretrained", str(source), "--model.init_from", str(source),
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0"]  # fmt: skip
    UmaCLI(args)
    checkpoints = tmp_path / "run" / "checkpoints"
    exported = tmp_path / "exported"
    code, out, err = run_main(["ckpt", "export", str(checkpoints), "--format", "hf", "--to", str(exported),
                               "--max-shard-size", "200KB"], capsys)  # fmt: skip
    assert code == 0, err
    assert f"with the config and tokenizer of {source.resolve()}" in out
    assert len(list(exported.glob("*.safetensors"))) >= 2
    assert {"tokenizer.json", "processor_config.json"} <= {file.name for file in exported.iterdir()}
    mismatched = ["ckpt", "export", str(checkpoints), "--format", "hf", "--to", str(tmp_path / "other"),
             "--hf-source", str(tiny_vlms[other])]  # fmt: skip
    code, _, err = run_main(mismatched, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"uma ckpt: error: {tiny_vlms[other] / 'config.json'}: the checkpoint does not fit "), err

    ours = Policy.from_checkpoint(str(checkpoints)).model.vlm
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(exported)
    processor = transformers.AutoProcessor.from_pretrained(exported)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=generator)
    inputs = processor(**prompt(images), return_tensors="pt")
    with torch.no_grad():
        expected, actual = ours.eval()(**inputs).logits, theirs.eval()(**inputs).logits
    assert torch.equal(actual, expected)
    started = transformers.AutoModelForImageTextToText.from_pretrained(source).state_dict()
    trained = f"{next(name for name, module in theirs.named_modules() if module is theirs.get_decoder())}.layers.0.mlp.up_proj.weight"
    assert not torch.equal(theirs.state_dict()[trained], started[trained])


# ---- uma fit: the weights loaded after the strategy's layout ---------------------------------------


def larger_paligemma(tiny: Path, output: Path) -> Path:
    """The tiny PaliGemma's vision tower, tokenizer and processor with a language model of 4 layers of
    width 256 (about 30 MB in float32), saved in 1 MB shard files: large enough beside the rest of a
    run's memory for the measure to tell a rank's half of it from all of it."""
    config = transformers.AutoConfig.from_pretrained(tiny)
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 256, 2048, 8
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 4, 2, 64
    config.projection_dim = config.vision_config.projection_dim = 256
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.PaliGemmaForConditionalGeneration(config).save_pretrained(output, max_shard_size="1MB")
    for file in tiny.iterdir():  # the tokenizer and processor beside the weights
        if not (output / file.name).exists():
            shutil.copy(file, output / file.name)
    return output


@pytest.mark.slow(seconds=35)
def test_uma_fit_under_fsdp_loads_on_each_rank_its_part_of_the_pretrained_weights(tiny_vlms, tmp_path):
    """A real ``uma fit`` from ``network.pretrained`` on 2 gloo processes under fsdp: the VLM is built
    from its config on the meta device, sharded, then each rank loads its blocks of the weights, so its
    peak (from before ``configure_model`` to after the layout) stays below the whole model plus one
    shard file, while one process holds it all; the model every rank then holds is, bitwise, the one a
    single process builds and loads (our parameters' initialisation, the weights, the computed buffers)."""
    directory = larger_paligemma(tiny_vlms["paligemma"], tmp_path / "paligemma")
    model_kb = sum(value.nbytes for value in saved_tensors(directory).values()) / 1024
    largest_file_kb = max(file.stat().st_size for file in directory.glob("*.safetensors")) / 1024
    assert largest_file_kb < model_kb / 8

    def fit(name: str, processes: int, *args: str, config: str = RECIPE) -> tuple[list[dict], dict[str, torch.Tensor]]:
        out = tmp_path / name
        out.mkdir()
        callback = {"class_path": "load_memory.LoadMemory", "init_args": {"out_dir": str(out)}}
        argv = ["fit", "--config", config, *QUICK, "--trainer.logger", "false", "--trainer.accelerator", "cpu",
                "--model.network.pretrained", str(directory), "--model.network.max_text_len", "8",
                "--trainer.default_root_dir", str(out / "run"), "--trainer.max_steps", "1",
                "--trainer.limit_val_batches", "0", "--trainer.callbacks+", json.dumps(callback),
                "--trainer.devices", str(processes), *args]  # fmt: skip
        codes = forked_cli.run_as_ranks(argv, out / "job.log", tmp_path, world_size=processes)
        assert set(codes) == {0}, (out / "job.log").read_text()[-3000:]
        ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
        return ranks, torch.load(out / "model.pt", weights_only=True)

    sharded, loaded = fit("fsdp", 2, "--trainer.strategy", "fsdp")
    (whole,), expected = fit("one", 1)
    bound = model_kb + largest_file_kb
    assert len(sharded) == 2 and all(rank["peak_kb"] < bound for rank in sharded), (sharded, bound)
    assert whole["peak_kb"] > model_kb, (whole, model_kb)  # the measure sees a whole model where one is held
    assert loaded.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(loaded[key], expected[key])] == []
    saved = saved_tensors(directory)
    assert torch.equal(loaded["vlm.model.language_model.layers.3.mlp.up_proj.weight"],
                       saved["language_model.model.layers.3.mlp.up_proj.weight"])  # fmt: skip
    # Post-training with an EMA (the VLM recipe's default): the average is laid out beside the model and
    # starts as its copy, on each rank's part (it used to make every rank load the whole model first:
    # 136 MB per rank, against 81 MB now, measured with this model).
    # It validates too: the EMA's predict_actions, which encodes the prefix without the network's forward,
    # gathers the sharded weights as forward does.
    expert = ["--model.expert", json.dumps({"dim": 128, "ffn_dim": 256}), "--data.action_horizon", "4",
              "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "1"]  # fmt: skip
    _, averaged = fit("fsdp-ema", 2, "--trainer.strategy", "fsdp", *expert, config=recipe("posttrain_vlm"))
    log = forked_cli.rank_log(tmp_path / "fsdp-ema" / "job.log", 0).read_text()
    assert log.index("parallel plan generic") < log.index("load paligemma: "), log[-3000:]  # after the layout
    assert "validation at step 1: val/action_l1 " in log, log[-3000:]
    ema = {name.removeprefix("ema."): value for name, value in averaged.items() if name.startswith("ema.")}
    model = {name: value for name, value in averaged.items() if not name.startswith("ema.")}
    assert ema.keys() == model.keys() and all(torch.equal(ema[name], model[name]) for name in model)
    assert [name for name in loaded if name.startswith("vlm.") and not torch.equal(model[name], loaded[name])] == []
