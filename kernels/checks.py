"""Each kernel against its reference, values and gradients, on any device: the tests run these on CPU
(Triton in its interpreter), the GPU script on CUDA.

The reference is the plain PyTorch computation in float32 on float32 copies of the inputs. A
check passes when max |actual − reference| ≤ tol · max |reference|, with tol per dtype in
``TOLERANCE``: about the rounding of a result to that dtype, plus summation order. For the
gradients of a product, A B, the scale is max |A| |B| instead: a sum's rounding error grows with
the sizes of its terms, which cancellation in the sum does not shrink (the fused cross-entropy's
d hidden sums 32000 classes' terms of both signs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from uma_lightning.kernels.attention import attention
from uma_lightning.kernels.cross_entropy import linear_cross_entropy
from uma_lightning.kernels.rms_norm import rms_norm
from uma_lightning.kernels.rotary import apply_rotary
from uma_lightning.kernels.swiglu import swiglu

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Check:
    name: str
    error: float  # max |actual - reference|
    allowed: float

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed  # False for NaN

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: max error {self.error:.3g} (allowed {self.allowed:.3g})"


def compare(
    name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: Optional[float] = None
) -> Check:
    """``scale``: what the error is measured against; by default max |expected|."""
    if actual.shape != expected.shape:
        return Check(f"{name} (shape {tuple(actual.shape)} != {tuple(expected.shape)})", float("inf"), 0.0)
    expected = expected.detach().float()
    error = (actual.detach().float() - expected).abs().max().item() if expected.numel() else 0.0
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 0.0
    return Check(name, error, TOLERANCE[dtype] * (scale or 1.0))


def _leaves(dtype: torch.dtype, device, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Leaf copies in ``dtype`` on ``device``, and float32 copies of those (the reference's inputs)."""
    low = [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]
    return low, [t.detach().float().requires_grad_() for t in low]


def _values_and_grads(label: str, dtype, out, expected, inputs, reference_inputs, names) -> list[Check]:
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7)).to(expected.device)
    got = torch.autograd.grad(out, inputs, grad.to(out.dtype))
    want = torch.autograd.grad(expected, reference_inputs, grad)
    return [compare(label, out, expected, dtype)] + [
        compare(f"{label} d{n}", g, w, dtype) for g, w, n in zip(got, want, names)
    ]


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device, backend: str = "triton") -> list[Check]:
    gen = torch.Generator().manual_seed(0)
    (x, w), (xr, wr) = _leaves(
        dtype, device, torch.randn(shape, generator=gen), 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    )
    out = rms_norm(x, w, 1e-5, backend=backend)
    expected = F.rms_norm(xr, (shape[-1],), wr, 1e-5)
    return _values_and_grads(
        f"rms_norm {backend} {_dtype(dtype)} {shape}", dtype, out, expected, (x, w), (xr, wr), "xw"
    )


def check_swiglu(shape: tuple[int, ...], dtype: torch.dtype, device, backend: str = "triton") -> list[Check]:
    gen = torch.Generator().manual_seed(1)
    (gate, up), (gr, ur) = _leaves(
        dtype, device, 3 * torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    )
    out = swiglu(gate, up, backend=backend)
    expected = F.silu(gr) * ur
    return _values_and_grads(
        f"swiglu {backend} {_dtype(dtype)} {shape}", dtype, out, expected, (gate, up), (gr, ur), ("gate", "up")
    )


def check_rotary(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device, backend: str = "triton", heads_last: bool = False
) -> list[Check]:
    """x [B, H, S, D]; ``heads_last`` lays it out as projections viewed as heads ([B, S, H, D] memory)."""
    batch, heads, seq, head_dim = shape
    gen = torch.Generator().manual_seed(2)
    angles = torch.outer(torch.arange(seq + 5, dtype=torch.float32), 1e4 ** -(torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = angles.cos().to(device), angles.sin().to(device)  # longer than the sequence, as in the model
    base = (
        torch.randn(batch, seq, heads, head_dim, generator=gen).transpose(1, 2)
        if heads_last
        else torch.randn(shape, generator=gen)
    )
    (x,), (xr,) = _leaves(dtype, device, base)
    out = apply_rotary(x, cos, sin, backend=backend)
    half = head_dim // 2
    # Reference as complex multiplication by e^{iθ}: an independent statement of the rotation.
    turned = torch.complex(xr[..., :half], xr[..., half:]) * torch.polar(
        torch.ones_like(cos[:seq]), angles[:seq].to(device)
    )
    expected = torch.cat((turned.real, turned.imag), dim=-1)
    layout = "bshd" if heads_last else "bhsd"
    return _values_and_grads(
        f"rotary {backend} {_dtype(dtype)} {shape} {layout}", dtype, out, expected, (x,), (xr,), "x"
    )


def check_linear_cross_entropy(
    rows: int, dim: int, vocab: int, dtype: torch.dtype, device, backend: str = "triton"
) -> list[Check]:
    gen = torch.Generator().manual_seed(3)
    (h, w), (hr, wr) = _leaves(
        dtype, device, torch.randn(rows, dim, generator=gen), torch.randn(vocab, dim, generator=gen) / dim**0.5
    )
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[1::4] = -100
    targets = targets.to(device)
    loss, predicted = linear_cross_entropy(h, w, targets, backend=backend)
    logits = hr @ wr.T
    expected = F.cross_entropy(logits, targets) if (targets != -100).any() else logits.sum() * 0
    label = f"linear_cross_entropy {backend} {_dtype(dtype)} rows={rows} dim={dim} vocab={vocab}"
    checks = [compare(f"{label} loss", loss, expected, dtype)]
    got = torch.autograd.grad(loss, (h, w))
    *want, grad_logits = torch.autograd.grad(expected, (hr, wr, logits))
    sizes = (grad_logits.abs() @ wr.detach().abs(), grad_logits.abs().T @ hr.detach().abs())  # |G| |W|, |G|ᵀ |H|
    checks += [
        compare(f"{label} d{name}", g, r, dtype, scale=size.max().item())
        for g, r, size, name in zip(got, want, sizes, ("hidden", "weight"))
    ]
    # Predictions must be an argmax: their logit at most the tolerance below the row's maximum (ties may go either way).
    shortfall = logits.max(dim=-1).values - logits.gather(1, predicted[:, None]).squeeze(1)
    checks.append(
        Check(
            f"{label} predictions are the argmax", shortfall.max().item(), TOLERANCE[dtype] * logits.abs().max().item()
        )
    )
    return checks


def check_attention(
    backend: str,
    dtype: torch.dtype,
    device,
    *,
    kv_heads: int,
    causal: bool,
    prefix_len: int,
    padded: bool,
    seq: int = 11,
    head_dim: int = 16,
) -> list[Check]:
    """``backend`` against ``reference``; outputs and gradients compared at real (unpadded) positions only."""
    gen = torch.Generator().manual_seed(4)
    (q, k, v), _ = _leaves(
        dtype,
        device,
        torch.randn(2, 4, seq, head_dim, generator=gen),
        *torch.randn(2, 2, kv_heads, seq, head_dim, generator=gen),
    )
    mask = None
    real = torch.ones(2, seq, dtype=torch.bool, device=device)
    if padded:
        mask = real.clone()
        mask[-1, 2:4] = False  # padding inside the prefix, as short instructions leave it
        real = mask
    keep = real[:, None, :, None]
    weight = torch.randn(q.shape, generator=gen).to(device) * keep
    results = []
    for name in (backend, "reference"):
        out = attention(q, k, v, causal=causal, prefix_len=prefix_len, key_padding_mask=mask, backend=name)
        results.append((out * keep, *torch.autograd.grad((out.float() * weight).sum(), (q, k, v))))
    mask_name = "block-causal" if causal and prefix_len > 1 else "causal" if causal else "full"
    label = f"attention {backend} {_dtype(dtype)} kv_heads={kv_heads} {mask_name}{' padded' if padded else ''}"
    return [
        compare(f"{label} {part}", got, want, dtype) for got, want, part in zip(*results, ("out", "dq", "dk", "dv"))
    ]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
