"""Integrity of one checkpoint directory: a manifest of file sizes and checksums, written last.

A checkpoint directory is complete exactly when its manifest exists and every file it lists has
the recorded size and checksum. The writer flushes every other file to disk before it writes the
manifest, and renames the directory into place only after that (see ``directory.commit``), so a
crash at any moment leaves either a complete checkpoint or a staging directory that is never loaded.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

from zlib_ng.zlib_ng import crc32

from uma_lightning.progress import Progress

MANIFEST = "manifest.json"
FORMAT = "uma-checkpoint/1"
_CHUNK = 16 * 2**20


class CheckpointError(Exception):
    """A checkpoint that cannot be used, with the reason and the path; ``failed_rank``, when known, is the
    rank whose reading or writing failed (every rank raises the error of a collective save or load)."""

    def __init__(self, message: str, failed_rank: int | None = None):
        super().__init__(message)
        self.failed_rank = failed_rank


def file_checksum(path: str | Path, progress: Progress | None = None) -> str:
    """CRC-32 of the file's bytes as 8 hex digits: catches truncation and bit rot, and is cheap enough to
    verify every checkpoint before it is loaded. ``progress`` counts the bytes read."""
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            crc = crc32(chunk, crc)
            if progress is not None:
                progress.advance(len(chunk))
    return f"{crc:08x}"


def describe_files(directory: Path, names) -> dict[str, dict]:
    """``{name: {"bytes": size, "crc32": checksum}}`` for files of ``directory``."""
    return {
        name: {"bytes": (directory / name).stat().st_size, "crc32": file_checksum(directory / name)} for name in names
    }


def write_json_durably(path: Path, content: dict) -> None:
    """Write JSON so that ``path`` holds either nothing or all of it, flushed to disk."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as file:
        json.dump(content, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def write_manifest(directory: Path, files: dict[str, dict], summary: dict) -> None:
    """The last file of a checkpoint: what it holds (``summary``) and the size and checksum of every file."""
    write_json_durably(directory / MANIFEST, {"format": FORMAT, **summary, "files": files})


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {MANIFEST} (the save did not finish)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable manifest: {err}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    return manifest


def verify(directory: str | Path, names: list[str] | None = None, show_progress: bool = False) -> list[str]:
    """Problems that make ``directory`` unusable; empty when it is complete.

    ``names`` restricts the (expensive) checksum comparison to some of the listed files, so that ranks
    can share the work; the manifest itself and every file's presence and size are always checked.
    ``show_progress`` reports the bytes checksummed (``uma_lightning.progress``).
    """
    directory = Path(directory)
    try:
        files = read_manifest(directory)["files"]
    except CheckpointError as err:
        return [str(err)]
    problems = []
    checked = sum(int(entry.get("bytes") or 0) for name, entry in files.items() if names is None or name in names)
    with (
        Progress(checked, f"verify {directory.name}:", "B", byte_counts=True) if show_progress else nullcontext()
    ) as progress:
        for name, expected in sorted(files.items()):
            path = directory / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                problems.append(f"{path}: missing")
                continue
            if size != expected.get("bytes"):
                problems.append(f"{path}: {size} bytes, the manifest says {expected.get('bytes')}")
            elif names is None or name in names:
                checksum = file_checksum(path, progress)
                if checksum != expected.get("crc32"):
                    problems.append(
                        f"{path}: checksum {checksum} does not match the manifest's {expected.get('crc32')}"
                    )
    return problems
