"""Experiment trackers: TensorBoard event files in the run directory, and Weights & Biases
when installed and asked for (config.report_to, as TRL's and OpenRLHF's report_to).

    trackers = Trackers.open(run_dir, config, run_tag, first_step)   # PPOTrainer.train
    trackers.log_step(out)               # scalars of one ppo_step output, at its step
    trackers.log_samples(step, rows)     # the eval samples: a text table / a wandb.Table
    trackers.close()

TensorBoard (`tensorboard --logdir runs/`): scalars are tagged by group, `train/<key>` for
the step's statistics, `time/<phase>_s` for the phase seconds, `eval/<key>` for the
evaluation numbers; the samples go to the text tab as `eval/samples`. A resumed run purges
the events of the steps after its checkpoint from the earlier event files (SummaryWriter's
purge_step), so the curves show each step once.

Weights & Biases (the optional extra: `pip install 'ppo-ray[wandb]'`): `wandb.init(project=
wandb_project or $WANDB_PROJECT or "ppo-ray", name=wandb_name or <run dir name>,
group=wandb_group, tags=wandb_tags, config=<the config>)` (the config's wandb_* fields); the
run's id is kept in <run_dir>/run.json so a resumed run appends to the same wandb run. Its own
environment (WANDB_MODE=offline, WANDB_API_KEY, ...) applies.

Bottom layer: imports nothing of ours; tensorboard (through torch) and wandb lazily.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ppo_ray.atomic import atomic_write_text

TENSORBOARD_DIR = "tensorboard"
RUN_FILE = "run.json"
# report_to name -> (the module it imports, how to install it): tensorboard is a dependency,
# wandb the optional extra of pyproject.toml
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
                    "wandb": ("wandb", "pip install 'ppo-ray[wandb]'")}


class TrackerError(ValueError):
    """A tracker named in report_to that cannot be used here."""


def check_trackers(report_to: Sequence[str]) -> None:
    """TrackerError, before anything starts, for a tracker whose package is missing."""
    for name in report_to:
        module, install = TRACKER_PACKAGES[name]
        try:
            __import__(module)
        except ImportError as e:
            raise TrackerError(f"report_to names {name!r}, but the package {module!r} is not installed "
                               f"({install}), or drop it from report_to: {e}") from e


def tag(key: str) -> str:
    """The TensorBoard / wandb name of a ppo_step key: grouped by its prefix."""
    if "/" in key:
        return key  # time/generate_s
    if key.startswith(("gold_", "eval_")):
        return f"eval/{key}"
    return f"train/{key}"


def scalars(out: dict) -> dict[str, float]:
    """The finite numbers of a step's output (texts, lists and NaN left out)."""
    found = {}
    for key, value in out.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "step":
            continue
        if math.isfinite(value):
            found[tag(key)] = float(value)
    return found


def samples_markdown(rows: Sequence[dict]) -> str:
    """The eval samples as a markdown table (TensorBoard's text tab renders it)."""
    def cell(value: Any) -> str:
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    columns = [c for c in ("prompt", "response", "reward", "gold") if any(c in r for r in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def read_run_file(run_dir: Path) -> dict:
    path = Path(run_dir) / RUN_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def update_run_file(run_dir: Path, **changes: Any) -> dict:
    """Merge `changes` into <run_dir>/run.json (written atomically)."""
    data = {**read_run_file(run_dir), **changes}
    path = Path(run_dir) / RUN_FILE
    atomic_write_text(path, json.dumps(data, indent=1))
    return data


EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


def wait_for_a_later_event_file(log_dir: Path) -> None:
    """Wait (at most a second) until a new event file's name sorts after every one in
    `log_dir`. TensorBoard reads a directory's event files in name order, and a resumed run's
    purge of the later steps only holds when its file is read last. The name is
    ``events.out.tfevents.<unix seconds>.<host>.<pid>.<counter>``: in the same second, in one
    process, counter 10 sorts before 9 (a resume in the second its run stopped, as a sweep or a
    test does), so a strictly later second is what keeps the order. A file stamped more than 2 s
    ahead of this clock (another machine's) is not waited for."""
    stamps = [int(m.group(1)) for f in Path(log_dir).glob("events.out.tfevents.*")
              if (m := EVENT_FILE.match(f.name)) is not None]
    latest = max(stamps, default=0)
    if latest - time.time() < 2:  # a file from a clock ahead of ours is not waited for
        while int(time.time()) <= latest:
            time.sleep(latest + 1 - time.time() + 0.01)


class Trackers:
    def __init__(self, tensorboard=None, wandb_run=None):
        self.tensorboard = tensorboard
        self.wandb = wandb_run

    @classmethod
    def open(cls, run_dir: Path, report_to: Sequence[str], config: dict, run_tag: str,
             first_step: int = 1) -> "Trackers":
        """The trackers of `report_to` for a run directory; `first_step` > 1 (a resumed run)
        purges later steps' TensorBoard events and resumes the wandb run."""
        run_dir = Path(run_dir)
        writer = wandb_run = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            wait_for_a_later_event_file(run_dir / TENSORBOARD_DIR)
            writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR),
                                   purge_step=first_step if first_step > 1 else None)
            if first_step <= 1:
                writer.add_text("run/config", "```yaml\n" + _yaml(config) + "\n```", 0)
                writer.add_text("run/tag", run_tag, 0)
        if "wandb" in report_to:
            import os

            import wandb

            saved: Optional[str] = read_run_file(run_dir).get("wandb_id")
            wandb_run = wandb.init(project=config.get("wandb_project") or os.environ.get("WANDB_PROJECT", "ppo-ray"),
                                   name=config.get("wandb_name") or run_dir.name, group=config.get("wandb_group"),
                                   tags=list(config.get("wandb_tags") or ()) or None, dir=str(run_dir),
                                   config={**config, "run_tag": run_tag}, id=saved, resume="allow")
            update_run_file(run_dir, wandb_id=wandb_run.id)
        return cls(writer, wandb_run)

    def log_step(self, out: dict) -> None:
        step, values = int(out["step"]), scalars(out)
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()  # a crash or Ctrl-C keeps every finished step
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_samples(self, step: int, rows: Sequence[dict]) -> None:
        if not rows:
            return
        if self.tensorboard is not None:
            self.tensorboard.add_text("eval/samples", samples_markdown(rows), step)
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            columns = [c for c in ("prompt", "response", "reward", "gold") if any(c in r for r in rows)]
            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self.wandb.log({"eval/samples": table}, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
