"""Mixture of experts on CPU: the layer's speed, and how well bias balancing spreads the tokens.

1. One MoE feed-forward's forward + backward over a batch of tokens: the grouped-GEMM experts
   against the per-expert loop, and against a dense SwiGLU feed-forward with the same active
   parameters per token (hidden = (top_k + n_shared) x expert hidden). Variants alternate; medians.
2. Load imbalance (the busiest expert's token choices over the mean, per MoE layer and step,
   averaged over layers) over the last ``--window`` steps of a pretraining run of the tiny_moe
   preset, with the aux-loss-free bias balancing and without it (bias_update_rate 0), same seed.
3. Expert parallelism: the tiny_moe backbone's forward + backward on 2 gloo processes under ep=2,
   and the share of that step spent in the all-to-alls (the token counts, the tokens out and
   back, and their gradients), timed around every ``all_to_all_single`` call on each rank.

    python benchmarks/moe.py                      # layer and balance, 300-step runs
    python benchmarks/moe.py --part layer --tokens 8192
    python benchmarks/moe.py --part balance --steps 100 --window 20
    python benchmarks/moe.py --part balance --rates 0.001 --batch-size 8   # one run
    python benchmarks/moe.py --part ep --tokens 2048                       # tokens per rank
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import median, print_table, time_calls  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def layer_speed(
    tokens: int, dim: int, hidden: int, n_experts: int, top_k: int, n_shared: int, repeats: int
) -> list[list[object]]:
    import torch

    from uma_lightning.kernels import KernelConfig
    from uma_lightning.models.moe import MoEConfig
    from uma_lightning.models.transformer import FeedForward, TransformerConfig, build_feed_forward

    torch.manual_seed(0)
    cfg = TransformerConfig(dim=dim, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=hidden,
                            moe=MoEConfig(n_experts=n_experts, top_k=top_k, n_shared=n_shared, expert_dim=hidden))  # fmt: skip
    moe = build_feed_forward(cfg, 0)
    moe.init_weights(0.02, 0.02)
    dense = FeedForward(dim, (top_k + n_shared) * hidden)
    x = torch.randn(1, tokens, dim, requires_grad=True)

    def step(module):
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).square().mean().backward()

    def with_experts(backend):
        moe.experts.kernels = KernelConfig(experts=backend)
        step(moe)

    variants = {
        "moe grouped": lambda: with_experts("grouped"),
        "moe loop": lambda: with_experts("loop"),
        "dense, same active": lambda: step(dense),
    }
    times = {name: [] for name in variants}
    for _ in range(repeats):  # alternate, so drift in the machine's load hits every variant alike
        for name, fn in variants.items():
            times[name] += time_calls(fn, repeats=1)
    grouped = median(times["moe grouped"])
    return [[name, 1e3 * median(ts), median(ts) / grouped] for name, ts in times.items()]


class ImbalanceRecorder(Callback):
    """Each training step's imbalance, averaged over the MoE layers, and how many tokens a layer routed."""

    def __init__(self):
        self.per_step: list[float] = []
        self.tokens_per_step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from uma_lightning.models.moe import moe_layers

        layers = [layer for _, layer in moe_layers(pl_module)]
        ratios = [(layer.stats["routed"].max() / layer.stats["routed"].float().mean()).item() for layer in layers]
        self.tokens_per_step = int(layers[0].stats["routed"].sum()) // layers[0].cfg.top_k
        self.per_step.append(sum(ratios) / len(ratios))
        if len(self.per_step) % 25 == 0:  # a long run on a busy machine: say how far it is
            last = self.per_step[-50:]
            print(
                f"step {len(self.per_step)}: mean imbalance over the last {len(last)} steps {sum(last) / len(last):.3f}",
                flush=True,
            )


def tiny_moe_preset() -> dict:
    from uma_lightning.models import load_size

    # Empty settings left out: the command line would read a JSON null as the string "null".
    return {key: value for key, value in dataclasses.asdict(load_size("tiny_moe").moe).items() if value is not None}


def balance(steps: int, window: int, bias_update_rate: float, bias_update: str, batch_size: int) -> dict:
    from uma_lightning.cli import UmaCLI

    moe = {**tiny_moe_preset(), "bias_update_rate": bias_update_rate, "bias_update": bias_update}
    size = {"name": "tiny_moe", "moe": moe}
    recorder = ImbalanceRecorder()
    with tempfile.TemporaryDirectory() as root:
        cli = UmaCLI(
            ["--config", str(REPO / "recipes" / "pretrain.yaml"),
             "--model.network.size", json.dumps(size),
             "--data.batch_size", str(batch_size), "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps), "--trainer.limit_val_batches", "1",
             "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.default_root_dir", root],
            run=False,
        )  # fmt: skip
        cli.trainer.callbacks.append(recorder)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    last = recorder.per_step[-window:]
    return {
        "bias_update_rate": bias_update_rate, "bias_update": bias_update, "steps": len(recorder.per_step),
        "imbalance_last": sum(last) / len(last), "worst_step": max(last), "tokens_per_step": recorder.tokens_per_step,
    }  # fmt: skip


def sampling_floor(tokens: int, n_experts: int, top_k: int, draws: int = 500) -> float:
    """The mean imbalance of routing that is balanced in expectation: each of ``tokens`` tokens picks its
    ``top_k`` experts uniformly at random, so only the sampling spreads the loads."""
    import torch

    generator = torch.Generator().manual_seed(0)
    chosen = torch.rand(draws, tokens, n_experts, generator=generator).topk(top_k, dim=-1).indices.flatten(1)
    counts = torch.zeros(draws, n_experts).scatter_add_(1, chosen, torch.ones(chosen.shape))
    return (counts.max(1).values / counts.mean(1)).mean().item()


def expert_parallel_rank(out: str, tokens: int, repeats: int) -> None:
    """One rank of part 3 (``run_local_group`` sets up the process group's environment)."""
    import time

    import torch
    import torch.distributed as dist

    from uma_lightning.models import Transformer, load_size
    from uma_lightning.parallel import MeshShape
    from uma_lightning.parallel.mesh import build_mesh
    from uma_lightning.parallel.plans.experts import apply_expert_parallel

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = build_mesh(MeshShape(dp_replicate=world, dp_shard=1, tp=1, ep=world), "cpu")
    torch.manual_seed(0)
    seq = 128
    model = Transformer(load_size("tiny_moe"), max_seq_len=seq)
    apply_expert_parallel(model, mesh["ep"])
    x = torch.randn(
        tokens // seq, seq, load_size("tiny_moe").dim, generator=torch.Generator().manual_seed(dist.get_rank())
    )

    exchange = [0.0]
    all_to_all = dist.all_to_all_single

    def timed_all_to_all(*args, **kwargs):  # forward and backward exchanges both go through it
        start = time.perf_counter()
        result = all_to_all(*args, **kwargs)
        exchange[0] += time.perf_counter() - start
        return result

    dist.all_to_all_single = timed_all_to_all
    steps, shares = [], []
    for index in range(repeats + 1):
        dist.barrier()
        exchange[0] = 0.0
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        elapsed = time.perf_counter() - start
        if index:  # the first step warms up
            steps.append(elapsed)
            shares.append(exchange[0] / elapsed)
    dist.all_to_all_single = all_to_all
    gathered = [None] * world
    dist.all_gather_object(gathered, {"step_ms": 1e3 * median(steps), "share": median(shares)})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def expert_parallel_share(tokens: int, repeats: int, world_size: int = 2) -> list[list[object]]:
    from uma_lightning.tools.launch import run_local_group

    with tempfile.TemporaryDirectory() as root:
        out = str(Path(root) / "ranks.json")
        run_local_group(expert_parallel_rank, world_size, (out, tokens, repeats), timeout=1200)
        ranks = json.loads(Path(out).read_text())
    return [[rank, r["step_ms"], 100 * r["share"]] for rank, r in enumerate(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=("layer", "balance", "both", "ep"), default="both", help="both: layer and balance"
    )
    parser.add_argument("--tokens", type=int, default=4096, help="per rank for --part ep (a multiple of 128)")
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--hidden", type=int, default=128, help="each expert's hidden size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--shared", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="the pretrain recipe's")
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        help="bias_update_rate of each run (0: no bias balancing); default: the preset's, and 0",
    )
    parser.add_argument(
        "--bias-update", choices=("sign", "proportional"), help="moe.bias_update of every run; default: the preset's"
    )
    args = parser.parse_args()
    if args.part in ("layer", "both"):
        rows = layer_speed(args.tokens, args.dim, args.hidden, args.experts, args.top_k, args.shared, args.repeats)
        print_table(
            f"MoE feed-forward, forward + backward of {args.tokens} tokens (dim {args.dim}, {args.experts} experts of hidden {args.hidden}, "
            f"top-{args.top_k}, {args.shared} shared)",
            ["variant", "ms (median)", "x grouped"], rows,
        )  # fmt: skip
    if args.part in ("balance", "both"):
        preset = tiny_moe_preset()
        rates = args.rates or [preset["bias_update_rate"], 0.0]
        results = [
            balance(args.steps, args.window, rate, args.bias_update or preset["bias_update"], args.batch_size)
            for rate in rates
        ]
        tokens = results[0]["tokens_per_step"]
        print_table(
            f"Load imbalance (max/mean token choices per expert, mean over MoE layers) over the last {args.window} of {args.steps} "
            f"pretraining steps, tiny_moe, batch {args.batch_size} ({tokens} tokens per step and layer; the sampling floor, "
            f"each token's {preset['top_k']} of {preset['n_experts']} experts drawn uniformly: {sampling_floor(tokens, preset['n_experts'], preset['top_k']):.3f})",
            ["bias_update_rate", "bias_update", "steps", f"mean imbalance, last {args.window}", "worst step"],
            [[r["bias_update_rate"], r["bias_update"], r["steps"], r["imbalance_last"], r["worst_step"]] for r in results],
        )  # fmt: skip
    if args.part == "ep":
        print_table(
            f"tiny_moe backbone, forward + backward of {args.tokens} tokens per rank under ep=2 (gloo, 2 processes): "
            "time in all_to_all_single (token counts, tokens out and back, their gradients)",
            ["rank", "step ms (median)", "all-to-all % of the step (median)"],
            expert_parallel_share(args.tokens, args.repeats),
        )  # fmt: skip


if __name__ == "__main__":
    main()
