"""The stages on the config's task (ppo_ray.tasks.base: a registered task or "module:object"):
data -> SFT -> reward model (a task with an "rm" stage) -> PPO -> the task's report. Everything
task-specific (its data, SFT targets, reward, evaluation and report) is asked of the Task: tldr's
SFT -> reward model -> PPO, judged by the gold judge (ppo_ray.tasks.tldr_task), arith's SFT -> RL
with a verifier as the reward, judged by pass@1 and pass@k (ppo_ray.tasks.arith; the run
directory has no rm/, and report.json the pass rates).

    run_dir/
      config.yaml          the config used
      data/                the task's splits (JSONL), written deterministically (task.json: their spec)
      sft/                 the SFT checkpoint (policy start and frozen reference)
      rm/                  the reward model (and the value model's initialisation)
      metrics.jsonl        one line per PPO step (+ gold evaluations every eval_every steps)
      eval-before-ppo.json the SFT policy's held-out evaluation and the settings it was computed with
                           (a resume with other ones evaluates it again: before_training)
      adapter/             the final policy LoRA (PEFT format)
      curves.png           reward, KL, gold score and losses over steps
      samples.md           before/after summaries of held-out prompts
      report.json          the summary printed at the end (report_errors: a part that could not be
                           computed, said instead of a traceback: report_part)
      report.html          all of it on one page (launch.py, ppo_ray.tasks.report_page)

A task's evaluation only scores (tldr's gold judge, ppo_ray.tasks.tldr_synth; arith's pass
rates): SFT learns from the SFT targets, the reward model from the preference pairs, PPO from
the reward model or the verifier.

The real path: when the config names datasets (sft_dataset, preference_dataset: hub ids or
local JSONL/parquet in the TL;DR schemas) the same stages read them through ppo_ray.tasks.tldr
(N+ formatting) instead of the bundled files, and PPO's prompts are the SFT data's queries,
as in the recipe. Real data has no gold judge: run_ppo then reports the reward model's score
and the KL to SFT, and samples.md holds held-out summaries to read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NamedTuple, Optional

from ppo_ray.atomic import atomic_write_text
from ppo_ray.config import PPOConfig
from ppo_ray.data import DataError, column, read_rows

log = logging.getLogger(__name__)


def _encode(tok, prompts, responses):
    q = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in responses]
    return q, r


# ----------------------------------------------------------------------------- data sources
# Each stage takes token ids from one of two sources: the bundled task's files in data_dir,
# or the datasets the config names (sft_dataset / preference_dataset, read by ppo_ray.tasks.tldr).
# `part` is "train" or "eval": the bundled files' train / validation splits, or the config's
# train_split / eval_split.


class SFTIds(NamedTuple):
    queries: list[list[int]]
    responses: list[list[int]]  # each ends with EOS
    info: dict  # what loading kept, dropped and cut (real data; empty for the bundled task)
    # per response token, True = an environment's (a multi-turn transcript's observations, out
    # of the SFT loss); None = every response token is an SFT target
    env_masks: Optional[list[list[bool]]] = None


def _values(rows: list[dict], name: str, source: str) -> list:
    """Column `name` of every row, whatever its type; a missing one is a DataError naming the row."""
    for i, row in enumerate(rows):
        if name not in row:
            raise DataError(f"{source}: row {i} has no column {name!r} (columns: {sorted(row)})")
    return [row[name] for row in rows]


def encode_segments(tok, prompts: list[str], transcripts: list, source: str
                     ) -> tuple[list[list[int]], list[list[int]], list[list[bool]]]:
    """Prompt ids, and each transcript ([who, text] segments, who "model" or "env") tokenised
    segment by segment and concatenated, EOS after the last, with its env mask: model segments
    as single SFT targets are (_encode), environment segments as the episode loop encodes an
    observation (tokenizer.encode(text, add_special_tokens=False), ppo_ray.environments), so
    SFT trains on the token sequence an episode holds. A transcript that is not a list of
    segments, or does not end with the model's, is a DataError naming the row."""
    q = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    responses, masks = [], []
    for i, segments in enumerate(transcripts):
        if not isinstance(segments, list) or not segments or \
                any(not isinstance(s, list) or len(s) != 2 or s[0] not in ("model", "env") or not isinstance(s[1], str)
                    for s in segments) or segments[-1][0] != "model":
            raise DataError(f"{source}: row {i}: segments must be a list of [\"model\" | \"env\", text] ending with "
                            f"the model's, got {segments!r:.120}")
        ids: list[int] = []
        env: list[bool] = []
        for who, text in segments:
            part = tok(text, add_special_tokens=False)["input_ids"] if who == "model" \
                else tok.encode(text, add_special_tokens=False)
            ids += part
            env += [who == "env"] * len(part)
        responses.append(ids + [tok.eos_token_id])
        masks.append(env + [False])
    return q, responses, masks


class PreferenceIds(NamedTuple):
    queries: list[list[int]]
    chosen: list[list[int]]  # each ends with EOS
    rejected: list[list[int]]
    info: dict


def _real_split(config: PPOConfig, source: str, part: str) -> tuple[str, str]:
    """(source, split) for a named dataset: a path with "{split}" names one file per split."""
    split = config.train_split if part == "train" else config.eval_split
    return source.replace("{split}", split), split


def _load_info(stage: str, part: str, data) -> dict:
    """Counts of one tldr load for the stage's report; an empty load is an error naming the source."""
    from ppo_ray.tasks.tldr import TLDRDataError

    if not len(data):
        raise TLDRDataError(f"{data.source}: no usable examples for stage {stage!r} ({data.rows} rows read, "
                            f"dropped: {data.dropped or 'none'})")
    key = f"{stage}_{part}"
    return {f"{key}_examples": len(data), f"{key}_rows": data.rows, f"{key}_dropped": dict(data.dropped),
            f"{key}_query_cuts": dict(data.query_cuts)}


def task_of(config: PPOConfig):
    """The config's task (ppo_ray.tasks.base.get_task: a registered name or "module:object")."""
    from ppo_ray.tasks.base import get_task

    return get_task(config.task)


def task_stages(config: PPOConfig) -> tuple[str, ...]:
    """The stages `launch.py` (stage all) runs for the config's task, in order."""
    return tuple(task_of(config).stages)


def sft_ids(config: PPOConfig, data_dir: Path, tok, part: str) -> SFTIds:
    """SFT (query ids, response ids + EOS) of one part, from the bundled task or sft_dataset; a
    task that declares `sft_segments` (a column of [who, text] transcripts: ppo_ray.tasks.tool_mul)
    gives them encoded segment by segment, with their env masks (encode_segments)."""
    if config.uses_bundled_data:
        path = data_dir / f"sft_{'train' if part == 'train' else 'validation'}.jsonl"
        rows = read_rows(path)[: config.data_max_rows]
        task = task_of(config)
        if task.sft_segments is not None:  # a multi-turn task's transcripts (ppo_ray.tasks.tool_mul)
            q, r, env = encode_segments(tok, column(rows, "prompt", str(path)), _values(rows, task.sft_segments,
                                                                                        str(path)),
                                         str(path))
            return SFTIds(q, r, {}, env)
        q, r = _encode(tok, column(rows, "prompt", str(path)), column(rows, task.sft_target, str(path)))
        return SFTIds(q, r, {})
    from ppo_ray.tasks.tldr import load_sft

    source, split = _real_split(config, config.sft_dataset, part)
    # N+: SFT targets no longer than the rollouts (53 tokens, EOS counted); longer ones are dropped.
    data = load_sft(source, split, tok, max_query_length=config.max_prompt_length,
                    max_response_length=config.max_new_tokens, max_rows=config.data_max_rows)
    info = _load_info("sft", part, data)
    return SFTIds([ex.query_ids for ex in data], [ex.response_ids for ex in data], info)


def preference_ids(config: PPOConfig, data_dir: Path, tok, part: str) -> PreferenceIds:
    """Preference pairs (query, chosen, rejected ids) of one part, from the bundled task or
    preference_dataset (chosen = summaries[choice]; CNN/DM rows skipped)."""
    if config.uses_bundled_data:
        path = data_dir / f"preferences_{'train' if part == 'train' else 'validation'}.jsonl"
        rows = read_rows(path)[: config.data_max_rows]
        prompts = column(rows, "prompt", str(path))
        q, c = _encode(tok, prompts, column(rows, "chosen", str(path)))
        _, r = _encode(tok, prompts, column(rows, "rejected", str(path)))
        return PreferenceIds(q, c, r, {})
    from ppo_ray.tasks.tldr import load_preferences

    source, split = _real_split(config, config.preference_dataset, part)
    data = load_preferences(source, split, tok, config_name=config.preference_config,
                            max_query_length=config.max_prompt_length, max_rows=config.data_max_rows)
    info = _load_info("rm", part, data)
    return PreferenceIds([ex.query_ids for ex in data], [ex.chosen_ids for ex in data],
                         [ex.rejected_ids for ex in data], info)


def real_prompts(config: PPOConfig, tok, part: str, max_rows: int | None = None) -> list[str]:
    """PPO prompt texts of the real path: sft_dataset's queries (the recipe's PPO reads the SFT
    data's queries), each cut to fit max_prompt_length tokens."""
    from ppo_ray.tasks.tldr import load_queries

    source, split = _real_split(config, config.sft_dataset, part)
    limits = [n for n in (config.data_max_rows, max_rows) if n is not None]
    data = load_queries(source, split, tok, max_query_length=config.max_prompt_length,
                        max_rows=min(limits) if limits else None)
    _load_info("ppo", part, data)  # only its check: an empty prompt set is an error
    return [q.text for q in data]


# ----------------------------------------------------------------------------- stages
DATA_STAMP = "task.json"  # in the data directory: what the bundled task's files were written for


def data_spec(config: PPOConfig) -> dict:
    """What the bundled task's files depend on: the task, its seed and its parameters (Task.data_spec)."""
    return task_of(config).data_spec(config)


def write_data(config: PPOConfig, run_dir: Path, keep: bool = False) -> Path:
    """The bundled task's splits in run_dir/data, written for config's seed and task parameters.

    `keep`: the run's SFT stage is not starting now (a later stage alone, or --resume auto past
    SFT). Then the data the SFT model was trained on stays as it is, whatever this command's
    seed: writing another seed's problems would put problems the SFT model was trained on into
    the test split (the seed of `launch.py ppo --seed S` seeds the PPO stage's sampling and LoRA
    only). A warning says when the two differ."""
    data_dir = run_dir / "data"
    if not config.uses_bundled_data:  # named datasets are read where they are
        return data_dir
    spec, stamp = data_spec(config), data_dir / DATA_STAMP
    if keep and any(data_dir.glob("*.jsonl")):
        written = json.loads(stamp.read_text()) if stamp.is_file() else None
        if written != spec:
            log.warning("%s holds the data the run's SFT stage was trained on (%s); it is kept, not rewritten for "
                        "this command's %s", data_dir, written or "written before data stamps", spec)
        return data_dir
    task_of(config).write_data(data_dir, config)
    atomic_write_text(stamp, json.dumps(spec) + "\n")
    return data_dir


def run_sft(config: PPOConfig, run_dir: Path, data_dir: Path) -> dict:
    """SFT as a Ray task on a node with the config's stage resources (stage_tasks.run_stage):
    the driver tokenises the data, the task trains, run_dir/sft is written on the driver's node."""
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.paths import resolve_model_path
    from ppo_ray.driver.stage_tasks import run_stage, stage_settings

    base = resolve_model_path(config.model_name)
    tok = load_tokenizer(base)
    train, val = sft_ids(config, data_dir, tok, "train"), sft_ids(config, data_dir, tok, "eval")
    settings = stage_settings(config, config.sft_epochs, config.sft_learning_rate)
    if train.env_masks is None:
        stats = run_stage(config, "sft", base, (train.queries, train.responses), settings, run_dir / "sft",
                          val=(val.queries, val.responses))
    else:  # a multi-turn task's transcripts: their environment tokens are out of the loss
        stats = run_stage(config, "sft", base, (train.queries, train.responses), settings, run_dir / "sft",
                          val=(val.queries, val.responses, val.env_masks), env_masks=train.env_masks)
    if config.uses_bundled_data:  # the task's own diagnostics of the SFT model (tldr: its fact copying)
        stats.update(task_of(config).sft_report(config, run_dir, data_dir))
    return {**train.info, **val.info, **stats}


def run_rm(config: PPOConfig, run_dir: Path, data_dir: Path) -> dict:
    """The reward model as a Ray task, like run_sft; run_dir/rm is written on the driver's node."""
    from ppo_ray.modeling import load_tokenizer
    from ppo_ray.driver.stage_tasks import run_stage, stage_settings

    sft = str(run_dir / "sft")
    tok = load_tokenizer(sft)
    train, val = preference_ids(config, data_dir, tok, "train"), preference_ids(config, data_dir, tok, "eval")
    settings = stage_settings(config, config.rm_epochs, config.rm_learning_rate)
    stats = run_stage(config, "rm", sft, (train.queries, train.chosen, train.rejected), settings, run_dir / "rm",
                      val=(val.queries, val.chosen, val.rejected))
    correct = stats.pop("rm_val_correct", None)
    if config.uses_bundled_data and correct is not None:  # can the RM guide PPO? (the task's diagnostics)
        stats.update(task_of(config).rm_report(config, run_dir, data_dir, correct))
    return {**train.info, **val.info, **stats}


def ppo_config(config: PPOConfig, run_dir: Path, data_dir: Path) -> PPOConfig:
    """The PPO stage's config: policy and reference = SFT, reward = RM. The value model is
    the SFT backbone with a zero head unless config.value_model_name says otherwise ("rm"
    = the run's reward model, the N+ recipe's init)."""
    value = config.value_model_name
    task = task_of(config)
    if task.verifier is not None or task.environment is not None:  # no reward model exists
        if value == "rm":
            raise ValueError(f"value_model_name 'rm' needs the reward-model stage, which task {config.task} does not "
                             "have")
        data = dict(dataset=str(data_dir / "prompts_train.jsonl"), prompt_column="prompt")
        # a task with no SFT stage trains the base model itself (its reference too)
        policy = str(run_dir / "sft") if "sft" in task.stages else config.model_name
        # the verifier is the reward, the environment's on top (or alone)
        funcs = [task.verifier_spec] if task.verifier is not None else []
        return config.replace(model_name=policy, ref_model_name=None, reward_model_name=None,
                              value_model_name=value, reward_funcs=funcs, reward_weights=[],
                              environment=task.environment, **data)
    if value == "rm":
        value = str(run_dir / "rm")
    # the bundled task's prompts; real data's are read from sft_dataset (run_ppo_real)
    data = dict(dataset=str(data_dir / "prompts_train.jsonl"), prompt_column="prompt") if config.uses_bundled_data \
        else {}
    return config.replace(
        model_name=str(run_dir / "sft"), ref_model_name=None, reward_model_name=str(run_dir / "rm"),
        value_model_name=value, reward_funcs=[], reward_weights=[], **data)


@contextmanager
def ppo_trainer(cfg: PPOConfig, run_dir: Path, resume: Optional[str | Path] = None,
                before: Optional["BeforeEval"] = None) -> Iterator[tuple]:
    """(trainer, the SFT policy's evaluation or None) for a PPO stage in `run_dir`: fresh (the
    run directory must hold no PPO run: RunDirError before any actor starts) or resumed from a
    checkpoint (`resume`: a run directory or a checkpoint; its config is checked against `cfg`
    before any actor starts). `before`: the SFT policy's held-out evaluation (before_training),
    on the fresh trainer (the SFT policy, adapter version 0) and so before the restore: a
    resume whose evaluation settings changed evaluates the SFT policy again. Shut down on exit,
    whatever happens."""
    from ppo_ray.driver.checkpoint import check_compatible, resolve_checkpoint, resumed_config
    from ppo_ray.driver.rundir import check_fresh
    from ppo_ray.trainer import PPOTrainer

    if resume is None:
        check_fresh(run_dir, "ppo")
    else:  # restore() checks it too; here a refused resume costs no evaluation
        ckpt = resolve_checkpoint(resume)
        check_compatible(resumed_config(ckpt, run_dir), cfg, ckpt)
    trainer = PPOTrainer(cfg, run_dir=run_dir)  # a failure to start leaves the old run's files alone
    ended = False
    try:
        sft = before_training(trainer, run_dir, before.settings, lambda: before.evaluate(trainer)) if before else None
        if resume is not None:
            trainer.restore(resume)
        yield trainer, sft
        ended = True
    finally:
        trainer.shutdown(graceful=ended)  # an error or an interrupt: the actors are killed at once


BEFORE_EVAL = "eval-before-ppo.json"
# The config fields that shape a held-out evaluation besides its prompts (eval_settings): how many
# prompts, how they are encoded, how they are sampled and with which seeds.
EVAL_FIELDS = ("eval_size", "seed", "temperature", "top_k", "top_p", "max_new_tokens", "max_prompt_length",
               "prompt_truncation", "apply_chat_template")


class BeforeEval(NamedTuple):
    settings: dict  # eval_settings(): what the evaluation depends on, kept with it
    evaluate: Callable  # evaluate(trainer) -> the SFT policy's evaluation (a dict of per-prompt lists)


def eval_settings(cfg: PPOConfig, splits: dict[str, tuple[str, list]], **task) -> dict:
    """What the PPO stage's held-out evaluations depend on, so that two are paired only when
    they agree (before_training): the stage config's EVAL_FIELDS, the task's own (`task`, e.g.
    arith's eval_k), and per split, named as `launch.py eval --split` names it, where its
    prompts come from (`source`), how many and the sha256 of the rows (or prompts) evaluated."""
    def digest(items: list) -> str:
        return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()

    return {**{name: getattr(cfg, name) for name in EVAL_FIELDS}, **task,
            "splits": {split: {"source": source, "prompts": len(items), "sha256": digest(items)}
                       for split, (source, items) in splits.items()}}


def settings_changes(kept: Optional[dict], now: dict) -> list[str]:
    """Each setting (dotted: splits.test.sha256) in which `now` differs from `kept`, as
    "name: kept -> now"; one entry when `kept` is None (none recorded)."""
    if kept is None:
        return ["no settings recorded (a file of an older version, or unreadable)"]

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    def show(k: str, d: dict) -> str:
        v = d.get(k, "(none)")
        return f"{v[:12]}..." if k.endswith("sha256") and isinstance(v, str) else repr(v)

    a, b = flat(kept), flat(now)
    return [f"{k}: {show(k, a)} -> {show(k, b)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def before_training(trainer, run_dir: Path, settings: dict, evaluate: Callable[[], dict]) -> dict:
    """The SFT policy's held-out evaluation, kept in the run directory with the settings that
    shaped it (eval_settings), so a resumed run compares against the same numbers. One kept
    with other settings (a resume with another eval_size or eval_k, other held-out data) is
    never paired with this run's evaluation: it moves to <run_dir>/replaced/ and the SFT policy
    is evaluated again, which needs the SFT policy (adapter version 0: ppo_trainer calls this
    before it restores a checkpoint)."""
    from ppo_ray.driver.rundir import move_aside

    path = run_dir / BEFORE_EVAL
    if path.exists():
        try:
            kept = json.loads(path.read_text())
        except ValueError:
            kept = None
        kept = kept if isinstance(kept, dict) else {}  # unreadable: no settings recorded
        changes = settings_changes(kept.get("settings"), settings)
        if not changes:
            return {k: v for k, v in kept.items() if k != "settings"}
        log.warning("%s (the SFT policy's held-out evaluation) was computed with other settings than this run's "
                    "(%s): it is not paired with this run's evaluation; the SFT policy is evaluated again",
                    path, "; ".join(changes))
        move_aside(run_dir, [BEFORE_EVAL], why="eval-settings-changed")
    if trainer.version != 0:
        raise RuntimeError(f"{path}: the SFT policy's evaluation needs the trainer at adapter version 0, not "
                           f"{trainer.version} (evaluate it before restoring a checkpoint: ppo_trainer)")
    out = evaluate()
    atomic_write_text(path, json.dumps({**out, "settings": settings}))
    return out


def recorded_splits(run_dir: Path) -> list[str]:
    """The held-out splits the run's PPO stage evaluated on, as eval-before-ppo.json records
    them (`launch.py eval --split` names); [] when it records none (no PPO stage yet, or a
    file of an older version)."""
    try:
        kept = json.loads((run_dir / BEFORE_EVAL).read_text())
    except (OSError, ValueError):
        return []
    return list(((kept.get("settings") or {}).get("splits") or {}))


def report_part(errors: dict, name: str, compute: Callable[[], Any]) -> Any:
    """compute() of one part of a stage's report (numbers, or a file written), or None when it
    fails: the error is logged naming the part and kept in `errors` (report.json's
    report_errors), and the report keeps what the other parts computed: a report's number
    never costs the trained run (its samples are kept to compute it again)."""
    try:
        return compute()
    except Exception as e:  # noqa: BLE001 - any failure of one part is said, the others still run
        log.error("the report's %s could not be computed: %s: %s", name, type(e).__name__, e)
        errors[name] = f"{type(e).__name__}: {e}"
        return None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _source(path: Path, run_dir: Path) -> str:
    """A data file's name in the settings: relative to the run directory when inside it (a moved
    run directory evaluates the same files)."""
    return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else str(path)


def run_ppo(config: PPOConfig, run_dir: Path, data_dir: Path, resume: Optional[str | Path] = None,
            cfg: Optional[PPOConfig] = None) -> dict:
    """The PPO stage: `cfg` is its config (default: ppo_config(config); a resumed stage's is
    its checkpoint's plus the command's overrides, ppo_ray.driver.checkpoint.resumed_config). The
    task's held-out rows (the first eval_size of the test and validation splits) are evaluated
    by the task (Task.evaluate) before training (the SFT policy) and after, with the same
    sampling seeds, the validation rows every eval_every steps (Task.periodic); the task's
    report (Task.report) is report.json's numbers. The evaluation only scores: its numbers
    never reach the learner."""
    if not config.uses_bundled_data:  # real data: no gold judge, see run_ppo_real
        return run_ppo_real(config, run_dir, data_dir, resume, cfg)
    from ppo_ray.data import load_prompts
    from ppo_ray.modeling import load_tokenizer

    task = task_of(config)
    cfg = cfg or ppo_config(config, run_dir, data_dir)
    test_path, val_path = data_dir / "prompts_test.jsonl", data_dir / "prompts_validation.jsonl"
    test_rows = read_rows(test_path)[: cfg.eval_size]
    val_rows = read_rows(val_path)[: cfg.eval_size]

    def evaluate(trainer, step: int) -> dict:
        return task.periodic(trainer, cfg, val_rows)

    metrics = run_dir / "metrics.jsonl"
    # every prompt checked before actors start; the rows keep their columns (a verifier's answers)
    prompts = load_prompts(cfg, load_tokenizer(cfg.model_name))
    # the SFT policy itself, on the test prompts and (for any selection) the validation prompts
    before = BeforeEval(eval_settings(cfg, {"test": (_source(test_path, run_dir), test_rows),
                                            "validation": (_source(val_path, run_dir), val_rows)},
                                      **task.eval_settings(cfg)),
                        lambda trainer: {**task.evaluate(trainer, cfg, test_rows),
                                         "val": task.evaluate(trainer, cfg, val_rows)})
    with ppo_trainer(cfg, run_dir, resume, before) as (trainer, sft):
        trainer.train(prompts, metrics_path=metrics, evaluate=evaluate, eval_prompts=task.train_eval_prompts(val_rows))
        after = task.evaluate(trainer, cfg, test_rows)  # same sampling seeds as the SFT evaluation
        after_val = task.evaluate(trainer, cfg, val_rows)
        trainer.save_adapter(run_dir / "adapter")
    return task.report(run_dir, metrics, cfg, test_rows, val_rows, sft, after, after_val)

def final_rewards(history: list[dict]) -> dict:
    """report.json's final rewards: the mean score of every rollout the last step generated and,
    under dynamic_sampling (which trains on some of them), of those it trained on."""
    last = history[-1]
    out = {"final_reward": last["reward_mean"]}
    if "dynamic_sampling_rounds" in last:
        out["final_reward_trained"] = last.get("reward_trained_mean", float("nan"))
    return out


def run_ppo_real(config: PPOConfig, run_dir: Path, data_dir: Path, resume: Optional[str | Path] = None,
                 cfg: Optional[PPOConfig] = None) -> dict:
    """PPO on the named datasets. No gold judge exists for real data, so the report is the
    reward model's score (mean over each step's rollouts, missing-EOS penalty included) and
    the KL to the SFT model; samples.md shows held-out SFT and PPO summaries to read."""
    from ppo_ray.modeling import load_tokenizer

    # real prompts are read from sft_dataset and passed in (config.dataset is not read)
    cfg = cfg or ppo_config(config, run_dir, data_dir)
    tok = load_tokenizer(cfg.model_name)
    prompts = real_prompts(config, tok, "train")
    held_out, settings = real_held_out(config, cfg, tok)
    metrics = run_dir / "metrics.jsonl"
    from ppo_ray.tasks.evaluation import sample

    # what before_training keeps in the run directory: texts, finish reasons, version
    before = BeforeEval(settings, lambda trainer: sample(trainer, held_out))
    with ppo_trainer(cfg, run_dir, resume, before) as (trainer, sft):
        trainer.train(prompts, metrics_path=metrics, eval_prompts=held_out)
        ppo_texts = sample(trainer, held_out)["texts"]  # same sampling seeds as before training
        trainer.save_adapter(run_dir / "adapter")
    history = read_metrics(metrics)
    errors: dict = {}
    report_part(errors, "samples.md", lambda: write_held_out_texts(run_dir / "samples.md", held_out, sft["texts"],
                                                                   ppo_texts))
    report_part(errors, "curves.png", lambda: plot_curves(metrics, run_dir / "curves.png"))
    return {
        "evaluation": "reward-model score and KL to SFT only: real data has no gold judge",
        "first_reward": history[0]["reward_mean"],
        **final_rewards(history),
        "final_kl": history[-1]["kl"],
        "ppo_steps": len(history),
        "ppo_prompts": len(prompts),
        "eval_prompts": len(held_out),
        **({"report_errors": errors} if errors else {}),
    }


def real_held_out(config: PPOConfig, cfg: PPOConfig, tok) -> tuple[list[str], dict]:
    """The real path's held-out prompts (eval_split's first eval_size queries of sft_dataset) and
    their eval_settings, under the split's own name: the split `launch.py eval` defaults to."""
    held_out = real_prompts(config, tok, "eval", max_rows=cfg.eval_size)
    source, split = _real_split(config, config.sft_dataset, "eval")
    return held_out, eval_settings(cfg, {split: (source, held_out)})


HELD_OUT = "held_out.jsonl"  # the report's gold numbers come from these samples (one line per prompt and split)


def write_held_out_texts(path: Path, prompts, sft_texts, ppo_texts, n: int = 12) -> None:
    """samples.md of the real path: held-out posts with the SFT and PPO summaries (no scores)."""
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| # | post (start) | SFT summary | PPO summary |", "|---|---|---|---|"]
    for i, prompt in enumerate(prompts[:n]):
        post = re.search(r"POST: (.*)", prompt, re.S)
        lines.append(f"| {i} | {cell((post.group(1) if post else prompt)[:80])}... | {cell(sft_texts[i])} | "
                     f"{cell(ppo_texts[i])} |")
    path.write_text("# Held-out summaries before (SFT) and after PPO\n\n" + "\n".join(lines) + "\n")


def plot_curves(metrics_path: Path, out_path: Path | BinaryIO, gold_before: Optional[float] = None, *,
                gold_key: str = "gold_val", gold_title: str = "gold score (held-out validation)",
                reward_title: str = "reward-model score", before: str = "SFT") -> None:
    """The run's curves over PPO steps; `gold_before` (the SFT policy's held-out gold on the
    same validation prompts; `before`: that policy's name, "base model" for a task with no SFT
    stage) is drawn as step 0 of the gold panel, so the gain reads off it.
    `gold_key` / the titles: the held-out metric's panel and the reward's (task arith: pass@1
    and the verifier's reward). `out_path`: a file, or a binary stream the PNG is written to
    (the report page's curves of a run that wrote none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    panels = [("reward_mean", reward_title), ("kl", f"KL to {before} (nats/seq)"),
              (gold_key, gold_title), ("policy_loss", "policy loss"),
              ("value_loss", "value loss"), ("clipfrac", "clip fraction")]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(s, r[key]) for s, r in zip(steps, rows) if key in r and r[key] is not None
               and math.isfinite(r[key])]
        if key == gold_key and gold_before is not None:
            pts = [(0, gold_before)] + pts
            ax.axhline(gold_before, color="grey", linestyle="--", linewidth=1, label=f"{before} (step 0)")
            ax.legend(loc="lower right")
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == gold_key else None)
        else:  # e.g. value loss under a critic-free estimator: say so rather than draw empty axes
            ax.text(0.5, 0.5, "not measured in this run" if key != "value_loss" else "no value model",
                    ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100, format="png")
    plt.close(fig)
