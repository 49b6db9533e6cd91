"""Files and directories written whole or not at all: write into a temp file or directory
beside the destination, then rename it into place (a rename within one filesystem is
atomic, so a reader sees the old one or the new one, never a half-written one).

    with atomic_dir(dest) as tmp:             # tmp: a new, empty directory beside dest
        (tmp / "config.json").write_text(...)
    # here dest is the finished directory; on any exception tmp is gone and dest untouched

    atomic_write_text(path, text)             # one file: the same rule

The one home of that rule: checkpoints and their `latest` pointer (ppo_ray.driver.checkpoint),
model directories moved between nodes and the per-node model cache (ppo_ray.transfer), the
embedded models' builds (ppo_ray.tiny_model, ppo_ray.tldr_model) and converted GGUF files
(ppo_ray.gguf_model; both with exclusive_lock, so that one builder of an entry pays for it), run.json
(ppo_ray.tracking), a resumed run's truncated logs (ppo_ray.driver.runlog), the pipeline's saved
evaluation (ppo_ray.tasks.pipeline).

Bottom layer: imports the standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional


def temp_prefix(dest: Path) -> str:
    """The name every temp directory of `dest` starts with (then 8 hex digits); a dot
    name, so listings of the parent skip it."""
    return f".tmp-{dest.name}-"


def fsync_dir(path: Path) -> None:
    """fsync a directory's entry table (a rename or a new file in it survives a crash)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then `path` itself."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def remove_stale_temps(parent: Path, prefix: str, max_age_s: Optional[float] = None) -> None:
    """Remove the temp directories under `parent` whose name starts with `prefix` that an
    earlier crash left behind: every one (max_age_s None: the caller holds the only writer),
    or those untouched for more than max_age_s seconds (a concurrent writer's is fresh)."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    now = time.time()
    for p in entries:
        if p.name.startswith(prefix) and p.is_dir():
            try:
                if max_age_s is None or now - p.stat().st_mtime > max_age_s:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, *, replace: bool = False, fsync: bool = False,
               keep_existing: Optional[Callable[[], bool]] = None) -> Iterator[Path]:
    """Yield a new, empty directory beside `dest` (its parent is created); when the block
    ends, rename it to `dest`. On any exception, in the block or the rename, the temp
    directory is removed and the exception propagates; `dest` is as it was.

    What an existing `dest` gets:
    - replace=False: the rename replaces an empty directory; a non-empty one makes it fail
      (OSError ENOTEMPTY/EEXIST) unless keep_existing says that one will do;
    - replace=True: it is moved aside, the new one renamed into place, then it is removed
      (put back if the rename fails).
    keep_existing: for writers that race to build the same `dest` (several actors of one
    node, concurrent builders): called when the rename finds `dest` taken; True = another
    writer finished the same content first, so keep theirs and discard this one.
    fsync=True: every file and the temp directory are fsynced before the rename, and the
    parent after it, so that `dest` survives a machine crash whole (checkpoints)."""
    dest = Path(dest)
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{temp_prefix(dest)}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if fsync:
            fsync_tree(tmp)
        old = None
        if replace and (dest.exists() or dest.is_symlink()):
            old = parent / f".tmp-old-{dest.name}-{uuid.uuid4().hex[:8]}"
            dest.rename(old)
        try:
            tmp.rename(dest)
        except OSError as e:
            if old is not None:
                old.rename(dest)
                raise
            if not (e.errno in (errno.ENOTEMPTY, errno.EEXIST) and keep_existing is not None and keep_existing()):
                raise
        if old is not None:
            _remove(old)
        if fsync:
            fsync_dir(parent)
    finally:
        if tmp.exists():  # the block or the rename failed, or another writer's dest was kept
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike) -> Iterator[None]:
    """An advisory exclusive lock (``flock`` on the file `path`, created if missing) held for
    the block, so that concurrent builders of one cache entry on one machine do not each pay
    for the build (the embedded models, converted GGUF files). Correctness never depends on
    it (the build itself is atomic_dir's): where it cannot be taken, the block runs unlocked."""
    fd = None
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass  # no lock: concurrent builders each build, and the first rename wins
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    """Write `text` to `path` whole or not at all: a temp file beside it (a dot name with
    8 hex digits, so concurrent writers never share one), then os.replace. On any exception
    the temp file is removed and `path` is as it was. fsync=True: the file is fsynced before
    the rename and the directory after it (it survives a machine crash: checkpoints)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    if fsync:
        fsync_dir(path.parent)
