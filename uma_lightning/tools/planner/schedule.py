"""A pipeline schedule drawn slot by slot: which microbatch each pipeline rank runs forward or backward
at each time slot, and the idle slots between them (the bubble).

Each rank runs its actions in the order its schedule gives (GPipe, 1F1B, or Interleaved1F1B's
Megatron order); an action starts at the first slot after the actions it needs have finished on the
neighbouring stages. Forward and backward are drawn as one slot each, the same assumption as the
planner's bubble arithmetic (``estimate.pipeline_bubble``), which the idle fraction drawn matches.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class Action(NamedTuple):
    stage: int  # the model stage: chunk * ranks + rank
    backward: bool
    microbatch: int


def rank_order(schedule: str, rank: int, ranks: int, microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """The actions ``rank`` runs, in its schedule's order."""
    if schedule == "GPipe":
        return [Action(rank, False, i) for i in range(microbatches)] + [
            Action(rank, True, i) for i in range(microbatches)
        ]
    chunks = virtual_stages if schedule == "Interleaved1F1B" else 1
    total = microbatches * chunks

    def nth(k: int, backward: bool) -> Action:
        group = (k // ranks) % chunks
        chunk = chunks - 1 - group if backward else group
        return Action(chunk * ranks + rank, backward, (k // (ranks * chunks)) * ranks + k % ranks)

    warmup = min(total, (ranks - rank - 1) * 2 + (chunks - 1) * ranks if chunks > 1 else ranks - rank - 1)
    order = [nth(k, False) for k in range(warmup)]
    forwards, backwards = warmup, 0
    while forwards < total:
        order += [nth(forwards, False), nth(backwards, True)]
        forwards, backwards = forwards + 1, backwards + 1
    return order + [nth(k, True) for k in range(backwards, total)]


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
