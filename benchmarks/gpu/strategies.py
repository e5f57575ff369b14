"""Tokens/s and MFU of the strategies that fit one GPU, for an H200 (989 TFLOP/s dense bf16), on
each model family: the house transformer's sizes, a network with no plan (the shipped example,
``uma_lightning.examples.chunk_mlp``) and a pretrained vision-language model (SmolVLM-256M's
shape, random weights written locally, pi0-style post-training with the flow expert).

    python benchmarks/gpu/strategies.py [--models small,1b,chunk_mlp,smolvlm] [--steps 30]
    python benchmarks/gpu/strategies.py --cpu-smoke    # the same code on the CPU: tiny models, a few steps

On one device every mesh is 1 x 1 x 1, so a strategy reduces to its plan's single-device part:
activation checkpointing and per-block compile, applied by MeshStrategy (a process group of
one). The baseline is Lightning's own single-device strategy on the same batches. MFU counts
the model's training FLOPs (``StageModule.count_flops_per_sample``, torch's flop counter over one
step) per second over the peak. Nothing is installed; each check is named, and any failure names the check and exits 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# Off the path: this folder's kernels.py would shadow the `kernels` distribution that transformers imports.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import print_table  # noqa: E402

PEAK_BF16_FLOPS = 989e12  # H200 SXM, dense bf16
BATCH = {"tiny": 4, "small": 256, "1b": 64, "chunk_mlp": 256, "smolvlm": 32}
MODELS = ("tiny", "small", "1b", "chunk_mlp", "smolvlm")
VARIANTS = {
    "lightning single device": None,
    "mesh strategy (plan only)": {},
    "+ AC ops": {"activation_checkpointing": "ops"},
    "+ AC full": {"activation_checkpointing": "full"},
    "+ compile blocks": {"compile": "blocks"},
    "+ compile blocks, AC ops": {"compile": "blocks", "activation_checkpointing": "ops"},
}


class Failed(Exception):
    pass


def check(name: str, fn, *args):
    """Run one named check; a failure says which check failed and why."""
    try:
        return fn(*args)
    except Exception as err:
        traceback.print_exc()
        raise Failed(f"{name}: {type(err).__name__}: {err}") from None


def environment(cpu_smoke: bool) -> str:
    if cpu_smoke:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible (use --cpu-smoke on a machine without one)")
    if not torch.cuda.is_bf16_supported():
        raise RuntimeError(f"{torch.cuda.get_device_name()} does not support bf16")
    name = torch.cuda.get_device_name()
    if "H200" not in name:
        print(
            f"note: {name} is not an H200; MFU is still computed against the H200 peak of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s"
        )
    return "cuda"


def batches_for(model: str, steps: int):
    from uma_lightning.data import RobotDataModule

    data = RobotDataModule(generation={"n_episodes": 20}, batch_size=BATCH[model], loader={"num_workers": 0})
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    return data.spec, [batch] * steps  # one real batch, reused: the data loader is not what is measured


def build_module(model: str, spec, smoke: bool, workdir: Path):
    """The LightningModule of ``model`` (one of ``MODELS``) for ``spec``."""
    from uma_lightning.modules import NetworkConfig, OptimizerConfig, PosttrainModule, PretrainModule

    optimizer = OptimizerConfig(warmup_steps=1)
    if model == "chunk_mlp":
        from uma_lightning.examples.chunk_mlp import ChunkMLPPretrain

        width, depth = (64, 2) if smoke else (2048, 8)
        return ChunkMLPPretrain(spec=spec, width=width, depth=depth, optimizer=optimizer)
    if model == "smolvlm":
        directory = smolvlm_directory(workdir, smoke)
        expert = {"dim": 32, "ffn_dim": 64} if smoke else {"dim": 384, "ffn_dim": 1024}
        network = {"pretrained": str(directory), "max_text_len": 16, "freeze_vision": True}
        return PosttrainModule(spec=spec, network=network, expert=expert, optimizer=optimizer)
    return PretrainModule(spec=spec, network=NetworkConfig(size=model), optimizer=optimizer)


def smolvlm_directory(workdir: Path, smoke: bool) -> Path:
    """A local model directory as ``save_pretrained`` writes it, with random weights: the suite's tiny
    Idefics3 for the smoke run, else SmolVLM-256M's widths (vision 12 x 768, language model 30 x 576,
    9 heads and 3 key/value heads), its image 512 px in patches of 16 at scale factor 4."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from hf_models import tiny_vlm_dir, vlm_dir

    if smoke:
        return tiny_vlm_dir("idefics3", workdir)
    return vlm_dir(
        "idefics3",
        workdir / "smolvlm-256m-random",
        vision={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                "image_size": 512, "patch_size": 16},
        text={"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3},
        scale_factor=4,
    )  # fmt: skip


def run_variant(
    spec, batches, model: str, strategy_args, device: str, compile_backend: str, smoke: bool, workdir: Path
) -> dict:
    from lightning.pytorch import Callback

    from uma_lightning.parallel import MeshStrategy, ParallelConfig
    from uma_lightning.tools.fixed_batches import fit_on_batches

    class StepTimer(Callback):
        def __init__(self):
            self.times, self.start = [], 0.0

        def on_train_batch_start(self, *_):
            if device == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    module = build_module(model, spec, smoke, workdir)
    timer = StepTimer()
    strategy = (
        "auto"
        if strategy_args is None
        else MeshStrategy(wrapping=ParallelConfig(**strategy_args, compile_backend=compile_backend))
    )
    fit_on_batches(
        module,
        batches,
        strategy,
        [timer],
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if device == "cuda" else "32-true",
        gradient_clip_val=1.0,
    )
    warmup = min(5, len(timer.times) - 1)  # compile and allocator warm-up
    step = statistics.median(timer.times[warmup:])
    samples_per_s = len(batches[0]["sample_id"]) / step
    return {
        "samples/s": samples_per_s,
        "tokens/s": samples_per_s * module.tokens_per_sample if module.tokens_per_sample else None,
        "mfu": samples_per_s * module.count_flops_per_sample(batches[0]) / PEAK_BF16_FLOPS,
        "step ms": step * 1e3,
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,1b,chunk_mlp,smolvlm", help=f"from {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny models of each family, 3 steps, CPU, compile with aot_eager (no kernel generation)",
    )
    args = parser.parse_args()
    models = ["tiny", "chunk_mlp", "smolvlm"] if args.cpu_smoke else args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    steps = 3 if args.cpu_smoke else args.steps
    compile_backend = "aot_eager" if args.cpu_smoke else "inductor"
    failures, rows = [], []
    try:
        device = check("environment", environment, args.cpu_smoke)
    except Failed as failure:
        print(f"FAILED {failure}")
        return 1
    with tempfile.TemporaryDirectory() as workdir:
        for model in models:
            try:
                spec, batches = check(f"{model}: data", batches_for, model, steps)
            except Failed as failure:
                failures.append(str(failure))
                continue
            baseline = None
            for variant, strategy_args in VARIANTS.items():
                try:
                    result = check(f"{model} / {variant}", run_variant, spec, batches, model, strategy_args, device,
                                   compile_backend, args.cpu_smoke, Path(workdir))  # fmt: skip
                except Failed as failure:
                    failures.append(str(failure))
                    continue
                baseline = baseline or result["samples/s"]
                on_gpu = device == "cuda"
                tokens = f"{result['tokens/s']:.0f}" if result["tokens/s"] else "-"
                rows.append([model, variant, f"{result['samples/s']:.1f}", tokens, f"{result['samples/s'] / baseline:.2f}",
                             f"{result['mfu']:.1%}" if on_gpu else "n/a", f"{result['step ms']:.1f}",
                             f"{result['peak GiB']:.1f}" if on_gpu else "n/a"])  # fmt: skip
                print("done:", " | ".join(rows[-1]), flush=True)  # a run cut short still shows its rows
    print_table(
        f"{device}, {'fp32' if device == 'cpu' else 'bf16-mixed'}, median step after warm-up; MFU against {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s",
        ["model", "variant", "samples/s", "tokens/s", "vs baseline", "MFU", "step ms", "peak GiB"],
        rows,
    )
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
