"""Model directories as bytes: what moves a checkpoint from one node to another through
Ray's object store (ppo_ray.driver.shipping does the Ray part), with no shared filesystem.

    files = read_files(path)                  # {relative path: uint8 array} of a directory
    key = content_digest(path)                # sha256 over names and contents
    write_files(files, dest)                  # atomically: a temp dir renamed into place
    cache = model_cache_dir() / key           # where a node keeps received models

The arrays are numpy uint8 views of the files, so Ray stores them out of band and a
reader on the receiving node maps them from its object store without a copy. A directory
is identified by its content digest: a node that already holds that digest in its cache
(an earlier run, another actor on the same node) reuses it.

Bottom layer: imports numpy, the standard library and ppo_ray.atomic only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ppo_ray.atomic import atomic_dir

CACHE_ENV = "PPO_RAY_MODEL_CACHE"
COMPLETE = ".complete"  # written last into a cache entry


def model_cache_dir() -> Path:
    """This node's cache of received model directories: $PPO_RAY_MODEL_CACHE, else
    $PPO_RAY_CACHE/models, else ~/.cache/ppo_ray/models."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ.get("PPO_RAY_CACHE") or Path.home() / ".cache" / "ppo_ray")
    return base.expanduser() / "models"


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def content_digest(path: str | Path) -> str:
    """sha256 over the directory's relative file names and contents (16 hex digits)."""
    path = Path(path)
    h = hashlib.sha256()
    for p in _files(path):
        h.update(p.relative_to(path).as_posix().encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


def list_files(path: str | Path) -> list[str]:
    """The posix relative paths of every file under `path`, sorted."""
    path = Path(path)
    return [p.relative_to(path).as_posix() for p in _files(path)]


def read_file(path: str | Path, name: str) -> np.ndarray:
    """One file of a directory as a uint8 array."""
    return np.fromfile(Path(path) / name, dtype=np.uint8)


def read_files(path: str | Path) -> dict[str, np.ndarray]:
    """Every file under `path` as {posix relative path: uint8 array}."""
    return {name: read_file(path, name) for name in list_files(path)}


def _write_into(files: dict[str, np.ndarray], path: Path) -> None:
    for name, data in files.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        np.asarray(data, dtype=np.uint8).tofile(target)


def write_files(files: dict[str, np.ndarray], dest: str | Path) -> Path:
    """Write `files` (read_files' output) as the directory `dest`, atomically: into a temp
    directory beside it, then renamed into place (ppo_ray.atomic). An existing `dest` is
    replaced (a stage rerun in the same run directory)."""
    dest = Path(dest)
    with atomic_dir(dest, replace=True) as tmp:
        _write_into(files, tmp)
    return dest


def cached(digest: str) -> Path | None:
    """The cache entry of `digest` on this node, if complete."""
    entry = model_cache_dir() / digest
    return entry if (entry / COMPLETE).is_file() else None


def write_cache_entry(files: dict[str, np.ndarray], digest: str) -> Path:
    """Put `files` into this node's cache under `digest` (several actors of one node may race
    to write the same entry: each writes its own temp directory, the first rename wins)."""
    entry = model_cache_dir() / digest
    if cached(digest):
        return entry
    with atomic_dir(entry, keep_existing=lambda: cached(digest) is not None) as tmp:
        _write_into(files, tmp)
        (tmp / COMPLETE).write_text(digest + "\n")
    return entry
