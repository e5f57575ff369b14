"""Checksums taken while a save writes its files equal a checksum read back from the disk, a save
reports where its time went, a background save copies to host memory it keeps, and a load reads
tensors straight into their destination when it can (without DCP's planning when a tensor or shard
was saved whole, as it is now)."""

import errno
import fcntl
import io
import json
import math
import os
import runpy
import sys
import time
import zlib
from pathlib import Path

import forked_cli
import pytest
import torch
from checkpoint_helpers import assert_bitwise_equal, backbone, full_state, optimizer_for, train_step
from suite import free_port
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex

from uma_lightning.checkpoint import CheckpointWriter, step_dirname, storage
from uma_lightning.checkpoint.manifest import CheckpointError, file_checksum, read_manifest, verify
from uma_lightning.checkpoint.staging import HostCopies
from uma_lightning.checkpoint.state import encode_parts, load_module, model_and_optimizer
from uma_lightning.checkpoint.storage import (
    SafeFileSystemReader,
    _DeviceStaging,
    _InPlace,
    _read_entry,
    load_tensors,
    save_tensors,
)


@pytest.mark.parametrize("async_save", [False, True])
def test_checksums_taken_while_writing_match_the_bytes_on_disk(tmp_path, async_save, monkeypatch):
    # Blocks of 8 KiB, so that the small files of this test cross many of them.
    monkeypatch.setattr("uma_lightning.checkpoint.storage._BLOCK", 8192)
    model = backbone()
    optimizer = optimizer_for(model)
    train_step(model, optimizer)
    state, tensors = encode_parts(model_and_optimizer(model, [optimizer]))
    writer = CheckpointWriter(tmp_path, 2, None, async_save, None)
    writer.save(1, state, tensors, {"epoch": 0, "world_size": 1})
    writer.close()
    checkpoint = tmp_path / step_dirname(1)
    files = read_manifest(checkpoint)["files"]
    assert "__0_0.distcp" in files and files["__0_0.distcp"]["bytes"] > 3 * 4096
    for name, entry in files.items():
        assert entry == {"bytes": (checkpoint / name).stat().st_size, "crc32": file_checksum(checkpoint / name)}
        # zlib's CRC-32, as every checkpoint's manifest has recorded it
        assert entry["crc32"] == f"{zlib.crc32((checkpoint / name).read_bytes()):08x}"
    assert verify(checkpoint) == []
    assert {
        "write",
        "checksum",
        "fsync",
        "tensors in all",
        "state and manifest",
        "commit",
    } <= writer.last_profile.keys()
    assert torch.serialization.get_crc32_options()  # the process-wide zip CRC setting is given back


class _RecordingFile(io.FileIO):
    """A checkpoint file that records, at each write, whether it was opened for O_DIRECT, and can refuse
    O_DIRECT writes (as a file system with a larger alignment does) or run out of space after some writes."""

    def __init__(self, path, mode, opener, log, refuse_direct=False, space_for=None):
        super().__init__(path, mode, opener=opener)
        self.log, self.refuse_direct, self.space_for = log, refuse_direct, space_for

    def write(self, data):
        direct = bool(fcntl.fcntl(self.fileno(), fcntl.F_GETFL) & os.O_DIRECT)
        self.log.append(direct)
        if direct and self.refuse_direct:
            raise OSError(errno.EINVAL, "Invalid argument", self.name)
        if self.space_for is not None and len(self.log) > self.space_for:
            raise OSError(errno.ENOSPC, "No space left on device", self.name)
        return super().write(data)


def _tensors_of_odd_sizes() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"t{n}": torch.randn(n, generator=generator) for n in (1, 1000, 4093, 20000, 3)} | {
        "half": torch.randn(777, generator=generator).half()
    }


def _dcp_reference(tensors: dict, directory: Path) -> bytes:
    """The data file DCP's own writer makes of ``tensors`` (without torch.save's zip CRC, as our saves)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True)
    with storage._without_zip_crc():
        torch.distributed.checkpoint.save(tensors, storage_writer=writer, no_dist=True)
    return (directory / "__0_0.distcp").read_bytes()


@pytest.mark.parametrize("file_system", ["takes O_DIRECT", "refuses it at the open", "refuses it at a write"])
def test_files_hold_the_bytes_dcp_writes_across_blocks_written_directly_or_not(tmp_path, monkeypatch, file_system):
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip("the file system under the test's folder refuses O_DIRECT")
    monkeypatch.setattr(storage, "_BLOCK", 8192)  # the 90 KB file crosses many blocks
    log: list[bool] = []
    refuse = file_system == "refuses it at a write"
    monkeypatch.setattr(
        storage,
        "open",
        lambda path, mode, buffering=-1, opener=None: _RecordingFile(path, mode, opener, log, refuse),
        raising=False,
    )
    if file_system == "refuses it at the open":

        def refuse_direct(path, flags):
            raise OSError(errno.EINVAL, "Invalid argument", path)

        monkeypatch.setattr(storage, "_direct_opener", refuse_direct)
    tensors = _tensors_of_odd_sizes()
    written = save_tensors(tensors, tmp_path / "ours", None)
    data = (tmp_path / "ours" / "__0_0.distcp").read_bytes()
    assert data == _dcp_reference(tensors, tmp_path / "dcp") and len(data) > 10 * 8192 and len(data) % 4096
    assert written["__0_0.distcp"] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    expected = {"takes O_DIRECT": [True], "refuses it at the open": [False], "refuses it at a write": [True, False]}
    assert sorted(set(log), reverse=True) == expected[file_system]
    assert log[0] == (file_system != "refuses it at the open")  # refused at a write: the first, then buffered
    loaded = {key: torch.empty_like(value) for key, value in tensors.items()}
    load_tensors(loaded, tmp_path / "ours", None)
    assert_bitwise_equal(loaded, tensors)


def test_a_block_that_fails_to_write_fails_the_save_and_the_next_save_is_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_BLOCK", 8192)
    log: list[bool] = []
    monkeypatch.setattr(
        storage,
        "open",
        lambda path, mode, buffering=-1, opener=None: _RecordingFile(path, mode, opener, log, space_for=3),
        raising=False,
    )
    tensors = _tensors_of_odd_sizes()
    with pytest.raises(CheckpointError, match=r"No space left on device.*__0_0\.distcp"):
        save_tensors(tensors, tmp_path / "full", None)
    assert len(log) == 4  # the failed write is the last: nothing more is written after it
    monkeypatch.setattr(storage, "open", open, raising=False)
    # Every block went back to the pool once: a block handed out twice would mix two files' bytes.
    assert len({id(block) for block in storage._free_blocks}) == len(storage._free_blocks)
    save_tensors(tensors, tmp_path / "next", None)
    assert (tmp_path / "next" / "__0_0.distcp").read_bytes() == _dcp_reference(tensors, tmp_path / "dcp")


def test_a_flipped_byte_in_a_file_written_with_a_running_checksum_is_caught(tmp_path):
    model = backbone()
    optimizer = optimizer_for(model)
    state, tensors = encode_parts(model_and_optimizer(model, [optimizer]))
    writer = CheckpointWriter(tmp_path, 2, None, False, None)
    writer.save(1, state, tensors, {"epoch": 0, "world_size": 1})
    shard = tmp_path / step_dirname(1) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert [problem for problem in verify(tmp_path / step_dirname(1)) if "checksum" in problem]


def test_tensors_are_read_in_place_unless_the_bytes_on_disk_are_laid_out_otherwise(tmp_path, monkeypatch):
    saved = {
        "weight": torch.randn(64, 48),
        "large": torch.randn(300_000),  # beyond the header read, so its data is a read of its own
        "bias": torch.arange(5.0),
        "transposed": torch.randn(48, 64).t(),  # stored with its strides: not the destination's layout
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "half": torch.randn(10).half(),  # loaded into a float32 tensor: converted, not read in place
    }
    save_tensors(saved, tmp_path, None)
    by_dcp = []
    dcp_read = FileSystemReader.read_data

    def spy(self, plan, planner):
        by_dcp.extend(item.dest_index.fqn for item in plan.items)
        return dcp_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    loaded = {key: torch.zeros(value.shape, dtype=torch.float32) for key, value in saved.items()}
    load_tensors(loaded, tmp_path, None)
    assert all(torch.equal(loaded[key], saved[key].float()) for key in saved)
    assert sorted(by_dcp) == ["channels_last", "half", "transposed"]


def test_a_failed_background_write_is_raised_by_the_next_save_and_a_failed_copy_before_the_next_step(
    tmp_path, monkeypatch
):
    """Every rank must stop at the same step: a write, which fails on every rank of a collective save
    though not at the same instant, is raised by the next save (a collective point), never by
    wait_staged() just because it is over here; a failed copy to host memory, after which this rank
    never joins the write, is raised by wait_staged() before the state changes."""
    model = backbone()
    optimizer = optimizer_for(model)
    train_step(model, optimizer)
    state, tensors = encode_parts(model_and_optimizer(model, [optimizer]))
    summary = {"epoch": 0, "world_size": 1}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    writer = CheckpointWriter(tmp_path / "write", 2, None, True, None)
    monkeypatch.setattr("uma_lightning.checkpoint.writer.save_tensors", full_disk)
    writer.save(1, state, tensors, summary)
    while not writer._pending.done():
        time.sleep(0.01)
    writer.wait_staged()  # over and failed, yet not raised here
    with pytest.raises(OSError, match="No space left"):
        writer.save(2, state, tensors, summary)
    monkeypatch.undo()
    writer.close()

    writer = CheckpointWriter(tmp_path / "copy", 2, None, True, None)
    monkeypatch.setattr(writer._stager, "stage", full_disk)
    writer.save(1, state, tensors, summary)
    with pytest.raises(OSError, match="No space left"):
        writer.wait_staged()
    writer.close()


def test_whole_tensors_load_without_dcp_and_the_others_through_it(tmp_path, monkeypatch):
    saved = {"weight": torch.randn(64, 48), "step": torch.tensor(7.0), "half": torch.randn(10).half()}
    save_tensors(saved, tmp_path, None)
    by_dcp = []
    dcp_load = torch.distributed.checkpoint.load

    def spy(state_dict, **kwargs):
        by_dcp.append(sorted(state_dict))
        return dcp_load(state_dict, **kwargs)

    monkeypatch.setattr(torch.distributed.checkpoint, "load", spy)
    loaded = {key: torch.zeros(value.shape, dtype=value.dtype) for key, value in saved.items()}
    load_tensors(loaded, tmp_path, None)
    assert by_dcp == []
    assert_bitwise_equal(loaded, saved)

    loaded = {key: torch.zeros(value.shape) for key, value in saved.items()}  # "half" into float32: converted
    load_tensors(loaded, tmp_path, None)
    assert by_dcp == [["half"]]
    assert_bitwise_equal(loaded, {key: value.float() for key, value in saved.items()})


def test_tensors_off_the_host_are_read_piece_by_piece_through_two_buffers(tmp_path):
    """The GPU path's staging, run on the host: pieces smaller than the tensors, one ending inside
    the entry's header read, the two buffers taking turns; every byte lands where it belongs."""
    saved = {"large": torch.randn(2_500), "ragged": torch.randn(333).double(), "in_header": torch.arange(7.0)}
    save_tensors(saved, tmp_path, None)
    storage_data = SafeFileSystemReader(tmp_path).read_metadata().storage_data
    staging = _DeviceStaging(torch.device("cpu"), piece=1000)
    fills = []
    fill = staging.fill
    staging.fill = lambda target, read_piece: fills.append(target.nbytes) or fill(target, read_piece)
    with open(tmp_path / "__0_0.distcp", "rb") as shard:
        loaded = {key: torch.zeros_like(value) for key, value in saved.items()}
        for key, target in loaded.items():
            entry = storage_data[MetadataIndex(key, (0,))]
            assert _read_entry(shard.fileno(), _InPlace(entry, tuple(target.shape), target), staging)
    staging.finish()
    assert_bitwise_equal(loaded, saved)
    assert fills == [10_000, 2_664, 28] and staging.turn == (10 + 3 + 1) % 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_load_in_place_through_pinned_buffers(tmp_path, monkeypatch):
    saved = {"weight": torch.randn(4096, 1024), "step": torch.tensor(3.0), "half": torch.randn(100).half()}
    save_tensors(saved, tmp_path, None)
    monkeypatch.setattr(torch.distributed.checkpoint, "load", lambda *args, **kwargs: pytest.fail("DCP was asked"))
    loaded = {key: torch.full_like(value, float("nan"), device="cuda") for key, value in saved.items()}
    load_tensors(loaded, tmp_path, None)
    assert_bitwise_equal({key: value.cpu() for key, value in loaded.items()}, saved)


def test_host_copies_are_exact_independent_of_training_and_kept_from_one_save_to_the_next():
    model = backbone()
    optimizer = optimizer_for(model)
    train_step(model, optimizer)
    _, tensors = encode_parts(model_and_optimizer(model, [optimizer]))
    copies = HostCopies()
    staged = copies.stage(tensors)
    expected = {key: value.clone() for key, value in tensors.items()}
    assert_bitwise_equal(staged, expected)
    assert not {value.data_ptr() for value in staged.values()} & {value.data_ptr() for value in tensors.values()}
    train_step(model, optimizer, seed=2)  # changes every parameter and moment in place
    assert_bitwise_equal(staged, expected)

    addresses = {key: value.data_ptr() for key, value in staged.items()}
    tensors = {**tensors, "model/extra": torch.arange(3.0), "model/layers.0.attn.wq.weight": torch.ones(2, 2)}
    staged_again = copies.stage(tensors)
    assert_bitwise_equal(staged_again, tensors)
    reused = {key for key, value in staged_again.items() if addresses.get(key) == value.data_ptr()}
    assert reused == set(addresses) - {"model/layers.0.attn.wq.weight"}  # the one whose shape changed is new


def _sharded_background_save_loads_back(rank: int, world_size: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))

    def sharded(seed):
        model = fully_shard(backbone(seed), mesh=mesh)
        optimizer = optimizer_for(model)
        train_step(model, optimizer, seed=seed + rank)
        return model, optimizer

    model, optimizer = sharded(0)
    state, tensors = encode_parts(model_and_optimizer(model, [optimizer]))
    shards = [key for key, value in tensors.items() if isinstance(value, DTensor)]
    staged = HostCopies().stage(tensors)
    assert shards and all(
        isinstance(staged[key], DTensor)
        and staged[key].placements == tensors[key].placements
        and torch.equal(staged[key].to_local(), tensors[key].to_local())
        and staged[key].to_local().data_ptr() != tensors[key].to_local().data_ptr()
        for key in shards
    )
    expected = full_state(model, optimizer)
    writer = CheckpointWriter(Path(root), 2, None, True, dist.new_group(backend="gloo"))
    writer.save(1, state, tensors, {"epoch": 0, "world_size": world_size})
    writer.wait_staged()
    train_step(model, optimizer, seed=10 + rank)  # the live shards change while the write runs
    writer.close()

    read_by_dcp = []
    dcp_read = FileSystemReader.read_data
    FileSystemReader.read_data = lambda self, plan, planner: (
        read_by_dcp.extend(plan.items) or dcp_read(self, plan, planner)
    )
    fresh, fresh_optimizer = sharded(1)
    load_module(fresh, Path(root) / step_dirname(1), [fresh_optimizer], dist.new_group(backend="gloo"))
    assert read_by_dcp == []  # every shard was saved whole under this layout: read without DCP's planning
    assert_bitwise_equal(full_state(fresh, fresh_optimizer), expected)
    dist.destroy_process_group()


def test_a_background_save_of_sharded_state_loads_back_bit_for_bit_under_the_same_layout(tmp_path):
    forked_cli.run_ranks(_sharded_background_save_loads_back, 2, free_port(), str(tmp_path))


def test_the_benchmark_writes_its_four_ratios_from_one_run(tmp_path, monkeypatch, capsys):
    """benchmarks/checkpoint_io.py on the tiny model, once: the figures the issue's goals are read from.
    Run in this process (its own would spend most of its time importing)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint_io.py"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its folder first; undone after
    arguments = ["--size", "tiny", "--repeats", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    ratios = json.loads((tmp_path / "r.json").read_text())
    assert sorted(ratios) == sorted(
        ["sync_save_vs_raw_write", "async_commit_vs_raw_write", "cold_load_vs_raw_read", "async_blocked_vs_sync_save"]
    )
    assert all(math.isfinite(value) and value > 0 for value in ratios.values())
    for row in ("raw cold read", "cold load", "async blocked, no overlap", "copy to host memory", "fsync", "checksum"):
        assert row in out
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # its checkpoints and raw files are gone
