"""Where uma_lightning keeps what it makes once and reuses: generated datasets, remote shards,
decoded-frame stores, the empty MLflow store new runs start from and the MFU peak probed on a CPU."""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$UMA_CACHE_DIR, else $XDG_CACHE_HOME/uma_lightning, else ~/.cache/uma_lightning."""
    if os.environ.get("UMA_CACHE_DIR"):
        return Path(os.environ["UMA_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "uma_lightning"
    return Path.home() / ".cache" / "uma_lightning"
