"""ppo-ray command line.

    python launch.py                      # all stages on the bundled task (preset tldr-tiny)
    python launch.py sft --run_dir runs/x # one stage: sft, rm or ppo, in a run directory
    python launch.py ppo --config configs/tiny.yaml --steps 30 --kl_coef 0.05
    RAY_ADDRESS=... python launch.py ppo --config ...   # attach to a running cluster
    ray job submit --working-dir . -- python launch.py ppo --config ...
    python launch.py export runs/x --merged /tmp/m      # a finished run's LoRA merged into its base
    python launch.py eval runs/x                        # a finished run evaluated as its PPO stage did

Commands (the first argument; each has its own options, `launch.py export --help`): `export`
writes a run's LoRA (its final adapter/ or a checkpoint's) as a merged model and/or a portable
PEFT adapter, each with a model card (ppo_ray/driver/export.py, docs/EXPORT.md); `eval` evaluates a
finished run's SFT policy and checkpoint with its PPO stage's evaluation, functions and seeds
(ppo_ray/tasks/evaluate.py; its options include PPOConfig's fields).

Stages: `sft` writes the bundled task's data and the SFT checkpoint, `rm` the reward model,
`ppo` trains the policy with PPO. `ppo` uses the run directory's SFT and reward model when
the config names no reward source; with reward sources in the config (reward_funcs or
reward_model_name) it runs PPO on config.model_name and config.dataset directly. `all` (the
default) runs sft, rm and ppo and prints the report.

The real path: with `sft_dataset` / `preference_dataset` set (hub ids, or local JSONL/parquet
in the real TL;DR schemas; configs/qwen3-0.6b-tldr.yaml) the stages read those through
ppo_ray/tasks/tldr.py instead of writing the bundled task, and `ppo` reports the reward model's
score and the KL to SFT (no gold judge exists for real data).

Every `--name value` is a PPOConfig field (ppo_ray/config/fields.py; listed below by section);
`--config FILE|PRESET` loads a YAML file or a shipped preset by name first (tldr-tiny, tiny,
qwen3-0.6b-tldr; a file that exists wins). `--run_dir DIR` picks the run directory (default
output_dir/<time>).

Console: one line per PPO step as it finishes (Python logging on stderr; --log_level debug |
info | warning | error, default info), Ray's, vLLM's and transformers' own messages cut to
errors unless debug; the JSON summary is stdout's last line. The run directory also gets
TensorBoard event files (report_to: [tensorboard], the default; wandb when installed and
named), eval_samples.jsonl and run.json (the run tag: the `run` label of the ray_ppo_*
Prometheus metrics).

Trusted input: a config file (YAML, --config, or a run directory's saved config that
--resume reloads) is code, like a Python script: every "module:function" in reward_funcs is
imported and run, in this process and in the reward actor. Run only configs you trust.

Checkpoints: the PPO stage writes <run_dir>/checkpoints/step-N every checkpoint_every steps
and at the end. `launch.py ppo --resume DIR` (a run directory or one checkpoint) continues
from it; Ctrl-C or `ray job stop` leaves the last checkpoint intact. Whichever way a resume
is asked for, the PPO stage continues with its checkpoint's own config plus the command's
--field options (e.g. a larger --steps, another --kl_coef: each change is named in the log and
applies from the next step).

A run directory is never written over: a fresh stage into a --run_dir that holds that
stage's outputs stops before writing anything. `--resume auto` continues whatever the
run directory holds (finished stages are skipped, PPO resumes from its newest intact
checkpoint, an unfinished stage starts again) and starts a new run when it holds none: the
same command can be re-applied (a RayJob, a restarted cluster). `--overwrite` starts over,
moving the old outputs to <run_dir>/replaced/<time>/. A stage that starts again (overwritten,
or unfinished) takes the stages built on it along: their outputs move aside with its own, so
nothing trained on the old SFT or reward model is resumed onto a new one. A run touches only
its own files: `--resume CKPT --run_dir OTHER` is refused while OTHER holds a run
(`--overwrite` moves that run aside first), and one driver at a time holds a run directory
(a second one stops at once, naming the first; a killed driver's lock is taken over).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger("ppo_ray.launch")

DEFAULT_CONFIG = "tldr-tiny"  # a preset's name: ppo_ray/configs/tldr-tiny.yaml (ppo_ray.config.resolve_config)
STAGES = ("all", "sft", "rm", "ppo")


# --------------------------------------------------------------------------- commands that are not stages
class CommandParser(argparse.ArgumentParser):
    """A command's own options (not PPOConfig's): errors raise ConfigError, which _main prints
    as one `error:` line with exit 2 (argparse would print its usage and exit)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(allow_abbrev=False, exit_on_error=False, add_help=False, **kwargs)
        self.add_argument("-h", "--help", action="store_true", help="show this message and exit")
        self.add_argument("--log_level", "--log-level", default="info", choices=("debug", "info", "warning", "error"),
                          help="console log level (default: info)")

    def error(self, message: str):
        from ppo_ray.config import ConfigError

        raise ConfigError(f"command line: {message}")


@dataclass(frozen=True)
class Command:
    """A first argument that is not a stage: it reads a run and writes elsewhere (never into
    the run). `main(argv)`, the arguments after the command, is its exit status (2: bad input,
    named on stderr, nothing written)."""

    summary: str
    main: Callable[[list], int]


def export_parser() -> CommandParser:
    parser = CommandParser(
        prog="launch.py export",
        usage="python launch.py export RUN_DIR|CHECKPOINT|ADAPTER_DIR [--merged OUT] [--adapter OUT] "
              "[--dtype float32|bfloat16|float16]",
        description="A run's LoRA for use outside ppo-ray (docs/EXPORT.md): the base with the LoRA merged, loadable "
                    "by transformers and vLLM without PEFT, and/or the PEFT adapter with its base named by hub id or "
                    "absolute path; each with a model card (README.md). The source: a run directory (its final "
                    "adapter/), a checkpoint (RUN/checkpoints/step-N) or a PEFT adapter directory. An OUT must not "
                    "exist or be empty; it is written whole or not at all.")
    parser.add_argument("source", metavar="RUN_DIR|CHECKPOINT|ADAPTER_DIR", nargs="?")  # optional for --help
    parser.add_argument("--merged", metavar="OUT", help="write the merged model (safetensors, config, tokenizer) here")
    parser.add_argument("--adapter", metavar="OUT", help="write the portable PEFT adapter here")
    parser.add_argument("--dtype", help="the merged model's dtype: float32, bfloat16 or float16 (default: the run's "
                                        "dtype)")
    return parser


def run_export(options: argparse.Namespace, argv: list) -> int:
    from ppo_ray.driver.export import ExportError, check_dtype, check_output, export, find_source

    if options.source is None:
        print("error: name what to export: a run directory, a checkpoint or an adapter directory", file=sys.stderr)
        return 2
    try:
        # the cheap checks first: nothing is loaded before the options are known to be usable
        check_dtype(options.dtype)
        for what in ("merged", "adapter"):
            if getattr(options, what) is not None:
                check_output(getattr(options, what), f"--{what}")
        source = find_source(options.source)
        summary = export(source, merged=options.merged, adapter=options.adapter, dtype=options.dtype,
                         command=["ppo-ray", "export", *argv])
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def export_main(argv: list) -> int:
    """`launch.py export ...`: its options (export_parser), then run_export; starts no Ray."""
    from ppo_ray.config import ConfigError
    from ppo_ray.logs import setup_logging

    parser = export_parser()
    try:
        options = parser.parse_args(argv)
    except (ConfigError, argparse.ArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if options.help:
        print(parser.format_help())
        return 0
    setup_logging(options.log_level)
    return run_export(options, argv)


def eval_main(argv: list) -> int:
    """`launch.py eval ...`: its options include PPOConfig's fields, so it parses its own
    (ppo_ray/tasks/evaluate.py); it starts Ray and the run's actors."""
    from ppo_ray.tasks.evaluate import main as evaluate

    return evaluate(argv)


COMMANDS: dict[str, Command] = {
    "export": Command("a run's LoRA as a merged model and/or a portable PEFT adapter", export_main),
    "eval": Command("a finished run evaluated as its PPO stage did", eval_main),
}


def check_ray_address() -> None:
    """RAY_ADDRESS, when set, must have a Ray cluster behind it (ClusterError naming it)."""
    import os

    if os.environ.get("RAY_ADDRESS"):
        from ppo_ray.driver.cluster import check_ray_address as check

        check(os.environ["RAY_ADDRESS"])


def check_context(config) -> None:
    """The models' context windows hold max_prompt_length + max_new_tokens (ContextLengthError
    naming the fields and the limit), before anything is written or started: for the
    pipeline the base model, which SFT and the reward model inherit."""
    from ppo_ray.config import MODEL_FIELDS
    from ppo_ray.modeling import check_context_length
    from ppo_ray.paths import resolve_model_path

    names = {name: getattr(config, name) for name in MODEL_FIELDS if getattr(config, name)}
    if names.get("value_model_name") == "rm":  # the pipeline's reward model, not trained yet
        del names["value_model_name"]
    check_context_length(config.max_prompt_length, config.max_new_tokens,
                         {name: resolve_model_path(value) for name, value in names.items()})


def plain_ppo_inputs(config) -> list[str]:
    """The plain PPO stage's cheap checks, before anything is written or started: the reward
    sources (ppo_ray.rewards.check_reward_sources: the functions import, the reward model is
    one by its config.json; the environment loads), and every prompt of config.dataset is usable (not empty, within
    max_prompt_length unless truncated). Returns the prompts."""
    from ppo_ray.data import load_prompts
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.rewards import check_reward_sources

    check_reward_sources(config.reward_model_name, config.reward_funcs, config.reward_weights,
                         environment=config.environment, proxy=config.reward_verifier_proxy)
    if config.environment is not None:
        from ppo_ray.environments import load_environment

        load_environment(config.environment)  # it imports and follows the contract's shape (EnvError naming it)
    return load_prompts(config, load_tokenizer(config.model_name))


def run_plain_ppo(config, run_dir: Path, resume: str | None = None, prompts: list[str] | None = None) -> dict:
    """PPO on config.model_name and config.dataset with the config's own reward sources."""
    from ppo_ray.tasks.pipeline import ppo_trainer, read_metrics

    prompts = plain_ppo_inputs(config) if prompts is None else prompts
    # the eval samples of a plain run: the dataset's first prompts (it has no held-out split)
    with ppo_trainer(config, run_dir, resume) as (trainer, _):
        trainer.train(prompts, metrics_path=run_dir / "metrics.jsonl", eval_prompts=prompts)
        trainer.save_adapter(run_dir / "adapter")
    history = read_metrics(run_dir / "metrics.jsonl")
    return {"steps": len(history), "first_reward": history[0]["reward_mean"],
            "last_reward": history[-1]["reward_mean"], "final_kl": history[-1]["kl"]}


def plan_run_dir(run_dir: Path, stage: str, stages: tuple[str, ...], resume: str | None,
                 overwrite: bool) -> tuple[dict, str | None]:
    """What the run directory's contents mean for this command, decided and acted on under the
    run directory's lock, before any stage runs: (the stages already finished, to be skipped;
    the PPO checkpoint to resume).

    A fresh stage into a run directory that holds its outputs is a RunDirError (naming
    --resume and --overwrite); --overwrite moves them aside. Downstream follows upstream: a
    stage that starts (fresh, over, or again) moves the outputs of every stage built on it
    aside with its own (ppo_ray.driver.rundir.invalidate), so nothing trained on the old stage can be
    resumed onto the new one. --resume auto skips the stages that finished, in pipeline order
    (a stage counts as finished only when the stages before it did), resumes PPO from its
    newest intact checkpoint, and moves the first unfinished stage's outputs and its
    downstream aside before it starts again. `--resume CKPT --overwrite` (a checkpoint of
    another run directory) moves this directory's PPO run aside, then resumes CKPT here."""
    from ppo_ray.driver.checkpoint import checkpoint_root, resolve_checkpoint
    from ppo_ray.driver.rundir import check_fresh, downstream, held_outputs, invalidate, stages_done

    if overwrite:
        invalidate(run_dir, [stage], why="overwrite")
        return {}, resume
    if resume is None:
        check_fresh(run_dir, stage)
        if held_outputs(run_dir, [s for first in stages[:1] for s in downstream(first)]):
            log.warning("stage %s starts in %s: the stages built on an earlier one are moved aside", stage, run_dir)
            invalidate(run_dir, stages[:1], why=f"{stages[0]}-starts")
        return {}, None
    if resume != "auto":
        return {}, resume
    finished = stages_done(run_dir)
    done: dict = {}
    for name in stages:  # in pipeline order: a stage whose upstream starts again starts again too
        if name not in finished:
            break
        done[name] = finished[name]
    checkpoint = None
    if "ppo" in stages and set(stages[:stages.index("ppo")]) <= set(done) \
            and any(checkpoint_root(run_dir).glob("step-*")):
        checkpoint = resolve_checkpoint(run_dir)
        done.pop("ppo", None)  # a finished PPO stage resumes too: it trains to config.steps and reports again
    unfinished = [name for name in stages if name not in done and not (name == "ppo" and checkpoint)]
    if unfinished:
        invalidate(run_dir, unfinished[:1], why=f"{unfinished[0]}-restarts")
    log.info("--resume auto in %s: %s", run_dir, "; ".join(
        [f"{', '.join(done)} finished"] * bool(done) + [f"PPO resumes from {checkpoint}"] * bool(checkpoint)
        + [f"{', '.join(unfinished)} start{'s' * (len(unfinished) == 1)}"] * bool(unfinished)))
    return done, str(checkpoint) if checkpoint else None


def saved_config(run_dir: Path, stage: str) -> Path | None:
    """The config a run directory saved for `stage` (config-<stage>.yaml), else the pipeline's
    (config.yaml), else None: what a resume reads for its stages (the PPO stage itself resumes
    with its checkpoint's config, ppo_ray.driver.checkpoint.resumed_config)."""
    names = ["config.yaml", "config-ppo.yaml"] if stage == "all" else [f"config-{stage}.yaml", "config.yaml"]
    return next((run_dir / name for name in names if (run_dir / name).is_file()), None)


def report_config_file_changes(config_file: str, file_ppo, resumed) -> None:
    """--config with --resume auto: a resumed PPO stage runs with its checkpoint's config plus
    the command's --field options; name the file's values that differ (they are not applied)."""
    from ppo_ray.driver.checkpoint import config_changes

    diffs = [f"{k}: {b!r} in the file, {a!r} in the checkpoint" for k, a, b in config_changes(resumed, file_ppo)
             if k != "steps"]
    if diffs:
        log.warning("--config %s differs from the checkpoint's config, which the resumed PPO stage keeps (give a "
                    "change as --<field> VALUE): %s", config_file, "; ".join(diffs))


def build_parser():
    """The command line: PPOConfig's options by section (ppo_ray.config.ConfigParser) with the
    stages and --run_dir / --resume; `launch.py --help` prints it."""
    from ppo_ray.config import ConfigParser

    parser = ConfigParser(prog="launch.py", description=__doc__,
                          usage="python launch.py [all|sft|rm|ppo] [--config FILE|PRESET] [--run_dir DIR] [--resume DIR] "
                                "[--<field> VALUE ...]\n       python launch.py export RUN_DIR|CHECKPOINT "
                                "[--merged OUT] [--adapter OUT] [--dtype DTYPE]\n       python launch.py eval RUN_DIR "
                                "[--checkpoint CKPT] [--split SPLIT|--prompts FILE] [--out DIR] [--<field> VALUE ...]",
                          epilog=f"stages (the positional argument): {', '.join(STAGES)}; default: all (ppo with "
                                 "--resume).\ncommands (first, each with its own options: launch.py COMMAND --help): "
                                 + "; ".join(f"{name}: {c.summary}" for name, c in COMMANDS.items())
                                 + ".\nA config file is trusted input: its reward_funcs are imported and run.")
    parser.add_argument("--run_dir", "--run-dir", metavar="DIR",
                        help="run directory (default: output_dir/<time>; with --resume, the checkpoint's run)")
    parser.add_argument("--resume", metavar="DIR|auto",
                        help="continue the PPO stage from a run directory's latest checkpoint or one checkpoint, "
                             "with the checkpoint's config plus the options given; 'auto': continue whatever "
                             "--run_dir holds (finished stages skipped, PPO from its checkpoint), or start when it "
                             "holds nothing")
    parser.add_argument("--overwrite", action="store_true",
                        help="start the stage over in a --run_dir that holds its outputs (they and the outputs "
                             "of the stages built on it are moved to <run_dir>/replaced/<time>/, not deleted); "
                             "with --resume CKPT of another run directory: move --run_dir's PPO run aside and "
                             "continue CKPT there")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command; its exit status. One Ctrl-C (SIGINT) or SIGTERM (`ray job stop`) stops it at
    any point, however the process was started (ppo_ray.driver.interrupts: a `launch.py &` from a
    script inherits SIGINT ignored): exit 130, with the resume hint once the run has started."""
    from ppo_ray.driver.interrupts import stop_on_signals

    with stop_on_signals():
        try:
            return _main(argv)
        except KeyboardInterrupt:  # outside the stages (_run reports those, naming the checkpoint)
            print("\n[ppo-ray] interrupted", file=sys.stderr)
            return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]].main(argv[1:])
    from ppo_ray.config import ConfigError, PPOConfig

    parser = build_parser()
    try:
        options, overrides, positional = parser.parse(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if options.help:  # also after a stage: `launch.py ppo --help`
        print(parser.format_help())
        return 0
    run_dir_opt, resume, config_path = options.run_dir, options.resume, options.config
    auto = resume == "auto"
    stage = positional[0] if positional else ("ppo" if resume is not None and not auto else "all")
    if stage not in STAGES or len(positional) > 1:
        if stage in COMMANDS:
            print(f"error: {stage} is a command, not a stage: it comes first (python launch.py {stage} --help)",
                  file=sys.stderr)
            return 2
        print(f"error: unknown stage {' '.join(positional)!r}; stages: {', '.join(STAGES)}; commands: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if resume is not None and not auto and stage != "ppo":
        print(f"error: --resume continues the PPO stage; stage {stage!r} cannot resume (use: launch.py ppo --resume "
              f"{resume})", file=sys.stderr)
        return 2
    if auto and options.overwrite:
        print("error: --overwrite starts the run over; --resume auto continues it: give one of them", file=sys.stderr)
        return 2
    from ppo_ray.driver.checkpoint import CheckpointError, check_own_lineage, resolve_checkpoint, resumed_config
    from ppo_ray.driver.rundir import RunDirError

    # One resume rule, whichever way a resume is asked for: the PPO stage continues with its
    # checkpoint's own config plus this command's --field options (resumed_config); the run
    # directory's saved config (saved_config) is what its other stages and reports read.
    checkpoint, from_run = None, False
    try:
        if auto:
            if run_dir_opt is None:
                print("error: --resume auto continues the run in --run_dir, or starts one there: pass --run_dir",
                      file=sys.stderr)
                return 2
            saved = saved_config(Path(run_dir_opt), stage)
            if config_path is None and saved is not None:  # the run's own config; overrides still apply
                config_path, from_run = str(saved), True
        elif resume is not None:
            if config_path is not None:
                print(f"error: --config with --resume {resume}: a resume continues with its checkpoint's own config "
                      "(config.yaml in the checkpoint); give changes as --<field> VALUE options", file=sys.stderr)
                return 2
            checkpoint = resolve_checkpoint(resume)
            own_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
            if run_dir_opt is None and own_dir is None:
                print(f"error: {checkpoint} is not in a run directory's checkpoints/: pass --run_dir", file=sys.stderr)
                return 2
            run_dir_opt = run_dir_opt or str(own_dir)
            inside = own_dir is not None and own_dir.resolve() == Path(run_dir_opt).resolve()
            if options.overwrite and inside:
                print(f"error: --overwrite moves {run_dir_opt}'s PPO run aside, and {checkpoint} is part of it: "
                      "resume it without --overwrite", file=sys.stderr)
                return 2
            if not options.overwrite:  # a run touches only its own lineage (before anything is read or written)
                check_own_lineage(checkpoint, run_dir_opt)
            saved = saved_config(own_dir or Path(run_dir_opt), "ppo")
            config_path, from_run = (str(saved), True) if saved is not None else (None, False)
        # a run's saved config: knobs its selections ignore (older runs saved some) go back to their defaults
        config = (PPOConfig.from_saved if from_run else PPOConfig.from_yaml)(config_path or DEFAULT_CONFIG, **overrides)
        if checkpoint is not None and (config_path is None or config.reward_funcs or config.reward_model_name):
            config = resumed_config(checkpoint, run_dir_opt, overrides)  # a plain PPO run: its config is the PPO's
    except (ConfigError, ValueError) as e:  # CheckpointError and RunDirError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ppo_ray.logs import setup_logging

    setup_logging(config.log_level)
    if resume is not None and config.reward_funcs:
        # a run directory's saved config is reloaded and its reward functions imported: say which
        log.warning("resuming with the run's saved config: it imports and runs the reward functions %s "
                    "(config files are trusted input, like a Python script)", ", ".join(config.reward_funcs))
    has_reward = bool(config.reward_funcs or config.reward_model_name or config.environment)
    if stage in ("all", "sft", "rm") and has_reward:
        print(f"error: stage {stage!r} trains its own SFT and reward model on the bundled task; "
              "the config names reward sources (reward_funcs / reward_model_name / environment): use stage 'ppo'",
              file=sys.stderr)
        return 2

    run_dir = Path(run_dir_opt or Path(config.output_dir) / time.strftime("%Y%m%d-%H%M%S"))
    from ppo_ray.tasks.base import TaskError
    from ppo_ray.tasks.pipeline import task_of

    task_stages: tuple[str, ...] = ()
    if not has_reward:  # the pipeline's task (a registered name or module:object; plain PPO reads none)
        try:
            task = task_of(config)
        except TaskError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        task_stages = tuple(task.stages)
    if stage not in ("all", *task_stages) and not has_reward:
        print(f"error: task {config.task!r} has no stage {stage!r}; its stages: {', '.join(task_stages)}",
              file=sys.stderr)
        return 2
    trains_sft_or_rm = [s for s in (task_stages if stage == "all" else (stage,)) if s in ("sft", "rm")]
    if trains_sft_or_rm and config.apply_chat_template:
        print(f"error: apply_chat_template formats the PPO prompts of an instruct model (stage 'ppo' with reward "
              f"sources, or a task with no SFT stage such as arith-chat); stage {trains_sft_or_rm[0]!r} trains on "
              "plain text", file=sys.stderr)
        return 2
    if stage in ("rm", "ppo") and not has_reward and "sft" in task_stages and not (run_dir / "sft").is_dir():
        print(f"error: stage {stage!r} needs {run_dir / 'sft'} from stage 'sft' (pass --run_dir)", file=sys.stderr)
        return 2
    if stage == "ppo" and not has_reward and "rm" in task_stages and not (run_dir / "rm").is_dir():
        print(f"error: stage 'ppo' needs {run_dir / 'rm'} from stage 'rm' (pass --run_dir)", file=sys.stderr)
        return 2
    from ppo_ray.driver.cluster import ClusterError
    from ppo_ray.data import DataError
    from ppo_ray.environments import EnvError
    from ppo_ray.gguf_model import GGUFError
    from ppo_ray.modeling import ContextLengthError
    from ppo_ray.rewards import RewardError
    from ppo_ray.driver.rundir import check_writable
    from ppo_ray.driver.runlock import RunLock, RunLockError
    from ppo_ray.tracking import TrackerError, check_trackers

    # Cheap checks of what the stage needs, before anything is written (a rejected command
    # leaves an existing run directory as it was) and before Ray or any actor starts.
    prompts = None
    stages = task_stages if stage == "all" and not has_reward else (stage,)
    try:
        check_context(config)
        if not has_reward and stage in ("all", "ppo") and task.verifier is not None:
            from ppo_ray.rewards import import_reward_fn

            import_reward_fn(task.verifier_spec)  # the task's verifier imports (RewardError naming it)
        if not has_reward and stage in ("all", "ppo") and task.environment is not None:
            from ppo_ray.environments import load_environment

            load_environment(task.environment)  # the task's environment imports (EnvError naming it)
        check_trackers(config.report_to)
        if stage in ("all", "ppo"):
            check_ray_address()
        if stage == "ppo" and has_reward:
            prompts = plain_ppo_inputs(config)
        check_writable(run_dir)
        # One writer per run directory, from here to the end of the command.
        lock = RunLock.acquire(run_dir, ["ppo-ray", *argv])
    except (ClusterError, RewardError, FileNotFoundError, DataError, ContextLengthError, TrackerError,
            RunDirError, CheckpointError, RunLockError, GGUFError, EnvError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        ppo_config = None  # the resumed PPO stage's config, when it differs from the pipeline's
        try:
            # last of the checks: a fresh stage never writes over what the run directory holds
            done, resume = plan_run_dir(run_dir, stage, stages, resume, options.overwrite)
            if resume is not None:
                checkpoint = resolve_checkpoint(resume)
                ppo_config = resumed_config(checkpoint, run_dir, overrides)
                if options.config is not None and auto:
                    from ppo_ray.tasks.pipeline import ppo_config as pipeline_ppo_config

                    file_ppo = config if has_reward else pipeline_ppo_config(config, run_dir, run_dir / "data")
                    report_config_file_changes(options.config, file_ppo, ppo_config)
                if has_reward:  # a plain PPO run: the checkpoint's config (+ overrides) is the run's
                    config, ppo_config = ppo_config, None
                    prompts = plain_ppo_inputs(config)
        except (RewardError, FileNotFoundError, DataError, RunDirError, CheckpointError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

        from ppo_ray.logs import console_log

        with console_log(run_dir, ["ppo-ray", *argv]) as log_path:
            return _run(config, stage, stages, done, resume, run_dir, has_reward, prompts, log_path, ppo_config)
    finally:
        lock.release()


def _run(config, stage: str, stages: tuple[str, ...], done: dict, resume, run_dir: Path, has_reward: bool,
         prompts, log_path: Path, ppo_config=None) -> int:
    """The stages, after the checks: the run directory exists and the console goes to log_path too.
    `ppo_config`: the pipeline's resumed PPO stage's config (its checkpoint's plus the overrides)."""
    from ppo_ray.driver.checkpoint import CheckpointError
    from ppo_ray.driver.cluster import ClusterError
    from ppo_ray.data import DataError
    from ppo_ray.machine import machine_info
    from ppo_ray.modeling import ContextLengthError
    from ppo_ray.rewards import RewardError
    from ppo_ray.driver.rundir import RunDirError, mark_done
    from ppo_ray.driver.runlock import RunLockLost
    from ppo_ray.tasks.tldr import TLDRDataError
    from ppo_ray.tracking import read_run_file, update_run_file

    config.to_yaml(run_dir / f"config{'' if stage == 'all' else '-' + stage}.yaml")
    # the driver's machine and packages, for the report page (the latest command's)
    update_run_file(run_dir, environment={**machine_info(), "recorded": time.strftime("%Y-%m-%d %H:%M:%S")})
    log.info("run directory: %s (console log: %s)", run_dir, log_path.relative_to(run_dir))

    import ray

    from ppo_ray.tasks import pipeline

    ray_was_up = ray.is_initialized()  # an in-process caller's Ray is left running
    report: dict = {"run_dir": str(run_dir)}
    t0 = time.perf_counter()
    # Ctrl-C and `ray job stop` (SIGTERM) raise KeyboardInterrupt here (main: stop_on_signals):
    # the stages unwind (actors shut down; the last checkpoint, written atomically, stays the
    # latest and resumable).
    try:
        if stage == "ppo" and has_reward:
            report.update(run_plain_ppo(config, run_dir, resume, prompts))
            mark_done(run_dir, "ppo", report)
        else:
            # the data is the SFT stage's: written when SFT starts, kept by the stages built on it
            data_dir = pipeline.write_data(config, run_dir, keep="sft" not in stages or "sft" in done)
            run = {"sft": lambda: pipeline.run_sft(config, run_dir, data_dir),
                   "rm": lambda: pipeline.run_rm(config, run_dir, data_dir),
                   "ppo": lambda: pipeline.run_ppo(config, run_dir, data_dir, resume, ppo_config)}
            for name in stages:
                if name in done:  # --resume auto: finished in an earlier attempt
                    log.info("stage %s: finished earlier in %s, skipped", name, run_dir)
                    report.update(done[name])
                    continue
                stats = run[name]()
                mark_done(run_dir, name, stats)
                report.update(stats)
    except (ClusterError, RewardError, FileNotFoundError, TLDRDataError, CheckpointError, DataError,
            ContextLengthError, RunDirError, RunLockLost) as e:
        # expected, user-fixable problems (and another driver that took the run directory over):
        # the message names the bad thing; no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:  # a folder of the run directory made unwritable mid-run
        print(f"error: {e.strerror}: {e.filename} (this process runs as uid {os.geteuid()}, gid {os.getegid()}); "
              "make the run directory writable by it and continue with --resume auto", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        latest = run_dir / "checkpoints" / "latest"
        where = (f"the last checkpoint is {run_dir / 'checkpoints' / latest.read_text().strip()}; resume with: "
                 f"python launch.py ppo --resume {run_dir}") if latest.is_file() else "no checkpoint was written yet"
        print(f"\n[ppo-ray] interrupted: {where}", file=sys.stderr)
        return 130
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if stage in ("all", "ppo") and read_run_file(run_dir).get("run_tag"):
        report["run_tag"] = read_run_file(run_dir)["run_tag"]  # the `run` label of the Prometheus series
    if not ray_was_up and ray.is_initialized():
        # The actors are gone, but Ray forwards their last log lines asynchronously (vLLM's
        # engine-core teardown): disconnect the Ray this run started, so that the summary
        # is the last line of stdout (scripts read it with tail -1 | jq).
        ray.shutdown()
    (run_dir / f"report{'' if stage == 'all' else '-' + stage}.json").write_text(json.dumps(report, indent=2))
    if stage in ("all", "ppo"):
        write_page(run_dir)
    print(json.dumps(report))
    return 0


def write_page(run_dir: Path) -> None:
    """<run_dir>/report.html from what the run directory holds (ppo_ray.tasks.report_page). The
    page is a view of files already written: failing to build it costs a warning, not the run."""
    from ppo_ray.tasks.report_page import write_report_page

    try:
        log.info("report page: %s", write_report_page(run_dir))
    except Exception as e:  # noqa: BLE001
        log.warning("the report page of %s was not written (python -m ppo_ray.tasks.report_page %s): %r",
                    run_dir, run_dir, e)


if __name__ == "__main__":
    sys.exit(main())
