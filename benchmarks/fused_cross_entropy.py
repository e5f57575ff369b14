"""Peak memory and time of the fused linear + cross-entropy against the unfused loss, on CPU.

Unfused: F.cross_entropy(hidden @ weightᵀ, targets), which keeps the logits [N, V], their
log-softmax and their gradient. Fused: ``uma_lightning.kernels.linear_cross_entropy`` with the
``torch`` backend (the Triton kernel runs on GPU; the chunking, hence the memory saving, is the
same). Each measurement is one forward + backward in a fresh process, so its peak resident
memory (ru_maxrss) minus the resident memory once the inputs exist is the loss's own peak.
Variants alternate, and medians are printed side by side.

    python benchmarks/fused_cross_entropy.py                     # N=2048 rows, D=512, V=32k and 128k
    python benchmarks/fused_cross_entropy.py --vocab 65536 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import median, print_table  # noqa: E402

VARIANTS = ("unfused", "fused")


def measure(variant: str, rows: int, dim: int, vocab: int) -> dict:
    """Run in a child process: peak MB above the inputs and seconds of one forward + backward."""
    import psutil
    import torch
    import torch.nn.functional as F

    from uma_lightning.kernels import linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(rows, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) / dim**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if variant == "unfused":
        loss = F.cross_entropy(hidden @ weight.T, targets)
    else:
        loss, _ = linear_cross_entropy(hidden, weight, targets, backend="torch")
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_mb": (peak - before) / 2**20, "seconds": seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048, help="tokens in the batch (N)")
    parser.add_argument("--dim", type=int, default=512, help="hidden size (D)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072], help="vocabulary sizes (V)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.dim, args.vocab[0])))
        return

    rows = []
    for vocab in args.vocab:
        results = {variant: [] for variant in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                command = [
                    sys.executable,
                    __file__,
                    "--child",
                    variant,
                    "--rows",
                    str(args.rows),
                    "--dim",
                    str(args.dim),
                    "--vocab",
                    str(vocab),
                ]
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                results[variant].append(json.loads(out.strip().splitlines()[-1]))
                print(f"vocab {vocab}, repeat {repeat + 1}/{args.repeats}: {variant} done", file=sys.stderr)
        losses = {variant: results[variant][0]["loss"] for variant in VARIANTS}
        if abs(losses["fused"] - losses["unfused"]) > 1e-4 * abs(losses["unfused"]):
            raise SystemExit(f"fused and unfused losses differ at vocab {vocab}: {losses}")
        peak = {variant: median([r["peak_mb"] for r in results[variant]]) for variant in VARIANTS}
        secs = {variant: median([r["seconds"] for r in results[variant]]) for variant in VARIANTS}
        logits_mb = args.rows * vocab * 4 / 2**20
        rows.append(
            [
                vocab,
                logits_mb,
                peak["unfused"],
                peak["fused"],
                peak["unfused"] / peak["fused"],
                secs["unfused"],
                secs["fused"],
                secs["fused"] / secs["unfused"],
            ]
        )
    print_table(
        f"linear + cross-entropy forward+backward, N={args.rows} D={args.dim} float32, medians of {args.repeats} (peak = resident MB above the inputs)",
        [
            "vocab",
            "fp32 logits MB",
            "unfused peak MB",
            "fused peak MB",
            "memory ratio",
            "unfused s",
            "fused s",
            "time ratio",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
