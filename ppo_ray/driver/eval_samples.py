"""What train() does at an evaluation step (every config.eval_every steps and at the end): the
user's evaluate(trainer, step), the eval samples (the first config.eval_samples of
`eval_prompts`, sampled with the current policy at the same seeds every time and scored by the
reward actor: eval_samples.jsonl, eval_reward_mean) and the token attribution of a few of the
step's rollouts and of the samples (attribution.jsonl, ppo_ray.attribution); a multi-turn step's
first episodes, whole transcripts (episodes.jsonl)."""

from __future__ import annotations

import math
from typing import Sequence

from ppo_ray.attribution import RolloutAttribution, pick_rows, sa_pairs
from ppo_ray.driver.roles import EVAL_SEED_STEP
from ppo_ray.driver.runlog import RunLog
from ppo_ray.stats import StepResult


def evaluate_step(trainer, result: StepResult, evaluate, eval_prompts, runlog: RunLog) -> None:
    """The user's evaluate(trainer, step), the eval samples and the attribution, merged into
    `result` (StepResult.extra) and written through `runlog`."""
    if evaluate:
        result.extra.update(evaluate(trainer, result.step))
    samples = list(eval_prompts or [])[: trainer.config.eval_samples]
    shown = trainer.config.attribution_rows if trainer.run_dir is not None else 0
    held: list[RolloutAttribution] = []
    if samples:
        rows, held = eval_samples(trainer, samples, result.step, pick_rows(len(samples), shown))
        finite = [r["reward"] for r in rows if math.isfinite(r["reward"])]
        result.extra["eval_reward_mean"] = sum(finite) / len(finite) if finite else math.nan
        runlog.samples(result.step, rows)
    if result.transcripts:  # a multi-turn step: its first episodes, whole
        runlog.episodes(result, trainer.config.eval_samples)
    if shown:  # the step's rollouts and the held-out samples, per token
        runlog.attribution((trainer.attribution(pick_rows(trainer.config.batch_size, shown), result.step) or []) + held)


def eval_samples(trainer, prompts: list[str] | list[dict], step: int,
                 attribute: Sequence[int] = ()) -> tuple[list[dict], list[RolloutAttribution]]:
    """The current policy's responses to `prompts` (strings or rows: their columns go to the
    reward functions), scored by the reward actor. The same sampling seeds at every
    evaluation (common random numbers across steps). With them, the responses `attribute`
    per token (their logprobs and KL_t: held-out samples have no advantage). With an environment
    each sample also has its transcript ([role, text] segments, "model" | "env"), turns and tool
    calls."""
    rows = trainer.feed.rows(prompts)
    out = trainer.generate(rows, seed_step=EVAL_SEED_STEP, score=True, attribute=attribute)
    held = [] if out.held_out is None else sa_pairs(out.held_out, trainer.tokenizer.decode, step)
    for h in held:
        h.score = out.rewards[h.row]
    samples = [{"step": step, "prompt": p, "response": t, "reward": r, "finish_reason": f}
               for p, t, r, f in zip(rows.texts, out.texts, out.rewards, out.finish_reasons)]
    for sample, episode in zip(samples, out.episodes or ()):  # multi-turn: the transcript, turns marked
        sample.update(transcript=[list(seg) for seg in episode.segments], turns=episode.turns,
                      tool_calls=episode.tool_calls)
    return samples, held
