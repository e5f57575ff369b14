"""Where dataset files come from: a local directory, or an fsspec URL (``s3://bucket/prefix``) whose files
are copied into a local disk cache before they are read.

The cache is bounded in bytes and evicts the least recently used files. Every download is checked
(size, and the MD5 in the ETag when the server gives one) and written under a temporary name, then
renamed, so a cached file is either complete or absent. A cached file is checked again (size, and
its SHA-256 once per process) before it is used; a damaged one is downloaded again. Several
processes (loader workers, ranks on one node) can share one cache directory: file locks make each
file download once. Files the loader will need next are downloaded in the background.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 2**20
RECENT_S = 10.0


class StorageError(RuntimeError):
    """A remote file is missing, unreadable, fails its integrity check, or cannot fit in the cache."""


def is_remote(root: str | Path) -> bool:
    return "://" in str(root) and not str(root).startswith("file://")


class ShardCache:
    """Remote files copied to `directory`, at most `max_bytes` in total."""

    def __init__(self, directory: str | Path, max_bytes: int, filesystem: Any, prefetch_threads: int = 2) -> None:
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.fs = filesystem
        self.prefetch_threads = prefetch_threads
        self.downloads = 0  # files this process downloaded (tests and logs read it)
        self._verified: set[str] = set()
        self._pending: dict[str, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, url: str) -> Path:
        """Local path of the file at `url`, downloading it first unless a good copy is cached."""
        pending = self._pending.pop(url, None)
        if pending is not None:
            path = pending.result()
            try:
                os.utime(path)  # handed out now: the LRU keeps it longest (it may sit prefetched a while)
                return path
            except FileNotFoundError:  # evicted between its prefetch and its use: fetched again below
                pass
        return self._fetch(url)

    def prefetch(self, urls: Iterable[str]) -> None:
        """Start downloading `urls` in the background (at most `prefetch_threads` at a time)."""
        if self.prefetch_threads < 1:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="shard-prefetch")
        for url in urls:
            if url not in self._pending and not self._looks_cached(url):
                self._pending[url] = self._executor.submit(self._fetch, url)

    def cached_bytes(self) -> int:
        return sum(entry["size"] for _, entry in self._entries())

    def local_path(self, url: str) -> Path:
        digest = hashlib.sha1(url.encode()).hexdigest()
        return self.directory / digest[:2] / (digest + Path(url).suffix)

    # ---- internals ---------------------------------------------------------------------------

    def _looks_cached(self, url: str) -> bool:
        path = self.local_path(url)
        return path.is_file() and _sidecar(path).is_file()

    def _fetch(self, url: str) -> Path:
        path = self.local_path(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            if self._valid(url, path):
                os.utime(path)  # the modification time is the LRU clock
                return path
            return self._download(url, path)

    def _valid(self, url: str, path: Path) -> bool:
        sidecar = _sidecar(path)
        if not (path.is_file() and sidecar.is_file()):
            return False
        try:
            entry = json.loads(sidecar.read_text())
        except (OSError, json.JSONDecodeError):
            entry = {}
        size = path.stat().st_size
        problem = None
        if entry.get("url") != url or entry.get("size") != size:
            problem = f"size {size} differs from the recorded {entry.get('size')}"
        elif url not in self._verified and _sha256(path) != entry.get("sha256"):
            problem = "its SHA-256 differs from the one recorded at download"
        if problem:
            logger.warning("cached copy %s of %s is damaged (%s); downloading it again", path, url, problem)
            return False
        self._verified.add(url)
        return True

    def _download(self, url: str, path: Path) -> Path:
        try:
            info = self.fs.info(url)
        except FileNotFoundError as error:
            raise StorageError(f"{url} is missing") from error
        except OSError as error:
            raise StorageError(f"cannot stat {url}: {error}") from error
        size = int(info["size"])
        if size > self.max_bytes:
            raise StorageError(
                f"{url} is {size / 2**20:.1f} MiB, larger than the whole shard cache "
                f"({self.max_bytes / 2**20:.1f} MiB in {self.directory}); raise the cache size"
            )
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        reservation = partial.with_name(partial.name[: -len(".partial")] + ".reserve.json")
        self._make_room(size, reservation)
        sha256, md5, written = hashlib.sha256(), hashlib.md5(), 0
        start = time.perf_counter()
        try:
            try:
                with self.fs.open(url, "rb") as source, open(partial, "wb") as target:
                    while chunk := source.read(CHUNK_BYTES):
                        target.write(chunk)
                        sha256.update(chunk)
                        md5.update(chunk)
                        written += len(chunk)
            except OSError as error:
                raise StorageError(f"cannot download {url}: {error}") from error
            etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
            if written != size:
                raise StorageError(f"download of {url} is corrupt: got {written} bytes, the server lists {size}")
            if len(etag) == 32 and "-" not in etag and md5.hexdigest() != etag:  # a plain MD5 ETag (single-part upload)
                raise StorageError(f"download of {url} is corrupt: MD5 {md5.hexdigest()} differs from the ETag {etag}")
            os.replace(partial, path)
            _sidecar(path).write_text(
                json.dumps({"url": url, "size": size, "sha256": sha256.hexdigest(), "etag": etag})
            )
        finally:
            partial.unlink(missing_ok=True)
            reservation.unlink(missing_ok=True)
        self._verified.add(url)
        self.downloads += 1
        logger.debug("downloaded %s (%.1f MiB) in %.2fs", url, size / 2**20, time.perf_counter() - start)
        return path

    def _make_room(self, incoming: int, reservation: Path) -> None:
        """Evict least recently used files until the cached files, the downloads in flight (of every
        process sharing the cache) and `incoming` fit; then reserve `incoming` for this download."""
        with _locked(self.directory / ".evict.lock"):
            entries = sorted(self._entries(), key=lambda item: _mtime(item[0]))
            total = sum(entry["size"] for _, entry in entries) + self._reserved()
            # Files used in the last RECENT_S seconds were just handed to a reader that may not have
            # opened them yet: they go last, and only when nothing else frees enough room.
            recent = time.time() - RECENT_S
            entries = [e for e in entries if _mtime(e[0]) < recent] + [e for e in entries if _mtime(e[0]) >= recent]
            for path, entry in entries:
                if total + incoming <= self.max_bytes:
                    break
                if _mtime(path) >= recent:
                    logger.warning(
                        "shard cache %s is smaller than the files in use; evicting recently used %s",
                        self.directory,
                        entry.get("url"),
                    )
                # Unlinking a file another process has open is safe on POSIX: its reads go on.
                path.unlink(missing_ok=True)
                _sidecar(path).unlink(missing_ok=True)
                total -= entry["size"]
                logger.debug("evicted %s from the shard cache", entry.get("url"))
            reservation.write_text(json.dumps({"size": incoming, "pid": os.getpid()}))

    def _reserved(self) -> int:
        """Bytes of downloads in flight, skipping reservations left by processes that died."""
        total = 0
        for path in self.directory.glob("*/*.reserve.json"):
            try:
                entry = json.loads(path.read_text())
                os.kill(entry["pid"], 0)
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            total += entry["size"]
        return total

    def _entries(self) -> Iterator[tuple[Path, dict]]:
        for sidecar in self.directory.glob("*/*.meta.json"):
            try:
                entry = json.loads(sidecar.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            yield sidecar.with_name(sidecar.name[: -len(".meta.json")]), entry


class Storage:
    """Reads the files of a dataset under `root`, a local directory or an fsspec URL.

    Picklable: loader workers rebuild the filesystem client and the cache handle on first use,
    because clients with event-loop threads (s3fs) do not survive pickling or fork.
    """

    def __init__(
        self,
        root: str | Path,
        cache_dir: str | Path | None = None,
        cache_bytes: int = 20 * 2**30,
        storage_options: dict[str, Any] | None = None,
        prefetch_threads: int = 2,
    ) -> None:
        self.remote = is_remote(root)
        root = str(root)
        self.root = root.rstrip("/") if self.remote else Path(root.removeprefix("file://"))
        self.storage_options = dict(storage_options or {})
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache_bytes = int(cache_bytes)
        self.prefetch_threads = prefetch_threads
        self._fs: Any = None
        self._cache: ShardCache | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_cache": None}

    def __str__(self) -> str:
        return str(self.root)

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}" if self.remote else str(self.root / relative)

    def path(self, relative: str) -> Path:
        """A local path to read `relative` from; remote files are downloaded into the cache first."""
        if not self.remote:
            return self.root / relative
        return self.cache.get(self.url(relative))

    def prefetch(self, relatives: Iterable[str]) -> None:
        if self.remote:
            self.cache.prefetch(self.url(r) for r in relatives)

    def read_bytes(self, relative: str) -> bytes:
        """A small file read whole (metadata), not cached."""
        if not self.remote:
            return (self.root / relative).read_bytes()
        try:
            return self.fs.cat_file(self.url(relative))
        except FileNotFoundError:
            raise
        except OSError as error:
            raise OSError(f"cannot read {self.url(relative)}: {error}") from error

    def is_dir(self) -> bool:
        return self.fs.isdir(self.root) if self.remote else self.root.is_dir()

    def glob(self, pattern: str) -> list[str]:
        """Relative paths matching `pattern` (relative to the root), sorted."""
        if not self.remote:
            return sorted(str(p.relative_to(self.root)) for p in self.root.glob(pattern))
        prefix = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in self.fs.glob(prefix + pattern))

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(str(self.root), **self.storage_options)
        return self._fs

    @property
    def cache(self) -> ShardCache:
        if self._cache is None:
            if self.cache_dir is None:
                raise StorageError(f"{self.root}: remote data needs a local shard cache directory")
            self._cache = ShardCache(self.cache_dir, self.cache_bytes, self.fs, self.prefetch_threads)
        return self._cache


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".meta.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
