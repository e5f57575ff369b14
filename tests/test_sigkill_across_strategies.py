"""SIGKILL at a random moment under strategies and stages the other SIGKILL tests leave out (tensor
parallel, expert parallel, post-training's flow model), then the same command again: it resumes
from the newest committed checkpoint and ends bit for bit where the uninterrupted run ends.
``benchmarks/sigkill_matrix.py`` draws 20 such kills over every strategy and both stages; the
suite runs this sample, drawn from a fixed seed."""

import pytest
from kill_and_rerun import MAX_STEPS, different_tensors, draw_moments, kill_and_rerun, reference

from uma_lightning.checkpoint import step_dirname

SEED = 36
MOMENTS = draw_moments(SEED, 3, cases=[("tp", "pretrain"), ("tp", "posttrain"), ("ep", "posttrain")])


@pytest.mark.slow(seconds=25)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("moment", MOMENTS, ids=lambda m: f"{m.strategy}-{m.stage}-{m.phase}")
def test_a_rerun_after_sigkill_ends_bit_for_bit_as_the_uninterrupted_run(tmp_path, moment):
    print(f"seed {SEED}: step {moment.step}, {moment.describe()}")
    expected = reference(moment.strategy, moment.stage, tmp_path / "reference")
    outcome = kill_and_rerun(moment, tmp_path / "killed", expected)
    print(f"killed at {outcome.killed_at}; newest committed checkpoint: step {outcome.newest_before_rerun}")
    assert outcome.killed_at.startswith(f"{moment.phase}: ")
    assert outcome.resumed_as_expected, (tmp_path / "killed" / "rerun.log").read_text()[-3000:]
    assert outcome.different == []
    # The comparison finds a difference where there is one: the uninterrupted run's previous checkpoint.
    assert different_tensors(expected.parent / step_dirname(MAX_STEPS - 2), expected)
