"""`launch.py eval RUN_DIR`: evaluate a finished run (or one of its checkpoints) the way its PPO
stage did, with the same functions (ppo_ray.tasks.evaluation) and the same sampling seeds.

    python launch.py eval runs/x                               # the run's held-out split, newest checkpoint
    python launch.py eval runs/x --checkpoint runs/x/checkpoints/step-000050 --split validation
    python launch.py eval runs/x --prompts mine.jsonl --out evals/mine

The trainer is built with the PPO stage's config (the checkpoint's own, ppo_ray.driver.checkpoint.
resumed_config, plus any --<field> option). A fresh trainer's policy is the SFT model (LoRA
B = 0), so a run with an SFT stage gets the SFT policy evaluated first (a task with no SFT
stage, arith-chat: the base model, its keys *_base); then the checkpoint
is restored (trainer.restore) and the trained policy evaluated on the same prompts with the
same seeds. On the run's held-out split (the first eval_size rows, as the PPO stage took
them) the numbers equal report.json's, key for key. Without --split, that is the split the
run's PPO stage evaluated on (recorded in its eval-before-ppo.json: test for the bundled
tasks, the config's eval_split on the real path).

Written into --out (default RUN_DIR/eval/<time>/; never an existing non-empty folder, so never
over the run's own files): eval.json (the task's numbers; which were skipped and why),
samples.jsonl (one line per prompt: each policy's samples and scores), samples.md and logs/.
Every check (the run, the checkpoint, the split or the prompts file row by row, --out) comes
before anything is written or any actor starts: a bad one is one line naming it, exit 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ppo_ray.driver.rundir import EVAL_DIR  # RUN_DIR/eval/<time>/: the default --out (moved aside with the run's outputs)

log = logging.getLogger("ppo_ray.eval")

USAGE = ("python launch.py eval RUN_DIR [--checkpoint CKPT] [--split test|validation] [--prompts FILE.jsonl] "
         "[--out DIR] [--<field> VALUE ...]")
SPLITS = {"test": "test", "validation": "val"}  # --split -> the report's key tag (report.json: *_test_*, *_val_*)
DEFAULT_SPLIT = "test"


class EvalError(ValueError):
    """Bad input to `launch.py eval` (the message names it)."""


@dataclass
class Plan:
    """What an evaluation will do, decided (and checked) before anything is written or started."""

    run_dir: Path
    checkpoint: Path
    config: object  # PPOConfig: the PPO stage's (the checkpoint's plus the options)
    task: Optional[object]  # the run's task (ppo_ray.tasks.base.Task) when its bundled data is evaluated; else None
    has_sft: bool  # the run's starting policy (its SFT stage's, or a task's base model) is evaluated too
    score: bool  # the run has a reward model (or reward functions of its own): its mean score is reported
    rows: list[dict]
    source: str  # the split or the prompts file
    tag: str  # the numbers' key tag: test, val, prompts
    out: Path
    skipped: dict[str, str] = field(default_factory=dict)  # metric -> why it was not computed

    @property
    def who(self) -> str:  # the trained policy's name in the report's keys
        return self.task.policy_name if self.task is not None else "ppo"

    @property
    def before(self) -> str:  # the starting policy's name in the report's keys: sft, or base (no SFT stage)
        return self.task.before_name if self.task is not None else "sft"

    @property
    def kind(self) -> str:  # the task's name, or "reward" (no task: the run's reward only)
        return self.task.name if self.task is not None else "reward"


def build_parser():
    from ppo_ray.config import ConfigParser

    parser = ConfigParser(prog="launch.py eval", usage=USAGE, description=__doc__, config_option=False)
    parser.add_argument("--checkpoint", metavar="CKPT",
                        help="a checkpoint of RUN_DIR (checkpoints/step-N; default: the run's newest intact one)")
    parser.add_argument("--split", metavar="test|validation",
                        help="the task's held-out split (its first eval_size rows, as the PPO stage; default: the one "
                             f"the run's PPO stage evaluated on, {DEFAULT_SPLIT} for the bundled tasks, eval_split on "
                             "the real path)")
    parser.add_argument("--prompts", metavar="FILE.jsonl",
                        help="prompts to evaluate instead: a `prompt` column, and the task's columns for its "
                             "metrics (arith: `answer`; the bundled TL;DR task: `facts`, and `summary` for the "
                             "reference comparison)")
    parser.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/eval/<time>/)")
    return parser


def plan(argv: list[str]) -> Optional[Plan]:
    """Parse and check everything; None for --help (printed). EvalError, ConfigError,
    CheckpointError, DataError or FileNotFoundError name what is wrong. Reads only."""
    from ppo_ray.driver.checkpoint import (CheckpointError, check_compatible, check_fingerprints, read_meta,
                                    resolve_checkpoint, resumed_config)
    from ppo_ray.config import ConfigError

    parser = build_parser()
    options, overrides, positional = parser.parse(argv)
    if options.help:
        print(parser.format_help())
        return None
    if len(positional) != 1:
        raise EvalError(f"give one run directory (usage: {USAGE})" if not positional
                        else f"one run directory, got {' '.join(positional)!r}")
    if options.config is not None:
        raise ConfigError("--config: eval runs with the run's own config (its checkpoint's); give changes as "
                          "--<field> VALUE options")
    run_dir = Path(positional[0])
    if not run_dir.is_dir():
        raise EvalError(f"run directory {run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}")
    if options.split is not None and options.prompts is not None:
        raise EvalError("--split and --prompts: give one of them (a split of the run's task, or a prompts file)")

    try:  # the newest intact checkpoint of the run, or the one named (CheckpointError naming it)
        checkpoint = resolve_checkpoint(options.checkpoint or run_dir)
    except CheckpointError as e:  # its messages speak of --resume
        raise CheckpointError(str(e).replace("--resume ", "--checkpoint " if options.checkpoint else
                                             "run directory ", 1)) from None
    if run_dir.resolve() not in checkpoint.resolve().parents:
        raise EvalError(f"checkpoint {checkpoint} is not one of {run_dir}'s (its config's paths are the run's)")
    saved = resumed_config(checkpoint, run_dir)
    cfg = saved.replace(**overrides) if overrides else saved
    # the checks restore() makes, here before any actor starts
    check_compatible(saved, cfg, checkpoint)
    check_fingerprints((read_meta(checkpoint) or {}).get("fingerprints") or {}, cfg, checkpoint, run_dir)

    sft_dir = run_dir / "sft"
    has_sft = sft_dir.is_dir() and Path(cfg.model_name).resolve() == sft_dir.resolve()
    from ppo_ray.tasks.pipeline import DATA_STAMP, task_of

    if not has_sft and cfg.uses_bundled_data and (run_dir / "data" / DATA_STAMP).is_file():
        # a pipeline task with no SFT stage (arith-chat): the base model is the starting policy
        has_sft = "sft" not in task_of(cfg).stages
    pipeline_task = has_sft and cfg.uses_bundled_data  # the bundled task's data, with its judge
    task = task_of(cfg) if pipeline_task else None
    # a verifier's score is the task's own numbers (its pass rates), not a reward to report
    score = (task is None or task.verifier is None) and bool(cfg.reward_model_name or cfg.reward_funcs)

    from ppo_ray.modeling import load_tokenizer

    tok = load_tokenizer(cfg.model_name)
    if options.prompts is not None:
        rows = prompts_file_rows(Path(options.prompts), cfg, tok)
        source, tag = str(options.prompts), "prompts"
    elif not has_sft:
        raise EvalError(f"{run_dir} is a PPO run on {cfg.dataset!r} without a task's held-out split: give --prompts "
                        "FILE.jsonl")
    else:
        split, tag = held_out_split(options.split, run_dir, cfg, real=not pipeline_task)
        if pipeline_task:
            from ppo_ray.data import read_rows

            path = run_dir / "data" / f"prompts_{split}.jsonl"
            rows = read_rows(path)[: cfg.eval_size]  # the PPO stage's held-out rows
            source = f"{split} split ({path}, first {len(rows)} rows)"
        else:  # the real path: the named dataset's split, as run_ppo_real reads its held-out queries
            from ppo_ray.tasks.pipeline import real_prompts

            rows = [{"prompt": p} for p in real_prompts(cfg.replace(eval_split=split), tok, "eval",
                                                         max_rows=cfg.eval_size)]
            source = f"{split} split of {cfg.sft_dataset}"
    if not rows:
        raise EvalError(f"{source}: no rows")

    skipped: dict[str, str] = dict(task.check_columns(rows, source)) if task is not None else {}
    out = Path(options.out) if options.out else run_dir / EVAL_DIR / time.strftime("%Y%m%d-%H%M%S")
    if not options.out:
        n = 1
        while out.exists():
            n += 1
            out = out.with_name(f"{out.name.split('.')[0]}.{n}")
    check_out(out, run_dir)
    if os.environ.get("RAY_ADDRESS"):  # a cluster to attach to must be there
        from ppo_ray.driver.cluster import check_ray_address

        check_ray_address(os.environ["RAY_ADDRESS"])
    return Plan(run_dir=run_dir, checkpoint=checkpoint, config=cfg, task=task, has_sft=has_sft, score=score,
                rows=rows, source=source, tag=tag, out=out, skipped=skipped)


def held_out_split(asked: Optional[str], run_dir: Path, cfg, real: bool) -> tuple[str, str]:
    """(split, the numbers' key tag) of a held-out evaluation. The default: the first split the
    run's PPO stage evaluated on, as its eval-before-ppo.json records it (the bundled tasks: test;
    the real path: its eval_split), else (a run of an older version) the real path's eval_split
    or test. On the real path the split names are its dataset's: the recorded ones are valid too."""
    from ppo_ray.tasks.pipeline import recorded_splits

    recorded = recorded_splits(run_dir)
    split = asked or (recorded[0] if recorded else cfg.eval_split if real else DEFAULT_SPLIT)
    known = {**SPLITS, **({name: SPLITS.get(name, name) for name in recorded} if real else {})}
    if split not in known:
        raise EvalError(f"unknown split {split!r}; splits: {', '.join(known)}")
    return split, known[split]


def prompts_file_rows(path: Path, cfg, tok) -> list[dict]:
    """The rows of a prompts file: every row has a non-empty str `prompt` that fits the run's
    max_prompt_length (as the trainer encodes it); DataError naming the file and row."""
    from ppo_ray.data import DataError, column, encode_prompts, read_rows

    rows = read_rows(path)
    if not rows:
        raise DataError(f"{path}: no rows")
    prompts = column(rows, "prompt", str(path))
    try:
        encode_prompts(tok, prompts, cfg.max_prompt_length, cfg.prompt_truncation,
                       chat_template=cfg.apply_chat_template)
    except ValueError as e:  # "prompt i ...": i is the row index
        raise DataError(f"{path} column 'prompt': {e}") from e
    return rows


def check_out(out: Path, run_dir: Path) -> None:
    """--out must be new or an empty folder (nothing is written over: the run's own files least
    of all) and writable."""
    from ppo_ray.driver.rundir import check_writable

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvalError(f"--out {out}: exists and is not an empty folder (eval writes only into a new one)")
    if out.resolve() == run_dir.resolve():
        raise EvalError(f"--out {out} is the run directory: eval never writes over the run's files")
    check_writable(out)


# ----------------------------------------------------------------------------- the evaluation
def evaluate_policy(plan: Plan, trainer, label: str) -> dict:
    """One policy's evaluation on the plan's rows: the PPO stage's functions, its seeds."""
    from ppo_ray.tasks import evaluation as ev

    if plan.task is not None:
        return plan.task.eval_policy(trainer, plan.config, plan.rows, label=label, skipped=plan.skipped,
                                     score=plan.score)
    return ev.sample(trainer, plan.rows, label=label, score=plan.score)


def numbers(plan: Plan, after: dict, before: Optional[dict]) -> dict:
    """The task's numbers under report.json's keys, the paired "vs SFT" ones, the reward's mean."""
    from ppo_ray.tasks import evaluation as ev

    out: dict = {}
    tag, who = plan.tag, plan.who
    if plan.task is not None:
        out.update(plan.task.eval_numbers(tag, plan.config, plan.rows, after, before, plan.skipped))
    if plan.score:
        out.update(ev.reward_numbers(tag, after, before, who=who))
    return out


def sample_lines(plan: Plan, results: dict[str, dict]):
    """One JSON object per prompt: its index, prompt (and the task's columns), and per policy
    every per-prompt field of its evaluation (<policy>_<field>: texts -> the text)."""
    names = {"texts": "", "stops": "_stop"}  # as held_out.jsonl names them
    for i, row in enumerate(plan.rows):
        line = {"index": i, **{k: v for k, v in row.items() if k in ("id", "prompt", "answer", "summary")}}
        for who, res in results.items():
            for key, values in res.items():
                if isinstance(values, list) and len(values) == len(plan.rows):
                    line[f"{who}{names.get(key, '_' + key)}"] = values[i]
        yield line


def write_samples_md(plan: Plan, path: Path, after: dict, before: Optional[dict]) -> None:
    from ppo_ray.tasks.pipeline import write_held_out_texts

    if plan.task is not None and plan.task.eval_samples_md(path, plan.config, plan.rows, after, before,
                                                           plan.skipped):
        return
    # no judge: the texts to read (the real path's samples.md)
    write_held_out_texts(path, [row["prompt"] for row in plan.rows],
                         before["texts"] if before is not None else [""] * len(after["texts"]), after["texts"])


def run(plan: Plan) -> dict:
    """Start the trainer (the PPO stage's config, no run directory: nothing of the run is
    written), evaluate the SFT policy (when the run has one), restore the checkpoint, evaluate
    the trained policy; write eval.json, samples.jsonl and samples.md into plan.out."""
    import ray

    from ppo_ray.trainer import PPOTrainer

    t0 = time.perf_counter()
    ray_was_up = ray.is_initialized()
    log.info("evaluating %s on %s (%d prompts) -> %s", plan.checkpoint, plan.source, len(plan.rows), plan.out)
    for metric, why in plan.skipped.items():
        log.warning("%s skipped: %s", metric, why)
    trainer = PPOTrainer(plan.config)
    ended = False
    try:
        before = evaluate_policy(plan, trainer, f"{plan.before.upper()} policy") if plan.has_sft else None
        trainer.restore(plan.checkpoint)
        after = evaluate_policy(plan, trainer, f"policy of step {trainer.step}")
        step = trainer.step
        ended = True
    finally:
        trainer.shutdown(graceful=ended)
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()
    report = {"run_dir": str(plan.run_dir), "checkpoint": str(plan.checkpoint), "step": step,
              "prompts": plan.source, "eval_prompts": len(plan.rows),
              "policies": ([plan.before] if before is not None else []) + [plan.who],
              **numbers(plan, after, before)}
    if plan.skipped:
        report["skipped"] = plan.skipped
    report["seconds"] = round(time.perf_counter() - t0, 1)
    results = {**({plan.before: before} if before is not None else {}), plan.who: after}
    with open(plan.out / "samples.jsonl", "w") as f:
        for line in sample_lines(plan, results):
            f.write(json.dumps(line) + "\n")
    write_samples_md(plan, plan.out / "samples.md", after, before)
    (plan.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str]) -> int:
    """`launch.py eval ...`: its exit status (2: bad input, named, nothing written)."""
    from ppo_ray.driver.checkpoint import CheckpointError
    from ppo_ray.driver.cluster import ClusterError
    from ppo_ray.config import ConfigError
    from ppo_ray.data import DataError
    from ppo_ray.logs import console_log, setup_logging
    from ppo_ray.modeling import ContextLengthError
    from ppo_ray.rewards import RewardError
    from ppo_ray.driver.rundir import RunDirError
    from ppo_ray.tasks.base import TaskError
    from ppo_ray.tasks.tldr import TLDRDataError

    expected = (EvalError, ConfigError, CheckpointError, DataError, FileNotFoundError, RunDirError, RewardError,
                ContextLengthError, ClusterError, TLDRDataError, TaskError)
    try:
        p = plan(argv)
    except expected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if p is None:
        return 0
    setup_logging(p.config.log_level)
    p.out.mkdir(parents=True, exist_ok=True)
    try:
        with console_log(p.out, ["ppo-ray", "eval", *argv]):
            report = run(p)
    except (RewardError, ContextLengthError, ClusterError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
