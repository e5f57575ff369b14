"""Datasets as the `lerobot` library (0.4) writes them, v2.1 and v3.0 (see lerobot_conformance.py):
each variant is read frame for frame and trained a few steps under the pretrain recipe; a dataset
broken where the CLI's config links read it stops `uma fit` with one clear line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import av
import lerobot_conformance as conformance
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from lerobot_conformance import Camera, Variant
from suite import TINY, run_main

from uma_lightning.cli import UmaCLI
from uma_lightning.data import RobotDataModule
from uma_lightning.data.dataset import FrameDataset, resize_frames
from uma_lightning.data.lerobot import ACTION_KEY, STATE_KEY, DatasetError, LeRobotMetadata
from uma_lightning.data.video import decode_frames_at
from uma_lightning.tools.data import main as data_tool

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "pretrain.yaml")
FRONT, WRIST, DEPTH = (
    Camera("observation.images.front", 32, 32),
    Camera("observation.images.wrist", 16, 24),
    Camera("observation.images.depth", 16, 16, depth=True),
)
VARIANTS = [
    # More episodes than lerobot's metadata buffer (10): meta/episodes spans two files, the first of
    # two row groups; data and video files roll over into chunk 1; names null on state and action.
    Variant(
        "v3.0-h264",
        "v3.0",
        "libx264",
        (FRONT, WRIST, DEPTH),
        lengths=(3, 4, 5) * 4,
        names="null",
        chunks_size=2,
        episodes_per_data_file=3,
        episodes_per_video_file=4,
        episodes_per_meta_file=11,
        gop=12,
    ),
    Variant(
        "v3.0-av1",
        "v3.0",
        "libsvtav1",
        (FRONT,),
        lengths=(4, 3, 5),
        names="dict",
        episodes_per_video_file=2,
        missing_stats=(ACTION_KEY,),
    ),
    Variant("v2.1-h264", "v2.1", "libx264", (FRONT, WRIST), lengths=(4, 5, 3), chunks_size=2, gop=12),
    Variant("v2.1-av1", "v2.1", "libsvtav1", (FRONT,), lengths=(5, 3, 4), names="null"),
    # lerobot's own converter on a v2.1 dataset: vectors as list<float>; size limits small enough
    # (7 KB of parquet, 4 KB of mp4) that the first two episodes share files and the third starts new ones.
    Variant(
        "v3.0-converted",
        "v3.0",
        "libx264",
        (FRONT, WRIST),
        lengths=(4, 5, 3),
        chunks_size=2,
        gop=12,
        converted=True,
        data_file_mb=0.007,
        video_file_mb=0.004,
    ),
    # The newest release's writer.
    Variant(
        "v3.0-lerobot-0.6",
        "v3.0",
        "libsvtav1",
        (FRONT, WRIST),
        lengths=(4, 3, 5),
        release="0.6",
        episodes_per_video_file=2,
    ),
]
# Measured over all variants (crf 30, frames of 16 to 32 pixels): a frame scores 26.8 dB or more
# against what was recorded at its time, and 18.4 dB at most against the frames just before and after.
MIN_PSNR_DB, NEIGHBOUR_MAX_PSNR_DB = 25.0, 21.0


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("lerobot")
    return {v.name: conformance.write(v, base / v.name) for v in VARIANTS}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


def test_the_generator_writes_what_lerobot_writes(written):
    """The features the reader must cope with are really in the files."""
    root = written["v3.0-h264"]
    front = sorted((root / "videos" / FRONT.key).rglob("*.mp4"))
    assert [p.relative_to(root).as_posix() for p in front] == [
        f"videos/{FRONT.key}/chunk-000/file-000.mp4",
        f"videos/{FRONT.key}/chunk-000/file-001.mp4",
        f"videos/{FRONT.key}/chunk-001/file-000.mp4",
    ]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in front)
    with av.open(str(front[0])) as container:  # B-frames: presentation order differs from decoding order
        pts = [packet.pts for packet in container.demux(video=0) if packet.pts is not None]
    assert pts != sorted(pts)
    assert b"elst" in front[0].read_bytes()
    assert len(list((root / "data").rglob("*.parquet"))) == 4
    meta_files = sorted((root / "meta" / "episodes").rglob("*.parquet"))
    assert len(meta_files) == 2
    import pyarrow.parquet as pq

    assert [pq.ParquetFile(meta_files[0]).metadata.row_group(i).num_rows for i in range(2)] == [10, 1]
    columns = pq.read_schema(meta_files[0]).names
    assert f"stats/{STATE_KEY}/q99" in columns and f"stats/{FRONT.key}/mean" in columns
    assert pq.read_schema(root / "meta" / "tasks.parquet").names == ["task_index", "__index_level_0__"]
    info = json.loads((root / "meta" / "info.json").read_text())
    assert (
        info["features"][STATE_KEY]["names"] is None
        and info["features"][DEPTH.key]["info"]["video.is_depth_map"] is True
    )
    with av.open(str(sorted((written["v3.0-av1"] / "videos").rglob("*.mp4"))[0])) as container:
        assert container.streams.video[0].codec.canonical_name == "av1"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_frame_reads_back(written, variant):
    meta = LeRobotMetadata.load(written[variant.name])
    assert meta.version == variant.version and [e.length for e in meta.episodes] == list(variant.lengths)
    assert meta.image_size == (32, 32)
    for episode, length in enumerate(variant.lengths):
        raw = meta.read_episode(episode)
        state, action = conformance.vectors(episode, length)
        np.testing.assert_array_equal(raw.state, state)
        np.testing.assert_array_equal(raw.action, action)
    dataset = FrameDataset(meta, n_obs_steps=1, action_horizon=1)
    assert len(dataset) == sum(variant.lengths)
    for row in range(len(dataset)):
        sample = dataset[row]
        episode, t = int(sample["episode_index"]), int(sample["frame_index"])
        assert sample["instruction"] == conformance.task_of(episode)
        np.testing.assert_array_equal(
            sample["state"][0],
            dataset.state_normalizer.normalize(conformance.vectors(episode, variant.lengths[episode])[0][t]),
        )
        for c, camera in enumerate(meta.cameras):
            recorded = next(cam for cam in variant.cameras if cam.key == camera)
            start = meta.episodes[episode].videos[camera][1]  # the episode's place in a shared file
            native = decode_frames_at(meta.video_path(episode, camera), np.array([start + t / variant.fps]))[0]
            quality = psnr(native, conformance.frame(recorded, episode, t))
            assert quality >= MIN_PSNR_DB, (camera, episode, t, quality)
            for other in (t - 1, t + 1):  # and not a neighbouring frame
                if 0 <= other < variant.lengths[episode]:
                    assert psnr(native, conformance.frame(recorded, episode, other)) < NEIGHBOUR_MAX_PSNR_DB, (
                        camera,
                        episode,
                        t,
                        other,
                    )
            # Every camera at the dataset's image size: the smaller ones scaled up.
            np.testing.assert_array_equal(
                sample["images"][0, c].numpy(), resize_frames(native[None], meta.image_size)[0]
            )


def test_names_and_statistics_as_lerobot_leaves_them(written):
    null = RobotDataModule(root=str(written["v3.0-h264"]), loader={"num_workers": 0}).normalization()
    assert null["state"]["names"] == [f"state_{i}" for i in range(6)] and null["action"]["names"] == [
        f"action_{i}" for i in range(4)
    ]
    grouped = RobotDataModule(root=str(written["v3.0-av1"]), loader={"num_workers": 0}).normalization()
    assert grouped["state"]["names"] == [f"joint_{i}" for i in range(6)]  # {"motors": [...]} flattened
    # meta/stats.json of the AV1 variant lacks the action: computed from the data.
    meta = LeRobotMetadata.load(written["v3.0-av1"])
    actions = np.concatenate([conformance.vectors(e, n)[1] for e, n in enumerate((4, 3, 5))]).astype(np.float64)
    np.testing.assert_allclose(meta.stats[ACTION_KEY]["mean"], actions.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(meta.stats[ACTION_KEY]["min"], actions.min(axis=0))
    # lerobot's extra quantiles and [3, 1, 1] camera statistics are read as written.
    h264 = LeRobotMetadata.load(written["v3.0-h264"])
    assert {"q01", "q10", "q50", "q90", "q99"} <= set(h264.stats[STATE_KEY]) and h264.stats[FRONT.key][
        "mean"
    ].shape == (3, 1, 1)


def test_task_text_in_a_named_pandas_index(written, tmp_path):
    root = shutil.copytree(written["v3.0-av1"], tmp_path / "named")
    tasks = pd.read_parquet(root / "meta" / "tasks.parquet")
    tasks.index.name = "instruction"  # pandas keeps a named index as a column of that name
    tasks.to_parquet(root / "meta" / "tasks.parquet")
    assert LeRobotMetadata.load(root).tasks == conformance.TASKS


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_every_variant_trains_under_the_pretrain_recipe(written, variant, tmp_path):
    cli = UmaCLI(
        [
            "fit",
            "--config",
            RECIPE,
            "--model.network.size",
            json.dumps({"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}),
            "--data.root",
            str(written[variant.name]),
            "--data.batch_size",
            "4",
            "--data.loader.num_workers",
            "0",
            "--data.val_episodes",
            "1",
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ]
    )
    assert cli.trainer.global_step == 2
    assert np.isfinite(float(cli.trainer.callback_metrics["train/loss"]))
    assert cli.model.spec.image_size == (32, 32) and len(cli.model.spec.cameras) == len(variant.cameras)
    # The checkpointed normalisation carries the dimension names, generated where lerobot wrote none.
    names = cli.model.hparams.normalization["state"]["names"]
    assert names == ([f"state_{i}" for i in range(6)] if variant.names == "null" else [f"joint_{i}" for i in range(6)])


def test_a_dataset_broken_at_normalisation_is_one_error_line(tmp_path):
    root = conformance.write(Variant("broken", "v3.0", "libx264", (WRIST,), lengths=(3, 3)), tmp_path / "arm")
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"][STATE_KEY]["names"] = ["shoulder", "elbow"]  # the state has 6 dimensions
    info_path.write_text(json.dumps(info))
    # `uma fit` as the console script runs it, counting the process's native threads once the
    # imports are done and again at exit: threads started in between (Arrow's pools, once) could
    # abort the exit with "terminate called without an active exception".
    script = (
        "import atexit, os, sys\n"
        "import uma_lightning.cli  # what `uma fit` imports, before the count\n"
        "from uma_lightning.command import main\n"
        "threads = lambda: len(os.listdir('/proc/self/task'))\n"
        "started = threads()\n"
        "atexit.register(lambda: print('native threads started:', threads() - started))\n"
        "main(sys.argv[1:])\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "fit",
            "--config",
            RECIPE,
            "--data.root",
            str(root),
            "--trainer.logger",
            "false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines[-1] == (
        f"uma: error: {info_path}: feature '{STATE_KEY}' has 2 names for its shape [6] (6 dimensions): ['shoulder', 'elbow']"
    ), result.stderr
    assert sum("error" in line for line in lines) == 1, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "native threads started: 0"


def test_the_converter_and_the_newest_writer_lay_out_what_lerobot_does(written):
    converted = written["v3.0-converted"]
    schema = pq.read_schema(converted / "data" / "chunk-000" / "file-000.parquet")
    assert schema.field(STATE_KEY).type == pa.list_(pa.float32()) and b"pandas" in schema.metadata
    assert [p.relative_to(converted).as_posix() for p in sorted((converted / "data").rglob("*.parquet"))] == [
        "data/chunk-000/file-000.parquet",
        "data/chunk-000/file-001.parquet",
    ]
    assert len(list((converted / "meta" / "episodes").rglob("*.parquet"))) == 1
    assert pq.read_schema(converted / "meta" / "tasks.parquet").names == ["task_index", "task"]
    info = json.loads((converted / "meta" / "info.json").read_text())
    assert tuple(info) == conformance.DATASET_INFO_FIELDS and info["features"][STATE_KEY]["fps"] == 10
    meta = LeRobotMetadata.load(converted)
    assert [e.videos[FRONT.key][1] > 0 for e in meta.episodes] == [False, True, False]  # shared, then a new file
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (converted / "videos").rglob("*.mp4"))

    newest = written["v3.0-lerobot-0.6"]
    info = json.loads((newest / "meta" / "info.json").read_text())
    assert tuple(info) == conformance.DATASET_INFO_FIELDS
    camera = info["features"][FRONT.key]["info"]
    assert camera["is_depth_map"] is False and camera["video.g"] == 2 and "video.is_depth_map" not in camera
    assert pq.read_schema(newest / "data" / "chunk-000" / "file-000.parquet").field(STATE_KEY).type == pa.list_(
        pa.float32(), 6
    )
    assert pq.read_schema(newest / "meta" / "tasks.parquet").names == ["task_index", "task"]


def _rewrite_state_row(path: Path, row: int, values: list[float]) -> None:
    table = pq.read_table(path)
    states = table.column(STATE_KEY).to_pylist()
    states[row] = values
    column = table.schema.get_field_index(STATE_KEY)
    pq.write_table(table.set_column(column, STATE_KEY, pa.array(states, pa.list_(pa.float32()))), path)


def test_uma_data_info_checks_what_training_reads(written, tmp_path, capsys):
    """Quiet on a dataset the loader reads whole; a list row of the wrong length, and a truncated
    video, are each named by file (and column and row) with exit status 2."""
    root = shutil.copytree(written["v3.0-converted"], tmp_path / "converted")
    assert data_tool(["info", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "every file the loader reads: 3 episode(s), 4 video file(s)" in out and err == ""

    data_file = root / "data" / "chunk-000" / "file-000.parquet"
    _rewrite_state_row(data_file, 6, [0.5] * 5)  # episode 1's third frame: 5 values for 6 dimensions
    message = f"episode 1: {data_file}: column '{STATE_KEY}': row 6 holds 5 values, meta/info.json declares shape [6]"
    with pytest.raises(DatasetError) as error:
        LeRobotMetadata.load(root).read_episode(1)
    assert str(error.value) == message
    video = root / "videos" / WRIST.key / "chunk-000" / "file-001.mp4"
    video.write_bytes(video.read_bytes()[: video.stat().st_size // 2])
    assert data_tool(["info", str(root)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"uma data: error: {message}"
    assert len(lines) == 2 and lines[1].startswith("uma data: error: episode 2: ") and str(video) in lines[1], lines


@pytest.mark.parametrize("damage", ["video", "parquet"])
def test_a_bad_file_met_in_a_loader_worker_is_one_error_line(written, tmp_path, capsys, damage):
    """Found by a worker mid-run, re-raised by torch with the worker's traceback: `uma fit` prints
    only the message, which names the file, and exits 2."""
    root = shutil.copytree(written["v3.0-converted"], tmp_path / "converted")
    if damage == "video":
        bad = root / "videos" / FRONT.key / "chunk-000" / "file-001.mp4"
        bad.write_bytes(bad.read_bytes()[:200])
    else:
        bad = root / "data" / "chunk-000" / "file-001.parquet"
        _rewrite_state_row(bad, 1, [0.5] * 7)
    args = ["fit", "--config", RECIPE, "--model.network.size", json.dumps(TINY), "--data.root", str(root)]
    args += ["--data.batch_size", "4", "--data.val_episodes", "0", "--data.loader.num_workers", "1"]
    args += ["--trainer.max_steps", "3", "--trainer.limit_val_batches", "0", "--trainer.logger", "false"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run")]
    code, _, err = run_main(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("uma: error: episode 2: ") and str(bad) in lines[-1], err
    assert sum("error" in line for line in lines) == 1, err


def test_columns_training_does_not_read_are_named_and_left_alone(written, tmp_path, capsys):
    """lerobot 0.6's annotation pipeline adds two columns of dtype "language" (lists of message
    structs, src/lerobot/datasets/language.py): the dataset still loads, and `uma data info` names them."""
    root = shutil.copytree(written["v3.0-lerobot-0.6"], tmp_path / "annotated")
    row = pa.struct(
        [("role", pa.string()), ("content", pa.string()), ("style", pa.string()), ("camera", pa.string())]
        + [("tool_calls", pa.list_(pa.string()))]
    )
    for path in (root / "data").rglob("*.parquet"):
        table = pq.read_table(path)
        messages = [[{"role": "user", "content": "pick", "style": "subtask", "camera": None, "tool_calls": []}]]
        for name in ("language_persistent", "language_events"):
            table = table.append_column(name, pa.array(messages * table.num_rows, pa.list_(row)))
        pq.write_table(table, path)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    for name in ("language_persistent", "language_events"):
        info["features"][name] = {"dtype": "language", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info, indent=4))

    meta = LeRobotMetadata.load(root)
    np.testing.assert_array_equal(meta.read_episode(2).state, conformance.vectors(2, 5)[0])
    assert data_tool(["info", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "unused    language_persistent (language), language_events (language): training does not read these" in out
    assert err == ""
