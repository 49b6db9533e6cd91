"""PPOTrainer: the driver-side orchestration of one PPO step (seed steps 1-11) on Ray.

    trainer = PPOTrainer(PPOConfig(...))
    out = trainer.ppo_step(prompts)        # one step: generated_texts, rewards, losses, kl, ...
    history = trainer.train(prompts, steps=100)

Prompts are strings, or rows: dicts whose config.prompt_column ("prompt") holds the text and
whose other keys are the dataset's columns (ppo_ray.data.prompt_rows). The driver keeps the
rows; each score call takes its prompts' values of the columns the reward functions take
(ppo_ray.data.PromptColumns, one entry per prompt, found on the reward side by the batch's
group ids), so they reach fn(prompts, completions, **columns) and never the generators or the
learner. A batch's columns follow its drawn prompts, so a retried or resumed step gets the same.

Data between actors travels as ObjectRefs; the driver pulls only small things (texts,
B scores, stats). The generator reports the adapter version it sampled with and the
learner refuses rollouts from any other version, so a lost LoRA sync is an error, never
a silent off-policy step. After every sync, in every mode, the sync check compares what
the generators compute with what the learner computes at the same version (a small fixed
probe: _check_sync); on fresh steps the rollouts' own logprobs are compared too. A gap
beyond logprob_gap_tolerance (on the rollouts under is_correction: a share of tokens outside
the correction's band beyond logprob_gap_outside_tolerance) re-syncs and checks again by
default (logprob_gap_check): nothing is sampled for training from a generator that failed
the check.

Faults: each step has one commit point (_commit), after the learner's update returned its
stats, the new adapter and its state. Until then an actor's death is recovered by retrying
the step from the committed state (the learners restored from the driver's object-store
copy of their state, lost rollouts regenerated identically); after it, only the sync is
redone. Every other call to an actor (the sync check, the evaluations, a checkpoint's state
fetch, a restore; ppo_ray.supervisor.PLACES) goes through the same retry rule: the lost actor
is restarted, brought back to the committed state, and the call redone. No step is lost,
doubled or restarted, and no checkpoint is needed (tests/test_faults.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from learner.algos import varying_groups
from ppo_ray.attribution import RolloutAttribution, pick_rows, sa_pairs
from ppo_ray.batch import RolloutBatch, fresh_enough
from ppo_ray.checkpoint import (CheckpointError, Lineage, branch_from, check_own_lineage, checkpoint_root,
                                config_changes, load_checkpoint, model_fingerprints, resolve_checkpoint, resumed_config,
                                run_ids, save_checkpoint)
from ppo_ray.config import PPOConfig
from ppo_ray.data import (PromptColumns, PromptCursor, PromptRows, check_chat_template, encode_prompts,
                          prompt_rows, prompts_fingerprint)
from ppo_ray.metrics import TrainingMetrics
from ppo_ray.modeling import check_context_length, load_tokenizer
from ppo_ray.paths import resolve_model_path
from ppo_ray.placement import HOSTS, create_roles, init_ray
from ppo_ray.rewards import check_reward_sources, columns_taken, guarded_calls
from ppo_ray.roles import (EVAL_SEED_STEP, EXIT_TIMEOUT_S, RETRYABLE, SAMPLING_SEED_STEP, Generation, Roles, Update,
                           role_names)
from ppo_ray.runlock import RunLock
from ppo_ray.runlog import RunLog, new_run_tag
from ppo_ray.stats import (DynamicSampling, GenerationSummary, LearnerStats, ReferenceStats, Responses, RewardStats,
                           StepResult, StepTiming, SyncReport)
from ppo_ray.supervisor import Supervisor
from ppo_ray.tracking import check_trackers


log = logging.getLogger(__name__)


class StaleAdapterError(RuntimeError):
    """A generator sampled with a LoRA version other than the one the step expects."""


class LogprobGapError(RuntimeError):
    """The generator's logprobs differ from the learner's for the same adapter version beyond
    logprob_gap_tolerance (logprob_gap_check: error, or resync when a re-sync did not mend
    it): the generator holds another policy."""


@dataclass(frozen=True)
class SyncCheck:
    """One sync check (PPOTrainer._check_sync)."""

    gap: float      # largest |generator - learner| probe logprob over the replicas (NaN: check off)
    seconds: float  # re-syncs included


def sync_probe_prompts(tokenizer, seed: int, max_prompt_length: int, n: int = 4, length: int = 16) -> list[list[int]]:
    """The sync check's fixed probe prompts: `n` prompts of `length` ordinary token ids (no
    special tokens) drawn with the run seed. Random tokens share no prefix-cache block with
    real prompts, so the probe neither reads KV that rollouts left nor leaves KV they reuse."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
    rows = torch.randint(len(vocab), (n, min(length, max_prompt_length)), generator=torch.Generator().manual_seed(seed))
    return [[vocab[i] for i in row] for row in rows.tolist()]


@dataclass
class Rollouts:
    """One step's rollouts: what to generate, and (once submitted) the generation in flight.
    A retry reuses it while it is intact and regenerates it, with the same prompts, seeds and
    adapter version, when it is not. Under dynamic_sampling the step's extra generation rounds
    are Rollouts too, kept in its `rounds` as they are drawn, so a retry reuses (or
    regenerates) exactly them and draws no prompt twice."""

    prompt_ids: list[list[int]]
    step: int                                # PPOTrainer.step before the step: the sampling seeds' step index
    version: int                             # the adapter version they are (to be) sampled with
    cursor: Optional[tuple] = None           # the prompt cursor before this batch was drawn
    generation: Optional[Generation] = None  # the replicas' ObjectRefs once submitted
    # the global index of its first prompt (the sampling seeds' and group ids' index): dynamic
    # sampling's round r starts at r * prompts_per_step, so no two rounds share a seed
    index_offset: int = 0
    # the dataset columns of its prompts that the reward functions take (first = index_offset),
    # sent with its score call; None: none
    columns: Optional[PromptColumns] = None
    rounds: list["Rollouts"] = field(default_factory=list)  # dynamic_sampling: the extra rounds, in order
    # dynamic_sampling under max_staleness >= 1: the rest of the batch's window, the indices in
    # train()'s prompt list of the prompts its extra rounds take in order (_draw); empty in the
    # synchronous step (they come from the cursor)
    window: list[int] = field(default_factory=list)
    # dynamic_sampling: (scores (B,), RewardStats) once fetched; a retry filters and trains on these
    scored: Optional[tuple] = None

    def batches(self) -> list["Rollouts"]:
        """This batch and its extra rounds, in generation order."""
        return [self, *self.rounds]

    def forget(self) -> None:
        """Sample every round again (a re-sync: what the generators sampled is not to be used)."""
        for rollouts in self.batches():
            rollouts.generation, rollouts.scored = None, None


@dataclass
class _Picked:
    """dynamic_sampling's outcome (PPOTrainer._dynamic_sampling): the batch the step trains on
    and what the driver reports of it."""

    batch: object                              # ObjectRef of the selected RolloutBatch
    scores: object                             # ObjectRef of its (B,) scores: the ones the filter saw
    score_list: list[float]
    generated_scores: list[float]              # every round's scores: all the policy generated
    reward_stats: RewardStats                  # every round's score calls, joined
    generated: GenerationSummary               # the selected rows; seconds of every round's generation
    generated_tokens: int                      # response tokens of every round
    summaries: list[GenerationSummary]         # every round's replicas (the stale-version check)
    info: DynamicSampling


@dataclass
class _Uncommitted:
    """Everything a step produced before its commit point."""

    rollouts: Rollouts
    generated: GenerationSummary  # the replicas' summaries, joined
    stats: LearnerStats
    update: Update      # its weights and state: ObjectRefs of the new LoRA and the learner's state
    scores: list[float]
    reward_stats: RewardStats
    reference_stats: ReferenceStats
    t_start: float
    t_update_done: float
    queue_depth: int  # batches in flight beyond this one while the learner trained
    generated_tokens: int  # response tokens of every rollout generated (dynamic_sampling: every round's)
    dynamic: Optional[DynamicSampling] = None
    generated_scores: Optional[list[float]] = None  # dynamic_sampling: every round's scores


class PPOTrainer:
    # The Ray actor class of each role kind (ppo_ray.placement.HOSTS); a subclass may name
    # subclasses of them.
    hosts: Mapping[str, type] = HOSTS

    def __init__(self, config: PPOConfig, *, run_dir: str | Path | None = None):
        self.config = config
        # Everything that can fail cheaply fails before any actor starts.
        # the reward sources (RewardError naming one): its config.json refuses a causal LM here
        reward_fns = check_reward_sources(config.reward_model_name, config.reward_funcs, config.reward_weights,
                                          proxy=config.reward_verifier_proxy)
        self._reward_fns = [fn for _, fn in reward_fns]  # which dataset columns to send (_columns)
        self.model_dir = resolve_model_path(config.model_name)
        self.ref_model_dir = resolve_model_path(config.ref_model_name or config.model_name)
        self.reward_model_dir = resolve_model_path(config.reward_model_name) if config.reward_model_name else None
        self.value_model_dir = resolve_model_path(config.value_model_name) if config.value_model_name else None
        self.tokenizer = load_tokenizer(self.model_dir)
        if config.apply_chat_template:
            check_chat_template(self.tokenizer, config.model_name)
        # before any actor: the vLLM engine would refuse a max_model_len over the model's window
        check_context_length(config.max_prompt_length, config.max_new_tokens, {
            "model_name": self.model_dir, "ref_model_name": self.ref_model_dir,
            "reward_model_name": self.reward_model_dir, "value_model_name": self.value_model_dir})
        check_trackers(config.report_to if run_dir else ())
        self.run_dir = Path(run_dir) if run_dir else None
        # One writer per run directory (ppo_ray.runlock; re-entrant: launch.py holds it already),
        # released by shutdown(). What the run's models hold, for its checkpoints: a resume
        # onto models re-trained since is refused (ppo_ray.checkpoint.check_fingerprints).
        self._lock = RunLock.acquire(self.run_dir) if self.run_dir is not None else None
        try:
            self._start(config)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise

    def _start(self, config: PPOConfig) -> None:
        """Ray, the actors and the committed state of a new trainer."""
        self.fingerprints = model_fingerprints(config) if self.run_dir is not None else {}
        self._abandoned: Optional[Path] = None  # where restore() moved an abandoned branch's checkpoints
        init_ray(log_level=config.log_level, metrics_report_interval_ms=config.metrics_report_interval_ms)
        # The run tag: Ray namespace of the actors and the `run` label of every Prometheus series.
        self.namespace = new_run_tag()
        # Prometheus gauges and counters (those at 0 for each role and the sync mode), tagged run=namespace
        self.metrics = TrainingMetrics(run=self.namespace, roles=role_names(config.num_generators, config.num_learners),
                                       lora_sync=config.lora_sync_mode,
                                       reward_failures=guarded_calls(config.reward_workers, config.reward_failure,
                                                                     config.reward_funcs))
        log.info("run tag %s (actors %s/<role>, their Ray namespace, Prometheus label run=\"%s\")",
                 self.namespace, self.namespace, self.namespace)
        self.roles: Roles = create_roles(
            config, model_dir=self.model_dir, ref_model_dir=self.ref_model_dir,
            reward_model_dir=self.reward_model_dir, value_model_dir=self.value_model_dir,
            namespace=self.namespace, hosts=self.hosts)
        self.supervisor = Supervisor(self.roles, self.metrics, config.max_step_retries)
        # The committed state: steps done, the adapter version every generator holds, and the
        # driver's copy of the learner's state (ObjectRefs in the object store, never pulled
        # here): a learner that dies is restored from it, checkpoint or not.
        self.step = 0
        self.version, weights_ref, self._learner_state = self.supervisor.run(
            lambda _: self._first_state(), where="start", step=0, recover=self.roles.wait_for_actors)
        # LoRA weights of the committed version and of those that batches in flight were sampled
        # with (max_staleness of them)
        self._weights = {self.version: weights_ref}
        self.cursor = PromptCursor(config.seed)
        self._prompts_key: Optional[str] = None  # fingerprint of the list the cursor indexes
        self._prompt_ids: tuple[Optional[str], list[list[int]]] = (None, [])  # (fingerprint, its prompts encoded once)
        self._prompt_columns: Optional[PromptColumns] = None  # the list's dataset columns the reward functions take
        self._cursor_from_checkpoint = False
        # max_staleness >= 1: the next steps' batches, drawn and generating (step order), and the
        # step train() runs to (no batch is drawn for a step past it)
        self._inflight: deque[Rollouts] = deque()
        self._target: Optional[int] = None
        self._resyncs = 0  # re-syncs during the current step (StepResult.sync_resyncs)
        self._probe_ids = sync_probe_prompts(self.tokenizer, config.seed, config.max_prompt_length)
        self._last_checkpoint = time.monotonic()
        # this run's history: a fresh run id, until restore() continues a checkpoint's
        self.lineage = Lineage.fresh()
        # the step where the learning-rate schedule ends: config.steps, unless the run is
        # extended (a resume with more steps, train() past it: _plan_steps)
        self.planned_steps = config.steps

    def _first_state(self) -> tuple:
        """(version, ref of the LoRA weights, ref of the state) of the learner as it starts. The
        state is asked for first: the learner runs its calls in order, so once the version has
        come back the state exists (a learner that dies in between fails both calls)."""
        state = self.roles.learner_state()
        version, weights = self.roles.current_weights()
        return version, weights, state

    @property
    def retries(self) -> list[dict]:
        """{"step", "role", "where"} of every actor failure survived."""
        return self.supervisor.retries

    # ------------------------------------------------------------------ one step
    def ppo_step(self, prompts: Sequence[str] | Sequence[dict]) -> StepResult:
        """One PPO step on `prompts` (config.samples_per_prompt rollouts each, contiguous: the
        step trains on len(prompts) * samples_per_prompt rollouts): strings, or rows whose other
        columns reach the reward functions (the module docstring). Returns a StepResult: texts,
        scores, the learner's losses and diagnostics, per-phase seconds (`result["policy_loss"]`
        works too). A step whose actor dies is retried from the last committed step."""
        rows = self._rows(prompts)
        current = Rollouts(self._encode(rows.texts), step=self.step, version=self.version, columns=self._columns(rows))
        return self._run_step(current)

    def _rows(self, prompts) -> PromptRows:
        """Prompts as texts and columns (strings, or rows keyed by config.prompt_column)."""
        return prompt_rows(prompts, self.config.prompt_column)

    def _columns(self, rows: PromptRows, first: int = 0) -> Optional[PromptColumns]:
        """The columns of `rows` that some reward function takes (its signature names them, or
        it has **kwargs: ppo_ray.rewards.columns_taken, the rule the reward side applies to each
        function), the first row for group id `first`; None when none does (a reward model
        alone reads none): the score call then carries nothing more than before."""
        taken = {name for fn in self._reward_fns for name in columns_taken(fn, list(rows.columns))}
        values = {name: v for name, v in rows.columns.items() if name in taken}
        return PromptColumns(values, first) if values else None

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        cfg = self.config
        return encode_prompts(self.tokenizer, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation,
                              chat_template=cfg.apply_chat_template)

    def _drawn(self, indices: Sequence[int], first: int = 0) -> tuple[list[list[int]], Optional[PromptColumns]]:
        """The encoded prompts of train()'s list at `indices` and their columns (the first for
        group id `first`): a drawn batch's, so a batch drawn again gets the same."""
        ids = self._prompt_ids[1]
        columns = self._prompt_columns.take(indices, first) if self._prompt_columns is not None else None
        return [ids[i] for i in indices], columns

    def _submit(self, rollouts: Rollouts) -> Rollouts:
        """1-2. Generate on every replica, not waited for. Each replica must hold
        rollouts.version (else StateLostError)."""
        rollouts.generation = self.roles.generate(rollouts.prompt_ids, rollouts.step, rollouts.version,
                                                  samples_per_prompt=self.config.samples_per_prompt,
                                                  segment_versions=self._segments(rollouts),
                                                  segment_tokens=self.config.partial_rollout_tokens,
                                                  index_offset=rollouts.index_offset)
        return rollouts

    def _segments(self, rollouts: Rollouts) -> Optional[list[int]]:
        """partial_rollout continue: the adapter versions of a batch's successive segments of
        partial_rollout_tokens tokens, from its own up to the one before its step's synchronous
        version (which is loaded only as its step starts: waiting for it would put the tail
        back on the step's path); a function of the step, like the batch's version. None
        under finish."""
        if self.config.partial_rollout != "continue":
            return None
        newest = self.version - (self.step - rollouts.step) - 1
        return list(range(rollouts.version, max(rollouts.version, newest) + 1))

    def _run_step(self, current: Rollouts) -> StepResult:
        """One step, supervised: attempts until one reaches the commit point, then the
        committed step's sync. Under max_staleness k (in train()) the next k steps' batches
        are drawn and generating while the learner trains (self._inflight, _fill).

        Before the commit point an actor that dies (or comes back without its state) costs a
        retry of the step from the committed state: every learner is restored from the
        driver's copy of its state, intact rollouts are reused and lost ones regenerated with
        the same prompts, seeds and adapter version, so the retried step computes exactly
        what the first attempt would have. After it, nothing retries the step: a generator
        lost in the sync or the prefetch is restarted and brought to the committed version
        (and to those the batches in flight need)."""
        t_start = time.perf_counter()
        self._resyncs = 0
        while True:
            try:
                step = self.supervisor.run(lambda _: self._until_commit(current, t_start), where="step",
                                           step=self.step + 1, recover=lambda: self._recover(current))
                break
            except Exception as error:
                if not isinstance(error, RETRYABLE):
                    # Not an actor failure (a stale sync, bad rewards, the logprob guard): the step
                    # fails, and the learners go back to the committed state, so the trainer stays
                    # usable at its version (a learner may have stepped already).
                    self._restore_learners(best_effort=True)
                if isinstance(error, LogprobGapError) and self.config.logprob_gap_check == "resync" \
                        and not self._resyncs:
                    # the rollouts came from a generator that does not hold the learner's policy:
                    # re-sync, check, and sample the step again (same prompts, seeds, version)
                    log.warning("%s: re-syncing the generators to version %d and sampling the step again",
                                error, self.version)
                    self._resync(self.version, list(range(len(self.roles.generators))))
                    self._check_sync(self.version)
                    current.forget()
                    continue
                raise
        self._commit(step)  # ---------------- the commit point: from here on the step is done
        self._finish_prefetch()
        t_generation_done = time.perf_counter()
        loads = self._sync_generators(self.version)
        t_sync_done = time.perf_counter()
        check = self._check_sync(self.version)
        return self._result(step, loads, check, t_generation_done, t_sync_done)

    def _until_commit(self, current: Rollouts, t_start: float) -> _Uncommitted:
        """Steps 1-11 up to the commit point: everything the step produces, nothing committed."""
        roles = self.roles
        # 1-2. Rollouts (already in flight when prefetched or kept from a failed attempt).
        if current.generation is None:
            if current.version != self.version and not self.config.sync_capabilities.several_versions:
                # the first batch after a resume under max_staleness 1: merged sync holds one
                # version, so the batch's goes in first, and the committed one after it
                self._regenerate_lost([current])
            else:
                self._submit(current)
        parts = current.generation.parts
        # 4 first under dynamic_sampling: the rewards decide which rollouts the step trains on,
        # and more rounds are generated until enough prompts' scores vary
        picked = self._dynamic_sampling(current) if self.config.dynamic_sampling else None
        if picked is not None:
            parts = [picked.batch]
        # 3-4. Reference logprobs and rewards, concurrently, straight from the object store.
        ref_logprobs, reference_stats = roles.reference_logprobs(parts)
        scores, reward_stats = (picked.scores, None) if picked is not None \
            else roles.score(parts, current.step, current.columns)
        # 5-11 in the learner, with its old logprobs (step 2) and KL_t (step 3): values, rewards, GAE, PPO.
        limit = self.config.max_staleness
        update = roles.update(ref_logprobs, scores, parts, expected_version=self.version, max_staleness=limit,
                              planned_steps=self.planned_steps, gap_limit=self.config.logprob_gap_limit)
        self._fill(current)  # max_staleness: the next steps generate while the learner trains
        queue_depth = len(self._inflight)

        summaries: list[GenerationSummary] = (picked.summaries if picked is not None
                                              else roles.fetch(current.generation.summaries))
        versions = {s.version for s in summaries}
        if versions != {current.version} or not fresh_enough(current.version, self.version, limit):
            raise StaleAdapterError(f"generators sampled with adapter versions {sorted(versions)} "
                                    f"but the learner is at version {self.version}")
        stats = roles.learner_stats(update)  # raises a learner's own error (e.g. stale rollouts)
        if picked is not None:
            reference_stats = roles.fetch(reference_stats)
            generated, score_list, reward_stats = picked.generated, picked.score_list, picked.reward_stats
            generated_tokens = picked.generated_tokens
        else:
            scores, reward_stats, reference_stats = roles.fetch([scores, reward_stats, reference_stats])
            generated, score_list = GenerationSummary.join(summaries), scores.tolist()
            generated_tokens = sum(generated.lengths)
        t_update_done = time.perf_counter()
        self._check_logprob_gap(stats)
        return _Uncommitted(current, generated, stats, update, score_list, reward_stats, reference_stats, t_start,
                            t_update_done, queue_depth, generated_tokens, picked.info if picked is not None else None,
                            picked.generated_scores if picked is not None else None)

    def _dynamic_sampling(self, current: Rollouts) -> _Picked:
        """DAPO's dynamic sampling (config dynamic_sampling; Yu et al. 2025, section 3.2): score
        the step's batch, keep the groups whose scores vary (learner.algos.varying_groups),
        and while fewer than the batch's prompts vary and dynamic_sampling_max_rounds allows,
        draw the next prompts of the cursor (train() only: ppo_step's caller gave its prompts),
        generate (seeds of their own: Rollouts.index_offset) and score them. The step trains on
        the first varying groups in generation order, filled up with the first constant ones
        when the cap leaves too few (pick_groups); the driver builds that batch from the rounds'
        batches and puts it, with the scores the filter saw, into the object store.

        Each round is recorded in current.rounds as it is drawn, and its scores once fetched,
        so a retry after an actor's death reuses them (a lost generation is regenerated by
        _recover, identically) and draws only the rounds the first attempt had not reached: the
        retried step trains on the same rollouts, and the cursor holds every prompt drawn once."""
        cfg, roles = self.config, self.roles
        wanted = len(current.prompt_ids)
        batches: list[RolloutBatch] = []    # per round, its rollouts (rows in prompt order)
        positions: list[list[int]] = []     # per round, each row's group: its position in the round
        varies: list[bool] = []             # per group generated, in generation order
        for r in range(cfg.dynamic_sampling_max_rounds + 1):
            if r > len(current.rounds):
                if current.cursor is None:
                    break  # ppo_step(prompts): no cursor to draw more from
                current.rounds.append(self._draw_round(current, r))  # recorded before anything can fail
            rollouts = current.batches()[r]
            if rollouts.generation is None:
                if r and self._windowed:
                    # the batch's version may be one the generators never loaded as an adapter
                    # (0, the base model, until the first sync): load what batches in flight need
                    self._bring_generators_to(self._needed())
                self._submit(rollouts)
            if rollouts.scored is None:
                rollouts.scored = tuple(roles.fetch(list(roles.score(rollouts.generation.parts, rollouts.step,
                                                                     rollouts.columns))))
            batch = RolloutBatch.cat(roles.fetch(rollouts.generation.parts))
            rows_vary = varying_groups(rollouts.scored[0], batch.groups).tolist()  # (B,)
            position = _group_positions(batch.groups.tolist())
            flags = [False] * (max(position) + 1)
            for row, group in enumerate(position):
                flags[group] = rows_vary[row]
            batches.append(batch)
            positions.append(position)
            varies += flags
            if sum(varies) >= wanted:
                break
        rounds = current.batches()[:len(batches)]
        unused = current.rounds[len(batches) - 1:]
        if unused and unused[0].cursor is not None:
            # a retry that needs fewer rounds than an earlier attempt drew (a re-sync changed its
            # samples): the prompts of the rounds it does not use go back to the cursor
            self.cursor.set_state(unused[0].cursor)
            del current.rounds[len(batches) - 1:]
        chosen, filled = pick_groups(varies, wanted)
        chosen = set(chosen)
        # the chosen groups' rows, round by round: the step's batch, in generation order
        parts, scores, picked_rows, first_group, first_row = [], [], [], 0, 0
        for batch, position, rollouts in zip(batches, positions, rounds):
            rows = [i for i, g in enumerate(position) if first_group + g in chosen]
            if rows:
                parts.append(batch.select(rows))
                scores.append(rollouts.scored[0][rows])
                picked_rows += [first_row + i for i in rows]
            first_group += max(position) + 1
            first_row += len(batch)
        per_round = [roles.fetch(rollouts.generation.summaries) for rollouts in rounds]
        summaries = [s for replicas in per_round for s in replicas]
        joined = GenerationSummary.join(summaries)
        # each round's replicas run at once (its slowest one's seconds); the rounds one after another
        generated = replace(joined.select(picked_rows), seconds=sum(max(s.seconds for s in r) for r in per_round))
        selected_scores = torch.cat(scores)  # (B,)
        return _Picked(batch=roles.store(RolloutBatch.cat(parts)), scores=roles.store(selected_scores),
                       score_list=selected_scores.tolist(),
                       generated_scores=torch.cat([r.scored[0] for r in rounds]).tolist(),
                       reward_stats=RewardStats.join([r.scored[1] for r in rounds], [len(b) for b in batches]),
                       generated=generated, generated_tokens=sum(joined.lengths), summaries=summaries,
                       info=DynamicSampling(rounds=len(batches), kept_frac=sum(varies) / len(varies), filled=filled))

    def _draw_round(self, current: Rollouts, r: int) -> Rollouts:
        """dynamic_sampling's extra round `r` (>= 1) of the step of `current`: as many prompts as
        the step's, sampled with its step's seeds at the global indices r * len(current.prompt_ids)
        + i and with its version. The synchronous step draws them from the cursor; under
        max_staleness >= 1 they are the next ones of the batch's window (_draw), so that no
        batch's draws wait for, or depend on, another batch's scores."""
        n = len(current.prompt_ids)
        cursor = None
        if self._windowed:
            drawn = current.window[(r - 1) * n:r * n]
        else:
            cursor = self.cursor.state()
            drawn = self.cursor.draw(len(self._prompt_ids[1]), n)
        prompts, columns = self._drawn(drawn, first=r * n)
        return Rollouts(prompts, step=current.step, version=current.version, index_offset=r * n, cursor=cursor,
                        columns=columns)

    @property
    def _windowed(self) -> bool:
        """dynamic_sampling with batches in flight (max_staleness >= 1): each batch draws its
        window of (1 + dynamic_sampling_max_rounds) x prompts_per_step prompts at once."""
        return self.config.dynamic_sampling and self.config.max_staleness >= 1

    def _commit(self, step: _Uncommitted) -> None:
        """The step's one commit point: the step count, the version, the learner's state."""
        new_version = step.stats.version
        self._weights[new_version] = step.update.weights
        self._weights = {v: w for v, w in self._weights.items() if v >= new_version - self.config.max_staleness}
        self.step += 1
        self.version = new_version
        self._learner_state = step.update.state

    def _finish_prefetch(self) -> None:
        """Before the sync: wait for the batches in flight whose adapter version the sync
        retires (merged sync holds one version: all of them; adapter and tensor sync keep every
        version a batch in flight needs: none); the sync queues behind them anyway. Lost ones
        are regenerated with the version they were sampled with."""
        for rollouts in [r for r in self._inflight if r.version < self._keep_from(self.version)]:
            self.supervisor.run(lambda _, r=rollouts: self.roles.fetch(r.generation.summaries), where="prefetch",
                                step=self.step, recover=lambda: self._regenerate_lost([], hold=False))

    # ------------------------------------------------------------------ batches in flight (max_staleness)
    def _version_for(self, step: int) -> int:
        """The adapter version the batch of step index `step` (0-based: the sampling seeds' step)
        is sampled with: max_staleness versions before the one its step trains, never below
        the first. A function of the step alone, so a lost or resumed batch is generated
        again exactly."""
        rule = max(0, self.version - (self.step - step) - self.config.max_staleness)
        # a run resumed with a larger max_staleness than its checkpoint's has no older adapters
        return max(rule, min(self._weights))

    def _keep_from(self, version: int) -> int:
        """The oldest adapter version the generators keep once `version` is loaded: the oldest a
        batch in flight can need (merged sync holds one: `version` itself)."""
        return self.config.sync_capabilities.oldest_kept(version, self.config.max_staleness)

    def _needed(self) -> dict:
        """{version: weights} the generators must hold: the committed one and, with adapter or
        tensor sync, every one a batch in flight was sampled with."""
        keep = self._keep_from(self.version)
        return {v: w for v, w in self._weights.items() if v >= keep}

    def _fill(self, current: Rollouts) -> None:
        """train() under max_staleness k: draw and submit the batches of the next k steps (up
        to train()'s last) that are not in flight yet, each with its version (_version_for)."""
        if self._target is None:
            return
        last = self._inflight[-1].step if self._inflight else current.step
        for step in range(last + 1, min(self._target, current.step + self.config.max_staleness + 1)):
            self._inflight.append(self._submit(self._draw(step)))

    def _regenerate_lost(self, also: list[Rollouts], hold: bool = True) -> None:
        """After a failure: every batch of `also` and of those in flight whose generation was
        lost is generated again (same prompts, seeds and version), oldest first; then (`hold`)
        every generator holds the versions the committed state needs (not before the sync,
        which loads the new one). A merged-sync generator holds one version: it is given each
        lost batch's before that batch is submitted (its calls run in order)."""
        self.roles.wait_for_actors()
        for rollouts in [r for batch in [*also, *self._inflight] for r in batch.batches()]:
            if self.roles.intact(rollouts.generation):
                continue
            if not self.config.sync_capabilities.several_versions:
                self._bring_generators_to({rollouts.version: self._weights[rollouts.version]})
            else:
                self._bring_generators_to(self._needed())
            self._submit(rollouts)
        if hold:
            self._bring_generators_to(self._needed())  # queued behind those generations

    def _bring_generators_to(self, weights: dict) -> None:
        """Roles.bring_generators_to, then the sync check of every version it loaded, on the
        replicas that loaded it, before they sample with it (_check_loaded)."""
        for version, replicas in sorted(self.roles.bring_generators_to(weights).items()):
            self._check_loaded(version, replicas)

    def _check_loaded(self, version: int, replicas: list[int]) -> None:
        """The sync check of `version` loaded again into generator `replicas` (a restarted
        replica, a resume): older than the learner's version (one a batch in flight needs), the
        learner scores the probe with that version's adapter, which the driver holds
        (Learner.sync_gap). No step is reported for it; a gap over logprob_gap_limit is, by
        logprob_gap_check, loaded again and checked once more (resync), an error, or a warning.
        Unsupervised: it runs inside a supervised place's recovery or attempt, whose failure
        handling covers it."""
        cfg = self.config
        if cfg.logprob_gap_check == "off":
            return
        gens = [self.roles.generators[i] for i in replicas]
        weights = None if version == self.version else self._weights[version]
        for again in (False, True):
            gaps = self.roles.sync_gaps(self._probe_ids, version, weights=weights, generators=gens)
            bad = [i for i, g in zip(replicas, gaps) if g > cfg.logprob_gap_limit]
            if not bad:
                return
            self.metrics.record_logprob_gap(cfg.lora_sync_mode)
            message = (f"after step {self.step}: generator replica(s) {bad}, given adapter version {version} again, "
                       f"compute logprobs up to {max(gaps):.3g} nats away from the learner's with that version "
                       f"(logprob_gap_tolerance {cfg.logprob_gap_limit:g} for {cfg.dtype}, "
                       f"lora_sync={cfg.lora_sync_mode}): the load did not deliver it")
            if cfg.logprob_gap_check == "warn":
                log.warning(message)
                return
            if cfg.logprob_gap_check == "error" or again:
                raise LogprobGapError(message + ("; it persists after loading it again" if again else ""))
            log.warning("%s; loading it again", message)
            self._resyncs += 1
            gens = [self.roles.generators[i] for i in bad]
            replicas = bad
            self.roles.load_adapter(version, self._weights[version], restore=True, generators=gens)

    def _sync_generators(self, version: int) -> list[SyncReport]:
        """The committed LoRA goes from the learner's object store entry to every replica; a
        replica that dies here is restarted and given it."""
        weights = self._weights[version]
        # max_staleness with adapter or tensor sync: first retire the versions no batch in flight
        # needs (otherwise the load replaces the previous version once it is in place)
        keep = self._keep_from(version)
        loads = self.supervisor.run(lambda attempt: self.roles.load_adapter(version, weights, restore=attempt > 0,
                                                                            retire_below=keep if keep < version else None),
                                    where="sync", step=self.step, recover=self.roles.wait_for_actors)
        bad = [r.version for r in loads if r.version != version]
        if bad:
            raise StaleAdapterError(f"generators report adapter versions {bad} after loading {version}")
        return loads

    def _check_sync(self, version: int) -> SyncCheck:
        """The sync check, after every sync in every mode: each generator samples the fixed
        probe prompts (sync_probe_prompts) with the version it just loaded, untruncated at the
        PPO temperature, and the learner at the same version recomputes those tokens'
        logprobs (Roles.sync_gaps). The largest gap within logprob_gap_limit passes, with or
        without is_correction: the probe is small and fixed (4 prompts x PROBE_NEW_TOKENS), so
        its largest gap does not grow with the run's responses as the rollouts' does, and it
        is what catches a lost or corrupted sync when is_correction relaxes the rollout check
        (_check_logprob_gap). Beyond it, logprob_gap_check decides: resync (the default) loads
        the version again into the replicas that failed (a new adapter, or merged weights
        rebuilt from the base) and checks again, and a gap that persists is a
        LogprobGapError; error raises at once; warn logs it. Either way the step's gap is
        reported (StepResult.sync_probe_gap)."""
        cfg = self.config
        if cfg.logprob_gap_check == "off":
            return SyncCheck(math.nan, 0.0)
        t0 = time.perf_counter()
        resyncs = 0
        while True:
            # a generator or the learner lost during the check comes back in the committed state
            gaps = self.supervisor.run(lambda _: self.roles.sync_gaps(self._probe_ids, version), where="sync check",
                                       step=self.step, recover=self._back_to_committed)
            gap = max(gaps)
            if gap <= cfg.logprob_gap_limit:
                return SyncCheck(gap, time.perf_counter() - t0)
            bad = [i for i, g in enumerate(gaps) if g > cfg.logprob_gap_limit]
            self.metrics.record_logprob_gap(cfg.lora_sync_mode)
            message = (f"after step {self.step}: generator replica(s) {bad} compute logprobs up to {gap:.3g} nats "
                       f"away from the learner's at the same adapter version {version} (logprob_gap_tolerance "
                       f"{cfg.logprob_gap_limit:g} for {cfg.dtype}, lora_sync={cfg.lora_sync_mode}): the sync did not "
                       "deliver the learner's policy")
            if cfg.logprob_gap_check == "warn":
                log.warning(message)
                return SyncCheck(gap, time.perf_counter() - t0)
            if cfg.logprob_gap_check == "error" or resyncs:
                raise LogprobGapError(message + ("; it persists after a re-sync" if resyncs else ""))
            log.warning("%s; re-syncing them", message)
            self._resync(version, bad)
            resyncs += 1

    def _resync(self, version: int, replicas: list[int]) -> None:
        """Load `version` again into generator `replicas` (a new adapter registration, or the
        merged weights rebuilt from the base)."""
        self._resyncs += 1
        gens = [self.roles.generators[i] for i in replicas]
        self.supervisor.run(lambda _: self.roles.load_adapter(version, self._weights[version], restore=True,
                                                              generators=gens),
                            where="sync", step=self.step, recover=self._back_to_committed)

    def _result(self, step: _Uncommitted, loads: list[SyncReport], check: SyncCheck, t_generation_done: float,
                t_sync_done: float) -> StepResult:
        generated, stats = step.generated, step.stats
        now = time.perf_counter()
        timing = StepTiming(
            generate_s=generated.seconds,  # the slowest replica
            reference_s=step.reference_stats.seconds,
            reward_s=step.reward_stats.seconds,
            learner_forward_s=stats.learner_forward_s,
            update_s=stats.update_s,
            sync_s=t_sync_done - t_generation_done,
            sync_check_s=check.seconds,
            # overlap mode: how long the driver waited for the prefetched generation after the
            # learner finished (0 when generation is the faster of the two)
            prefetch_wait_s=t_generation_done - step.t_update_done,
            # the sync's parts on the generator side (the rest of sync_s is the object-store
            # transfer of the LoRA tensors and the actor call)
            sync_write_s=max(r.write_s for r in loads),
            sync_register_s=max(r.register_s + r.retire_s for r in loads),
            step_s=now - step.t_start)
        return StepResult(
            step=self.step,
            generated_texts=generated.texts, finish_reasons=generated.finish_reasons,
            rewards=step.scores, generated_rewards=step.generated_scores, learner=stats,
            reward_parts=step.reward_stats.parts(), adapter_version=self.version,
            timing=timing, lora_sync_bytes=loads[0].nbytes, response_lengths=generated.lengths,
            sync_probe_gap=check.gap, sync_resyncs=self._resyncs,
            # tokens and FLOPs per second of the generation and the learner (StepResult.rates)
            **StepResult.rates(timing, stats, step.generated_tokens),
            queue_depth=float(step.queue_depth), dynamic_sampling=step.dynamic)

    def _check_logprob_gap(self, stats: LearnerStats) -> None:
        """The generator and the learner must give a sampled token the same logprob at the
        same version (stale rollouts in overlap mode report NaN: another policy by design).
        Without is_correction the largest gap of one token is held to logprob_gap_tolerance
        (under top_p < 1, plus log(1 / top_p) for the few tokens at the nucleus's edge). With
        it, the share of tokens whose ratio is outside the correction's band [1/is_cap, is_cap]
        (is_outside_frac) is held to logprob_gap_outside_tolerance: the correction absorbs a
        mismatch that moves a few tokens far, and the largest gap of one token grows with the
        number of tokens (long bfloat16 responses). A lost or corrupted
        sync is still caught by the sync check's probe (_check_sync), whose rule is the
        largest gap whatever is_correction is.
        A sampled token that the learner's top-k/top-p truncation drops has no logprob to
        compare; such tokens count too: beyond TRUNCATED_TOKENS_LIMIT of the step's tokens
        the two truncations disagree by more than a tie at the boundary explains."""
        cfg = self.config
        gap = stats.gen_logprob_max_abs_diff
        if cfg.logprob_gap_check == "off" or not math.isfinite(gap):
            return
        outside = stats.truncated_tokens
        if cfg.is_correction == "none":
            # Under top_p < 1, where the cumulative probability meets top_p within rounding the
            # learner and vLLM can keep nuclei that differ by one edge token: the sampled token's
            # logprob is then renormalised over masses that differ by that token's, at most
            # log(1 / top_p) more. Such tokens count with the ones outside the learner's support.
            edge = -math.log(cfg.top_p) if cfg.top_p < 1 else 0.0
            close = gap <= cfg.logprob_gap_limit + edge
            if edge:
                outside += stats.gen_logprob_gap_tokens
            how = (f"by up to {gap:.3g} nats (logprob_gap_tolerance {cfg.logprob_gap_limit:g} for {cfg.dtype}"
                   + (f", plus up to {edge:.3g} at the top_p edge on at most {TRUNCATED_TOKENS_LIMIT:.0%} of the "
                      f"tokens: {stats.gen_logprob_gap_tokens:.0f} over the tolerance)" if edge else ")"))
        else:
            close = stats.is_outside_frac <= cfg.logprob_gap_outside_tolerance
            how = (f"by more than a factor is_cap {cfg.is_cap:g} on {stats.is_outside_frac:.1%} of its tokens "
                   f"(is_correction {cfg.is_correction}: logprob_gap_outside_tolerance "
                   f"{cfg.logprob_gap_outside_tolerance:.1%}; largest gap {gap:.3g} nats)")
        if close and outside / max(stats.tokens, 1.0) <= TRUNCATED_TOKENS_LIMIT:
            return
        message = (f"step {self.step + 1}: the generator's logprobs of its own samples differ from the learner's "
                   f"at the same adapter version {self.version} {how}, and {stats.truncated_tokens:.0f} of its "
                   f"{stats.tokens:.0f} sampled tokens are outside the learner's top-k/top-p support (at most "
                   f"{TRUNCATED_TOKENS_LIMIT:.0%}), lora_sync={cfg.lora_sync_mode}: the rollouts came from another policy "
                   "(stale KV cache? a lost sync?)")
        self.metrics.record_logprob_gap(cfg.lora_sync_mode)
        if cfg.logprob_gap_check in ("error", "resync"):  # resync: _run_step re-syncs and samples again
            raise LogprobGapError(message)
        log.warning(message)

    # ------------------------------------------------------------------ evaluation
    def generate(self, prompts: Sequence[str] | Sequence[dict], seed_step: int = SAMPLING_SEED_STEP, *,
                 score: bool = False, samples_per_prompt: int = 1, greedy: bool = False,
                 index_offset: int = 0) -> Responses:
        """Sample `samples_per_prompt` responses per prompt (contiguous, in the prompts' order)
        with the current policy (no training): Responses (texts, finish_reasons, version). A
        fixed `seed_step` gives every prompt the same sampling seed before and after training,
        so comparisons of two policies use common random numbers; `greedy` decodes by argmax
        instead (pass@1). With `score`, the reward actor scores the responses too (`rewards`:
        one float per response; rows' columns go to the reward functions). `index_offset`: the
        global index of prompts[0] (each prompt's seed and group id follow its global index), so
        a long list asked for in chunks gets the samples of one call. An actor lost on the way
        is restarted and the call redone (the generators at the committed version, the same
        seeds: the same samples)."""
        rows = self._rows(prompts)
        prompt_ids = self._encode(rows.texts)
        columns = self._columns(rows, first=index_offset) if score else None
        kept: list[Optional[Generation]] = [None]

        def attempt(_) -> Responses:
            # a redo keeps a generation that survived and samples a lost one again; every replica
            # must hold the committed version (a restarted one raises StateLostError, never
            # samples the base model)
            if not self.roles.intact(kept[0]):
                kept[0] = self.roles.generate(prompt_ids, seed_step, self.version, samples_per_prompt=samples_per_prompt,
                                              greedy=greedy, index_offset=index_offset)
            generation = kept[0]
            generated = GenerationSummary.join(self.roles.fetch(generation.summaries))
            rewards = None
            if score:
                scores, _ = self.roles.score(generation.parts, seed_step, columns)
                rewards = self.roles.fetch(scores).tolist()
            return Responses(generated.texts, generated.finish_reasons, generated.version, rewards)

        return self.supervisor.run(attempt, where="evaluation", step=self.step, recover=self._back_to_committed)

    def save_adapter(self, path: str | Path) -> Path:
        """Write the policy's LoRA adapter (PEFT format: PeftModel.from_pretrained and vLLM load
        it), the committed version's, here on the driver's node (the weights come through the
        object store: no storage shared with the learner's node is needed)."""
        from ppo_ray.modeling import write_lora_adapter

        weights = self.supervisor.run(lambda _: self.roles.fetch(self._weights[self.version]), where="adapter",
                                      step=self.step, recover=self._back_to_committed)
        return write_lora_adapter(path, weights, base_model=self.model_dir)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write <run_dir>/checkpoints/step-NNNNNN atomically (see ppo_ray.checkpoint): the
        committed learner state (both adapters and the value head, both optimisers, the RNG
        states), the step, the adapter version and the data cursor. The driver writes it, so
        the run directory only has to be reachable from the driver's node."""
        if self.run_dir is None:
            raise ValueError("save_checkpoint needs the trainer's run_dir (PPOTrainer(config, run_dir=...))")
        learner_state = self.supervisor.run(lambda _: self.roles.fetch(self._learner_state), where="checkpoint",
                                            step=self.step, recover=self._back_to_committed)
        # max_staleness: the next steps' batches are drawn (and generating); a resumed run draws
        # them again and samples them with the versions they were sampled with, kept here
        order, rng = self._inflight[0].cursor if self._inflight else self.cursor.state()
        behaviour = {v: w for v, w in self._weights.items() if v < self.version}
        if behaviour:
            behaviour = dict(zip(behaviour, self.supervisor.run(lambda _: self.roles.fetch(list(behaviour.values())),
                                                                where="checkpoint", step=self.step,
                                                                recover=self._back_to_committed)))
        if self._lock is not None:  # one writer per run directory: a driver whose lock was taken over stops here
            self._lock.check(read=True)
        path = save_checkpoint(self.run_dir, config=self.config, learner_state=learner_state, behaviour=behaviour,
                               model_dir=self.model_dir, keep=self.config.keep_checkpoints, lineage=self.lineage,
                               trainer_state={"step": self.step, "order": order, "data_rng": rng,
                                              "prompts_sha256": self._prompts_key,
                                              "planned_steps": self.planned_steps,
                                              "fingerprints": self.fingerprints})
        self.lineage = Lineage.after(path)
        self._last_checkpoint = time.monotonic()
        return path

    def restore(self, path: str | Path) -> Path:
        """Continue from a checkpoint (a step-NNNNNN directory, or a run directory: its
        newest intact one). Refuses one written with an incompatible config, or trained on
        models that have changed since (CheckpointError), and one of another run than the one
        this trainer's run directory holds (RunDirError: a run touches only its own lineage).
        The run continues the checkpoint's lineage; when the checkpoint is in this trainer's
        run directory and newer ones of the run are there, they are the branch this resume
        abandons: moved to checkpoints/abandoned/ (ppo_ray.checkpoint.branch_from), and their
        metric lines beside them when train() starts. Fields of this trainer's config that
        differ from the checkpoint's are named in the log and apply from the next step; the
        restored state never shadows them (_apply_changes)."""
        ckpt = resolve_checkpoint(path)
        if self.run_dir is not None:
            check_own_lineage(ckpt, self.run_dir)
        ckpt, learner_state, state = load_checkpoint(ckpt, self.config, run_dir=self.run_dir)
        saved = resumed_config(ckpt, self.run_dir or ckpt.parent.parent)
        learner_state = self._apply_changes(ckpt, saved, learner_state)
        self._learner_state = self.roles.store(learner_state)

        def load(attempt: int) -> int:  # a redo re-forms the learner group (a restarted member left it)
            version = self.roles.restore_learners(self._learner_state, reform=attempt > 0)[0]
            self._weights = {v: self.roles.store(w) for v, w in state["behaviour"].items()}
            self._weights[version] = self.roles.store(learner_state.policy)
            self.version, self.step = version, int(state["step"])
            # the generators start afresh at the checkpoint's versions: its own and (max_staleness)
            # those of the batches that were in flight
            oldest = min(self._needed())
            self.roles.load_adapter(oldest, self._weights[oldest], restore=True, retire_below=oldest)
            if len(self._needed()) > 1:
                self.roles.bring_generators_to(self._needed())
            every = list(range(len(self.roles.generators)))
            for held in sorted(self._needed())[:-1]:  # the batches in flight's (the newest: _check_sync)
                self._check_loaded(held, every)
            return version

        self.supervisor.run(load, where="restore", step=int(state["step"]), recover=self.roles.wait_for_actors)
        self._check_sync(self.version)
        self.cursor.set_state((state["order"], state["data_rng"]))
        self._inflight.clear()
        self._prompts_key = state.get("prompts_sha256")
        self._cursor_from_checkpoint = self._prompts_key is not None
        self.lineage = Lineage.after(ckpt)
        self.planned_steps = int(state["planned_steps"])
        if self.config.steps != self.planned_steps:
            self._plan_steps(self.config.steps, f"resumed with steps={self.config.steps}")
        if self.run_dir is not None and ckpt.parent.resolve() == checkpoint_root(self.run_dir).resolve():
            self._abandoned = branch_from(ckpt)
        log.info("resumed from %s (step %d, adapter version %d)", ckpt, self.step, self.version)
        return ckpt

    def _apply_changes(self, ckpt: Path, saved: PPOConfig, state):
        """Name the fields of this trainer's config that differ from the checkpoint's (they
        apply from the next step) and keep the restored state from shadowing them: the
        learning rates and schedule kind are the config's (Learner.load_state_dict), a fixed
        kl_coef is the config's, and an adaptive KL controller (kl_target) continues from the
        checkpoint's coefficient unless this run gives another kl_coef or another kl_target
        (then it starts from kl_coef). Returns the state to restore."""
        changes = [(k, a, b) for k, a, b in config_changes(saved, self.config) if k != "steps"]  # steps: _plan_steps
        if not changes:
            return state
        notes = {"learning_rate": "the policy's schedule keeps its position", "lr_scheduler": "from its current tick",
                 "value_learning_rate": "the value model's schedule keeps its position"}
        adaptive = self.config.kl_target is not None and state.kl_coef is not None
        if adaptive and (saved.kl_target is None or saved.kl_coef != self.config.kl_coef
                         or saved.kl_target != self.config.kl_target):
            notes["kl_coef"] = notes["kl_target"] = (f"the adaptive KL controller starts from kl_coef "
                                                     f"{self.config.kl_coef:g}, not the checkpoint's {state.kl_coef:.6g}")
            state = replace(state, kl_coef=None)
        elif saved.kl_target is not None and self.config.kl_target is None:
            notes["kl_target"] = (f"kl_coef is fixed at {self.config.kl_coef:g} from now on (the checkpoint's "
                                  f"adaptive coefficient was {state.kl_coef if state.kl_coef is not None else '?'})")
        log.warning("resuming from %s with changes to its config, applied from the next step: %s", ckpt, "; ".join(
            f"{k} {a!r} -> {b!r}" + (f" ({notes[k]})" if k in notes else "") for k, a, b in changes))
        return state

    def _recover(self, current: Rollouts) -> None:
        """Back to the committed state after a failure before the commit point: wait for the
        restarts, re-form the learner group, restore every learner from the committed state
        (a learner may have stepped, or half-stepped, before the failure), and regenerate the
        step's rollouts if they were lost."""
        self.roles.wait_for_actors()
        self._restore_learners()
        self._regenerate_lost([current])  # same prompts, seeds and version: the same samples (every round)

    def _back_to_committed(self) -> None:
        """Back to the committed state after a failure outside a step (the sync check, an
        evaluation, a checkpoint's or the adapter's fetch, a re-sync): wait for the restarts,
        every learner restored from the driver's copy of the committed state (a restarted one
        lost it; a live one holds it already: nothing changes) and every generator at the
        committed version (a restarted one is on the base model)."""
        self.roles.wait_for_actors()
        self._restore_learners()
        self._bring_generators_to(self._needed())

    def _restore_learners(self, best_effort: bool = False) -> None:
        """Every learner back to the committed state. best_effort: on the way out of a failed
        step, supervised itself (the recoveries that call it otherwise are), and a failure is
        logged, not raised."""
        if not best_effort:
            self.roles.restore_learners(self._learner_state)
            return
        try:
            self.supervisor.run(lambda _: self.roles.restore_learners(self._learner_state), where="restore",
                                step=self.step, recover=self.roles.wait_for_actors)
        except Exception:  # noqa: BLE001 - on the way out of a failed step: its own error is the one to raise
            log.exception("could not put the learners back to the committed state after a failed step")

    # ------------------------------------------------------------------ many steps
    def _draw(self, step: int) -> Rollouts:
        """The next config.prompts_per_step prompts (of train()'s list, encoded once: batch_size
        rollouts of samples_per_prompt samples each), as the rollouts of step index `step`
        (0-based), to be sampled with its version (_version_for). Under dynamic_sampling with
        max_staleness >= 1 the batch draws its whole window: (1 + dynamic_sampling_max_rounds)
        x prompts_per_step consecutive prompts of the cursor, the first prompts_per_step its
        first round, the rest its extra rounds' in order (_draw_round); the prompts of a window
        that its batch does not reach are not trained on in this epoch. The window, like the
        batch, is a function of the cursor before it: a resumed or retried run draws the same."""
        cursor = self.cursor.state()
        n = self.config.prompts_per_step
        width = n * (1 + self.config.dynamic_sampling_max_rounds) if self._windowed else n
        drawn = self.cursor.draw(len(self._prompt_ids[1]), width)
        prompts, columns = self._drawn(drawn[:n])
        return Rollouts(prompts, step=step, version=self._version_for(step), cursor=cursor, window=drawn[n:],
                        columns=columns)

    def _checkpoint_due(self) -> bool:
        cfg = self.config
        by_steps = bool(cfg.checkpoint_every) and self.step % cfg.checkpoint_every == 0
        by_time = bool(cfg.checkpoint_every_minutes) and \
            time.monotonic() - self._last_checkpoint >= 60.0 * cfg.checkpoint_every_minutes
        return by_steps or by_time

    def _use_prompts(self, prompts: Sequence[str] | Sequence[dict]) -> None:
        """The cursor indexes `prompts`: a new list starts a new epoch over it, except after
        restoring a checkpoint, whose cursor indexes its own list (CheckpointError). The list
        is encoded (and checked: a bad prompt is named by its index) once, here, not at
        every step; its rows' columns (the reward functions') are kept beside it. The list's
        identity is its texts' (prompts_fingerprint)."""
        if not prompts:
            raise ValueError("train() needs a non-empty list of prompts")
        rows = self._rows(prompts)
        key = prompts_fingerprint(rows)
        if self._prompt_ids[0] != key:
            self._prompt_ids = (key, self._encode(rows.texts))
        self._prompt_columns = self._columns(rows)
        if self._prompts_key is not None and self._prompts_key != key:
            if self._cursor_from_checkpoint:
                raise CheckpointError(f"train() got a different prompt list ({len(prompts)} prompts) from the one "
                                      "the checkpoint's data cursor indexes: resume with the run's dataset")
            self.cursor.order = []  # a new prompt list: a new epoch over it
        self._prompts_key, self._cursor_from_checkpoint = key, False

    def train(self, prompts: Sequence[str] | Sequence[dict], steps: Optional[int] = None, *, progress: bool = True,
              metrics_path: str | Path | None = None,
              evaluate: Optional[Callable[["PPOTrainer", int], dict]] = None,
              eval_prompts: Optional[Sequence[str] | Sequence[dict]] = None) -> list[StepResult]:
        """Run PPO steps on batches of config.prompts_per_step prompts (batch_size rollouts) drawn without replacement
        from `prompts` (strings, or rows with the dataset's columns for the reward functions: the
        module docstring), reshuffled every epoch with the run seed: `steps` more steps, or by
        default until the run's step count reaches config.steps (so after restore() it
        continues the run). Each finished step is logged as one line (logging, INFO) unless
        `progress` is False. `evaluate(trainer, step)`, if given, runs every
        config.eval_every steps and at the end; its (small) dict is merged into that step's
        result (StepResult.extra). At the same steps the first config.eval_samples of
        `eval_prompts` are sampled with the current policy and scored by the reward actor:
        appended to <run_dir>/eval_samples.jsonl and the trackers, their mean as
        eval_reward_mean. With a run_dir, a checkpoint is written every
        config.checkpoint_every steps, every config.checkpoint_every_minutes and at the end,
        and the trackers of config.report_to (TensorBoard event files in
        <run_dir>/tensorboard) get every step. An actor that dies is restarted and its step
        retried from the committed state (see _run_step): no step is lost, doubled or
        restarted. metrics_path keeps one line per step: lines past the current step (a
        resumed run) are dropped before appending, in eval_samples.jsonl too."""
        self._use_prompts(prompts)
        self._check_fresh_run(metrics_path)
        target = self.step + steps if steps is not None else self.config.steps
        if target > self.planned_steps:
            self._plan_steps(target, f"train() runs to step {target}")
        history: list[StepResult] = []
        saved_at = None
        runlog = RunLog.open(self.metrics, run_dir=self.run_dir, metrics_path=metrics_path, progress=progress,
                             target=target, step=self.step, report_to=self.config.report_to,
                             config=self.config.to_dict(), run_tag=self.namespace,
                             adaptive_kl=self.config.kl_target is not None, aside=self._abandoned, lock=self._lock)
        self._last_checkpoint = time.monotonic()
        self._target = target
        try:
            while self.step < target:
                current = self._inflight.popleft() if self._inflight else self._draw(self.step)
                before = self.step
                try:
                    result = self._run_step(current)
                except BaseException:
                    # the batches drawn for what did not happen are drawn again next time
                    if self.step == before:
                        self._inflight.appendleft(current)
                    raise
                if self._eval_due(result.step, target):
                    self._evaluate(result, evaluate, eval_prompts, runlog)
                history.append(result)
                runlog.step(result)
                if self.run_dir is not None and self._checkpoint_due():
                    self.save_checkpoint()
                    saved_at = self.step
            if self.run_dir is not None and saved_at != self.step and history:
                self.save_checkpoint()
        finally:
            runlog.close()
            self._target = None
            if self._inflight:  # a stopped run: the batches in flight are drawn again next time
                self.cursor.set_state(self._inflight[0].cursor)
                self._inflight.clear()
        return history

    def _plan_steps(self, steps: int, why: str) -> None:
        """The run's planned total changes to `steps`: from the next update on, the learners'
        learning-rate schedules are those of a run of `steps` steps (learner.learner.LRPlan),
        and the change is logged."""
        if self.config.lr_scheduler != "constant":
            log.warning("%s, but the %s learning-rate schedule was planned to reach 0 at step %d: from step %d on "
                        "it follows a run of %d steps (lr x %.3g now)", why, self.config.lr_scheduler,
                        self.planned_steps, self.step + 1, steps, max(0.0, 1.0 - self.step / steps))
        self.planned_steps = steps

    def _check_fresh_run(self, metrics_path: str | Path | None) -> None:
        """A run that has not started (no step, no checkpoint saved or restored) must not write
        into another run's files: its checkpoints would be pruned by name and its metrics
        truncated (RunDirError naming the file, before anything is written)."""
        from ppo_ray.rundir import RunDirError

        if self.step or self.lineage.parent is not None:
            return
        if self.run_dir is not None and run_ids(self.run_dir) - {self.lineage.run_id}:
            raise RunDirError(f"{checkpoint_root(self.run_dir)} holds another run's checkpoints: continue it "
                              f"(trainer.restore({str(self.run_dir)!r}), launch.py ppo --resume {self.run_dir}) or "
                              "train in a new run directory")
        if metrics_path is not None and Path(metrics_path).is_file() and Path(metrics_path).stat().st_size:
            raise RunDirError(f"{metrics_path} holds another run's steps: continue that run from its checkpoint "
                              "or write this one elsewhere")

    def _eval_due(self, step: int, target: int) -> bool:
        every = self.config.eval_every
        return bool(every and step % every == 0) or step == target

    def _evaluate(self, result: StepResult, evaluate, eval_prompts, runlog: RunLog) -> None:
        """The user's evaluate(trainer, step) and the eval samples, merged into the result."""
        if evaluate:
            result.extra.update(evaluate(self, result.step))
        samples = list(eval_prompts or [])[: self.config.eval_samples]
        if samples:
            rows = self._eval_samples(samples, result.step)
            finite = [r["reward"] for r in rows if math.isfinite(r["reward"])]
            result.extra["eval_reward_mean"] = sum(finite) / len(finite) if finite else math.nan
            runlog.samples(result.step, rows)
        if self.config.attribution_rows and self.run_dir is not None:  # the step's rollouts, per token
            rows = pick_rows(self.config.batch_size, self.config.attribution_rows)
            runlog.attribution(self.attribution(rows, result.step) or [])

    def attribution(self, rows: Sequence[int], step: int = 0) -> Optional[list[RolloutAttribution]]:
        """Rows `rows` of the last update's batch as the seeds' SA pairs, every number the step
        computed for each token (ppo_ray.attribution; a view: no forward, nothing of the step
        changes). None when the learner no longer holds that update's tensors (restarted)."""
        tensors = self.supervisor.run(lambda _: self.roles.attribution(list(rows)), where="evaluation", step=self.step,
                                      recover=self._back_to_committed)
        return None if tensors is None else sa_pairs(tensors, self.tokenizer.decode, step)

    def _eval_samples(self, prompts: list[str] | list[dict], step: int) -> list[dict]:
        """The current policy's responses to `prompts` (strings or rows: their columns go to the
        reward functions), scored by the reward actor. The same sampling seeds at every
        evaluation (common random numbers across steps)."""
        rows = self._rows(prompts)
        out = self.generate(rows, seed_step=EVAL_SEED_STEP, score=True)
        return [{"step": step, "prompt": p, "response": t, "reward": r, "finish_reason": f}
                for p, t, r, f in zip(rows.texts, out.texts, out.rewards, out.finish_reasons)]

    def shutdown(self, graceful: bool = True) -> None:
        """End the actors and remove their placement group (its reserved resources are freed),
        and give up the run directory's lock. `graceful` (a normal end): each actor closes and
        exits on its own (the dashboard says it exited), and those that have not within
        EXIT_TIMEOUT_S are killed; False (an error or an interrupt unwinds) kills them at once."""
        try:
            killed = self.roles.release(EXIT_TIMEOUT_S if graceful else 0.0)
            if graceful and killed:
                log.warning("actors %s did not exit within %g s and were killed", ", ".join(killed), EXIT_TIMEOUT_S)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None


def pick_groups(varies: Sequence[bool], wanted: int) -> tuple[list[int], int]:
    """dynamic_sampling's choice among the groups generated, flagged in generation order
    (`varies`: the group's scores vary): the positions of the groups the step trains on,
    ascending (generation order), and how many of them do not vary. The first `wanted` varying
    groups (DAPO discards the varying groups beyond them); when fewer vary, every varying group
    and the first constant ones, up to `wanted` (under a group baseline a constant group's
    advantage is its KL term alone, so the fill adds no policy-gradient signal, and the batch
    keeps its size)."""
    if len(varies) < wanted:
        raise ValueError(f"pick_groups: {len(varies)} groups generated, {wanted} wanted")
    keep = [i for i, v in enumerate(varies) if v][:wanted]
    fill = [i for i, v in enumerate(varies) if not v][:wanted - len(keep)]
    return sorted(keep + fill), len(fill)


def _group_positions(groups: list[int]) -> list[int]:
    """Each row's group as its position among the batch's groups in order of first appearance
    (group ids, not row order, say which rows are one prompt's samples)."""
    order: dict[int, int] = {}
    return [order.setdefault(g, len(order)) for g in groups]


# The rollout check's share of sampled tokens that the learner's truncation may drop: a token
# at the top-k/top-p boundary can flip sides by rounding (rare: well under 1e-3 of the tokens
# in float32), while a generator holding another policy samples many outside the support.
TRUNCATED_TOKENS_LIMIT = 0.01
