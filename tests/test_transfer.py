"""ppo_ray/transfer.py: model directories as bytes (no Ray): the content digest, the atomic
write, and a node's cache of received models. The Ray part (ship_model, local_model_dir)
runs on two simulated nodes in test_cluster.py."""

from __future__ import annotations

import shutil

import numpy as np

from ppo_ray.transfer import cached, content_digest, read_files, write_cache_entry, write_files


def model_dir(path):
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"a": 1}')
    (path / "sub" / "w.bin").write_bytes(bytes(range(256)))
    return path


def test_the_digest_names_the_content_not_the_place(tmp_path):
    a = model_dir(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert content_digest(a) == content_digest(b) and len(content_digest(a)) == 16
    (b / "sub" / "w.bin").write_bytes(bytes(range(255)))
    assert content_digest(b) != content_digest(a)
    shutil.copytree(a, tmp_path / "c")
    (tmp_path / "c" / "config.json").rename(tmp_path / "c" / "other.json")  # same bytes, another name
    assert content_digest(tmp_path / "c") != content_digest(a)


def test_write_files_round_trips_and_replaces_an_existing_directory(tmp_path):
    files = read_files(model_dir(tmp_path / "a"))
    assert sorted(files) == ["config.json", "sub/w.bin"] and files["sub/w.bin"].dtype == np.uint8
    dest = tmp_path / "out" / "model"
    dest.mkdir(parents=True)
    (dest / "stale.txt").write_text("old run")
    assert write_files(files, dest) == dest
    assert content_digest(dest) == content_digest(tmp_path / "a")  # stale.txt gone
    assert [p.name for p in dest.parent.iterdir()] == ["model"]  # no temp directories left


def test_a_cache_entry_is_used_only_once_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_RAY_MODEL_CACHE", str(tmp_path / "cache"))
    src = model_dir(tmp_path / "a")
    digest = content_digest(src)
    assert cached(digest) is None
    entry = write_cache_entry(read_files(src), digest)
    assert cached(digest) == entry == tmp_path / "cache" / digest
    assert (entry / "sub" / "w.bin").read_bytes() == bytes(range(256))
    assert write_cache_entry({}, digest) == entry  # already there: not rewritten
    (tmp_path / "cache" / "0123").mkdir()  # a directory without .complete (a writer died)
    assert cached("0123") is None
