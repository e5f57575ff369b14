"""The model contract: what a network must have for each feature of a run, in one place.

A stage module trains any ``nn.Module`` its ``build_model()`` returns. Each feature of the stack calls
the network through a few named pieces, listed in ``FEATURES``; ``uma fit`` (and validate, test,
predict) checks them when the run is set up, on the network built on the meta device, so a missing
piece stops the run before its first step in one line naming the piece and the feature that needs it:

- training: ``forward``, called by the stage's ``compute_loss``. The stages' own losses also read
  ``text_tokenizer`` (both) and ``action_binner`` (``PretrainModule``); a research subclass that
  overrides ``compute_loss`` calls what it likes;
- validation, test, prediction, closed-loop evaluation and ``Policy`` (``Policy.from_checkpoint``,
  RL actors): ``text_tokenizer`` and ``predict_actions``, as ``PolicyNetwork`` below spells them.
  Where the run itself needs neither, a network without them trains, and the run says once that
  its checkpoints cannot act as a ``Policy``;
- tokens per second in throughput logs and ``uma plan`` (optional): ``tokens_per_sample``.

The network's FLOPs are not part of the contract: they are counted from one training step
(``uma_lightning/modules/flops.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class PolicyNetwork(Protocol):
    """What evaluation, ``Policy`` and closed-loop evaluation call."""

    def text_tokenizer(self, instructions: list[str], device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and a mask of real tokens, [B, L] each, for B instructions."""
        ...

    def predict_actions(
        self, images: torch.Tensor, state: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor, **options
    ) -> torch.Tensor:
        """Normalised action chunks [B, action_horizon, action_dim] from uint8 images [B, T, C, H, W, 3],
        normalised state [B, T, state_dim] and the instructions' tokens; ``options`` are the stage's
        ``inference_options()`` (e.g. a flow sampler's ``steps``)."""
        ...


@dataclass(frozen=True)
class Piece:
    """One named piece of a network, and how the stack calls it (``positional`` arguments and
    ``keywords``; ``options`` adds the stage's inference options). Not callable: an attribute."""

    name: str
    call: str  # how it is called, for the message
    positional: int | None = None
    keywords: tuple[str, ...] = ()
    options: bool = False

    def problem(self, network: nn.Module, options: Mapping[str, Any]) -> str | None:
        """Why ``network`` lacks this piece, or cannot be called as the stack calls it; None when it
        has it. Signatures are checked, nothing is called."""
        kind = type(network).__name__
        if self.name == "forward":
            return f"{kind} has no forward" if type(network).forward is nn.Module.forward else None
        target = getattr(network, self.name, None)
        if target is None:
            return f"{kind} has no {self.call}"
        if self.positional is None:
            return None
        if not callable(target):
            return f"{kind}.{self.name} is not callable as {self.call}"
        keywords = {key: None for key in self.keywords} | (dict(options) if self.options else {})
        try:
            signature = inspect.signature(target)
        except ValueError:  # a builtin without a signature: nothing to check
            return None
        try:
            signature.bind(*(None,) * self.positional, **keywords)
        except TypeError as err:
            return f"{kind}.{self.name}{signature} cannot be called as {self.call}: {err}"
        return None


FORWARD = Piece("forward", "forward(...)")
TEXT_TOKENIZER = Piece(
    "text_tokenizer", "text_tokenizer(instructions, device=...) -> (text_ids, text_mask)", 1, ("device",)
)
PREDICT_ACTIONS = Piece(
    "predict_actions",
    "predict_actions(images, state, text_ids, text_mask, **options) -> normalised actions [B, horizon, action_dim]",
    4,
    options=True,
)
ACTION_BINNER = Piece("action_binner", "action_binner (encodes actions as tokens)")
TOKENS_PER_SAMPLE = Piece("tokens_per_sample", "tokens_per_sample (an int)")

POLICY = (TEXT_TOKENIZER, PREDICT_ACTIONS)

#: Each feature of a run, and the pieces of the network it calls.
FEATURES: dict[str, tuple[Piece, ...]] = {
    "training": (FORWARD,),
    "validation (errors of predicted action chunks)": POLICY,
    "test (errors of predicted action chunks)": POLICY,
    "prediction": POLICY,
    "closed-loop evaluation": POLICY,
    "Policy (Policy.from_checkpoint, uma predict, RL actors)": POLICY,
    "tokens per second": (TOKENS_PER_SAMPLE,),
}


def contract_problems(
    network: nn.Module, needs: Mapping[str, tuple[Piece, ...]], options: Mapping[str, Any] | None = None
) -> dict[str, list[str]]:
    """Each problem of ``network`` with what the features ``needs`` call, with the features that need
    it, in the order found; empty when it has every piece. ``options``: ``predict_actions``'s."""
    problems: dict[str, list[str]] = {}
    for feature, pieces in needs.items():
        for piece in pieces:
            problem = piece.problem(network, options or {})
            if problem:
                problems.setdefault(problem, []).append(feature)
    return problems
