"""GPU checks for uma_lightning.kernels, and the RL throughput case, in one run of under 10 minutes on one H200.

Prints, section by section:

1. correctness on the GPU: every Triton op against its float32 reference (values and gradients,
   float32/bfloat16/float16, realistic and ragged shapes), every attention backend against the
   reference under each mask, a small model with every backend on ``auto`` against the reference
   backends, and the Triton ops under torch.compile (inductor) against eager;
2. forward+backward time and peak memory of each op: eager PyTorch, Triton, torch.compile of the
   PyTorch version, and liger-kernel where installed;
3. attention backends at sequence lengths 1k-16k (causal and block-causal);
4. the experts of a mixture-of-experts layer: grouped GEMM against the per-expert loop (values
   and gradients, uneven token counts), and forward+backward time of both against a dense SwiGLU
   feed-forward with the same active parameters;
5. tokens/s and MFU of a ``1b`` model training step (bf16 autocast, AdamW) with every backend on
   ``auto`` against the plain-PyTorch path (PyTorch ops, SDPA, unfused cross-entropy);
6. RL throughput with the learner and inference server on the GPU and 14 actors on the cores
   (``benchmarks/gpu/rl_throughput.py``, in its own process, about 2 minutes; it needs gymnasium
   with MuJoCo and is skipped, saying so, without it). The CPU smoke run leaves it out: the test
   suite runs that script's ``--cpu-smoke`` on its own.

It installs nothing and needs only torch (and Triton, which CUDA builds of torch bring); it runs
from a checkout without ``pip install``. Every failure names its check, and the script exits 1
if any check failed. ``--cpu-smoke`` runs the CPU-possible parts at tiny sizes, with Triton in its
interpreter and torch.compile's aot_eager backend, to check the script itself anywhere.

    python benchmarks/gpu/kernels.py
    python benchmarks/gpu/kernels.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BF16_PEAK_FLOPS = 989e12  # H100/H200 SXM dense bfloat16


def import_package() -> str:
    """Use the installed package, or map this checkout's folders as the wheel does (kernels/ and configs/ ship inside)."""
    if importlib.util.find_spec("uma_lightning") is not None:
        return "installed"
    sys.path.insert(0, str(REPO))
    import uma_lightning  # noqa: F401

    for name in ("kernels", "configs"):
        spec = importlib.util.spec_from_file_location(
            f"uma_lightning.{name}", REPO / name / "__init__.py", submodule_search_locations=[str(REPO / name)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return "this checkout, not installed"


if "--cpu-smoke" in sys.argv:
    # Triton reads this when it is first imported (torch may import it), so set it before anything.
    os.environ.setdefault("TRITON_INTERPRET", "1")
PACKAGE_SOURCE = import_package()  # before the package's imports below

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from uma_lightning.data.spec import DataSpec  # noqa: E402
from uma_lightning.kernels import (  # noqa: E402
    KernelConfig,
    apply_rotary,
    attention,
    checks,
    expert_feed_forward,
    linear_cross_entropy,
    rms_norm,
    swiglu,
)  # noqa: E402
from uma_lightning.models import RobotModelConfig, RobotTransformer, VisionConfig, load_size, training_flops_per_sample  # noqa: E402

PLAIN = KernelConfig(attention="sdpa", rms_norm="torch", swiglu="torch", rotary="torch", cross_entropy="torch")
REFERENCE = KernelConfig(attention="reference", rms_norm="torch", swiglu="torch", rotary="torch", cross_entropy="torch")
TRITON = KernelConfig(attention="sdpa", rms_norm="triton", swiglu="triton", rotary="triton", cross_entropy="triton")


class Report:
    """Runs named checks, prints each failure with its name, and remembers them for the exit status."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def fail(self, name: str, why: str) -> None:
        self.failures.append(name)
        print(f"FAILED {name}: {why}", flush=True)

    def attempt(self, name: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # any error is this check's failure; the run goes on
            frame = traceback.extract_tb(err.__traceback__)[-1]
            message = str(err).strip().splitlines()[0] if str(err).strip() else ""
            self.fail(name, f"{type(err).__name__}: {message} (at {Path(frame.filename).name}:{frame.lineno})")
            return None


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def table(header: list[str], rows: list[list[object]]) -> None:
    def fmt(cell):
        return f"{cell:.4g}" if isinstance(cell, float) else str(cell)

    cells = [header] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        if index == 0:
            print("  ".join("-" * width for width in widths))
    sys.stdout.flush()


class Bench:
    """Median time and peak memory of a forward+backward callable, synchronised on CUDA."""

    def __init__(self, device, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(median ms, peak MB above what was allocated before; NaN on CPU)."""
        fn()  # warm-up: compilation, autotuning, allocator
        self.sync()
        peak = float("nan")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            self.sync()
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), peak


# ---- 1. correctness ------------------------------------------------------------------------


def correctness(report: Report, device, smoke: bool) -> None:
    section("correctness on " + device.type)
    dtypes = (
        [torch.float32] if smoke else [torch.float32, torch.bfloat16, torch.float16]
    )  # the tests cover the rest on CPU
    ragged = {
        "rms_norm": [(7, 97), (3, 4099)],
        "swiglu": [(3, 1001)],
        "rotary": [(2, 3, 37, 34)],
        "cross_entropy": [(37, 64, 5003)],
    }
    real = {
        "rms_norm": [(16384, 2048)],
        "swiglu": [(16384, 8192)],
        "rotary": [(8, 32, 2048, 64)],
        "cross_entropy": [(4096, 2048, 32000)],
    }
    shapes = ragged if smoke else {op: ragged[op] + real[op] for op in ragged}
    results = []
    for dtype in dtypes:
        for shape in shapes["rms_norm"]:
            results += (
                report.attempt(f"correctness rms_norm {dtype} {shape}", checks.check_rms_norm, shape, dtype, device)
                or []
            )
        for shape in shapes["swiglu"]:
            results += (
                report.attempt(f"correctness swiglu {dtype} {shape}", checks.check_swiglu, shape, dtype, device) or []
            )
        for shape in shapes["rotary"]:
            for heads_last in (False, True):
                results += (
                    report.attempt(
                        f"correctness rotary {dtype} {shape}",
                        checks.check_rotary,
                        shape,
                        dtype,
                        device,
                        heads_last=heads_last,
                    )
                    or []
                )
        for rows, dim, vocab in shapes["cross_entropy"]:
            results += (
                report.attempt(
                    f"correctness linear_cross_entropy {dtype} {(rows, dim, vocab)}",
                    checks.check_linear_cross_entropy,
                    rows,
                    dim,
                    vocab,
                    dtype,
                    device,
                )
                or []
            )
    _print_checks(report, results)

    section("attention backends against the reference")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    seq, head_dim = (11, 16) if smoke else (257, 64)
    masks = [
        dict(causal=False, prefix_len=0),
        dict(causal=True, prefix_len=0),
        dict(causal=True, prefix_len=seq * 3 // 4),
    ]
    results, unsupported = [], []
    for backend in attention_backends(device.type):
        for mask in masks:
            for padded in (False, True):
                for kv_heads in (4, 1):
                    label = f"attention {backend} {mask} padded={padded} kv_heads={kv_heads}"
                    try:
                        results += checks.check_attention(
                            backend, dtype, device, kv_heads=kv_heads, padded=padded, seq=seq, head_dim=head_dim, **mask
                        )
                    except RuntimeError as err:
                        if "cannot run" not in str(err):
                            report.fail(f"correctness {label}", str(err).splitlines()[0])
                        else:
                            unsupported.append(backend)
                    except Exception as err:
                        report.fail(f"correctness {label}", f"{type(err).__name__}: {err}")
    _print_checks(report, results)
    for backend in sorted(set(unsupported)):
        print(
            f"n/a  {backend}: cannot run {unsupported.count(backend)} of the {len(masks) * 4} mask/padding/GQA cases here (PyTorch's limits, not a failure)"
        )

    section("model with every backend auto against the reference backends")
    report.attempt("correctness model auto vs reference", model_agreement, report, device, smoke)
    section("Triton ops under torch.compile against eager")
    report.attempt("correctness torch.compile of Triton ops", compiled_ops_agree, report, device, smoke)


@functools.cache
def attention_backends(device_type: str) -> tuple[str, ...]:
    """Every backend worth trying here; says once why a flash-attn package is left out."""
    from uma_lightning.kernels import flash

    names = []
    for name in flash.PACKAGES:
        if device_type == "cuda" and flash.installed(name):
            names.append(name)
        else:
            print(f"skip {name}: {'not installed' if not flash.installed(name) else 'needs CUDA'}")
    return (*names, "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


def _print_checks(report: Report, results) -> None:
    for check in results:
        if not check.ok:
            report.fail(f"correctness {check.name}", f"max error {check.error:.3g} > allowed {check.allowed:.3g}")
    print(f"{sum(c.ok for c in results)}/{len(results)} comparisons within tolerance")


def small_model_and_batch(device, kernels):
    spec = DataSpec(
        cameras=("front", "wrist"),
        image_size=(32, 48),
        state_dim=5,
        action_dim=3,
        n_obs_steps=2,
        action_horizon=4,
        fps=10,
    )
    backbone = load_size({"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256})
    torch.manual_seed(0)
    with torch.device(device):
        model = RobotTransformer(RobotModelConfig(backbone=backbone, spec=spec, max_text_len=16, n_action_bins=64))
    model.set_kernels(kernels)
    return model, random_batch(model, batch=3, device=device)


def random_batch(model, batch: int, device) -> dict:
    spec = model.cfg.spec
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(
        0, 256, (batch, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3), dtype=torch.uint8, generator=gen
    )
    state = torch.randn(batch, spec.n_obs_steps, spec.state_dim, generator=gen)
    text_ids, text_mask = model.text_tokenizer((["reach the red square", "go", "touch blue"] * batch)[:batch])
    actions = model.action_binner.encode(
        torch.rand(batch, spec.action_horizon, spec.action_dim, generator=gen) * 2 - 1
    ).flatten(1)
    return {
        k: v.to(device)
        for k, v in dict(images=images, state=state, text_ids=text_ids, text_mask=text_mask, actions=actions).items()
    }


def training_loss(model, batch, *, fused: bool):
    """The fused linear + cross-entropy of the model's kernel config, or the plain logits-then-loss path."""
    args = (batch["images"], batch["state"], batch["text_ids"], batch["text_mask"], batch["actions"])
    if fused:
        return model(*args, loss_targets=batch["actions"])[0]
    return F.cross_entropy(model(*args).float().flatten(0, 1), batch["actions"].flatten())


def model_agreement(report: Report, device, smoke: bool) -> None:
    autocast = device.type == "cuda"
    signals = {}
    for name, kernels in (("auto", KernelConfig()), ("reference", REFERENCE)):
        model, batch = small_model_and_batch(device, kernels)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = training_loss(model, batch, fused=name == "auto")
        loss.backward()
        signals[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    dtype = torch.bfloat16 if autocast else torch.float32
    results = [checks.compare("model loss auto vs reference", signals["auto"][0], signals["reference"][0], dtype)]
    results += [
        checks.compare(f"model grad {n}", g, signals["reference"][1][n], dtype) for n, g in signals["auto"][1].items()
    ]
    print(
        f"loss auto {signals['auto'][0].item():.6f} vs reference {signals['reference'][0].item():.6f} ({'bf16 autocast' if autocast else 'fp32'})"
    )
    _print_checks(report, results)


def compiled_ops_agree(report: Report, device, smoke: bool) -> None:
    model, batch = small_model_and_batch(device, TRITON)
    compile_backend = "aot_eager" if smoke else "inductor"

    def loss_fn(batch):
        return training_loss(model, batch, fused=True)

    results = []
    for _name, fn in (
        ("eager", loss_fn),
        ("compiled", torch.compile(loss_fn, backend=compile_backend, fullgraph=True)),
    ):
        model.zero_grad(set_to_none=True)
        loss = fn(batch)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (loss, grads) = results
    checked = [checks.compare(f"compiled ({compile_backend}) loss", loss, eager_loss, torch.float32)]
    checked += [
        checks.compare(f"compiled ({compile_backend}) grad {i}", g, e, torch.float32)
        for i, (g, e) in enumerate(zip(grads, eager_grads))
    ]
    print(
        f"model loss with Triton ops, compiled whole with fullgraph=True ({compile_backend}): {loss.item():.6f} vs eager {eager_loss.item():.6f}"
    )
    _print_checks(report, checked)


# ---- 2. op speed and memory ----------------------------------------------------------------


def op_benchmarks(report: Report, device, smoke: bool, bench: Bench) -> None:
    section("ops: forward+backward, median ms and peak MB (bf16 on GPU)")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tokens, dim, ffn, heads, head_dim, seq = (64, 32, 64, 4, 16, 16) if smoke else (16384, 2048, 8192, 32, 64, 2048)
    vocabs = [300] if smoke else [256, 32768, 131072]
    compile_backend = "aot_eager" if smoke else "inductor"
    liger = liger_functions()
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_()

    x, w = leaf(tokens, dim), leaf(dim)
    gate, up = leaf(tokens, ffn), leaf(tokens, ffn)
    # q and k as the model makes them: projections [B, S, H, D] viewed as [B, H, S, D].
    q = leaf(tokens // seq, seq, heads, head_dim).detach().transpose(1, 2).requires_grad_()
    k = leaf(tokens // seq, seq, heads // 4, head_dim).detach().transpose(1, 2).requires_grad_()
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim)).to(
        device
    )
    cos, sin = angles.cos(), angles.sin()

    def op(backend: str) -> dict[str, tuple[Callable, tuple]]:
        return {
            f"rms_norm [{tokens}, {dim}]": (lambda x, w: rms_norm(x, w, 1e-5, backend=backend), (x, w)),
            f"swiglu [{tokens}, {ffn}]": (lambda a, b: swiglu(a, b, backend=backend), (gate, up)),
            f"rotary q and k [{tokens // seq}, {heads}/{heads // 4}, {seq}, {head_dim}]": (
                lambda q, k: (apply_rotary(q, cos, sin, backend=backend), apply_rotary(k, cos, sin, backend=backend)),
                (q, k),
            ),
        }

    cases = {
        name: {"eager": fn, "triton": op("triton")[name][0], "inputs": inputs}
        for name, (fn, inputs) in op("torch").items()
    }
    for name, key in zip(cases, ("rms_norm", "swiglu", "rotary")):
        if key in liger:
            cases[name]["liger"] = functools.partial(liger[key], cos=cos, sin=sin) if key == "rotary" else liger[key]
    for vocab in vocabs:
        h, head = leaf(tokens, dim), leaf(vocab, dim, scale=dim**-0.5)
        targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        cases[f"linear+cross_entropy [{tokens}, {dim}] x V={vocab}"] = {
            "eager": lambda h, w, targets=targets: F.cross_entropy((h @ w.T).float(), targets),
            "triton": lambda h, w, targets=targets: linear_cross_entropy(h, w, targets, backend="triton")[0],
            "torch chunked": lambda h, w, targets=targets: linear_cross_entropy(h, w, targets, backend="torch")[0],
            "inputs": (h, head),
            **(
                {"liger": lambda h, w, targets=targets: liger["cross_entropy"](h, w, targets)}
                if "cross_entropy" in liger
                else {}
            ),
        }
    rows = []
    for name, variants in cases.items():
        inputs = variants.pop("inputs")
        variants[f"compile({compile_backend})"] = torch.compile(variants["eager"], backend=compile_backend)
        timings = {}
        for variant, fn in variants.items():
            result = report.attempt(f"benchmark {name} {variant}", bench.run, forward_backward(fn, inputs))
            if result:
                timings[variant] = result
        base = timings.get("eager", (float("nan"),))[0]
        rows += [[name, variant, ms, base / ms, mb] for variant, (ms, mb) in timings.items()]
        torch._dynamo.reset()
    table(["op", "variant", "ms", "speedup vs eager", "peak MB"], rows)
    if not liger:
        print("liger-kernel not installed: no liger rows")


def forward_backward(fn: Callable, inputs: tuple) -> Callable[[], None]:
    def run() -> None:
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.float().sum() for o in outs if o.is_floating_point()).backward()
        for t in inputs:
            t.grad = None

    return run


def expert_benchmarks(report: Report, device, smoke: bool, bench: Bench) -> None:
    section("experts: grouped GEMM against the per-expert loop and a dense FFN of the same active parameters")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n_experts, top_k, tokens, dim, hidden = (4, 2, 64, 32, 64) if smoke else (64, 8, 8192, 2048, 1408)
    gen = torch.Generator().manual_seed(0)
    # Uneven loads, one expert idle: what a router produces, not a tidy equal split.
    shares = torch.rand(n_experts, generator=gen) ** 2
    shares[1] = 0
    counts = torch.distributions.Multinomial(tokens * top_k, probs=shares / shares.sum()).sample().long()

    def leaf(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_()

    x = leaf(tokens * top_k, dim, scale=1.0)
    w1, w3, w2 = (
        leaf(n_experts, dim, hidden, scale=dim**-0.5),
        leaf(n_experts, dim, hidden, scale=dim**-0.5),
        leaf(n_experts, hidden, dim, scale=hidden**-0.5),
    )
    inputs = (x, w1, w3, w2)
    outputs = {}
    for backend in ("loop", "grouped"):
        out = report.attempt(
            f"experts {backend} forward+backward",
            expert_feed_forward,
            x,
            counts.to(device),
            w1,
            w3,
            w2,
            backend=backend,
        )
        if out is None:
            continue
        out.float().square().mean().backward()
        outputs[backend] = [out.detach().float()] + [t.grad.float() for t in inputs]
        for t in inputs:
            t.grad = None
    if len(outputs) == 2:
        tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        for name, grouped, loop in zip(
            ("output", "x grad", "w1 grad", "w3 grad", "w2 grad"), outputs["grouped"], outputs["loop"]
        ):
            report.attempt(
                f"correctness experts grouped vs loop {name}", torch.testing.assert_close, grouped, loop, **tolerance
            )
        print(
            f"ok   grouped == loop (output and every gradient), {n_experts} experts, counts {counts.min().item()}..{counts.max().item()}"
        )
    dense = (
        leaf(dim, top_k * hidden, scale=dim**-0.5),
        leaf(dim, top_k * hidden, scale=dim**-0.5),
        leaf(top_k * hidden, dim, scale=hidden**-0.5),
    )
    tokens_in = leaf(tokens, dim, scale=1.0)
    cases = {
        "grouped": (lambda *t: expert_feed_forward(t[0], counts.to(device), *t[1:], backend="grouped"), inputs),
        "loop": (lambda *t: expert_feed_forward(t[0], counts.to(device), *t[1:], backend="loop"), inputs),
        f"dense FFN, hidden {top_k * hidden}": (lambda h, a, b, c: swiglu(h @ a, h @ b) @ c, (tokens_in, *dense)),
    }
    rows = []
    for name, (fn, args) in cases.items():
        result = report.attempt(f"benchmark experts {name}", bench.run, forward_backward(fn, args))
        if result:
            rows.append([name, *result])
    grouped_ms = rows[0][1] if rows and rows[0][0] == "grouped" else float("nan")
    table(
        [
            f"{tokens} tokens, top-{top_k} of {n_experts} experts, dim {dim}, hidden {hidden}",
            "ms",
            "peak MB",
            "x grouped",
        ],
        [[*r, r[1] / grouped_ms] for r in rows],
    )


def liger_functions() -> dict[str, Callable]:
    try:
        from liger_kernel.transformers.functional import (
            liger_fused_linear_cross_entropy,
            liger_rms_norm,
            liger_rope,
            liger_swiglu,
        )
    except ImportError:
        return {}

    def rope(q, k, cos, sin):  # liger takes q and k together, and tables [1, S, D] with each half repeated
        full_cos, full_sin = torch.cat((cos, cos), -1).to(q.dtype), torch.cat((sin, sin), -1).to(q.dtype)
        return liger_rope(q, k, full_cos[None], full_sin[None])

    return {
        "rms_norm": lambda x, w: liger_rms_norm(x, w, 1e-5),
        "swiglu": liger_swiglu,
        "rotary": rope,
        "cross_entropy": liger_fused_linear_cross_entropy,
    }


# ---- 3. attention at long sequences --------------------------------------------------------


def attention_benchmarks(report: Report, device, smoke: bool, bench: Bench) -> None:
    section("attention: forward+backward by sequence length (bf16, 32 heads, 8 kv heads, head_dim 64)")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    heads, kv_heads, head_dim, tokens = (4, 2, 16, 256) if smoke else (32, 8, 64, 16384)
    lengths = [64, 128] if smoke else [1024, 2048, 4096, 8192, 16384]
    dense_limit = 128 if smoke else 4096  # the math kernel and the reference hold S x S scores
    rows, left_out = [], []
    for seq in lengths:
        batch = max(1, tokens // seq)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, heads, seq, head_dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        k, v = (
            torch.randn(batch, kv_heads, seq, head_dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
            for _ in range(2)
        )
        for mask_name, prefix_len in (("causal", 0), ("block-causal", seq * 3 // 4)):
            results = {}
            for backend in (*attention_backends(device.type), "reference"):
                if backend in ("sdpa_math", "reference") and seq > dense_limit:
                    continue

                def run(backend=backend):
                    out = attention(q, k, v, causal=True, prefix_len=prefix_len, backend=backend)
                    out.backward(torch.ones_like(out))
                    q.grad = k.grad = v.grad = None

                try:
                    results[backend] = bench.run(run)
                except RuntimeError as err:
                    if "cannot run" in str(err) or "out of memory" in str(err):
                        left_out.append(
                            f"{backend} seq={seq} {mask_name}: {'out of memory' if 'out of memory' in str(err) else 'cannot run these inputs'}"
                        )
                    else:
                        report.fail(f"attention benchmark {backend} seq={seq} {mask_name}", str(err).splitlines()[0])
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            base = results.get("sdpa", (float("nan"),))[0]
            for backend, (ms, mb) in results.items():
                rows.append([seq, batch, mask_name, backend, ms, base / ms, mb])
    table(["seq", "batch", "mask", "backend", "ms", "speedup vs sdpa", "peak MB"], rows)
    print(f"sdpa_math and reference only up to {dense_limit} tokens (they hold S x S scores)")
    for line in left_out:
        print(f"not in the table: {line}")


# ---- 4. the 1b model's training step ------------------------------------------------------


def model_step_benchmark(report: Report, device, smoke: bool) -> None:
    size = "tiny" if smoke else "1b"
    precision = "bf16 autocast, fp32 master weights" if device.type == "cuda" else "fp32"
    section(f"{size} model training step ({precision}, AdamW): auto vs plain PyTorch")
    if smoke:
        spec = DataSpec(
            cameras=("front",), image_size=(32, 32), state_dim=4, action_dim=3, n_obs_steps=1, action_horizon=4, fps=10
        )
        batch_size, warmup, steps, patch = 2, 1, 2, 8
    else:
        # Two 224x224 cameras in 16-pixel patches, 14-D state and actions, a 50-step chunk: 1124 tokens.
        spec = DataSpec(
            cameras=("head", "wrist"),
            image_size=(224, 224),
            state_dim=14,
            action_dim=14,
            n_obs_steps=1,
            action_horizon=50,
            fps=50,
        )
        batch_size, warmup, steps, patch = 8, 3, 10, 16
    cfg = RobotModelConfig(
        backbone=load_size(size), spec=spec, vision=VisionConfig(patch_size=patch), max_text_len=32, n_action_bins=256
    )
    flops_per_sample = training_flops_per_sample(cfg)
    rows = []
    for name, kernels, fused in (("plain PyTorch", PLAIN, False), ("auto", KernelConfig(), True)):
        result = report.attempt(
            f"model step {size} {name}", _time_training, cfg, kernels, fused, device, batch_size, warmup, steps
        )
        if result:
            seconds, peak_mb = result
            samples_per_s = batch_size / seconds
            rows.append(
                [
                    name,
                    seconds * 1e3,
                    samples_per_s * cfg.seq_len,
                    flops_per_sample * samples_per_s / BF16_PEAK_FLOPS,
                    peak_mb,
                ]
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"{cfg.seq_len} tokens per sample, batch {batch_size}, {flops_per_sample / 1e12:.3f} TFLOP per sample (training_flops_per_sample)"
    )
    table(["path", "ms/step", "tokens/s", "MFU (of 989 TFLOP/s)", "peak MB"], rows)
    if len(rows) == 2:
        print(f"auto / plain PyTorch: {rows[0][1] / rows[1][1]:.3f}x step speed")


def _time_training(cfg, kernels, fused: bool, device, batch_size: int, warmup: int, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    with torch.device(device):
        model = RobotTransformer(cfg)
    model.set_kernels(kernels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = random_batch(model, batch_size, device)
    bench = Bench(device, repeats=1)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = training_loss(model, batch, fused=fused)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    bench.sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    bench.sync()
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return seconds, peak


RL_SCRIPT = REPO / "benchmarks" / "gpu" / "rl_throughput.py"


def rl_throughput(report: Report, cpu_smoke: bool) -> None:
    """The RL case in a process of its own (its actors, CUDA context and memory stay out of this one)."""
    import subprocess

    section("RL throughput (benchmarks/gpu/rl_throughput.py)")
    if cpu_smoke:
        print("left out of the smoke run: the test suite runs rl_throughput.py --cpu-smoke itself")
        return
    missing = [name for name in ("gymnasium", "mujoco") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"skipped: {', '.join(missing)} not installed (pip install 'gymnasium[mujoco]')")
        return
    done = subprocess.run([sys.executable, str(RL_SCRIPT)], timeout=300)
    if done.returncode != 0:
        report.fail("rl throughput", f"rl_throughput.py exited with {done.returncode} (its output is above)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run the CPU-possible parts at tiny sizes")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["correctness", "ops", "attention", "experts", "model", "rl"],
        help="sections to leave out",
    )
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("FAILED setup: no CUDA device (use --cpu-smoke on a CPU machine)")
        return 1
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    started = time.perf_counter()
    describe(device)
    report = Report()
    bench = Bench(device, repeats=2 if args.cpu_smoke else 10)
    sections = {
        "correctness": lambda: correctness(report, device, args.cpu_smoke),
        "ops": lambda: op_benchmarks(report, device, args.cpu_smoke, bench),
        "attention": lambda: attention_benchmarks(report, device, args.cpu_smoke, bench),
        "experts": lambda: expert_benchmarks(report, device, args.cpu_smoke, bench),
        "model": lambda: model_step_benchmark(report, device, args.cpu_smoke),
        "rl": lambda: rl_throughput(report, args.cpu_smoke),
    }
    for name, run in sections.items():
        if name not in args.skip:
            report.attempt(f"section {name}", run)
    section("summary")
    print(f"finished in {time.perf_counter() - started:.0f} s")
    if report.failures:
        print(f"{len(report.failures)} check(s) FAILED:")
        for name in report.failures:
            print(f"  {name}")
        return 1
    print("all checks passed")
    return 0


def describe(device) -> None:
    import triton

    section("environment")
    print(f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
    print(f"uma_lightning: {PACKAGE_SOURCE}")
    if device.type == "cuda":
        print(
            f"GPU: {torch.cuda.get_device_name()} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))})"
        )
    else:
        print("CPU smoke run: Triton in its interpreter, tiny sizes; timings say nothing about speed")
    for package in ("flash_attn", "liger_kernel", "torchao"):
        print(f"{package}: {'installed' if importlib.util.find_spec(package) else 'not installed'}")


if __name__ == "__main__":
    sys.exit(main())
