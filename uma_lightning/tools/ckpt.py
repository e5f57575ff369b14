"""``uma ckpt``: look into checkpoints and export their weights.

    uma ckpt inspect PATH [--all]                 step, size, manifest status, tensor shapes
    uma ckpt export PATH --to model.safetensors   consolidated weights of the network, for inference
    uma ckpt export PATH --format mlflow [--register NAME]
                                                  the policy as an MLflow Model (servable), in the run
                                                  that trained it or a new one
    uma ckpt export PATH --format hf --to DIR     the network's transformers model as a Hugging Face
                                                  directory (``from_pretrained`` loads it)

PATH is one checkpoint directory (``.../checkpoints/step-000000100``) or a run's checkpoints
directory, which means its newest valid checkpoint. Nothing is unpickled (see ``storage.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from uma_lightning.checkpoint.codec import decode
from uma_lightning.checkpoint.directory import committed
from uma_lightning.checkpoint.manifest import CheckpointError, read_manifest, verify
from uma_lightning.checkpoint.resume import unusable_because
from uma_lightning.checkpoint.storage import tensor_metadata
from uma_lightning.checkpoint.weights import MODEL, TRAINER, network_origin, read_state, read_weights, save_weights_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uma ckpt", description="Inspect and export checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="step, size, manifest status and tensor shapes")
    inspect.add_argument("path", type=Path, help="a checkpoint directory, or a run's checkpoints directory")
    inspect.add_argument("--all", action="store_true", help="list optimizer, trainer and RNG tensors too")
    export = commands.add_parser("export", help="the network's weights as one file, or the policy as an MLflow Model")
    export.add_argument(
        "path", type=Path, help="a checkpoint directory, or a run's checkpoints directory (newest valid)"
    )
    export.add_argument(
        "--format",
        choices=("safetensors", "mlflow", "hf"),
        default="safetensors",
        help="safetensors: weights to --to; mlflow: the policy as the MLflow Model 'model' of a run; hf: the "
        "network's transformers model as a Hugging Face directory --to (default: safetensors)",
    )
    export.add_argument(
        "--to", type=Path, help="output .safetensors file (--format safetensors), or directory (--format hf)"
    )
    export.add_argument(
        "--hf-source",
        type=Path,
        help="--format hf: the Hugging Face directory whose config.json and tokenizer and processor files to "
        "write beside the weights (default: the one the run recorded)",
    )
    export.add_argument(
        "--max-shard-size", default="5GB", help="--format hf: the largest safetensors file (default: 5GB)"
    )
    export.add_argument(
        "--module",
        default="model",
        help="attribute path of the network inside the LightningModule (default: model); '' exports everything",
    )
    export.add_argument(
        "--tracking-uri",
        help="MLflow server or store (default: $MLFLOW_TRACKING_URI, else the embedded store in ./mlruns)",
    )
    export.add_argument(
        "--run-id",
        help="run to log the model into (default: the run that saved the checkpoint, when the store has it; else a new run)",
    )
    export.add_argument("--experiment", default="uma", help="experiment of a new run (default: uma)")
    export.add_argument("--register", metavar="NAME", help="register the model under NAME in the Model Registry")
    export.add_argument(
        "--weights",
        choices=("artifact", "reference"),
        default="artifact",
        help="artifact: copy the weights into the model; reference: the model reads the checkpoint where it is",
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "export" and args.format in ("safetensors", "hf") and args.to is None:
        parser.error(f"export --format {args.format} needs --to {'FILE' if args.format == 'safetensors' else 'DIR'}")
    try:
        if args.command == "inspect":
            return inspect_checkpoints(args.path, args.all)
        if args.format == "mlflow":
            return export_mlflow_model(args)
        if args.format == "hf":
            return export_hf(args.path, args.to, args.hf_source, args.max_shard_size)
        return export_weights(args.path, args.to, args.module)
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
    """Write the network's weights, unsharded and under plain names, to a safetensors file. The
    network's own weights (``module`` "model") name their module class and network builder too, so
    ``Policy.from_checkpoint`` rebuilds the policy from the file alone."""
    prefix = f"{MODEL}/{module}." if module else f"{MODEL}/"
    directory, _, tensors = read_weights(path, (prefix,), show_progress=True)
    manifest = read_manifest(directory)
    trainer_state = read_state(directory)[TRAINER]
    hyperparameters = decode(trainer_state.get("hyper_parameters"), {})
    metadata = {"step": str(manifest["step"]), "source": str(directory), "ema": "false"}
    if module == "model":
        metadata.update(network_origin(trainer_state))
    save_weights_file(
        output, {key.removeprefix(prefix): value for key, value in tensors.items()}, hyperparameters, metadata
    )
    print(f"exported {len(tensors)} tensors of step {manifest['step']} from {directory} to {output}")
    return 0


def export_hf(path: Path, output: Path, hf_source: Path | None, max_shard_size: str) -> int:
    """Write the network's ``transformers`` model (at its ``hf_prefix``) as a Hugging Face directory:
    the inference weights (the EMA when the checkpoint has them, LoRA adapters folded in, as
    ``Policy.from_checkpoint`` rebuilds them), with the config, tokenizer and processor files of the
    directory the network was built from (``network.pretrained``) or ``hf_source``. Exit status 2
    with one line when the checkpoint or the directory does not fit."""
    from uma_lightning.checkpoint.hf import export_hf_directory, hf_prefix, hf_source_directory, is_hf_directory
    from uma_lightning.models.vlm import import_transformers
    from uma_lightning.policy import Policy

    try:
        # Its bars (loading the model the network is built around, writing the shards) would read as more work.
        import_transformers().utils.logging.disable_progress_bar()
        network = Policy.from_checkpoint(str(path)).model
        held = network.get_submodule(hf_prefix(network))
        source = hf_source or hf_source_directory(network)
        if source is None or not is_hf_directory(source):
            raise ValueError(
                f"{source or path}: no Hugging Face directory (config.json and safetensors) to take the config "
                "and tokenizer from; give --hf-source DIR"
            )
        count = export_hf_directory(held.state_dict(), Path(source), output, max_shard_size)
    except (ValueError, FileNotFoundError) as err:
        print(f"uma ckpt: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"exported {count} tensors of {path} with the config and tokenizer of {source} to {output}")
    return 0


def export_mlflow_model(args: argparse.Namespace) -> int:
    """Log the policy of ``args.path`` as an MLflow Model into ``args.run_id``, the run that saved the
    checkpoint, or a new run; exit status 2 with one line when the checkpoint or the store refuses."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from uma_lightning.checkpoint.weights import read_checkpoint
    from uma_lightning.tracking.mlflow_logger import local_store_uri
    from uma_lightning.tracking.policy_model import MODEL_NAME, log_policy_model

    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_store_uri("mlruns")
    new_run = None
    try:
        source = read_checkpoint(args.path)  # before the store is touched
        client = MlflowClient(uri)
        run_id = args.run_id or _training_run(client, Path(source.path))
        if run_id is None:
            experiment = client.get_experiment_by_name(args.experiment)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(args.experiment)
            run_id = new_run = client.create_run(experiment_id, run_name=f"export {source.path}").info.run_id
        else:
            client.get_run(run_id)  # a wrong id fails here, by name
        info = log_policy_model(uri, run_id, source, args.weights, args.register)
    except (MlflowException, ValueError, FileNotFoundError) as err:
        if new_run:
            client.set_terminated(new_run, "FAILED")
        print(f"uma ckpt: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if new_run:
        client.set_terminated(new_run)
    print(f"logged the policy of {args.path} as runs:/{run_id}/{MODEL_NAME} ({info.model_uri}) in {uri}")
    if args.register:
        print(f"registered as models:/{args.register}/{info.registered_model_version}")
    return 0


def _training_run(client, path: Path) -> str | None:
    """The MLflow run that saved the checkpoint ``path`` (a directory with a manifest), when this store has it."""
    from mlflow.exceptions import MlflowException

    run_id = read_manifest(path).get("mlflow_run_id") if (path / "manifest.json").exists() else None
    if not run_id:
        return None
    try:
        client.get_run(run_id)
    except MlflowException:
        return None
    return run_id
