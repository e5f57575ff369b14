"""Cost of sampling from the replay buffer against indexing plain tensors with random indices.

    python benchmarks/replay_sampling.py [--capacity 100000] [--batch 256] [--obs-dim 348] [--action-dim 17]

plain tensors:  the same fields as plain tensors, all indexed with one ``torch.randint(size, (batch,))``: the floor.
uniform:        ``ReplayBuffer.sample`` (shared memory, inter-process lock, generator state kept).
prioritized:    sum-tree descent, importance weights; and ``update_priorities`` for the drawn batch.

Variants alternate within each repeat; the table shows median microseconds per call and the ratio
to plain tensors. Defaults use Humanoid-v5's observation and action sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import median, print_table, time_calls  # noqa: E402

from uma_lightning.rl.replay import ReplayBuffer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--obs-dim", type=int, default=348)
    parser.add_argument("--action-dim", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)

    layout = {
        "obs": ((args.obs_dim,), torch.float32),
        "action": ((args.action_dim,), torch.float32),
        "reward": ((), torch.float32),
        "next_obs": ((args.obs_dim,), torch.float32),
        "terminated": ((), torch.bool),
    }
    data = {name: torch.randn(args.capacity, *shape).to(dtype) for name, (shape, dtype) in layout.items()}
    uniform = ReplayBuffer(args.capacity, layout)
    prioritized = ReplayBuffer(args.capacity, layout, prioritized=True)
    for buffer in (uniform, prioritized):
        buffer.add(data)
    prioritized.update_priorities(torch.arange(args.capacity), torch.rand(args.capacity))
    generator = torch.Generator().manual_seed(0)
    drawn = prioritized.sample(args.batch)[1]
    priorities = torch.rand(args.batch)

    def plain_sample() -> dict[str, torch.Tensor]:
        indices = torch.randint(0, args.capacity, (args.batch,), generator=generator)  # one draw for all fields
        return {k: v[indices] for k, v in data.items()}

    variants = {
        "plain tensors": plain_sample,
        "uniform ReplayBuffer.sample": lambda: uniform.sample(args.batch),
        "prioritized ReplayBuffer.sample": lambda: prioritized.sample(args.batch),
        "prioritized update_priorities": lambda: prioritized.update_priorities(drawn, priorities),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(median(time_calls(fn, args.calls, warmup=10)))
    base = median(times["plain tensors"])
    print_table(
        f"capacity {args.capacity}, batch {args.batch}, obs {args.obs_dim}, action {args.action_dim}: median of {args.repeats} x {args.calls} calls",
        ["variant", "us per call", "ratio to plain tensors"],
        [[name, median(t) * 1e6, median(t) / base] for name, t in times.items()],
    )


if __name__ == "__main__":
    main()
