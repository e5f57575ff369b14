"""Writing checkpoints: staged to host memory, written in the background, committed atomically, pruned.

One save at a time: a new save first waits for the previous one to be committed. With ``async_save``
the caller is blocked only until the state is copied to host memory, and not even that long if it
calls ``wait_staged()`` just before the state next changes (the optimizer step): the copy then runs
alongside the next forward and backward pass. Writing, checksums, the manifest and the commit happen
on a background thread. ``last_profile`` holds the seconds per phase of the last save. That thread
talks to the other ranks over its own gloo process group, so its collectives can never interleave with
(and deadlock against) a barrier or an all-reduce on the training thread.

Checkpoints that retention drops are deleted on a thread of their own after each commit, for both
kinds of save: deleting a gigabyte file takes a third of a second on a file system that discards freed
blocks (ext4 mounted with ``discard``), time that no save needs to wait for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from uma_lightning.checkpoint.directory import commit, prune, staging_path, step_dirname
from uma_lightning.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    describe_files,
    write_json_durably,
    write_manifest,
)
from uma_lightning.checkpoint.staging import HostCopies
from uma_lightning.checkpoint.storage import SaveProfile, save_tensors
from uma_lightning.checkpoint.weights import STATE_FILE

log = logging.getLogger(__name__)


class CheckpointWriter:
    def __init__(
        self,
        root: Path,
        keep_last: int,
        keep_every_n_steps: Optional[int],
        async_save: bool,
        process_group: Optional[dist.ProcessGroup],
    ):
        """
        Args:
            root: The run's checkpoints directory.
            keep_last: Committed checkpoints to keep, newest first; older ones are deleted after each commit.
            keep_every_n_steps: Also keep, for good, checkpoints whose step is a multiple of this.
            async_save: Write in the background (see the module docstring); else block until committed.
            process_group: A gloo group over all ranks used by nothing else; None in a single process.
        """
        self.root = root
        self.keep_last = keep_last
        self.keep_every_n_steps = keep_every_n_steps
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer") if async_save else None
        self._stager = HostCopies() if async_save else None
        self._pending: Optional[Future] = None
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-pruner")
        self._pruning: Optional[Future] = None
        self._staged = threading.Event()
        self._staged.set()
        self._staging_failed = False
        self.last_profile: dict[str, float] = {}

    def save(
        self,
        step: int,
        state: dict,
        tensors: dict[str, torch.Tensor],
        summary: dict,
        commit_after: Optional[threading.Event] = None,
    ) -> None:
        """Save ``tensors`` (this rank's, live) and ``state`` (JSON, written by rank 0) as the checkpoint of ``step``;
        with ``commit_after`` (background saves only), everything is written but the commit waits for that event."""
        self.wait()
        if self._pruning is not None and self._pruning.done():
            self.wait_pruned()  # a failure to delete is raised here, as a failed save would be
        if self._executor is None:
            if commit_after is not None:
                raise ValueError("commit_after needs async_save: a synchronous save commits before it returns")
            self._write(step, state, tensors, summary, time.monotonic(), 0.0)
            return
        self._staged.clear()
        self._pending = self._executor.submit(
            self._stage_and_write, step, state, tensors, summary, time.monotonic(), commit_after
        )

    def wait_staged(self) -> None:
        """Block until the pending save no longer reads the live tensors; call before changing them."""
        self._staged.wait()
        if self._staging_failed:
            # This rank's copy failed, so it never joins the collective write: raised here, not at the
            # next save. A failed write is raised by every rank's save at once, at the next save or
            # the last wait(): seen here, it would reach the ranks at different steps.
            self.wait()

    def wait(self) -> None:
        """Block until the pending save is committed; raises what it failed with."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_pruned(self) -> None:
        """Block until the checkpoints that retention dropped at the last commit are deleted."""
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            pruning.result()

    def close(self) -> None:
        try:
            self.wait()
            self.wait_pruned()
        finally:
            self._pruner.shutdown(wait=True)
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._stager.close()

    def _stage_and_write(
        self,
        step: int,
        state: dict,
        tensors: dict,
        summary: dict,
        started: float,
        commit_after: Optional[threading.Event],
    ) -> None:
        self._staging_failed = True
        try:
            staged = self._stager.stage(tensors)
            self._staging_failed = False
        finally:
            self._staged.set()
        staging_s = time.monotonic() - started
        # The training thread waits for the copy, and the write starts with much Python (DCP's planning):
        # without giving up the GIL for a moment here, that thread woke 10 to 16 ms late.
        time.sleep(0.001)
        self._write(step, state, staged, summary, started, staging_s, commit_after)
        self.last_profile["copy to host memory"] = staging_s

    def _write(
        self,
        step: int,
        state: dict,
        tensors: dict,
        summary: dict,
        started: float,
        staging_s: float,
        commit_after: Optional[threading.Event] = None,
    ) -> None:
        profile = SaveProfile()
        staging = staging_path(self.root, step)
        written = save_tensors(tensors, staging, self.process_group, profile)
        with profile.timed("gather checksums"):
            files = self._checksums_of_all_ranks(staging, written)
        if self.rank != 0:
            self.last_profile = dict(profile.seconds)
            return
        with profile.timed("state and manifest"):
            write_json_durably(staging / STATE_FILE, state)
            files.update(describe_files(staging, [n for n in os.listdir(staging) if n not in files and n != MANIFEST]))
            size = sum(entry["bytes"] for entry in files.values())
            write_manifest(staging, files, {**summary, "step": step, "bytes": size})
        final = self.root / step_dirname(step)
        if commit_after is not None:
            commit_after.wait()
        with profile.timed("commit"):
            commit(staging, final)
        self._pruning = self._pruner.submit(self._prune, self._pruning)
        self.last_profile = dict(profile.seconds)
        elapsed = time.monotonic() - started
        how = (
            f"in the background, training blocked for at most {staging_s:.2f} s" if self._executor else "synchronously"
        )
        log.info("checkpoint of step %d saved to %s: %.1f MB in %.2f s (%s)", step, final, size / 1e6, elapsed, how)

    def _prune(self, previous: Optional[Future]) -> None:
        if previous is not None:
            previous.result()  # passes a failure on to the newest future, which save() and close() check
        removed = prune(self.root, self.keep_last, self.keep_every_n_steps)
        if removed:
            log.info("deleted checkpoint(s) %s of %s", ", ".join(p.name for p in removed), self.root)

    def _checksums_of_all_ranks(self, staging: Path, written: dict[str, dict]) -> dict[str, dict]:
        """The sizes and checksums of the files each rank wrote, taken as they were written (DCP names them
        ``__<rank>_<n>.distcp``); rank 0 gets them all. A file whose size on disk differs is reported."""
        mine = {name: entry for name, entry in written.items() if name.startswith(f"__{self.rank}_")}
        try:
            for name, entry in mine.items():
                size = (staging / name).stat().st_size
                if size != entry["bytes"]:
                    mine[name] = {
                        "error": f"rank {self.rank}: {name} holds {size} bytes, {entry['bytes']} were written"
                    }
        except OSError as err:
            mine = {"": {"error": f"rank {self.rank}: {err}"}}
        if self.process_group is None:
            gathered = [mine]
        else:
            gathered = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(gathered, mine, group=self.process_group)
        errors = [entry["error"] for files in gathered for entry in files.values() if "error" in entry]
        if errors:
            raise CheckpointError(f"{staging}: could not checksum the written files: {'; '.join(errors)}")
        return {name: entry for files in gathered for name, entry in files.items()}
