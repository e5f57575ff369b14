"""Which implementation each op runs, chosen from config and logged once per decision.

Every fused op (``rms_norm``, ``swiglu``, ``rotary``, ``cross_entropy``) takes ``triton``, ``torch``
or ``auto``. ``auto`` runs the Triton kernel on a CUDA tensor when Triton is installed, and the
PyTorch version everywhere else. On CPU, Triton kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1``), which is for tests: asking for ``triton`` on CPU without it is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from uma_lightning.kernels import flash

log = logging.getLogger("uma_lightning.kernels")

OP_BACKENDS = ("auto", "triton", "torch")
EXPERT_BACKENDS = ("auto", "grouped", "loop")  # see experts.py
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INSTALL_TRITON = "pip install triton (CUDA builds of torch ship it)"
# Attention has backends of its own (described in attention.py); named here, where configs are checked.
SDPA_KERNELS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
ATTENTION_BACKENDS = ("auto", *flash.PACKAGES, "sdpa", *SDPA_KERNELS, "reference")


@dataclass(frozen=True)
class KernelConfig:
    """The implementation behind each op the model calls; see ``uma_lightning.kernels`` for the choices.

    Args:
        attention: auto, flash_attn, flash_attn_4, sdpa, sdpa_flash, sdpa_cudnn, sdpa_efficient, sdpa_math
            or reference; auto picks flash-attn where installed and usable, else sdpa.
        rms_norm: auto, triton or torch; auto picks triton on a CUDA GPU.
        swiglu: auto, triton or torch; auto picks triton on a CUDA GPU.
        rotary: auto, triton or torch; auto picks triton on a CUDA GPU.
        cross_entropy: The fused linear + cross-entropy: auto, triton or torch; auto picks triton on a CUDA GPU.
        linear: torch, or float8 (torchao; changes the numerics, so never chosen by auto).
        experts: Mixture-of-experts layers: auto, grouped (one grouped matmul for all experts) or loop.
    """

    attention: str = "auto"
    rms_norm: str = "auto"
    swiglu: str = "auto"
    rotary: str = "auto"
    cross_entropy: str = "auto"
    linear: str = "torch"
    experts: str = "auto"

    def __post_init__(self) -> None:
        allowed = {"attention": ATTENTION_BACKENDS, "linear": ("torch", "float8"), "experts": EXPERT_BACKENDS}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            choices = allowed.get(field.name, OP_BACKENDS)
            if value not in choices:
                raise ValueError(
                    f"kernels.{field.name}: unknown backend {value!r}{did_you_mean(value, choices)} (choose from {', '.join(choices)})"
                )
        self._check_installed()

    def _check_installed(self) -> None:
        """A backend asked for by name must be installed; ``auto`` never needs anything extra."""
        if self.attention in flash.PACKAGES and not flash.installed(self.attention):
            raise ValueError(f"kernels.attention: {flash.install_hint(self.attention)}")
        for field in ("rms_norm", "swiglu", "rotary", "cross_entropy"):
            if getattr(self, field) == "triton" and not triton_installed():
                raise ValueError(f"kernels.{field}=triton needs Triton: {INSTALL_TRITON}")
        if self.linear == "float8" and importlib.util.find_spec("torchao") is None:
            raise ValueError("kernels.linear=float8 needs torchao: pip install 'uma-lightning[float8]'")


def did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of the compiler stack, which
    loads DTensor and FSDP: the models import these kernels and must stay free of distributed code.
    Sets the mark that decorator sets, read only when torch.compile traces a call (the fullgraph
    tests in test_kernels.py break if it stops working)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def resolve(op: str, backend: str, device_type: str, dtype: torch.dtype) -> str:
    """``"triton"`` or ``"torch"`` for ``op`` on tensors of ``device_type`` and ``dtype``.

    Runs eagerly even under torch.compile (its result is a constant of the graph), so the choice
    is logged once and an unavailable backend fails with its message rather than a graph break.
    """
    return _resolve(op, backend, device_type, dtype, triton_interpreting())


@functools.cache  # called for every op of every forward: decide once per case
def _resolve(op: str, backend: str, device_type: str, dtype: torch.dtype, interpreting: bool) -> str:
    if backend not in OP_BACKENDS:
        raise ValueError(
            f"kernels.{op}: unknown backend {backend!r}{did_you_mean(backend, OP_BACKENDS)} (choose from {', '.join(OP_BACKENDS)})"
        )
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_installed():
            raise RuntimeError(f"kernels.{op}=triton needs Triton: {INSTALL_TRITON}")
        if device_type != "cuda" and not interpreting:
            raise RuntimeError(
                f"kernels.{op}=triton needs a CUDA tensor, got {device_type}; "
                "set TRITON_INTERPRET=1 to run Triton kernels on CPU in Triton's interpreter (slow, for tests)"
            )
        if dtype not in TRITON_DTYPES:
            raise RuntimeError(f"kernels.{op}=triton supports float32, float16 and bfloat16, got {dtype}")
        return "triton"
    if device_type != "cuda":
        choice, why = "torch", f"Triton kernels need a CUDA device, this tensor is on {device_type}"
    elif not triton_installed():
        choice, why = "torch", "Triton is not installed"
    elif dtype not in TRITON_DTYPES:
        choice, why = "torch", f"no Triton kernel for {dtype}"
    else:
        choice, why = "triton", "fused Triton kernel on CUDA"
    log_once(f"kernel {op}: {choice} (auto: {why})")
    return choice


_logged: set[str] = set()


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)
