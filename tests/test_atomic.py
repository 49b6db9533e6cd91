"""ppo_ray/atomic.py: a directory or file is written whole or not at all (checkpoints, transferred
models, the model cache and the embedded models' builds all go through atomic_dir)."""

from __future__ import annotations

import os
import pathlib

import pytest

from ppo_ray.atomic import atomic_dir, atomic_write_text, remove_stale_temps, temp_prefix


def old_dir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(parents=True)
    (path / "model.bin").write_text("old")
    return path


def listing(parent: pathlib.Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_the_directory_appears_whole_and_no_temp_is_left(tmp_path):
    dest = tmp_path / "runs" / "model"  # the parent is created
    with atomic_dir(dest) as tmp:
        assert tmp.parent == dest.parent and tmp.name.startswith(temp_prefix(dest))
        assert not dest.exists()  # nothing at dest while it is written
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"new")
    assert (dest / "sub" / "w.bin").read_bytes() == b"new"
    assert listing(dest.parent) == ["model"]


@pytest.mark.parametrize("replace", [False, True])
def test_a_failure_inside_leaves_the_old_directory_and_no_temp(tmp_path, replace):
    dest = old_dir(tmp_path / "model")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_dir(dest, replace=replace, fsync=True) as tmp:
            (tmp / "model.bin").write_text("half")
            raise RuntimeError("disk full")
    assert (dest / "model.bin").read_text() == "old"
    assert listing(tmp_path) == ["model"]


def test_replace_puts_the_new_directory_in_place_of_the_old(tmp_path):
    dest = old_dir(tmp_path / "model")
    (dest / "stale.txt").write_text("old run")
    with atomic_dir(dest, replace=True) as tmp:
        (tmp / "model.bin").write_text("new")
    assert listing(dest) == ["model.bin"] and (dest / "model.bin").read_text() == "new"
    assert listing(tmp_path) == ["model"]


def test_a_failed_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    dest = old_dir(tmp_path / "model")
    real_rename = pathlib.Path.rename

    def rename(self, target):
        if self.name.startswith(temp_prefix(dest)):
            raise OSError("rename refused")
        return real_rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", rename)
    with pytest.raises(OSError, match="rename refused"):
        with atomic_dir(dest, replace=True) as tmp:
            (tmp / "model.bin").write_text("new")
    assert (dest / "model.bin").read_text() == "old"
    assert listing(tmp_path) == ["model"]


def test_without_replace_a_taken_destination_fails_or_is_kept(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()  # an empty directory is replaced
    with atomic_dir(dest) as tmp:
        (tmp / "model.bin").write_text("first")
    with pytest.raises(OSError):  # a non-empty one is not
        with atomic_dir(dest) as tmp:
            (tmp / "model.bin").write_text("second")
    assert (dest / "model.bin").read_text() == "first" and listing(tmp_path) == ["model"]
    # a concurrent writer of the same content got there first: keep its directory
    with atomic_dir(dest, keep_existing=lambda: True) as tmp:
        (tmp / "model.bin").write_text("third")
    assert (dest / "model.bin").read_text() == "first" and listing(tmp_path) == ["model"]


def test_fsync_covers_every_file_before_the_rename(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    dest = tmp_path / "ckpt"
    with atomic_dir(dest, fsync=True) as tmp:
        (tmp / "a.json").write_text("{}")
        (tmp / "adapter").mkdir()
        (tmp / "adapter" / "w.safetensors").write_bytes(b"w")
    names = [pathlib.Path(p).name for p in synced]
    assert names[:2] == ["a.json", "w.safetensors"]  # the files, then the temp dir, then the parent
    assert names[2].startswith(temp_prefix(dest)) and synced[3] == str(tmp_path)


def test_stale_temps_are_removed_by_age(tmp_path):
    dest = tmp_path / "model"
    fresh = tmp_path / f"{temp_prefix(dest)}aaaa1111"
    stale = tmp_path / f"{temp_prefix(dest)}bbbb2222"
    other = tmp_path / f"{temp_prefix(tmp_path / 'other')}cccc3333"
    for p in (fresh, stale, other):
        p.mkdir()
    os.utime(stale, (0, 0))
    remove_stale_temps(tmp_path, temp_prefix(dest), max_age_s=3600.0)
    assert listing(tmp_path) == sorted([fresh.name, other.name])
    remove_stale_temps(tmp_path, ".tmp-")  # no age: every temp directory
    assert listing(tmp_path) == []


@pytest.mark.parametrize("fsync", [False, True])
def test_a_file_is_replaced_whole_and_no_temp_is_left(tmp_path, fsync):
    path = tmp_path / "run.json"
    atomic_write_text(path, "first", fsync=fsync)
    atomic_write_text(path, "second", fsync=fsync)
    assert path.read_text() == "second" and listing(tmp_path) == ["run.json"]


def test_a_failed_file_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "latest"
    path.write_text("ckpt-1\n")

    def refuse(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "ckpt-2\n", fsync=True)
    assert path.read_text() == "ckpt-1\n" and listing(tmp_path) == ["latest"]  # the temp file is gone
