"""How a policy is evaluated on held-out prompts, in one place: the PPO stage
(ppo_ray.tasks.pipeline) evaluates the SFT policy before training and the trained policy after
with these functions, and `launch.py eval` (ppo_ray.tasks.evaluate) evaluates a finished run's
checkpoint with the same ones: the same sampling seeds (trainer.generate's fixed seed step,
each prompt's seed from its index: common random numbers), the same judge, the same numbers
under the same keys as report.json.

Per task, a policy's evaluation is a dict of per-prompt lists (JSON, as eval-before-ppo.json
keeps the SFT policy's) and the report's numbers are computed from two of them:
- tldr (the bundled task): `judge` -> texts, stops (ended with EOS), gold (the gold judge's
  score; the judge only scores, it is never a training signal); `tldr_numbers`: gold means and
  win rates (ties half), against SFT and the reference summaries, and fact-copy accuracy.
- arith (the verifiable task): `solve` -> greedy completions and eval_k samples at the
  training temperature, right or not by the verifier's rule (the row's answer, then EOS); `arith_numbers`: pass@1 (greedy),
  pass@k (Chen et al.'s unbiased estimator), the samples' accuracy.
- any run: `sample` -> texts and finish reasons (real data has no judge), with the run's
  reward (its reward model's score) when asked.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

log = logging.getLogger(__name__)

EVAL_CHUNK = 512  # prompts per generate call of an evaluation (a log line each when labelled)


def generate(trainer, prompts: Sequence[str] | Sequence[dict], *, label: Optional[str] = None,
             samples_per_prompt: int = 1, greedy: bool = False, score: bool = False):
    """trainer.generate on `prompts` (its fixed evaluation seeds), in chunks of EVAL_CHUNK
    prompts: each prompt's seed follows its global index (index_offset), so the chunks give
    the samples of one call. `prompts`: texts, or rows keyed "prompt" whose other columns go
    to the reward functions that take them when scored (as in training). With a `label`, one
    log line per chunk (progress on long evaluations). Returns one ppo_ray.stats.Responses (with
    an environment, each response's episode too)."""
    from ppo_ray.data import prompt_rows
    from ppo_ray.stats import Responses

    prompts = prompt_rows(prompts, "prompt", "the evaluation's prompts")
    texts: list[str] = []
    reasons: list[str] = []
    rewards: list[float] = []
    episodes: list = []  # a multi-turn task's (config.environment)
    version = None
    t0 = time.perf_counter()
    for start in range(0, len(prompts), EVAL_CHUNK):
        out = trainer.generate(prompts.part(start, start + EVAL_CHUNK), samples_per_prompt=samples_per_prompt,
                               greedy=greedy, score=score, index_offset=start)
        texts += out.texts
        reasons += out.finish_reasons
        rewards += out.rewards or []
        episodes += out.episodes or []
        version = out.version
        if label:
            done = min(start + EVAL_CHUNK, len(prompts))
            log.info("%s: %d/%d prompts (%s), %.1f s", label, done, len(prompts),
                     "greedy" if greedy else f"{samples_per_prompt} sample{'s' * (samples_per_prompt > 1)} each",
                     time.perf_counter() - t0)
    return Responses(texts, reasons, version, rewards if score else None, episodes=episodes or None)


def prompts_of(rows: Sequence[dict]) -> list[str]:
    return [row["prompt"] for row in rows]


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


# ----------------------------------------------------------------------------- any run
def sample(trainer, prompts: Sequence[str] | Sequence[dict], *, label: Optional[str] = None,
           score: bool = False) -> dict:
    """One sample per prompt (texts or rows, as generate takes them): texts, finish_reasons,
    version (what run_ppo_real's SFT evaluation keeps), and with `score` the run's reward per
    sample (`reward`: the reward actor's score, as training sees it: a reward model's
    missing-EOS penalty included; the rows' columns passed)."""
    out = generate(trainer, prompts, label=label, score=score)
    res = {"texts": out.texts, "finish_reasons": out.finish_reasons, "version": out.version}
    if score:
        res["reward"] = out.rewards
    return res


def reward_numbers(tag: str, after: dict, before: Optional[dict] = None, who: str = "ppo") -> dict:
    """reward_<tag>_sft / _<who>: the mean reward of each policy's samples, and the paired
    difference (same prompts, same seeds)."""
    out = {}
    if before is not None:
        out[f"reward_{tag}_sft"] = mean(before["reward"])
    out[f"reward_{tag}_{who}"] = mean(after["reward"])
    if before is not None:
        out[f"reward_{tag}_{who}_minus_sft"] = out[f"reward_{tag}_{who}"] - out[f"reward_{tag}_sft"]
    return out


# ----------------------------------------------------------------------------- tldr (gold judge)
def judge(trainer, rows: Sequence[dict], *, label: Optional[str] = None, gold: bool = True,
          score: bool = False) -> dict:
    """One sample per prompt (texts, stops: ended with EOS) and, with `gold`, the gold
    judge's score of each (the rows need the task's `facts`); with `score`, the run's reward
    of each (`reward`)."""
    from ppo_ray.tasks.tldr_synth import gold_score

    out = generate(trainer, rows, label=label, score=score)
    stops = [reason == "stop" for reason in out.finish_reasons]
    res = {"texts": out.texts, "stops": stops}
    if gold:
        res["gold"] = [gold_score(row, text, stop) for row, text, stop in zip(rows, out.texts, stops)]
    if score:
        res["reward"] = out.rewards
    return res


def tldr_numbers(tag: str, rows: Sequence[dict], after: dict, before: Optional[dict] = None, *,
                 reference: bool = True, copy: bool = True) -> dict:
    """The gold numbers of split `tag` ("test", "val", ...), keys as in report.json: gold_<tag>_sft,
    gold_<tag>_ppo, win_rate[_<tag>]_ppo_vs_sft (the test split's keys carry no tag), and with
    `reference` each policy against the rows' reference summaries (the `summary` column, by the
    same judge: the N+ paper's metric), with `copy` the samples' fact-copy accuracy
    (tldr_synth.copy_accuracy)."""
    from ppo_ray.tasks.tldr_synth import copy_accuracy, gold_score, win_rate

    def win(a: str, b: str) -> str:
        return f"win_rate_{'' if tag == 'test' else tag + '_'}{a}_vs_{b}"

    out: dict = {}
    if before is not None:
        out[f"gold_{tag}_sft"] = mean(before["gold"])
    out[f"gold_{tag}_ppo"] = mean(after["gold"])
    ref = [gold_score(row, row["summary"], True) for row in rows] if reference else None
    if ref is not None:
        out[f"gold_{tag}_reference"] = mean(ref)
    if before is not None:
        out[win("ppo", "sft")] = win_rate(after["gold"], before["gold"])
    if ref is not None:
        if before is not None:
            out[win("sft", "reference")] = win_rate(before["gold"], ref)
        out[win("ppo", "reference")] = win_rate(after["gold"], ref)
    if copy:
        if before is not None:
            out[f"copy_{tag}_sft"] = copy_accuracy(rows, before["texts"])
        out[f"copy_{tag}_ppo"] = copy_accuracy(rows, after["texts"])
    return out


# ----------------------------------------------------------------------------- arith (verifier)
def solve(trainer, rows: Sequence[dict], k: int, *, sampled: bool = True, label: Optional[str] = None,
          rule=None) -> dict:
    """Greedy completions (pass@1) and, with `sampled`, k samples per prompt at the training
    temperature (pass@k), each right or not by the task's verifier's rule (`rule`; default
    arith.is_right: the sum, then EOS) against the row's `answer` (the prompt's sum where a row
    has none), with their finish reasons (greedy_finish, samples_finish)."""
    from ppo_ray.tasks.arith import is_right as exact

    is_right = rule or exact
    prompts = prompts_of(rows)
    answers = [row.get("answer") for row in rows]
    greedy = generate(trainer, prompts, greedy=True, label=label and f"{label}, greedy")
    out = {"greedy": greedy.texts, "greedy_finish": greedy.finish_reasons,
           "greedy_right": [is_right(*row) for row in zip(prompts, greedy.texts, greedy.finish_reasons, answers)]}
    if sampled:
        drawn = generate(trainer, prompts, samples_per_prompt=k, label=label and f"{label}, sampled")
        samples = [drawn.texts[i * k:(i + 1) * k] for i in range(len(prompts))]  # k contiguous per prompt
        finish = [drawn.finish_reasons[i * k:(i + 1) * k] for i in range(len(prompts))]
        right = [sum(is_right(p, t, f, a) for t, f in zip(ss, fs))
                 for p, ss, fs, a in zip(prompts, samples, finish, answers)]
        out.update(samples=samples, samples_finish=finish, right=right)
    return out


def arith_rates(res: dict, k: int) -> dict:
    """pass1 (greedy), pass<k> and sample_accuracy of one policy's `solve`, which must hold k
    samples per problem (ValueError otherwise: an evaluation of another eval_k)."""
    from ppo_ray.tasks.arith import pass_at_k

    out = {"pass1": mean([float(r) for r in res["greedy_right"]])}
    if "samples" in res and any(len(samples) != k for samples in res["samples"]):
        n = sorted({len(samples) for samples in res["samples"]})
        raise ValueError(f"pass@{k} needs {k} samples per problem (eval_k={k}); the evaluation has {n}")
    if "right" in res:
        out[f"pass{k}"] = mean([pass_at_k(k, c, k) for c in res["right"]])
        out["sample_accuracy"] = mean([c / k for c in res["right"]])
    return out


def arith_numbers(tag: str, k: int, after: dict, before: Optional[dict] = None, before_name: str = "sft") -> dict:
    """<rate>_<tag>_sft and <rate>_<tag>_rl, keys as in report.json (SFT's first; `before_name`
    "base" for a task whose starting policy is the base model); the two evaluations must be of
    the same problems (ValueError naming the counts)."""
    if before is not None and len(before["greedy_right"]) != len(after["greedy_right"]):
        raise ValueError(f"the {before_name.upper()} and RL evaluations of split {tag!r} are of "
                         f"{len(before['greedy_right'])} and {len(after['greedy_right'])} problems: paired rates need "
                         "the same problems")
    pairs = ([(before_name, before)] if before is not None else []) + [("rl", after)]
    return {f"{name}_{tag}_{who}": value for who, res in pairs for name, value in arith_rates(res, k).items()}

