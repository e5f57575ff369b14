"""Video encoding/decoding and the LeRobot v2.1 writer and reader, including bad-data errors."""

import hashlib
import json
import os
import re
import subprocess
import sys

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from uma_lightning.data.generate import CAMERA, Rollout, rollout_expert
from uma_lightning.data.lerobot import ACTION_KEY, STATE_KEY, DatasetError, LeRobotMetadata
from uma_lightning.data.video import VideoError, decode_frames_at, decode_video, encode_video, rgb_to_yuv420p
from uma_lightning.data.writer import LeRobotWriter
from uma_lightning.sim import PlanarArmConfig, PlanarArmEnv

FPS = 10.0


@pytest.fixture(scope="module")
def rollouts() -> list[Rollout]:
    env = PlanarArmEnv(PlanarArmConfig(image_size=32))
    return [rollout_expert(env, seed) for seed in range(3)]


def write_dataset(root, rollouts: list[Rollout]) -> LeRobotWriter:
    writer = LeRobotWriter(
        root,
        fps=FPS,
        cameras=(CAMERA,),
        image_size=(32, 32),
        state_names=PlanarArmEnv.state_names,
        action_names=PlanarArmEnv.action_names,
    )
    for rollout in rollouts:
        writer.add_episode({CAMERA: rollout.frames}, rollout.states, rollout.actions, rollout.instruction)
    return writer


@pytest.fixture
def dataset(tmp_path, rollouts):
    return write_dataset(tmp_path / "ds", rollouts).finalize()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / mse))


def format_psnr(frames: np.ndarray) -> float:
    """PSNR of a lossless yuv420p round trip: chroma subsampling of sharp coloured edges alone costs
    this much (~29 dB at 32x32), so it is the reference for the codec's own loss."""
    converted = [
        av.VideoFrame.from_ndarray(f, format="rgb24").reformat(format="yuv420p").reformat(format="rgb24").to_ndarray()
        for f in frames
    ]
    return psnr(np.stack(converted), frames)


def assert_close_to_original(decoded: np.ndarray, original: np.ndarray) -> None:
    assert decoded.dtype == np.uint8 and decoded.shape == original.shape
    assert psnr(decoded, original) > format_psnr(original) - 1.0  # H.264 at crf 20 adds < 1 dB
    assert np.abs(decoded.astype(int) - original).mean() < 4.0  # levels of 255


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------- video
def test_video_round_trip_is_close_and_timed(tmp_path, rollouts):
    frames = rollouts[0].frames
    path = tmp_path / "episode.mp4"
    encode_video(frames, path, FPS)
    video = decode_video(path)
    assert np.allclose(video.timestamps, np.arange(len(frames)) / FPS)
    assert_close_to_original(video.frames, frames)


@pytest.mark.parametrize("user_level", [None, "3"])
def test_av1_encoding_prints_only_errors_unless_svt_log_asks_for_more(tmp_path, user_level):
    script = (
        "import sys, numpy as np\n"
        "from uma_lightning.data.video import encode_video\n"
        "encode_video(np.zeros((4, 32, 32, 3), np.uint8), sys.argv[1], 30, codec='av1')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SVT_LOG"} | ({"SVT_LOG": user_level} if user_level else {})
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.mp4")], env=env, capture_output=True, text=True, check=True
    )
    printed = done.stdout + done.stderr
    assert ("Svt[info]" in printed) == (user_level == "3"), printed[-2000:]


def test_video_encoding_is_deterministic(tmp_path, rollouts):
    encode_video(rollouts[0].frames, tmp_path / "a.mp4", FPS)
    encode_video(rollouts[0].frames, tmp_path / "b.mp4", FPS)
    assert sha256(tmp_path / "a.mp4") == sha256(tmp_path / "b.mp4")


def test_colour_conversion_gives_bt601_limited_range_with_block_mean_chroma():
    red, green, blue, white = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)
    expected_yuv = {
        red: (81, 90, 240),
        green: (145, 54, 34),
        blue: (41, 240, 110),
        white: (235, 128, 128),
        (0, 0, 0): (16, 128, 128),
    }
    for rgb, (y, cb, cr) in expected_yuv.items():
        planes = rgb_to_yuv420p(np.full((2, 4, 3), rgb, dtype=np.uint8))
        assert planes.shape == (3, 4)
        assert planes[:2].tolist() == [[y] * 4] * 2 and planes[2].tolist() == [cb, cb, cr, cr]
    # A 2x2 block half red, half blue: its chroma is the mean of the two colours'.
    block = np.array([[red, blue], [blue, red]], dtype=np.uint8)
    assert rgb_to_yuv420p(block)[2:].reshape(-1).tolist() == [165, 175]


def test_frames_at_timestamps_match_the_decoded_frames(tmp_path, rollouts):
    path = tmp_path / "episode.mp4"
    encode_video(rollouts[0].frames, path, FPS)
    everything = decode_video(path).frames
    picked = decode_frames_at(path, np.array([0.3, 0.0, 0.3], dtype=np.float32))
    assert np.array_equal(picked, everything[[3, 0, 3]])


@pytest.mark.parametrize("timestamp", [0.05, 100.0, -0.1])  # between frames, past the end, before the start
def test_frame_missing_at_timestamp_is_an_error_naming_file_and_time(tmp_path, rollouts, timestamp):
    path = tmp_path / "episode.mp4"
    encode_video(rollouts[0].frames, path, FPS)
    with pytest.raises(VideoError, match=rf"{re.escape(str(path))}: no frame at timestamp {timestamp:.6f}s"):
        decode_frames_at(path, np.array([0.0, timestamp]))


def test_truncated_video_is_an_error_naming_the_file(tmp_path, rollouts):
    path = tmp_path / "episode.mp4"
    encode_video(rollouts[0].frames, path, FPS)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(VideoError, match=re.escape(str(path))):
        decode_video(path)


def test_encode_rejects_bad_frames(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        encode_video(np.zeros((2, 8, 8, 3), dtype=np.float32), tmp_path / "x.mp4", FPS)
    with pytest.raises(ValueError, match="even"):
        encode_video(np.zeros((2, 7, 8, 3), dtype=np.uint8), tmp_path / "x.mp4", FPS)


# ---------------------------------------------------------------------------------------- writer and reader
def test_round_trip_preserves_low_dim_data_exactly(dataset, rollouts):
    meta = LeRobotMetadata.load(dataset)
    offset = 0
    for index, rollout in enumerate(rollouts):
        episode = meta.read_episode(index)
        length = len(rollout.states)
        assert np.array_equal(episode.state, rollout.states)
        assert np.array_equal(episode.action, rollout.actions)
        assert np.array_equal(episode.frame_index, np.arange(length))
        assert np.array_equal(episode.global_index, offset + np.arange(length))
        assert np.allclose(episode.timestamp, np.arange(length) / FPS)
        assert {meta.tasks[i] for i in episode.task_index} == {rollout.instruction}
        assert meta.episodes[index].length == length and meta.episodes[index].tasks == (rollout.instruction,)
        offset += length

        assert_close_to_original(decode_video(meta.video_path(index, CAMERA)).frames, rollout.frames)


def test_info_json_describes_the_files(dataset, rollouts):
    info = json.loads((dataset / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v2.1"
    assert info["fps"] == FPS
    assert info["total_episodes"] == 3
    assert info["total_frames"] == sum(len(r.states) for r in rollouts)
    assert info["total_tasks"] == len({r.instruction for r in rollouts})
    assert info["splits"] == {"train": "0:3"}
    assert info["features"][STATE_KEY] == {"dtype": "float32", "shape": [5], "names": list(PlanarArmEnv.state_names)}
    assert info["features"][ACTION_KEY]["shape"] == [3]
    assert info["features"][CAMERA]["dtype"] == "video" and info["features"][CAMERA]["shape"] == [32, 32, 3]
    assert (dataset / "data" / "chunk-000" / "episode_000002.parquet").is_file()
    assert (dataset / "videos" / "chunk-000" / CAMERA / "episode_000002.mp4").is_file()
    schema = pq.read_schema(dataset / "data" / "chunk-000" / "episode_000000.parquet")
    assert schema.field(STATE_KEY).type == pa.list_(pa.float32(), 5)
    assert schema.field("index").type == pa.int64()


def test_stats_match_numpy_on_the_written_arrays(dataset, rollouts):
    meta = LeRobotMetadata.load(dataset)
    for key, arrays in ((STATE_KEY, [r.states for r in rollouts]), (ACTION_KEY, [r.actions for r in rollouts])):
        values = np.concatenate(arrays).astype(np.float64)
        stats = meta.stats[key]
        assert np.allclose(stats["mean"], values.mean(0), rtol=1e-12, atol=1e-12)
        assert np.allclose(stats["std"], values.std(0), rtol=1e-12, atol=1e-12)
        assert np.array_equal(stats["min"], values.min(0)) and np.array_equal(stats["max"], values.max(0))
        assert np.allclose(stats["q01"], np.quantile(values, 0.01, axis=0))
        assert np.allclose(stats["q99"], np.quantile(values, 0.99, axis=0))
        assert stats["count"].tolist() == [len(values)]

    pixels = np.concatenate([r.frames for r in rollouts]).reshape(-1, 3) / 255.0
    image = meta.stats[CAMERA]
    assert image["mean"].shape == (3, 1, 1)
    assert np.allclose(image["mean"].ravel(), pixels.mean(0)) and np.allclose(image["std"].ravel(), pixels.std(0))
    assert np.array_equal(image["min"].ravel(), pixels.min(0)) and np.array_equal(image["max"].ravel(), pixels.max(0))
    assert np.allclose(image["q99"].ravel(), np.quantile(pixels, 0.99, axis=0, method="inverted_cdf"))

    lines = (dataset / "meta" / "episodes_stats.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 3 and first["episode_index"] == 0
    assert np.allclose(first["stats"][ACTION_KEY]["mean"], rollouts[0].actions.astype(np.float64).mean(0))


def test_unfinished_dataset_never_looks_complete(tmp_path, rollouts):
    root = tmp_path / "ds"
    writer = write_dataset(root, rollouts[:1])
    assert not root.exists() and writer.partial.is_dir()  # a killed run leaves only the .partial directory
    with pytest.raises(DatasetError, match=re.escape(str(root))):
        LeRobotMetadata.load(root)

    # The next writer of the same root discards the leftover; a failure inside `with` removes its own.
    with pytest.raises(RuntimeError, match="boom"), write_dataset(root, rollouts[:1]) as second:
        raise RuntimeError("boom")
    assert not second.partial.exists() and not root.exists()

    write_dataset(root, rollouts[:1]).finalize()
    assert LeRobotMetadata.load(root).info["total_episodes"] == 1
    with pytest.raises(FileExistsError, match=re.escape(str(root))):
        write_dataset(root, rollouts[:1])


def test_writer_rejects_inconsistent_episodes(tmp_path, rollouts):
    writer = write_dataset(tmp_path / "ds", [])
    r = rollouts[0]
    with pytest.raises(ValueError, match=f"episode 0: {len(r.states)} states but {len(r.states) - 1} actions"):
        writer.add_episode({CAMERA: r.frames}, r.states, r.actions[:-1], r.instruction)
    with pytest.raises(ValueError, match=r"observation.state must be \[T >= 1, 5\]"):
        writer.add_episode({CAMERA: r.frames}, r.states[:, :4], r.actions, r.instruction)
    with pytest.raises(ValueError, match="cameras"):
        writer.add_episode({"observation.images.wrist": r.frames}, r.states, r.actions, r.instruction)
    with pytest.raises(ValueError, match="uint8"):
        writer.add_episode({CAMERA: r.frames[:, :16]}, r.states, r.actions, r.instruction)


# ---------------------------------------------------------------------------------------- bad data
def data_file(root, episode=1):
    return root / "data" / "chunk-000" / f"episode_{episode:06d}.parquet"


def rewrite_parquet(path, transform):
    pq.write_table(transform(pq.read_table(path)), path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda path: path.unlink(), r"episode 1: data file .*episode_000001\.parquet is missing"),
        (
            lambda path: path.write_bytes(b"not a parquet file"),
            r"episode 1: cannot read parquet file .*episode_000001\.parquet",
        ),
        (
            lambda path: path.write_bytes(path.read_bytes()[:-100]),
            r"episode 1: cannot read parquet file .*episode_000001\.parquet",
        ),
        (
            lambda path: rewrite_parquet(path, lambda t: t.drop_columns(["task_index"])),
            r"episode 1: .*episode_000001\.parquet: column 'task_index' declared in meta/info.json is missing",
        ),
        (
            lambda path: rewrite_parquet(
                path, lambda t: t.set_column(1, ACTION_KEY, t.column(ACTION_KEY).cast(pa.list_(pa.float64(), 3)))
            ),
            r"episode 1: .*episode_000001\.parquet: column 'action' has type fixed_size_list<item: double>\[3\], "
            r"meta/info.json declares fixed_size_list<item: float>\[3\]",
        ),
        (
            lambda path: rewrite_parquet(path, lambda t: t.slice(0, 5)),
            r"episode 1: .*episode_000001\.parquet: 5 rows from row 0, meta/episodes says",
        ),
    ],
    ids=["missing", "garbage", "truncated", "missing-column", "wrong-type", "wrong-length"],
)
def test_bad_parquet_is_an_error_naming_the_file(dataset, damage, message):
    damage(data_file(dataset))
    meta = LeRobotMetadata.load(dataset)
    meta.read_episode(0)  # undamaged episodes still load
    with pytest.raises(DatasetError, match=message):
        meta.read_episode(1)


def test_bad_metadata_is_an_error_naming_the_file(dataset):
    info_path = dataset / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    with pytest.raises(DatasetError, match=rf"{re.escape(str(info_path))}: codebase_version is 'v1.6'"):
        LeRobotMetadata.load(dataset)
    info_path.write_text("{")
    with pytest.raises(DatasetError, match=rf"cannot read {re.escape(str(info_path))}"):
        LeRobotMetadata.load(dataset)
    info_path.unlink()
    with pytest.raises(DatasetError, match=rf"{re.escape(str(info_path))} is missing"):
        LeRobotMetadata.load(dataset)


def test_a_new_format_comes_in_as_an_episode_source_written_to_lerobot(tmp_path, rollouts):
    """The data-format seam: a format the loader does not read (here, episodes held as .npz files) is
    an EpisodeSource, and write_lerobot turns it into a dataset whose arrays read back exactly."""
    from uma_lightning.data.source import Episode, SourceLayout, write_lerobot

    for index, rollout in enumerate(rollouts):
        np.savez(tmp_path / f"ep{index}.npz", frames=rollout.frames, state=rollout.states, action=rollout.actions)

    class NpzEpisodes:
        layout = SourceLayout(
            fps=FPS,
            cameras=("observation.images.wrist",),
            image_size=(32, 32),
            state_names=PlanarArmEnv.state_names,
            action_names=PlanarArmEnv.action_names,
            robot_type="npz_rig",
        )

        def __len__(self):
            return len(rollouts)

        def __iter__(self):
            for index in range(len(rollouts)):
                with np.load(tmp_path / f"ep{index}.npz") as npz:
                    yield Episode(
                        {"observation.images.wrist": npz["frames"]}, npz["state"], npz["action"], f"task {index}"
                    )

    root = write_lerobot(NpzEpisodes(), tmp_path / "converted", version="v3.0")
    metadata = LeRobotMetadata.load(root)
    assert metadata.version == "v3.0" and metadata.cameras == ("observation.images.wrist",)
    assert metadata.info["robot_type"] == "npz_rig" and len(metadata.episodes) == len(rollouts)
    for index, rollout in enumerate(rollouts):
        data = metadata.read_episode(index)
        assert np.array_equal(data.state, rollout.states) and np.array_equal(data.action, rollout.actions)
        assert metadata.tasks[data.task_index[0]] == f"task {index}"
    assert not (tmp_path / "converted.partial").exists()
