"""ppo_ray/runlog.py: a resumed run's JSONL files keep each step once."""

from __future__ import annotations

import json

from ppo_ray.runlog import truncate_jsonl


def test_truncate_drops_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "kl": 0.1 * s}) + "\n" for s in range(1, 6)))
    before = path.stat().st_mtime_ns
    truncate_jsonl(path, 5)  # nothing past step 5: the file is left as it is
    assert path.stat().st_mtime_ns == before
    truncate_jsonl(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # the temp file was renamed into place
    truncate_jsonl(tmp_path / "absent.jsonl", 3)  # no file: nothing to do
