"""Reward scorer: a reward model and/or reward functions, combined with weights.

Plain class, no Ray: ppo_ray.driver.hosts hosts it in a Ray actor.

- A reward model is an AutoModelForSequenceClassification with num_labels=1; its score is
  read at the last real token of prompt + response (the EOS when the response has one,
  never a pad: trl #3750 placed rewards on the pad after EOS). A causal LM (or any
  checkpoint without trained `score` weights) is refused, not loaded with a random head:
  its "rewards" would be noise and PPO would train on them without a sign of trouble
  (ppo_ray.rewards.check_reward_sources reads config.json before any actor starts, and
  again here; load_reward_model checks the weights).
- A reward function is named "package.module:function" and called as
  fn(prompts: list[str], completions: list[str], **columns) -> list[float]
  (ppo_ray.rewards.call_reward_fn): `columns` are the batch's per-row lists (reward_columns:
  finish_reasons, and the dataset's columns that came with the score call, each row its
  prompt's value, found by the batch's group ids), each passed only to a function whose
  signature names it (or has **kwargs), on every path below alike.
- Scores are summed with weights (reward model first, then functions, in config order); a
  multi-turn episode's environment reward (RolloutBatch.env_rewards) is added unweighted.
- missing_eos_penalty (N+ / TRL): a response cut at max_new_tokens without EOS gets that
  score instead of the model's.
- overlong_buffer (DAPO's soft overlong punishment): a response longer than
  max_new_tokens - overlong_buffer tokens gets a penalty added, linear to -overlong_penalty at
  max_new_tokens; its mean is the source "overlong_penalty".
- A non-finite score is an error naming the source and the prompt index, or, with
  nonfinite="drop", the sample's score becomes NaN, which the learner masks out and counts.
  A dropped row stays NaN whatever missing_eos_penalty and overlong_buffer would give it.

Guarded calls (guarded_scores), used with reward workers (`runner`: a RewardWorkerPool,
ppo_ray.driver.reward_pool: Ray actors, each call under reward_timeout_s, a worker past it killed and
replaced), with an HTTP verifier among reward_funcs, or with a failure policy other than
"error": the batch is cut into chunks (function_chunks), all of a round's calls run at once,
and a call that raises or times out is handled by `failure`:
- "error": a RewardError naming the function, the call's rows and what happened;
- "score" / "drop": the failed chunk is bisected (its halves called again, down to single
  rows), so only the rows that fail on their own get failure_score / NaN (dropped, counted);
  at most retry_calls extra calls per function and batch, after which a failed chunk's rows
  get the policy as they are.
Without any of the three, reward functions run as they always did: one call each on the whole
batch, in this process, with no time limit of their own (a Python function cannot be stopped
in-thread): a hung one is cut by the driver's deadline on the score call (ppo_ray.deadlines).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

from ppo_ray.batch import RolloutBatch
from ppo_ray.config import REWARD, ConfigSlice, PPOConfig, role_fields
from ppo_ray.data import PromptColumns
from ppo_ray.modeling import load_reward_model, pick_device, reward_scores
from ppo_ray.rewards import (CallResult, RewardCall, RewardError, RewardFn, RewardWorker, call_reward_fn,
                             check_reward_sources, check_values, guarded_calls, is_verifier_spec)
from ppo_ray.stats import RewardFailures, RewardStats

FAILURE_POLICIES = ("error", "score", "drop")  # reward_failure


class Runner(Protocol):
    """Where guarded calls run: RewardWorkerPool (Ray workers) or InlineRunner (this process)."""

    size: int  # calls it runs at once (function_chunks' rule)

    def run(self, calls: list[RewardCall]) -> list[CallResult]:
        """Each call's result, in order; waits for all."""
        ...


class InlineRunner:
    """Guarded calls in the reward actor's own process: a Python function in this thread (no
    time limit: it cannot be stopped here), a verifier's requests `concurrency` at a time in
    threads (each verifier call has its own deadline, reward_timeout_s)."""

    def __init__(self, worker: RewardWorker, concurrency: int = 1):
        self.worker, self.size = worker, concurrency

    def run(self, calls: list[RewardCall]) -> list[CallResult]:
        if self.size > 1 and len(calls) > 1 and all(is_verifier_spec(call.spec) for call in calls):
            with ThreadPoolExecutor(self.size) as pool:
                return list(pool.map(self.worker.call, calls))
        return [self.worker.call(call) for call in calls]


def row_ranges(rows: Sequence[int]) -> str:
    """Sorted row indices as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    out, rows = [], sorted(rows)
    start = prev = rows[0] if rows else None
    for r in [*rows[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    return ", ".join(out)


def reward_columns(batch: RolloutBatch, columns: Optional[PromptColumns] = None) -> dict[str, list]:
    """The per-row columns a reward function may take beside prompts and completions (by naming
    them in its signature, or with **kwargs: ppo_ray.rewards.call_reward_fn), the one home of
    what they are: finish_reasons, "stop" where the response ended with EOS (RolloutBatch.has_eos,
    the fact missing_eos_penalty reads; the generator's finish reason "stop"), "length" where it
    was cut at max_new_tokens; then the dataset's `columns` of the batch's prompts, each row its
    prompt's value by its group id (PromptColumns.rows: a prompt's samples share it). Their
    names never meet: ppo_ray.data.RESERVED_COLUMNS keeps finish_reasons out of a dataset's."""
    out = {"finish_reasons": ["stop" if eos else "length" for eos in batch.has_eos.tolist()]}
    if columns is not None and columns.values:
        if batch.groups is None:
            raise ValueError("dataset columns reach a batch's rows by its group ids, and this batch has none")
        out.update(columns.rows(batch.groups.tolist()))
    return out


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), (B,) float32 from (B,) response
    lengths in tokens: 0 up to max_new_tokens - buffer, then -(length - (max_new_tokens -
    buffer)) / buffer * factor, -factor at max_new_tokens (verl's overlong_reward in
    verl/workers/reward_manager/dapo.py: min(-exceed_len / buffer_len * penalty_factor, 0))."""
    exceed = lengths.float() - (max_new_tokens - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


class RewardScorer:
    # The config fields from_config reads (and log_level, scorer_torch_threads: its actor
    # host's): the reward actor gets only these (PPOConfig.slice).
    CONFIG_FIELDS = role_fields(REWARD)

    def __init__(self, reward_model_name: Optional[str] = None, reward_funcs: Sequence[str] = (),
                 weights: Sequence[float] = (), *, missing_eos_penalty: Optional[float] = None,
                 nonfinite: str = "error", dtype: str = "float32", micro_batch_size: int = 8,
                 device: Optional[str] = None, max_new_tokens: int = 0, overlong_buffer: int = 0,
                 overlong_penalty: float = 1.0, runner: Optional[Runner] = None, chunk_size: int = 0,
                 failure: str = "error", failure_score: float = 0.0, retry_calls: int = 16,
                 timeout_s: float = 60.0, verifier_batch_size: int = 0, verifier_concurrency: int = 1,
                 verifier_retries: int = 2, verifier_backoff_s: float = 0.5, verifier_proxy: Optional[str] = None,
                 environment: Optional[str] = None):
        verifier = dict(timeout_s=timeout_s, retries=verifier_retries, backoff_s=verifier_backoff_s,
                        batch_size=verifier_batch_size, proxy=verifier_proxy)
        self.funcs = check_reward_sources(reward_model_name, reward_funcs, weights, environment=environment, **verifier)
        if failure not in FAILURE_POLICIES:
            raise ValueError(f"reward_failure {failure!r} must be one of {list(FAILURE_POLICIES)}")
        if failure == "drop" and nonfinite != "drop":
            raise ValueError("reward_failure drop needs nonfinite_reward drop: a dropped row's score is NaN, which "
                             "the learner masks out only then")
        self.runner, self.chunk_size, self.retry_calls = runner, chunk_size, retry_calls
        self.failure, self.failure_score = failure, failure_score
        self.verifier_batch_size = verifier_batch_size
        self.guarded = guarded_calls(runner.size if runner is not None else 0, failure, list(reward_funcs))
        self.inline = InlineRunner(RewardWorker([s for s, _ in self.funcs], **verifier), verifier_concurrency) \
            if self.guarded else None
        self.device = pick_device(device)  # the GPU Ray gave this actor (scorer_num_gpus), else the CPU
        self.model = load_reward_model(reward_model_name, dtype).to(self.device) if reward_model_name else None
        self.weights = list(weights) if weights else [1.0] * (len(self.funcs) + (self.model is not None))
        self.missing_eos_penalty = missing_eos_penalty
        if overlong_buffer and not 0 < overlong_buffer < max_new_tokens:
            raise ValueError(f"overlong_buffer {overlong_buffer} must be in (0, max_new_tokens={max_new_tokens})")
        self.max_new_tokens, self.overlong_buffer, self.overlong_penalty = max_new_tokens, overlong_buffer, overlong_penalty
        self.nonfinite = nonfinite
        self.micro_batch_size = micro_batch_size

    @classmethod
    def from_config(cls, cfg: PPOConfig | ConfigSlice, reward_model_dir: Optional[str],
                    device: Optional[str] = None, runner: Optional[Runner] = None) -> "RewardScorer":
        """The reward scorer of `reward_model_dir` (the resolved reward_model_name, None for
        functions only) and cfg's reward functions, as `cfg` sets it up; `runner`: the reward
        workers (reward_workers > 0), made by its actor host."""
        return cls(reward_model_dir, cfg.reward_funcs, cfg.reward_weights, missing_eos_penalty=cfg.missing_eos_penalty,
                   nonfinite=cfg.nonfinite_reward, dtype=cfg.dtype, micro_batch_size=cfg.micro_batch_size,
                   device=device, max_new_tokens=cfg.max_new_tokens, overlong_buffer=cfg.overlong_buffer,
                   overlong_penalty=cfg.overlong_penalty, runner=runner, chunk_size=cfg.reward_chunk_size,
                   failure=cfg.reward_failure, failure_score=cfg.reward_failure_score,
                   retry_calls=cfg.reward_retry_calls, timeout_s=cfg.reward_timeout_s,
                   verifier_batch_size=cfg.reward_verifier_batch_size,
                   verifier_concurrency=cfg.reward_verifier_concurrency, verifier_retries=cfg.reward_verifier_retries,
                   verifier_backoff_s=cfg.reward_verifier_backoff_s, verifier_proxy=cfg.reward_verifier_proxy,
                   environment=cfg.environment)

    def model_scores(self, batch: RolloutBatch) -> Tensor:
        """(B,) float32 reward-model scores at the last real token."""
        return reward_scores(self.model, batch, self.micro_batch_size, self.device)

    def function_scores(self, spec: str, fn: RewardFn, batch: RolloutBatch, columns: dict[str, list]) -> Tensor:
        """The unguarded call: fn on the whole batch, here, its failure a RewardError (`columns`:
        the batch's, reward_columns)."""
        try:
            values = call_reward_fn(fn, batch.prompts, batch.responses, columns)
        except Exception as e:  # a user function: report which one and what it raised
            raise RewardError(f"reward function {spec!r} raised {type(e).__name__}: {e}") from e
        return torch.tensor(check_values(spec, values, len(batch)), dtype=torch.float32)

    def function_chunks(self, spec: str, n: int) -> list[list[int]]:
        """The rows of each first-round call of `spec` on n rows. A Python function: chunks of
        chunk_size rows (reward_chunk_size), or with 0 the rows split evenly over the runner's
        calls at once (reward_workers; 1 in this process): ceil(n / workers) rows a call, one
        call per worker. A verifier: requests of reward_verifier_batch_size rows (0: one)."""
        if is_verifier_spec(spec):
            size = self.verifier_batch_size or n
        else:
            size = self.chunk_size or -(-n // max(self.runner.size if self.runner is not None else 1, 1))
        size = max(size, 1)
        return [list(range(s, min(s + size, n))) for s in range(0, n, size)]

    def run_calls(self, calls: list[tuple[str, list[int]]], prompts: list[str], completions: list[str],
                  columns: dict[str, list]) -> list[CallResult]:
        """One round of guarded calls, (spec, rows) each: Python functions on the workers (when
        there are), verifiers and the rest here (InlineRunner)."""
        texts = [RewardCall(spec, [prompts[r] for r in rows], [completions[r] for r in rows],
                            {name: [values[r] for r in rows] for name, values in columns.items()})
                 for spec, rows in calls]
        remote = [self.runner is not None and not is_verifier_spec(spec) for spec, _ in calls]
        out: list[Optional[CallResult]] = [None] * len(calls)
        for runner, picked in ((self.runner, True), (self.inline, False)):
            idx = [i for i, r in enumerate(remote) if r == picked]
            if idx:
                for i, result in zip(idx, runner.run([texts[i] for i in idx])):
                    out[i] = result
        return out  # type: ignore[return-value]

    def guarded_scores(self, batch: RolloutBatch, columns: dict[str, list]) -> tuple[list[tuple[str, Tensor]],
                                                                                  RewardFailures]:
        """Every reward function's (B,) scores by guarded calls (the module docstring), and the
        counts of what failed and how it was handled (`columns`: the batch's, reward_columns;
        each call gets its rows' values)."""
        n, prompts, completions = len(batch), list(batch.prompts), list(batch.responses)
        values = {spec: [math.nan] * n for spec, _ in self.funcs}
        failed: dict[str, list[int]] = {spec: [] for spec, _ in self.funcs}
        budget = {spec: self.retry_calls for spec, _ in self.funcs}
        counts: Counter = Counter()
        pending = [(spec, rows) for spec, _ in self.funcs for rows in self.function_chunks(spec, n)]
        first = True
        while pending:
            results = self.run_calls(pending, prompts, completions, columns)
            if not first:
                counts["retry_calls"] += len(pending)
            first, retry = False, []
            for (spec, rows), result in zip(pending, results):
                if result.values is not None:
                    for r, v in zip(rows, result.values):
                        values[spec][r] = v
                    counts["nonfinite"] += sum(not math.isfinite(v) for v in result.values)
                    continue
                counts[result.failure] += 1
                if self.failure == "error":
                    raise RewardError(f"reward function {spec!r} failed on rows {row_ranges(rows)} of {n}: "
                                      f"{result.message} (reward_failure: error; score or drop keep the step)")
                if len(rows) > 1 and budget[spec] >= 2:  # bisect: only the rows that fail alone get the policy
                    budget[spec] -= 2
                    half = len(rows) // 2
                    retry += [(spec, rows[:half]), (spec, rows[half:])]
                else:
                    failed[spec] += rows
            pending = retry
        fill = self.failure_score if self.failure == "score" else math.nan
        for spec, rows in failed.items():
            for r in rows:
                values[spec][r] = fill
        bad = sum(len(rows) for rows in failed.values())
        failures = RewardFailures(timeouts=float(counts["timeout"]), exceptions=float(counts["exception"]),
                                  nonfinite=float(counts["nonfinite"]),
                                  rows_dropped=float(bad if self.failure == "drop" else 0),
                                  rows_fixed_score=float(bad if self.failure == "score" else 0),
                                  retry_calls=float(counts["retry_calls"]))
        return [(spec, torch.tensor(values[spec], dtype=torch.float32)) for spec, _ in self.funcs], failures

    def score(self, batch: RolloutBatch, columns: Optional[PromptColumns] = None) -> tuple[Tensor, RewardStats]:
        """(B,) float32 combined scores, and small stats (per-source means, drops, seconds;
        with guarded calls, their failures). `columns`: the dataset's columns of the batch's
        prompts, for the reward functions that take them (the reward model reads none)."""
        t0 = time.perf_counter()
        sources: list[tuple[str, Tensor]] = []
        if self.model is not None:
            sources.append(("reward_model", self.model_scores(batch)))
        failures = None
        if self.funcs:
            per_row = reward_columns(batch, columns)
            if self.guarded:
                guarded, failures = self.guarded_scores(batch, per_row)
                sources += guarded
            else:
                sources += [(spec, self.function_scores(spec, fn, batch, per_row)) for spec, fn in self.funcs]

        total = torch.zeros(len(batch))
        means: dict[str, float] = {}
        if batch.env_rewards is not None:
            # a multi-turn episode's environment reward (the sum of its steps'; NaN: a failed episode
            # dropped by reward_failure drop), unweighted, with the weighted sources on top
            env = batch.env_rewards.to(total.dtype)
            total = total + env
            finite = env[torch.isfinite(env)]
            means["environment"] = float(finite.mean()) if len(finite) else math.nan
        for (name, values), w in zip(sources, self.weights):
            bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
            if bad and self.nonfinite == "error":
                raise RewardError(f"reward source {name!r} gave non-finite score {values[bad[0]].item()} "
                                  f"for prompt index {bad[0]} ({len(bad)} non-finite in all)")
            total = total + w * values
            finite = values[torch.isfinite(values)]
            means[name] = float(finite.mean()) if len(finite) else math.nan
        # A row without a finite score (nonfinite_reward or reward_failure: drop) is dropped, and
        # stays dropped: the penalties below shape a score, and it has none (the learner masks
        # NaN rows out; a penalty in its place would train on a row counted as dropped).
        dropped_rows = ~torch.isfinite(total)  # (B,) bool
        if self.missing_eos_penalty is not None:
            total = torch.where(batch.has_eos, total, torch.full_like(total, self.missing_eos_penalty))
        if self.overlong_buffer:
            penalty = overlong_penalty(batch.response_lengths, self.max_new_tokens, self.overlong_buffer,
                                       self.overlong_penalty)
            total = total + penalty
            means["overlong_penalty"] = float(penalty.mean())
        total = torch.where(dropped_rows, torch.full_like(total, math.nan), total)
        return total, RewardStats(means, float(dropped_rows.sum()), seconds=time.perf_counter() - t0,
                                  failures=failures)
