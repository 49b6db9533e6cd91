"""What a run directory holds, and the rule that a fresh run never writes over a run.

A stage's outputs (STAGE_OUTPUTS) are what a fresh start of that stage would write over:
the SFT or reward model, or PPO's checkpoints, metrics and reports. launch.py asks
:func:`held_outputs` before it writes anything and stops with a RunDirError that names
``--resume`` and ``--overwrite``; ``--overwrite`` moves them aside (:func:`move_aside`,
into ``<run_dir>/replaced/<time>/``, never deleted), and ``--resume auto`` continues what
is there: a finished stage (recorded in run.json's ``stages_done``) is skipped, PPO resumes
from its newest intact checkpoint, and an unfinished stage's partial outputs are moved
aside before it starts again.

Bottom layer: imports nothing of ours above the tracking file helpers.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Iterable

from ppo_ray.tracking import TENSORBOARD_DIR, read_run_file, update_run_file

log = logging.getLogger(__name__)

REPLACED = "replaced"
EVAL_DIR = "eval"  # `launch.py eval`'s default --out: <run_dir>/eval/<time>/, evaluations of the run's checkpoints
STAGES_DONE = "stages_done"  # run.json: stage -> its statistics, written when the stage finished

# What a fresh start of each stage writes (and would overwrite), relative to the run directory.
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "sft": ("sft", "report-sft.json"),
    "rm": ("rm", "report-rm.json"),
    "ppo": ("checkpoints", "metrics.jsonl", "eval_samples.jsonl", "episodes.jsonl", "eval-before-ppo.json",
            TENSORBOARD_DIR,
            "adapter", "samples.md", "held_out.jsonl", "curves.png", "report-ppo.json", EVAL_DIR),
}
# The pipeline's report and its page (report.html, a view of the directory that `all` and `ppo`
# write at their end): a fresh `all` refuses to write over them, and they move aside with
# whatever stage starts over (invalidate).
RUN_REPORTS = ("report.json", "report.html")
STAGE_OUTPUTS["all"] = (*STAGE_OUTPUTS["sft"], *STAGE_OUTPUTS["rm"], *STAGE_OUTPUTS["ppo"], *RUN_REPORTS)
# The pipeline's stages in order: each is built on the ones before it (rm on sft, ppo on both).
PIPELINE = ("sft", "rm", "ppo")


def downstream(stage: str) -> tuple[str, ...]:
    """The pipeline stages built on `stage` (those after it; none for ppo or all)."""
    return PIPELINE[PIPELINE.index(stage) + 1:] if stage in PIPELINE else ()


def invalidate(run_dir: Path, stages: Iterable[str], why: str) -> Path | None:
    """`stages` start over: their outputs, every stage's built on them and the pipeline's
    report move aside together (one folder of <run_dir>/replaced/, never deleted), and
    run.json forgets that any of them finished. Downstream follows upstream: a re-trained SFT
    model leaves no reward model, value head or PPO checkpoint of the old one resumable."""
    stages = [s for stage in stages for s in (PIPELINE if stage == "all" else (stage,))]
    names = list(dict.fromkeys(s for stage in stages for s in (stage, *downstream(stage))))
    outputs = held_outputs(run_dir, names)
    if outputs:  # with them, the config each stage saved and the pipeline's report, of the old stages
        outputs += [n for n in (*(f"config-{s}.yaml" for s in names), *RUN_REPORTS)
                    if n not in outputs and _present(Path(run_dir) / n)]
    where = move_aside(run_dir, outputs, why=why)
    forget_done(run_dir, names)
    return where


class RunDirError(ValueError):
    """A fresh run asked to write where a run already is (names the files and the options)."""


def check_writable(run_dir: Path) -> None:
    """RunDirError, before anything is written, when this process cannot create or write
    `run_dir` (and the folders it holds): names the folder, its owner and mode, and this
    process's uid/gid. On Kubernetes a freshly provisioned volume is often root's while the
    image runs as uid 1000: the pod's securityContext.fsGroup makes it the pod's group's."""
    run_dir = Path(run_dir).absolute()
    folders = [run_dir] if run_dir.is_dir() else []
    if run_dir.is_dir():
        folders += [p for p in run_dir.iterdir() if p.is_dir()]
    else:
        existing = next((p for p in run_dir.parents if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise RunDirError(f"cannot make run directory {run_dir}: {existing} is a file, not a folder")
        folders = [existing] if existing is not None else []
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            st = folder.stat()
            raise RunDirError(
                f"cannot write run directory {run_dir}: {folder} (owner uid {st.st_uid} gid {st.st_gid}, mode "
                f"{st.st_mode & 0o777:o}) is not writable by this process (uid {os.geteuid()}, gid {os.getegid()}, "
                f"groups {sorted(os.getgroups())}). Pick a --run_dir this user can write, or make it writable "
                "(on Kubernetes: the pod's securityContext.fsGroup, deploy/rayjob.yaml)")


def _present(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def held_outputs(run_dir: Path, stages: Iterable[str]) -> list[str]:
    """The outputs of `stages` that `run_dir` already holds (non-empty files and folders)."""
    names = dict.fromkeys(name for stage in stages for name in STAGE_OUTPUTS[stage])
    return [name for name in names if _present(Path(run_dir) / name)]


def check_fresh(run_dir: Path, stage: str) -> None:
    """RunDirError when a fresh start of `stage` would write over what `run_dir` holds."""
    held = held_outputs(run_dir, [stage])
    if held:
        raise RunDirError(
            f"run directory {run_dir} already holds a run ({', '.join(held)}); a fresh {stage!r} stage would write "
            f"over it. Continue it with --resume auto (or `launch.py ppo --resume {run_dir}`), start over with "
            "--overwrite (the old files are moved to <run_dir>/replaced/, not deleted), or pick another --run_dir")


def move_aside(run_dir: Path, names: Iterable[str], why: str = "overwrite") -> Path | None:
    """Move `names` (those present) into <run_dir>/replaced/<time>-<why>/; returns that folder."""
    run_dir = Path(run_dir)
    present = [name for name in names if (run_dir / name).exists()]
    if not present:
        return None
    where = run_dir / REPLACED / f"{time.strftime('%Y%m%d-%H%M%S')}-{why}-{uuid.uuid4().hex[:4]}"
    where.mkdir(parents=True)
    for name in present:
        (run_dir / name).rename(where / name)
    log.warning("moved %s of %s aside to %s", ", ".join(present), run_dir, where)
    return where


def stages_done(run_dir: Path) -> dict[str, dict]:
    """stage -> the statistics it reported, for the stages that finished in `run_dir`."""
    return dict(read_run_file(run_dir).get(STAGES_DONE, {}))


def mark_done(run_dir: Path, stage: str, stats: dict) -> None:
    """Record that `stage` finished (after its outputs are complete) with its statistics."""
    update_run_file(run_dir, **{STAGES_DONE: {**stages_done(run_dir), stage: stats}})


def forget_done(run_dir: Path, stages: Iterable[str]) -> None:
    done = stages_done(run_dir)
    if any(stage in done for stage in stages):
        update_run_file(run_dir, **{STAGES_DONE: {k: v for k, v in done.items() if k not in set(stages)}})
