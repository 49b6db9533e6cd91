"""Where each finished PPO step goes during PPOTrainer.train: the Prometheus gauges, the
trackers (TensorBoard / wandb), <metrics_path> (one JSON line per step), the eval samples
(<run_dir>/eval_samples.jsonl), the evaluated steps' rollouts per token
(<run_dir>/attribution.jsonl, ppo_ray.attribution), a multi-turn run's evaluated steps' episodes as
whole transcripts (<run_dir>/episodes.jsonl) and the console line.

A resumed run first takes the lines of steps after its checkpoint out of the JSONL files, so
that every step appears once; they are moved, not deleted: beside the checkpoints of the branch
the resume abandoned (checkpoints/abandoned/<time>-after-step-N/), or into
<run_dir>/replaced/<time>-after-step-N/ (a tail past the last checkpoint, which the resumed run
computes again).

With the run directory's lock (ppo_ray.driver.runlock), every write asks it first: a driver whose
lock another driver took over stops with RunLockLost before writing its next line (the
heartbeat's finding, no I/O per step; one read of the lock file when the log opens).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Optional, Sequence

from ppo_ray.atomic import atomic_write_text
from ppo_ray.attribution import ATTRIBUTION, RolloutAttribution
from ppo_ray.logs import format_step
from ppo_ray.driver.metrics import TrainingMetrics
from ppo_ray.driver.rundir import REPLACED
from ppo_ray.driver.runlock import RunLock
from ppo_ray.stats import StepResult
from ppo_ray.tracking import Trackers, read_run_file, update_run_file

log = logging.getLogger("ppo_ray.trainer")

EVAL_SAMPLES = "eval_samples.jsonl"
EPISODES = "episodes.jsonl"  # a multi-turn run's evaluated steps: their first episodes' transcripts
# The run tag a process's trainer takes instead of a fresh one: deploy/submit.sh sets it, so
# that the job's submission id (ppo-ray-<stage>-<run tag>) names its actors and series.
RUN_TAG_ENV = "PPO_RAY_RUN_TAG"
RUN_TAG_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def new_run_tag() -> str:
    """The run tag of a new PPOTrainer: $PPO_RAY_RUN_TAG when set, else ppo-<8 hex>. It is
    the Ray namespace of the run's actors (named <run tag>/<role>) and the `run` label of its
    Prometheus series, so it must be a short name (letters, digits, . _ -)."""
    tag = os.environ.get(RUN_TAG_ENV, "")
    if not tag:
        return f"ppo-{uuid.uuid4().hex[:8]}"
    if not RUN_TAG_FORMAT.fullmatch(tag):
        raise ValueError(f"{RUN_TAG_ENV}={tag!r} is not a run tag: 1-63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit (it names the run's Ray namespace and Prometheus label)")
    return tag


class RunLog:
    def __init__(self, metrics: TrainingMetrics, *, run_dir: Optional[Path], metrics_path: Optional[Path],
                 progress: bool, target: int, adaptive_kl: bool = False, lock: Optional[RunLock] = None):
        self.metrics = metrics
        self.lock = lock  # the run directory's: asked before every write (RunLockLost once another driver has it)
        self.run_dir = run_dir
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.samples_path = run_dir / EVAL_SAMPLES if run_dir is not None else None
        self.attribution_path = run_dir / ATTRIBUTION if run_dir is not None else None
        self.episodes_path = run_dir / EPISODES if run_dir is not None else None
        self.progress = progress
        self.target = target
        self.adaptive_kl = adaptive_kl  # the console line shows beta (it moves)
        self.trackers = Trackers()

    @classmethod
    def open(cls, metrics: TrainingMetrics, *, run_dir: Optional[Path], metrics_path, progress: bool, target: int,
             step: int, report_to: Sequence[str], config: dict, run_tag: str,
             adaptive_kl: bool = False, aside: Optional[Path] = None, lock: Optional[RunLock] = None) -> "RunLog":
        """Truncate the JSONL files to `step` (the steps done; the lines past it go to `aside`,
        the abandoned branch's folder, or a new folder of <run_dir>/replaced/), record this
        process's run tag in <run_dir>/run.json and open the trackers. `lock`: the run
        directory's, read once here and asked before every later write."""
        if lock is not None:
            lock.check(read=True)
        out = cls(metrics, run_dir=run_dir, metrics_path=metrics_path, progress=progress, target=target,
                  adaptive_kl=adaptive_kl, lock=lock)
        if aside is None:
            base = run_dir or (out.metrics_path.parent if out.metrics_path else Path("."))
            aside = base / REPLACED / f"{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step}-{uuid.uuid4().hex[:4]}"
        for path in (out.metrics_path, out.samples_path, out.attribution_path, out.episodes_path):
            if path:
                truncate_jsonl(path, step, aside)
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            tags = read_run_tags(run_dir)  # one per process that trained in this run directory
            update_run_file(run_dir, run_tag=run_tag, run_tags=tags if tags[-1:] == [run_tag] else [*tags, run_tag])
            out.trackers = Trackers.open(run_dir, report_to, config, run_tag, first_step=step + 1)
        return out

    def _check_lock(self) -> None:
        if self.lock is not None:
            self.lock.check()

    def samples(self, step: int, rows: list[dict]) -> None:
        self._check_lock()
        if self.samples_path is not None:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        self.trackers.log_samples(step, rows)

    def attribution(self, rollouts: list[RolloutAttribution]) -> None:
        """The evaluated step's rollouts, per token: appended to <run_dir>/attribution.jsonl."""
        self._check_lock()
        if self.attribution_path is not None and rollouts:
            with open(self.attribution_path, "a") as f:
                f.write("".join(json.dumps(r.as_dict()) + "\n" for r in rollouts))

    def episodes(self, result: StepResult, n: int) -> None:
        """A multi-turn step's first `n` episodes, whole transcripts ([role, text] segments, "model"
        | "env") with their scores: appended to <run_dir>/episodes.jsonl."""
        self._check_lock()
        if self.episodes_path is not None and result.transcripts:
            with open(self.episodes_path, "a") as f:
                f.writelines(json.dumps({"step": result.step, "index": i, "reward": reward,
                                         "transcript": [list(seg) for seg in transcript]}) + "\n"
                             for i, (transcript, reward) in enumerate(zip(result.transcripts[:n], result.rewards)))

    def step(self, result: StepResult) -> None:
        self._check_lock()
        self.metrics.record_step(result)
        self.trackers.log_step(result)
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(result.scalars()) + "\n")
        if self.progress:
            log.info(format_step(result, self.target, adaptive_kl=self.adaptive_kl))

    def close(self) -> None:
        self.trackers.close()


def read_run_tags(run_dir: Path) -> list[str]:
    return list(read_run_file(run_dir).get("run_tags", []))


def truncate_jsonl(path: Path, step: int, aside: Path) -> None:
    """Take the lines of steps after `step` out of `path`: appended to aside/<path's name>
    (fsynced) first, then `path` rewritten without them (atomically: ppo_ray.atomic), so a
    crash in between loses no line."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(keep) == len(lines):
        return
    moved = [line for line in lines if line.strip() and json.loads(line).get("step", 0) > step]
    aside.mkdir(parents=True, exist_ok=True)
    with open(aside / path.name, "a") as f:
        f.writelines(line + "\n" for line in moved)
        f.flush()
        os.fsync(f.fileno())
    atomic_write_text(path, "".join(line + "\n" for line in keep), fsync=True)
    log.warning("%s: the %d lines of steps after step %d moved to %s", path, len(moved), step, aside / path.name)
