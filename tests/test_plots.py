"""The pictures the tools draw: pipeline schedules (their idle share is the bubble arithmetic's) and
the per-layer error of low precision."""

import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402
from suite import assert_short_error, logged_run, recipe, run_main  # noqa: E402

from uma_lightning.tools.parity.precision import layer_errors, plot_precision  # noqa: E402
from uma_lightning.tools.planner.estimate import pipeline_bubble  # noqa: E402
from uma_lightning.tools.planner.layout import Layout  # noqa: E402
from uma_lightning.tools.planner.schedule import (  # noqa: E402
    Action,
    RecordingStage,
    idle_fraction,
    plot_schedule,
    timeline,
)
from uma_lightning.tools.planner.step_time import plot_step_time, step_time_parts  # noqa: E402


@pytest.mark.parametrize(
    "schedule, ranks, microbatches, virtual_stages",
    [
        ("GPipe", 4, 8, 1),
        ("1F1B", 4, 8, 1),
        ("1F1B", 3, 3, 1),
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
    with pytest.raises(ValueError, match="greater than or equal to the number of stages"):
        timeline("1F1B", 3, 2)  # torch's 1F1B refuses fewer microbatches than stages


def torch_plan(schedule: str, ranks: int, microbatches: int, virtual_stages: int) -> dict[int, list[Action]]:
    """torch's own plan of the schedule (its ``pipeline_order``), forwards and backwards only, per rank."""
    from torch.distributed import pipelining

    planned = {}
    for rank in range(ranks):
        stages = [RecordingStage(chunk * ranks + rank, ranks, virtual_stages) for chunk in range(virtual_stages)]
        run = getattr(pipelining, f"Schedule{schedule}")(stages if virtual_stages > 1 else stages[0], microbatches)
        computed = (a for a in run.pipeline_order[rank] if a and a.computation_type.value in ("F", "B"))
        planned[rank] = [Action(a.stage_index, a.computation_type.value == "B", a.microbatch_index) for a in computed]
    return planned


@pytest.mark.parametrize(
    "schedule, ranks, microbatches, virtual_stages",
    [
        ("GPipe", 4, 8, 1),
        ("1F1B", 4, 8, 1),
        ("1F1B", 2, 5, 1),
        ("Interleaved1F1B", 4, 8, 2),
        ("Interleaved1F1B", 2, 4, 3),
    ],
)
def test_each_rank_is_drawn_in_the_order_torchs_schedule_plans(schedule, ranks, microbatches, virtual_stages):
    rows = timeline(schedule, ranks, microbatches, virtual_stages)
    planned = torch_plan(schedule, ranks, microbatches, virtual_stages)
    for rank, row in enumerate(rows):
        drawn = [action for action in row if action]
        if schedule == "1F1B" and rank == ranks - 1:
            # A single-stage schedule runs its own loop (what the drawing records); its pipeline_order
            # only describes it, and numbers the last rank's forwards from 1 (torch 2.13). The
            # forwards and backwards alternate the same way.
            assert [a.backward for a in drawn] == [a.backward for a in planned[rank]]
        else:
            assert drawn == planned[rank], rank


def recordings(output_error: float) -> tuple[dict, dict]:
    """fp32 and low-precision recordings of three layers; layer ``c``'s output off by ``output_error``."""
    reference = {name: torch.ones(4) for name in "abc"}
    grads = {f"{name}.weight": torch.ones(4) for name in "abc"}
    low = dict(reference, c=torch.ones(4) * (1 + output_error), a=torch.ones(4) * 1.001)
    fp32 = {"layer_order": list("abc"), "activations": [reference], "grads": [grads], "losses": [1.0]}
    return fp32, {"layer_order": list("abc"), "activations": [low], "grads": [grads], "losses": [1.0]}


def red_pixels(path) -> int:
    rgb = imread(path)[..., :3]
    red = torch.tensor(matplotlib.colors.to_rgb("tab:red"))
    return int(((torch.from_numpy(rgb.copy()) - red).abs().max(dim=-1).values < 0.02).sum())


def test_precision_picture_shows_the_flagged_layer_in_red_and_only_it(tmp_path):
    flagged = layer_errors(*recordings(1.0), "bf16-mixed")
    assert flagged["flagged"] == ["c"]
    within = layer_errors(*recordings(0.01), "bf16-mixed")
    assert within["flagged"] == []
    for name, results in (("flagged", flagged), ("within", within)):
        plot_precision(str(tmp_path / f"{name}.png"), "bf16-mixed", {"one process": results})
        # 3 layers: 9 x (1.2 + 0.28 * 3) inches at 100 dpi.
        assert imread(tmp_path / f"{name}.png").shape[:2] == (204, 900)
    assert red_pixels(tmp_path / "flagged.png") > 500  # the bar of layer c
    assert red_pixels(tmp_path / "within.png") == 0


def test_parity_plot_needs_precision(capsys):
    code, _, err = run_main(["parity", "--config", recipe("pretrain"), "--plot", "errors.png"], capsys)
    assert_short_error(code, err, "--plot", "--precision")


def colour_pixels(path, colour: str) -> int:
    rgb = torch.from_numpy(imread(path)[..., :3].copy())
    return int(((rgb - torch.tensor(matplotlib.colors.to_rgb(colour))).abs().max(dim=-1).values < 0.02).sum())


def test_step_time_breakdown_is_read_from_the_run_and_stacked(tmp_path, monkeypatch):
    logged = {"time/data_wait_ms": [5.0, 1.0], "time/forward_ms": [20.0, 21.0], "time/backward_ms": [40.0, 39.0],
              "time/optimizer_ms": [8.0, 8.0]}  # fmt: skip
    parts = step_time_parts(logged_run(tmp_path, monkeypatch, logged))
    assert parts == {"data_wait": {0: 5.0, 1: 1.0}, "forward": {0: 20.0, 1: 21.0}, "backward": {0: 40.0, 1: 39.0},
                     "optimizer": {0: 8.0, 1: 8.0}, "overhead": {}}  # fmt: skip
    image = tmp_path / "steps.png"
    plot_step_time(str(image), parts)
    assert imread(image).shape[:2] == (450, 800)
    # Backward (C2) twice forward (C1) in both bars; overhead (C4), never logged, not drawn.
    assert colour_pixels(image, "C2") == pytest.approx(2 * colour_pixels(image, "C1"), rel=0.1)
    assert colour_pixels(image, "C4") == 0
    with pytest.raises(ValueError, match="logged no time/data_wait_ms"):
        step_time_parts(logged_run(tmp_path / "other", monkeypatch, {"loss": [1.0]}))


def test_uma_report_steptime_draws_the_run_and_names_a_bad_one(tmp_path, monkeypatch, capsys):
    run = logged_run(tmp_path, monkeypatch, {"time/forward_ms": [20.0, 22.0, 30.0]})
    code, out, _ = run_main(["report", "steptime", run, "--plot", str(tmp_path / "steps.png")], capsys)
    assert code == 0
    assert "forward: median 22.0 ms over 3 steps" in out
    assert imread(tmp_path / "steps.png").shape[:2] == (450, 800)
    code, _, err = run_main(["report", "steptime", str(tmp_path / "checkpoints"), "--plot", "x.png"], capsys)
    assert_short_error(code, err, "is not a run directory")
