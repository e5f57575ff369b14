"""``uma ckpt``: look into checkpoints and export their weights.

    uma ckpt inspect PATH [--all]                 step, size, manifest status, tensor shapes
    uma ckpt export PATH --to model.safetensors   consolidated weights of the network, for inference

PATH is one checkpoint directory (``.../checkpoints/step-000000100``) or a run's checkpoints
directory, which means its newest valid checkpoint. Nothing is unpickled (see ``storage.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from uma_lightning.checkpoint.codec import decode
from uma_lightning.checkpoint.directory import committed
from uma_lightning.checkpoint.manifest import CheckpointError, read_manifest, verify
from uma_lightning.checkpoint.resume import unusable_because
from uma_lightning.checkpoint.storage import tensor_metadata
from uma_lightning.checkpoint.weights import MODEL, TRAINER, read_state, read_weights


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uma ckpt", description="Inspect and export checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="step, size, manifest status and tensor shapes")
    inspect.add_argument("path", type=Path, help="a checkpoint directory, or a run's checkpoints directory")
    inspect.add_argument("--all", action="store_true", help="list optimizer, trainer and RNG tensors too")
    export = commands.add_parser("export", help="consolidated weights as one safetensors file")
    export.add_argument(
        "path", type=Path, help="a checkpoint directory, or a run's checkpoints directory (newest valid)"
    )
    export.add_argument("--to", type=Path, required=True, help="output .safetensors file")
    export.add_argument(
        "--module",
        default="model",
        help="attribute path of the network inside the LightningModule (default: model); '' exports everything",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return (
            inspect_checkpoints(args.path, args.all)
            if args.command == "inspect"
            else export_weights(args.path, args.to, args.module)
        )
    except CheckpointError as err:
        print(f"uma ckpt: error: {err}", file=sys.stderr)
        return 1


def inspect_checkpoints(path: Path, show_all: bool = False) -> int:
    """Print what ``path`` holds; exit status 1 when the checkpoint (or every checkpoint) is unusable."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if not (path / "manifest.json").exists() and committed(path):
        problems = {}
        for step, directory in committed(path):
            problems[directory] = unusable_because(directory)
            summary = read_manifest(directory) if not problems[directory] else {}
            status = "valid" if not problems[directory] else "UNUSABLE: " + "; ".join(problems[directory])
            size = f"{summary.get('bytes', 0) / 1e6:.1f} MB" if summary else "?"
            print(f"{directory.name}  step {step}  {size}  {status}")
        usable = [d for d, found in problems.items() if not found]
        print(f"resume would continue from: {usable[-1] if usable else 'nothing (all unusable)'}")
        return 0 if usable else 1
    problems = verify(path)
    print(f"checkpoint: {path}")
    if problems:
        print("manifest: UNUSABLE, it would never be loaded:")
        for problem in problems:
            print(f"  {problem}")
        return 1
    manifest = read_manifest(path)
    print(
        f"manifest: valid ({len(manifest['files'])} files, {manifest['bytes'] / 1e6:.1f} MB, sizes and checksums match)"
    )
    print(
        f"step {manifest['step']}, epoch {manifest.get('epoch')}, saved by {manifest.get('world_size')} process(es) "
        f"at {manifest.get('created')} with torch {manifest.get('torch')}, MLflow run {manifest.get('mlflow_run_id') or '-'}"
    )
    entries = tensor_metadata(path)
    groups: dict[str, list[str]] = {}
    for key in sorted(entries):
        groups.setdefault(key.split("/", 1)[0], []).append(key)
    for group, keys in groups.items():
        count = sum(torch.Size(entries[k].size).numel() for k in keys)
        print(f"{group}: {len(keys)} tensors, {count:,} values")
        if group == MODEL or show_all:
            width = max(len(k) for k in keys)
            for key in keys:
                entry = entries[key]
                print(f"  {key:<{width}}  {list(entry.size)}  {str(entry.properties.dtype).removeprefix('torch.')}")
    return 0


def export_weights(path: Path, output: Path, module: str = "model") -> int:
    """Write the network's weights, unsharded and under plain names, to a safetensors file."""
    prefix = f"{MODEL}/{module}." if module else f"{MODEL}/"
    directory, _, tensors = read_weights(path, (prefix,), show_progress=True)
    manifest = read_manifest(directory)
    hyperparameters = decode(read_state(directory)[TRAINER].get("hyper_parameters"), {})
    metadata = {
        "step": str(manifest["step"]),
        "source": str(directory),
        "hyper_parameters": json.dumps(hyperparameters),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    save_file(
        {key.removeprefix(prefix): value.contiguous() for key, value in tensors.items()},
        str(partial),
        metadata=metadata,
    )
    os.replace(partial, output)
    print(f"exported {len(tensors)} tensors of step {manifest['step']} from {directory} to {output}")
    return 0
