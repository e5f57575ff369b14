"""Progress of long work: plain lines with the count, rate and time left in a log, a live bar with a
time left in a terminal (a real pseudo-terminal), for data generation, the frame store, conversion,
export and training."""

import fcntl
import io
import logging
import os
import pty
import re
import struct
import sys
import termios
import threading
import time
import tty

import forked_cli
import pytest
import torch
from checkpoint_helpers import backbone, optimizer_for, train_step
from lightning.fabric.utilities.rank_zero import rank_zero_only
from safetensors.torch import load_file
from suite import QUICK, RECIPE, run_main

from uma_lightning.checkpoint import CheckpointWriter
from uma_lightning.checkpoint.state import encode_parts, model_and_optimizer
from uma_lightning.data.generate import RealisticPreset, generate_realistic
from uma_lightning.progress import Progress

# A plain line: "<what> <count>/<total> (<rate> <unit>/s, <elapsed> elapsed, eta <time left>)".
LINE = r"(?P<done>[\d,.]+\w*)/(?P<total>[\d,.]+\w*) \([\d,.]+ ?\w*/s, \d+s elapsed, eta \d+s\)"


@pytest.fixture
def log_file(monkeypatch, caplog):
    """stderr is a file here, as in a job log; returns the lines of a logger (and its children) so far,
    and ``.clear()`` forgets them."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO)

    def lines(name="progress_test"):
        return [r.getMessage() for r in caplog.records if r.name.startswith(name)]

    lines.clear = caplog.clear
    return lines


def test_plain_lines_come_every_tenth_with_count_rate_and_time_left(log_file):
    with Progress(1000, "items", "item", logger=logging.getLogger("progress_test")) as progress:
        assert not progress.live
        for done in range(1, 1001):
            progress.update(done)
    lines = log_file()
    assert len(lines) == 10, lines  # not one per item
    matches = [re.fullmatch("items " + LINE, line) for line in lines]
    assert all(matches), lines
    assert [m["done"] for m in matches] == [f"{k * 100:,}" for k in range(1, 11)]
    assert {m["total"] for m in matches} == {"1,000"}


def test_plain_lines_of_unknown_totals_come_every_interval_and_not_more_often(log_file):
    logger = logging.getLogger("progress_test")
    with Progress(None, "steps", "step", logger=logger, every_s=0.2) as progress:
        for done in range(1, 101):  # quick work: no line
            progress.update(done)
        assert log_file() == []
        time.sleep(0.25)
        progress.update(101)
    (line,) = log_file()
    assert re.fullmatch(r"steps 101 \([\d.]+ step/s, \d+s elapsed\)", line), line


def test_only_rank_zero_reports_unless_the_work_is_one_process_alone(log_file, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = logging.getLogger("progress_test")
    with Progress(4, "items", "item", logger=logger) as progress:
        progress.update(4)
    assert log_file() == []
    with Progress(4, "items", "item", logger=logger, all_ranks=True) as progress:
        progress.update(4)
    assert len(log_file()) == 1


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    """Three episodes of three 224-pixel cameras, 6 frames each."""
    root = tmp_path_factory.mktemp("dataset") / "realistic"
    return generate_realistic(root, RealisticPreset(n_episodes=3, seconds=0.2, codec="h264"))


def test_frame_store_and_conversion_log_progress_lines(small_dataset, tmp_path, log_file, capsys):
    code, _, _ = run_main(["data", "cache", str(small_dataset), "--out", str(tmp_path / "store")], capsys)
    assert code == 0
    lines = [line for line in log_file("uma_lightning.data.frame_store") if "frames" in line]
    assert 1 <= len(lines) <= 10 and all(re.fullmatch("frame store: frames " + LINE, line) for line in lines), lines
    assert lines[-1].startswith("frame store: frames 54/54")  # 3 episodes x 3 cameras x 6 frames
    code, _, _ = run_main(["data", "convert", str(small_dataset), str(tmp_path / "v3"), "--to", "v3.0"], capsys)
    assert code == 0
    lines = [line for line in log_file("uma_lightning") if line.startswith("convert: episodes")]
    assert [re.fullmatch("convert: episodes " + LINE, line)["done"] for line in lines] == ["1", "2", "3"]


def test_export_logs_checksum_and_read_progress_and_exports_the_same_weights(tmp_path, log_file, capsys):
    model = backbone()
    optimizer = optimizer_for(model)
    train_step(model, optimizer)
    # A checkpoint as the training callback writes it, with the trainer part export reads settings from.
    parts = {**model_and_optimizer(model, [optimizer]), "trainer": {"hyper_parameters": {"lr": 0.01}}}
    writer = CheckpointWriter(tmp_path, 10, None, False, None)
    writer.save(3, *encode_parts(parts), {"epoch": 0, "world_size": 1})
    writer.close()
    expected = model.state_dict()
    # One checkpoint, or a run's checkpoints directory (its newest valid one, found by checksums too).
    for index, source in enumerate((tmp_path / "step-000000003", tmp_path)):
        output = tmp_path.with_name(f"{tmp_path.name}-export") / f"{index}.safetensors"
        code, _, err = run_main(["ckpt", "export", str(source), "--to", str(output), "--module", ""], capsys)
        assert code == 0, err
        lines = log_file("uma_lightning")
        verified = [line for line in lines if line.startswith("verify step-000000003: ")]
        read = [line for line in lines if line.startswith("read step-000000003: ")]
        assert verified and all(re.fullmatch("verify step-000000003: " + LINE, line) for line in verified), lines
        assert 1 <= len(read) <= 10 and all(re.fullmatch("read step-000000003: " + LINE, line) for line in read), lines
        last = re.fullmatch("read step-000000003: " + LINE, read[-1])
        assert last["done"] == last["total"]
        exported = load_file(output)
        assert exported.keys() == expected.keys()
        assert all(torch.equal(exported[key], expected[key]) for key in expected)
        log_file.clear()


def run_in_terminal(argv: list[str], cwd, timeout: float) -> tuple[int, str]:
    """Run ``uma ARGV`` with stdout and stderr on a pseudo-terminal of 100x24 in raw mode (so every
    carriage return in the output is the program's own); its exit status and everything it wrote."""
    controller, terminal = pty.openpty()
    tty.setraw(terminal)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks = []

    def read_all():
        while True:
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        code = forked_cli.run(argv, os.ttyname(terminal), cwd, timeout)
    finally:
        os.close(terminal)
        reader.join(10)
        os.close(controller)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_data_generation_in_a_terminal_shows_a_live_bar_with_time_left(tmp_path):
    argv = ["data", "generate", "--preset", "realistic", "--episodes", "3", "--seconds", "0.2", "--codec", "h264"]
    code, output = run_in_terminal([*argv, "--out", str(tmp_path)], tmp_path, timeout=120)
    assert code == 0, output
    redraws = re.findall(r"\repisodes: +(\d+)%\|[^|\r\n]*\| (\d)/3 \[([\d:]+)<([\d:?]+)", output)
    assert {done for _, done, _, _ in redraws} >= {"0", "3"}, output  # redrawn in place, from 0 to 3 of 3
    assert any(re.fullmatch(r"\d\d:\d\d", left) for *_, left in redraws), output  # a time left
    # Log lines print whole, on lines of their own above the bar, and no plain progress lines.
    assert re.search(r"(^|\n)generating RealisticPreset\(n_episodes=3.*\n", output), output
    assert not re.search(r"episodes \d/3 \(", output), output
    assert str(tmp_path / RealisticPreset(3, 0.2, codec="h264").dirname) in output


@pytest.mark.slow(seconds=30)
def test_training_in_a_terminal_shows_steps_loss_samples_per_second_and_time_left(tmp_path):
    argv = ["fit", "--config", RECIPE, *QUICK, "--trainer.default_root_dir", str(tmp_path / "run")]
    code, output = run_in_terminal(argv, tmp_path, timeout=300)
    assert code == 0, output[-3000:]
    bars = re.findall(r"\rtrain: +\d+%\|[^|\r\n]*\| (\d)/4 \[[\d:]+<([\d:?]+), [^\]\r\n]*\]", output)
    assert {step for step, _ in bars} >= {"0", "4"}, output[-3000:]
    assert re.search(r"\rtrain: [^\r\n]*4/4 \[[^\]\r\n]*loss \d+\.\d{4}, [\d.]+ samples/s\]", output), output[-3000:]
    # The step lines of a job log give way to the bar; the validation lines print whole, the bar
    # cleared before them and redrawn after, and the summary follows the closed bar.
    assert "step 2/4 |" not in output and "step 4/4 |" not in output
    assert re.search(r"\r +\rvalidation at step 2: val/[^\r\n]*\n\rtrain: ", output), output[-3000:]
    assert re.search(r"\ntrained 4 steps in \d+s\n", output), output[-3000:]
