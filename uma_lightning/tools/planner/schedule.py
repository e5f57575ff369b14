"""A pipeline schedule drawn slot by slot: which microbatch each pipeline rank runs forward or backward
at each time slot, and the idle slots between them (the bubble).

Each rank's order of actions is torch's own, so the picture cannot drift from what
``torch.distributed.pipelining`` runs: a single-stage schedule (GPipe, 1F1B) is run on a stand-in
stage that records the forwards and backwards it is asked for, and Interleaved1F1B's order is the
schedule's ``pipeline_order``, the plan its runtime executes. An action then starts at the first slot
after the actions it needs have finished on the neighbouring stages. Forward and backward are drawn as
one slot each, the same assumption as the planner's bubble arithmetic (``estimate.pipeline_bubble``),
which the idle fraction drawn matches.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class Action(NamedTuple):
    stage: int  # the model stage: chunk * ranks + rank
    backward: bool
    microbatch: int


class RecordingStage:
    """Stands in for a ``PipelineStage``: no tensors and no communication. A multi-stage schedule
    reads its place to plan its order; a single-stage schedule runs it, and it records the forward
    and backward chunks it is asked for, in their order."""

    def __init__(self, stage_index: int, ranks: int, virtual_stages: int = 1):
        self.stage_index, self.num_stages = stage_index, ranks * virtual_stages
        self.group_rank, self.group_size = stage_index % ranks, ranks
        self.is_first, self.is_last = stage_index == 0, stage_index == self.num_stages - 1
        self.has_backward = True
        self.ran: list[Action] = []

    def forward_one_chunk(self, microbatch: int, *args, **kwargs) -> None:
        self.ran.append(Action(self.stage_index, False, microbatch))

    def backward_one_chunk(self, microbatch: int, *args, **kwargs) -> None:
        self.ran.append(Action(self.stage_index, True, microbatch))

    def __getattr__(self, name: str):
        # The sends, receives and gradient bookkeeping the schedule asks for: none here.
        return lambda *args, **kwargs: []


def rank_order(schedule: str, rank: int, ranks: int, microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """The forwards and backwards ``rank`` runs, in the order torch's schedule ``schedule`` runs them."""
    from torch.distributed import pipelining

    from uma_lightning.parallel.pipeline import SCHEDULE_CLASSES

    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    if schedule == "Interleaved1F1B":
        stages = [RecordingStage(chunk * ranks + rank, ranks, virtual_stages) for chunk in range(virtual_stages)]
        planned = schedule_class(stages, microbatches).pipeline_order[rank]
        compute = [action for action in planned if action and action.computation_type.value in ("F", "B")]
        return [Action(a.stage_index, a.computation_type.value == "B", a.microbatch_index) for a in compute]
    stage = RecordingStage(rank, ranks)
    run = schedule_class(stage, microbatches)
    # Marked as set up (setting a stage up infers its tensor shapes by running it); without a loss
    # function the schedule expects no backward set-up, yet still runs every backward.
    run._stage_forward_initialized, run._stage_backward_initialized = True, run._has_backward
    run._step_microbatches()
    return stage.ran


def timeline(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action | None]]:
    """Per rank, the action it runs at each slot (None: idle), from running every rank's order."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    if schedule == "Interleaved1F1B" and microbatches % ranks:
        raise ValueError(f"Interleaved1F1B needs microbatches ({microbatches}) divisible by the ranks ({ranks})")
    last = ranks * (virtual_stages if schedule == "Interleaved1F1B" else 1) - 1
    pending = [rank_order(schedule, r, ranks, microbatches, virtual_stages) for r in range(ranks)]
    done: set[Action] = set()
    rows: list[list[Action | None]] = [[] for _ in range(ranks)]
    while any(pending):
        finished = []
        for rank, actions in enumerate(pending):
            action = actions[0] if actions else None
            if action and all(need in done for need in _needs(action, last)):
                finished.append(actions.pop(0))
                rows[rank].append(action)
            else:
                rows[rank].append(None)
        if not finished:
            raise RuntimeError(f"{schedule} deadlocks with {ranks} ranks and {microbatches} microbatches")
        done.update(finished)
    return rows


def _needs(action: Action, last: int) -> list[Action]:
    stage, backward, i = action
    if not backward:
        return [Action(stage - 1, False, i)] if stage else []
    return [Action(stage, False, i)] + ([Action(stage + 1, True, i)] if stage < last else [])


def idle_fraction(rows: list[list[Action | None]]) -> float:
    slots = [slot for row in rows for slot in row]
    return sum(slot is None for slot in slots) / len(slots)


def plot_schedule(path: str, schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Draw the schedule's timeline to ``path`` (PNG); returns the idle fraction drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = timeline(schedule, ranks, microbatches, virtual_stages)
    bubble = idle_fraction(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(rows[0])), 0.6 * ranks + 1.4))
    colours = plt.get_cmap("tab10")
    for rank, row in enumerate(rows):
        for slot, action in enumerate(row):
            if action is None:
                ax.add_patch(plt.Rectangle((slot, rank), 1, 1, facecolor="whitesmoke", edgecolor="lightgray"))
                continue
            colour = colours(action.stage // ranks if virtual_stages > 1 else 0)
            shade = 0.45 if action.backward else 1.0
            ax.add_patch(plt.Rectangle((slot, rank), 1, 1, facecolor=colour, alpha=shade, edgecolor="white"))
            label = ("B" if action.backward else "F") + str(action.microbatch)
            ax.text(slot + 0.5, rank + 0.5, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(rows[0]))
    ax.set_ylim(ranks, 0)
    ax.set_yticks([r + 0.5 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("time slot (F: forward, B: backward of microbatch; grey: idle)")
    chunks = f", {virtual_stages} stages per rank" if schedule == "Interleaved1F1B" else ""
    ax.set_title(f"{schedule}: {ranks} ranks, {microbatches} microbatches{chunks}; bubble {bubble:.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return bubble
