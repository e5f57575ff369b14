"""The pictures the tools draw: pipeline schedules (their idle share is the bubble arithmetic's) and
the per-layer error of low precision."""

import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

from uma_lightning.tools.planner.estimate import pipeline_bubble  # noqa: E402
from uma_lightning.tools.planner.layout import Layout  # noqa: E402
from uma_lightning.tools.planner.schedule import Action, idle_fraction, plot_schedule, timeline  # noqa: E402


@pytest.mark.parametrize(
    "schedule, ranks, microbatches, virtual_stages",
    [
        ("GPipe", 4, 8, 1),
        ("1F1B", 4, 8, 1),
        ("1F1B", 3, 2, 1),
        ("Interleaved1F1B", 4, 8, 2),
        ("Interleaved1F1B", 2, 4, 3),
    ],
)
def test_schedule_idle_share_is_the_bubble_arithmetic(schedule, ranks, microbatches, virtual_stages):
    rows = timeline(schedule, ranks, microbatches, virtual_stages)
    layout = Layout(pp=ranks, microbatches=microbatches, virtual_stages=virtual_stages)
    assert idle_fraction(rows) == pytest.approx(pipeline_bubble(layout))
    # Every stage runs every microbatch forward and backward exactly once, forward before backward.
    stages = ranks * virtual_stages
    ran = [action for row in rows for action in row if action]
    assert sorted(ran) == sorted(
        Action(s, b, i) for s in range(stages) for b in (False, True) for i in range(microbatches)
    )
    when = {action: slot for row in rows for slot, action in enumerate(row) if action}
    for s in range(stages):
        for i in range(microbatches):
            assert when[Action(s, False, i)] < when[Action(s, True, i)]
            if s:
                assert when[Action(s - 1, False, i)] < when[Action(s, False, i)]
                assert when[Action(s, True, i)] < when[Action(s - 1, True, i)]


def test_1f1b_keeps_at_most_ranks_microbatches_in_flight_where_gpipe_keeps_all():
    def most_in_flight(schedule):
        rows = timeline(schedule, 4, 8)
        started = [0, 0]
        peak = 0
        for action in rows[0]:
            if action:
                started[action.backward] += 1
                peak = max(peak, started[0] - started[1])
        return peak

    assert most_in_flight("1F1B") == 4
    assert most_in_flight("GPipe") == 8


def test_schedule_picture_is_drawn_with_its_bubble(tmp_path):
    image = tmp_path / "schedule.png"
    bubble = plot_schedule(str(image), "1F1B", 4, 8)
    assert bubble == pytest.approx(3 / 11)
    pixels = imread(image)
    # 4 ranks x 22 slots: 7.04 x 3.8 inches at 100 dpi.
    assert pixels.shape[:2] == (380, 704)
    assert pixels[..., :3].std() > 0.1  # drawn, not blank


def test_unknown_schedule_and_uneven_interleaving_are_refused():
    with pytest.raises(ValueError, match="'ZB1'"):
        timeline("ZB1", 4, 8)
    with pytest.raises(ValueError, match="divisible"):
        timeline("Interleaved1F1B", 4, 6, 2)
