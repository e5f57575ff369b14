"""Checksums taken while a save writes its files equal a checksum read back from the disk, a save
reports where its time went, a background save copies to host memory it keeps, and a load reads
tensors straight into their destination when it can (without DCP's planning when a tensor or shard
was saved whole, as it is now)."""

import json
import math
import os
import random
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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

from uma_lightning.checkpoint import CheckpointWriter, crc, step_dirname
from uma_lightning.checkpoint.manifest import file_checksum, read_manifest, verify
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
    # Writeback every 4 KiB, so that the small files of this test cross many steps of it.
    monkeypatch.setattr("uma_lightning.checkpoint.storage._WRITEBACK_STEP", 4096)
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


@pytest.mark.parametrize("length", [0, 1, 4095, 4096 * 2, 4096 * 7 + 13])
def test_a_crc_computed_in_pieces_on_several_threads_is_zlibs(length, monkeypatch):
    monkeypatch.setattr(crc, "PIECE", 4096)  # many pieces and joins at a small size
    data = random.Random(length).randbytes(length)
    ints = torch.arange(length // 4 + 1, dtype=torch.int32).numpy()  # a buffer of 4-byte items
    for start in (0, 0xDEADBEEF):
        assert crc.crc32(data, start) == zlib.crc32(data, start)
        assert crc.crc32(memoryview(ints), start) == zlib.crc32(ints.tobytes(), start)
    middle = length // 3
    assert crc.join(zlib.crc32(data[:middle]), zlib.crc32(data[middle:]), length - middle) == zlib.crc32(data)


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
