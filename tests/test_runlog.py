"""ppo_ray/driver/runlog.py: a resumed run's JSONL files keep each step once, and the lines it takes
out are moved aside, never deleted."""

from __future__ import annotations

import json

from ppo_ray.driver.runlog import truncate_jsonl


def test_truncate_moves_the_steps_after_the_checkpoint_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "kl": 0.1 * s}) for s in range(1, 6)]
    path.write_text("".join(line + "\n" for line in lines))
    aside = tmp_path / "abandoned" / "after-step-3"
    before = path.stat().st_mtime_ns
    truncate_jsonl(path, 5, aside)  # nothing past step 5: the file is left as it is
    assert path.stat().st_mtime_ns == before and not aside.exists()
    truncate_jsonl(path, 3, aside)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    # the abandoned lines, whole and in order, beside the abandoned checkpoints
    assert (aside / "metrics.jsonl").read_text().splitlines() == lines[3:]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # the temp file was renamed into place
    truncate_jsonl(tmp_path / "absent.jsonl", 3, aside)  # no file: nothing to do
