"""LightningDataModule over one LeRobot dataset or a weighted mixture, by default the embedded planar-arm dataset."""

# No `from __future__ import annotations`: LightningCLI (jsonargparse) reads the real annotations of
# `RobotDataModule.__init__` to build the command line.
import dataclasses
import logging
import math
import multiprocessing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import lightning as L
import torch
from torch.utils.data import ConcatDataset, DataLoader

from uma_lightning.data.dataset import FrameDataset, Normalizer, NormMode, Window
from uma_lightning.data.frame_store import FrameStore, default_store_dir, open_store
from uma_lightning.data.generate import default_cache_dir, ensure_dataset
from uma_lightning.data.lerobot import ACTION_KEY, STATE_KEY, LeRobotMetadata
from uma_lightning.data.loader import BadDataPolicy, BatchStream, RobotDataLoader, collate
from uma_lightning.data.order import OrderConfig, OrderSettings
from uma_lightning.data.spec import DataSpec
from uma_lightning.data.storage import Storage
from uma_lightning.data.video import choose_decoder, decoder_threads
from uma_lightning.ranks import data_parallel_rank
from uma_lightning.stop_signals import LoaderWorkerSignals

logger = logging.getLogger(__name__)
# Lightning warns that an IterableDataset's length may be off with several workers; here each worker
# builds only its own share of the batches, so the length is exact.
warnings.filterwarnings("ignore", message=".*`IterableDataset` has `__len__` defined")


@dataclass
class DatasetSource:
    """One dataset of a mixture: where it is, how often it is drawn, and how it is normalised.

    Each dataset is normalised with its own statistics (its meta/stats.json).

    Args:
        root: The dataset: a directory or an fsspec URL.
        weight: Its share of the draws, relative to the other datasets' weights.
        state_norm: Normalisation of its state; None: the data module's state_norm.
        action_norm: Normalisation of its actions; None: the data module's action_norm.
    """

    root: str
    weight: float = 1.0
    state_norm: Optional[NormMode] = None
    action_norm: Optional[NormMode] = None


@dataclass(frozen=True)
class GenerationConfig:
    """The embedded planar-arm dataset, generated once and cached, used when neither ``root`` nor ``datasets`` is given.

    Args:
        n_episodes: Episodes generated.
        image_size: Square side of the camera frames, in pixels.
        seed: Seed of the generated scenes.
        cache_dir: Where; None uses $UMA_CACHE_DIR or ~/.cache/uma_lightning.
    """

    n_episodes: int = 200
    image_size: int = 64
    seed: int = 0
    cache_dir: Optional[str] = None


@dataclass(frozen=True)
class LoaderConfig:
    """How samples are read and batches loaded, per process.

    Args:
        num_workers: DataLoader worker processes.
        persistent_workers: Keep the workers (and their open files and caches) alive between epochs.
        prefetch_factor: Batches each worker loads ahead.
        multiprocessing_context: fork, forkserver or spawn for workers; None picks fork unless it is
            unsafe (remote storage clients run threads; CUDA is initialised), then forkserver.
        pin_memory: Pin batches in page-locked memory; None pins only when CUDA is available.
        device_prefetch: Copy the next batch to the GPU on a side stream while the current step runs.
        decode_cache_mb: Bound on decoded frames and episode columns kept per process, in MiB.
        max_open_files: Open parquet and video files kept per process.
        tolerance_s: How far a frame's timestamp may be from the requested time, in seconds.
        on_bad_data: A sample whose files are missing, corrupt or disagree with meta/info.json:
            error stops with a message naming the episode and file; skip leaves it out of its batch (which
            gets smaller), counts it and logs it.
        plan_batches: Each worker decodes its batch's frames file by file in time order, keeping
            the frames its next plan_batches batches show (bounded by decode_cache_mb: 16 batches
            of 32 samples with 2 steps of 3 cameras at 224x224 keep ~380 MiB; with 8, frames shared by
            batches further apart were decoded again and the loader decoded 1.3x the frames).
        image_size: Square side the frames are decoded at (scaled in the decoder's colour
            conversion), when the model wants smaller images than stored; None: as stored.
        decoder_threads: Threads per open video; None: from the worker count and frame size.
        frame_store: Decoded frames written by ``uma data cache``: auto uses the store at its
            default place when it exists and matches the dataset (a stale one is logged and ignored);
            off never; a directory must hold a valid store.
        decoder: cpu (PyAV), cuda (torchcodec's or PyNvVideoCodec's GPU decoder, 0 workers), or
            auto: cuda where a GPU decoder and a GPU are present, else cpu; the choice is logged.
    """

    num_workers: int = 1
    persistent_workers: bool = True
    prefetch_factor: int = 2
    multiprocessing_context: Optional[str] = None
    pin_memory: Optional[bool] = None
    device_prefetch: bool = True
    decode_cache_mb: float = 512.0
    max_open_files: int = 64
    tolerance_s: float = 1e-4
    on_bad_data: BadDataPolicy = "error"
    plan_batches: int = 16
    image_size: Optional[int] = None
    decoder_threads: Optional[int] = None
    frame_store: str = "auto"
    decoder: Literal["auto", "cpu", "cuda"] = "auto"

    def __post_init__(self) -> None:
        for name in ("prefetch_factor", "max_open_files", "plan_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"loader.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ValueError(f"loader.num_workers must be >= 0, got {self.num_workers}")
        if self.image_size is not None and (self.image_size < 2 or self.image_size % 2):
            raise ValueError(f"loader.image_size must be an even number of pixels >= 2, got {self.image_size}")
        if self.decoder_threads is not None and self.decoder_threads < 1:
            raise ValueError(f"loader.decoder_threads must be >= 1, got {self.decoder_threads}")
        if self.multiprocessing_context not in (None, *multiprocessing.get_all_start_methods()):
            raise ValueError(
                f"loader.multiprocessing_context must be one of {multiprocessing.get_all_start_methods()}, got {self.multiprocessing_context!r}"
            )


@dataclass(frozen=True)
class StorageConfig:
    """Remote datasets (an fsspec URL as ``root``).

    Args:
        options: fsspec options (endpoint_url, ...). Not saved in checkpoints; prefer the usual
            environment variables or credential files for secrets.
        cache_dir: Local cache of remote files; None uses <cache dir>/shards.
        cache_gb: Size limit of that cache; least recently used files are evicted.
        prefetch_batches: Batches ahead whose remote files each worker downloads in the background.
    """

    options: Optional[dict] = None
    cache_dir: Optional[str] = None
    cache_gb: float = 50.0
    prefetch_batches: int = 2


def split_episodes(n_episodes: int, val_episodes: Union[int, float]) -> tuple[list[int], list[int]]:
    """Train and validation episode indices, holding out the last episodes for validation.

    An int is a count of episodes, a float a fraction in [0, 1) (at least one episode when > 0).
    """
    if isinstance(val_episodes, float):
        if not 0.0 <= val_episodes < 1.0:
            raise ValueError(f"val_episodes as a fraction must be in [0, 1), got {val_episodes}")
        n_val = max(1, math.ceil(val_episodes * n_episodes)) if val_episodes > 0 else 0
    else:
        n_val = int(val_episodes)
    if not 0 <= n_val < n_episodes:
        raise ValueError(f"val_episodes={val_episodes} must leave at least one of {n_episodes} episodes for training")
    return list(range(n_episodes - n_val)), list(range(n_episodes - n_val, n_episodes))


class RobotDataModule(L.LightningDataModule):
    """Batches of robot data as described in `uma_lightning.data.spec`, in a seeded, resumable order.

    `spec` is ready right after construction (the CLI links it into the model's constructor), so the
    constructor reads the datasets' metadata, generating the embedded dataset first when neither
    `root` nor `datasets` is given.

    What a sample is (window, normalisation, split) are arguments; the rest is grouped in sections:
    `order` (`OrderSettings`), `loader`, `storage` and `generation`.
    """

    #: Arguments of earlier versions that moved into a section: old name -> new key.
    moved_settings = {
        **{name: f"generation.{name}" for name in ("n_episodes", "image_size", "cache_dir")},
        "dataset_seed": "generation.seed",
        **{name: f"order.{name}" for name in ("seed", "samples_per_epoch", "shuffle_buffer", "partitions")},
        **{field.name: f"loader.{field.name}" for field in dataclasses.fields(LoaderConfig)},
        "storage_options": "storage.options",
        "shard_cache_dir": "storage.cache_dir",
        "shard_cache_gb": "storage.cache_gb",
        "prefetch_batches": "storage.prefetch_batches",
    }

    def __init__(
        self,
        root: Optional[str] = None,
        datasets: Optional[list[DatasetSource]] = None,
        n_obs_steps: int = 1,
        action_horizon: int = 8,
        batch_size: int = 32,
        val_episodes: Union[int, float] = 0.1,
        state_norm: NormMode = "mean_std",
        action_norm: NormMode = "min_max",
        predict_split: Literal["train", "val"] = "val",
        order: OrderSettings = OrderSettings(),
        loader: LoaderConfig = LoaderConfig(),
        storage: StorageConfig = StorageConfig(),
        generation: GenerationConfig = GenerationConfig(),
    ) -> None:
        """
        Args:
            root: LeRobot dataset (v2.1 or v3.0): a directory or an fsspec URL such as s3://bucket/prefix.
                None (and no `datasets`) uses the embedded planar-arm dataset (see `generation`).
            datasets: A weighted mixture instead of `root`: a list of {root, weight, state_norm, action_norm}.
            n_obs_steps: Observation history length per sample, ending at the sample's frame.
            action_horizon: Length of the action chunk per sample, starting at the sample's frame.
            batch_size: Samples per batch (per device).
            val_episodes: Episodes held out for validation, taken from the end of each dataset: a count (int) or a fraction (float).
            state_norm: Normalisation of the state: mean_std, min_max or quantile (q01 -> -1, q99 -> +1).
            action_norm: Normalisation of the actions: mean_std, min_max or quantile.
            predict_split: Episodes `uma predict` runs on: the held-out (val) or the training episodes.
            order: The training order: seed, partitions, shuffle_buffer, samples_per_epoch (see `OrderSettings`).
            loader: Workers, caches and bad-data handling (see `LoaderConfig`).
            storage: Remote datasets: fsspec options, the local cache of remote files (see `StorageConfig`).
            generation: The embedded dataset: n_episodes, image_size, seed, cache_dir (see `GenerationConfig`).
        """
        super().__init__()
        as_section = lambda value, kind: kind(**value) if isinstance(value, dict) else value or kind()  # noqa: E731
        self.order_settings = as_section(order, OrderSettings)
        self.loader = as_section(loader, LoaderConfig)
        self.storage = as_section(storage, StorageConfig)
        self.generation = as_section(generation, GenerationConfig)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if datasets is not None and root is not None:
            raise ValueError("give either root or datasets (a mixture), not both")
        if datasets:
            sources = [s if isinstance(s, DatasetSource) else DatasetSource(**s) for s in datasets]
        elif root is not None:
            sources = [DatasetSource(root)]
        else:
            generation = self.generation
            sources = [
                DatasetSource(
                    str(
                        ensure_dataset(
                            "planar_arm",
                            generation.n_episodes,
                            generation.image_size,
                            generation.seed,
                            generation.cache_dir,
                        )
                    )
                )
            ]
        # Every argument, a subclass's too; plain types only, so checkpoints load with weights_only=True.
        self.save_hyperparameters(ignore=["datasets", "storage"])
        sections = {"order": self.order_settings, "loader": self.loader, "generation": self.generation}
        self.hparams.update({name: dataclasses.asdict(section) for name, section in sections.items()})
        # Storage options may hold credentials.
        self.hparams["storage"] = {**dataclasses.asdict(self.storage), "options": None}
        if datasets:
            self.hparams["datasets"] = [dataclasses.asdict(s) for s in sources]
        self.sources = sources
        storage = self.storage
        shard_cache = storage.cache_dir or str(default_cache_dir() / "shards")
        self.metadata = [
            LeRobotMetadata.load(Storage(s.root, shard_cache, int(storage.cache_gb * 2**30), storage.options))
            for s in sources
        ]
        self.root = self.metadata[0].root
        first = self.metadata[0]
        self.spec = DataSpec(
            cameras=first.cameras,
            image_size=self._image_size(first),
            state_dim=first.state_dim,
            action_dim=first.action_dim,
            n_obs_steps=n_obs_steps,
            action_horizon=action_horizon,
            fps=first.fps,
            # Only when every dataset of a mixture records it with the same size: a batch holds it for all samples or none.
            environment_state_dim=first.environment_state_dim
            if len({m.environment_state_dim for m in self.metadata}) == 1
            else 0,
        )
        for source, meta in zip(sources[1:], self.metadata[1:]):
            shape = (len(meta.cameras), self._image_size(meta), meta.state_dim, meta.action_dim, meta.fps)
            expected = (len(first.cameras), self._image_size(first), first.state_dim, first.action_dim, first.fps)
            if shape != expected:
                raise ValueError(
                    f"dataset {source.root}: (cameras, image size, state dim, action dim, fps) = {shape}, "
                    f"but the mixture's first dataset has {expected}"
                )
        self.splits = [split_episodes(len(meta.episodes), val_episodes) for meta in self.metadata]
        self.train_episodes, self.val_episodes = self.splits[0]
        for meta, (train, val) in zip(self.metadata, self.splits):
            logger.info(
                "dataset %s (LeRobot %s): %d train and %d validation episodes",
                meta.root,
                meta.version,
                len(train),
                len(val),
            )
        # Built here, not in setup(), so a bad mode fails at construction and inference can undo
        # the normalisation without loading the dataset.
        self.norm_modes = [(s.state_norm or state_norm, s.action_norm or action_norm) for s in sources]
        self.normalizers = [
            (
                Normalizer.from_stats(modes[0], meta.stats[STATE_KEY], STATE_KEY),
                Normalizer.from_stats(modes[1], meta.stats[ACTION_KEY], ACTION_KEY),
            )
            for modes, meta in zip(self.norm_modes, self.metadata)
        ]
        self.state_normalizer, self.action_normalizer = self.normalizers[0]
        self.order = OrderConfig(
            **dataclasses.asdict(self.order_settings),
            batch_size=batch_size,
            weights=tuple(float(s.weight) for s in sources),
        )
        self.pin_memory = torch.cuda.is_available() if self.loader.pin_memory is None else self.loader.pin_memory
        # Opened here, not in setup(), so a corrupt store fails at construction (`uma: error: ...`).
        self.frame_stores: dict[int, Optional[FrameStore]] = {
            d: self._frame_store(d) for d in range(len(self.metadata))
        }
        self.train_sets: Optional[list[FrameDataset]] = None
        self.val_sets: Optional[list[FrameDataset]] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_sets is None:
            self.train_sets = [self._dataset(d, train) for d, (train, _) in enumerate(self.splits)]
        if self.val_sets is None:
            self.val_sets = [self._dataset(d, val) for d, (_, val) in enumerate(self.splits) if val]

    def train_dataloader(self) -> RobotDataLoader:
        return self._loader(self.train_sets, self.order, resumable=True)

    def val_dataloader(self) -> Union[RobotDataLoader, list]:
        if not self.val_sets:
            return []  # no validation episodes: Lightning skips validation
        config = OrderConfig(
            seed=0,
            batch_size=self.hparams.batch_size,
            shuffle=False,
            drop_last=False,
            weights=(1.0,) * len(self.val_sets),
        )
        return self._loader(self.val_sets, config, resumable=False)

    def test_dataloader(self) -> Union[RobotDataLoader, list]:
        """The held-out episodes, as in validation: the embedded data has no third split."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Every frame of the `predict_split` episodes, in order. A plain DataLoader over the frames:
        Lightning's predict loop replaces its sampler (to record batch indices, and to split the
        frames over ranks)."""
        sets = self.val_sets if self.hparams.predict_split == "val" else self.train_sets
        if not sets:
            raise ValueError(
                f"predict_split={self.hparams.predict_split!r} has no episodes (val_episodes={self.hparams.val_episodes})"
            )
        workers = self.loader.num_workers
        return DataLoader(
            ConcatDataset(sets),
            batch_size=self.hparams.batch_size,
            collate_fn=collate,
            num_workers=workers,
            pin_memory=self.pin_memory,
            multiprocessing_context=self._start_method() if workers > 0 else None,
            worker_init_fn=LoaderWorkerSignals() if workers > 0 else None,
        )

    def normalize_state(self, state: torch.Tensor, dataset: int = 0) -> torch.Tensor:
        """Raw robot state -> the normalised state a model trained on this data expects."""
        return self.normalizers[dataset][0].normalize(state)

    def denormalize_actions(self, actions: torch.Tensor, dataset: int = 0) -> torch.Tensor:
        """Normalised model actions -> raw robot actions of the given dataset's robot."""
        return self.normalizers[dataset][1].denormalize(actions)

    def normalization(self) -> dict:
        """The state and action normalisation of the first dataset (the model's robot) as plain values,
        with the dimension names; models keep it in their checkpoints so that inference undoes it
        without the dataset."""
        meta = self.metadata[0]
        state, action = self.normalizers[0]
        return {
            "state": {**state.to_dict(), "names": meta.feature_names(STATE_KEY)},
            "action": {**action.to_dict(), "names": meta.feature_names(ACTION_KEY)},
        }

    def _image_size(self, metadata: LeRobotMetadata) -> tuple[int, int]:
        side = self.loader.image_size
        return (side, side) if side is not None else metadata.image_size

    def _frame_store(self, d: int) -> Optional[FrameStore]:
        """The decoded-frame store of dataset d, when loader.frame_store allows it and one is valid (logged once)."""
        setting, meta = self.loader.frame_store, self.metadata[d]
        if setting == "off":
            return None
        size = self._image_size(meta)
        directory = default_store_dir(meta, size, default_cache_dir()) if setting == "auto" else Path(setting)
        store = open_store(directory, meta)
        if store is None and setting != "auto":
            raise ValueError(
                f"loader.frame_store={setting!r}: no valid frame store of {meta.root} there (see the log); write one with `uma data cache`"
            )
        if store is not None and store.size != size:
            if setting != "auto":
                raise ValueError(
                    f"loader.frame_store={setting!r} holds {store.size[0]}x{store.size[1]} frames, but the loader wants {size[0]}x{size[1]}"
                )
            store = None
        if store is not None:
            logger.info(
                "frame store %s: %d camera(s) of %s read from decoded frames (%.1f GiB), not decoded",
                directory,
                len(store.cameras),
                meta.root,
                store.nbytes / 2**30,
            )
        else:
            logger.info("no frame store for %s (looked in %s): frames are decoded", meta.root, directory)
        return store

    def _dataset(self, d: int, episodes: list[int]) -> FrameDataset:
        loader = self.loader
        size = self._image_size(self.metadata[d])
        return FrameDataset(
            self.metadata[d],
            episodes,
            state_norm=self.norm_modes[d][0],
            action_norm=self.norm_modes[d][1],
            decode_cache_mb=loader.decode_cache_mb,
            tolerance_s=loader.tolerance_s,
            max_open_files=loader.max_open_files,
            window=Window.of_steps(self.spec.n_obs_steps, self.spec.action_horizon, self.metadata[d].fps),
            dataset_index=d,
            environment_state=self.spec.environment_state_dim > 0,
            image_size=size if loader.image_size is not None else None,
            decoder_threads=loader.decoder_threads or decoder_threads(loader.num_workers, *size),
            frame_store=self.frame_stores[d],
            decoder=self._decoder(),
        )

    def _decoder(self) -> str:
        """The video decoder the loader's `decoder` setting resolves to here, logged once."""
        if getattr(self, "_decoder_choice", None) is None:
            choice, why = choose_decoder(self.loader.decoder, self.loader.num_workers)
            if self.loader.decoder == "cuda" and choice != "cuda":
                logger.warning("loader.decoder=cuda is not available, decoding on the CPU: %s", why)
            logger.info("video decoder: %s (%s)", "GPU (NVDEC)" if choice == "cuda" else "CPU (PyAV)", why)
            self._decoder_choice = choice
        return self._decoder_choice

    def _loader(self, sets: Optional[list[FrameDataset]], config: OrderConfig, resumable: bool) -> RobotDataLoader:
        if sets is None:
            raise RuntimeError("call setup() before requesting dataloaders")
        loader = self.loader
        trainer = self.trainer
        rank, world = data_parallel_rank(trainer)
        device = trainer.strategy.root_device if trainer is not None else None
        stream = BatchStream(
            sets, config, rank, world, loader.on_bad_data, self.storage.prefetch_batches, loader.plan_batches
        )
        return RobotDataLoader(
            stream,
            num_workers=loader.num_workers,
            persistent_workers=loader.persistent_workers,
            prefetch_factor=loader.prefetch_factor,
            pin_memory=self.pin_memory,
            multiprocessing_context=self._start_method() if loader.num_workers > 0 else None,
            resumable=resumable,
            device=device if loader.device_prefetch and device is not None and device.type == "cuda" else None,
        )

    def _start_method(self) -> str:
        chosen = self.loader.multiprocessing_context
        if chosen is not None:
            why = "set in the config"
        elif any(meta.storage.remote for meta in self.metadata):
            chosen, why = "forkserver", "remote storage clients run threads, which fork does not copy safely"
        elif torch.cuda.is_initialized():
            chosen, why = "forkserver", "CUDA is initialised, and a forked child cannot use it"
        else:
            chosen, why = "fork", "fastest start, and nothing in this process makes fork unsafe"
        if chosen == "forkserver":
            # Workers fork from a server that has already imported the loader, so each starts in milliseconds.
            multiprocessing.get_context("forkserver").set_forkserver_preload(
                ["uma_lightning.forkserver_preload", "uma_lightning.data.loader"]
            )
        if getattr(self, "_logged_start_method", None) != chosen:
            logger.info("data loader workers: %d started with %s (%s)", self.loader.num_workers, chosen, why)
            self._logged_start_method = chosen
        return chosen
