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
probe); on fresh steps the rollouts' own logprobs are compared too. A gap beyond
logprob_gap_tolerance re-syncs and checks again by default (logprob_gap_check): nothing is
sampled for training from a generator that failed the check (ppo_ray.sync_guard).

Which batch each step trains on, the adapter version it is sampled with, the batches in flight
under max_staleness and their regeneration are ppo_ray.inflight's (the synchronous step is its
k = 0 case); this module keeps the step, its commit point, train, generate and restore.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from ppo_ray.attribution import RolloutAttribution, pick_rows, sa_pairs
from ppo_ray.batch import fresh_enough
from ppo_ray.checkpoint import (CheckpointError, Lineage, apply_changes, branch_from, check_own_lineage,
                                checkpoint_root, load_checkpoint, model_fingerprints, resolve_checkpoint,
                                resumed_config, run_ids, save_checkpoint)
from ppo_ray.cluster import init_ray
from ppo_ray.config import PPOConfig
from ppo_ray.creation import create_roles
from ppo_ray.data import (PromptColumns, PromptCursor, PromptRows, check_chat_template, encode_prompts,
                          prompt_rows, prompts_fingerprint)
from ppo_ray.hosts import HOSTS
from ppo_ray.inflight import Committed, Picked, Pipeline, Rollouts, pick_groups
from ppo_ray.metrics import TrainingMetrics
from ppo_ray.modeling import check_context_length, load_tokenizer
from ppo_ray.paths import resolve_model_path
from ppo_ray.rewards import check_reward_sources, columns_taken, guarded_calls
from ppo_ray.roles import (EVAL_SEED_STEP, EXIT_TIMEOUT_S, RETRYABLE, SAMPLING_SEED_STEP, Generation, Roles, Update,
                           role_names)
from ppo_ray.runlock import RunLock
from ppo_ray.runlog import RunLog, new_run_tag
from ppo_ray.stats import (DynamicSampling, GenerateRequest, GenerationSummary, LearnerStats, ReferenceStats, Responses, RewardStats,
                           StepResult, StepTiming, SyncReport)
from ppo_ray.supervisor import Supervisor
from ppo_ray.sync_guard import (TRUNCATED_TOKENS_LIMIT, LogprobGapError, StaleAdapterError, SyncCheck, SyncGuard,
                                sync_probe_prompts)
from ppo_ray.tracking import check_trackers

# Importable from here, as before the pipeline and the sync guard had modules of their own.
__all__ = ["PPOTrainer", "StaleAdapterError", "LogprobGapError", "SyncCheck", "TRUNCATED_TOKENS_LIMIT", "Rollouts",
           "pick_groups", "sync_probe_prompts"]

log = logging.getLogger(__name__)


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
    # The Ray actor class of each role kind (ppo_ray.hosts.HOSTS); a subclass may name
    # subclasses of them.
    hosts: Mapping[str, type] = HOSTS

    def __init__(self, config: PPOConfig, *, run_dir: str | Path | None = None):
        self._config = config
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
        version, weights_ref, self._learner_state = self.supervisor.run(
            lambda _: self._first_state(), where="start", step=0, recover=self.roles.wait_for_actors)
        # LoRA weights of the committed version and of those that batches in flight were sampled
        # with (max_staleness of them): the pipeline keeps them
        self.committed = Committed(step=0, version=version, weights={version: weights_ref})
        self.cursor = PromptCursor(config.seed)
        self._prompts_key: Optional[str] = None  # fingerprint of the list the cursor indexes
        self._prompt_ids: tuple[Optional[str], list[list[int]]] = (None, [])  # (fingerprint, its prompts encoded once)
        self._cursor_from_checkpoint = False
        # the sync guard (load, probe, the rollout check) and the rollout pipeline (the batches,
        # their versions, those in flight); both read the committed state, neither changes it
        self.guard = SyncGuard(config, self.roles, self.supervisor, self.metrics,
                               sync_probe_prompts(self.tokenizer, config.seed, config.max_prompt_length),
                               self.committed, recover=self._back_to_committed)
        self.pipeline = Pipeline(config, self.roles, self.supervisor, self.committed, self.cursor,
                                 load=self.guard.bring_generators_to)
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

    # The committed state (ppo_ray.inflight.Committed, which the pipeline and the guard read).
    @property
    def step(self) -> int:
        """Steps done (committed)."""
        return self.committed.step

    @step.setter
    def step(self, value: int) -> None:
        self.committed.step = value

    @property
    def version(self) -> int:
        """The adapter version every generator holds: the committed policy's."""
        return self.committed.version

    @version.setter
    def version(self, value: int) -> None:
        self.committed.version = value

    @property
    def config(self) -> PPOConfig:
        return self._config

    @config.setter
    def config(self, config: PPOConfig) -> None:
        """A new config (from the next call on): the pipeline and the guard read it too."""
        self._config = config
        for part in (getattr(self, "pipeline", None), getattr(self, "guard", None)):
            if part is not None:
                part.config = config

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

    def _run_step(self, current: Rollouts) -> StepResult:
        """One step, supervised: attempts until one reaches the commit point, then the
        committed step's sync. Under max_staleness k (in train()) the next k steps' batches
        are drawn and generating while the learner trains (ppo_ray.inflight.Pipeline.fill).

        Before the commit point an actor that dies (or comes back without its state) costs a
        retry of the step from the committed state: every learner is restored from the
        driver's copy of its state, intact rollouts are reused and lost ones regenerated with
        the same prompts, seeds and adapter version, so the retried step computes exactly
        what the first attempt would have. After it, nothing retries the step: a generator
        lost in the sync or the prefetch is restarted and brought to the committed version
        (and to those the batches in flight need)."""
        t_start = time.perf_counter()
        self.guard.resyncs = 0
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
                if self.guard.resamples(error):
                    # the rollouts came from a generator that does not hold the learner's policy:
                    # re-sync, check, and sample the step again (same prompts, seeds, version)
                    log.warning("%s: re-syncing the generators to version %d and sampling the step again",
                                error, self.version)
                    self.guard.resync(self.version, list(range(len(self.roles.generators))))
                    self.guard.check(self.version)
                    current.forget()
                    continue
                raise
        self._commit(step)  # ---------------- the commit point: from here on the step is done
        self.pipeline.finish_prefetch()
        t_generation_done = time.perf_counter()
        loads = self._sync_generators(self.version)
        t_sync_done = time.perf_counter()
        check = self.guard.check(self.version)
        return self._result(step, loads, check, t_generation_done, t_sync_done)

    def _until_commit(self, current: Rollouts, t_start: float) -> _Uncommitted:
        """Steps 1-11 up to the commit point: everything the step produces, nothing committed."""
        roles, pipeline = self.roles, self.pipeline
        # 1-2. Rollouts (already in flight when prefetched or kept from a failed attempt).
        pipeline.start(current)
        parts, pick = current.generation.parts, None
        # 4 first under dynamic_sampling: the rewards decide which rollouts the step trains on,
        # and more rounds are generated until enough prompts' scores vary; the actors take the
        # picked rows from the rounds' batches (pick: their indices)
        picked: Optional[Picked] = pipeline.dynamic_sampling(current) if self.config.dynamic_sampling else None
        if picked is not None:
            parts, pick = picked.parts, picked.pick
        # 3-4. Reference logprobs and rewards, concurrently, straight from the object store.
        ref_logprobs, reference_stats = roles.reference_logprobs(parts, pick=pick)
        scores, reward_stats = (picked.scores, None) if picked is not None \
            else roles.score(parts, current.step, current.columns)
        # 5-11 in the learner, with its old logprobs (step 2) and KL_t (step 3): values, rewards, GAE, PPO.
        limit = self.config.max_staleness
        update = roles.update(ref_logprobs, scores, parts, expected_version=self.version, max_staleness=limit,
                              planned_steps=self.planned_steps, gap_limit=self.config.logprob_gap_limit, pick=pick)
        pipeline.fill(current)  # max_staleness: the next steps generate while the learner trains
        queue_depth = len(pipeline.inflight)

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
        self.guard.check_rollouts(stats)
        return _Uncommitted(current, generated, stats, update, score_list, reward_stats, reference_stats, t_start,
                            t_update_done, queue_depth, generated_tokens, picked.info if picked is not None else None,
                            picked.generated_scores if picked is not None else None)

    def _commit(self, step: _Uncommitted) -> None:
        """The step's one commit point: the step count, the version, the learner's state."""
        new_version = step.stats.version
        self.pipeline.keep(new_version, step.update.weights)
        self.step += 1
        self.version = new_version
        self._learner_state = step.update.state

    def _sync_generators(self, version: int) -> list[SyncReport]:
        """The committed LoRA into every replica (SyncGuard.sync), first retiring the versions no
        batch in flight needs."""
        return self.guard.sync(version, keep=self.pipeline.keep_from(version))

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
            sync_probe_gap=check.gap, sync_resyncs=self.guard.resyncs,
            # tokens and FLOPs per second of the generation and the learner (StepResult.rates)
            **StepResult.rates(timing, stats, step.generated_tokens),
            queue_depth=float(step.queue_depth), dynamic_sampling=step.dynamic)

    # ------------------------------------------------------------------ evaluation
    def generate(self, prompts: Sequence[str] | Sequence[dict], seed_step: int = SAMPLING_SEED_STEP, *,
                 score: bool = False, samples_per_prompt: int = 1, greedy: bool = False,
                 index_offset: int = 0, attribute: Sequence[int] = ()) -> Responses:
        """Sample `samples_per_prompt` responses per prompt (contiguous, in the prompts' order)
        with the current policy (no training): Responses (texts, finish_reasons, version). A
        fixed `seed_step` gives every prompt the same sampling seed before and after training,
        so comparisons of two policies use common random numbers; `greedy` decodes by argmax
        instead (pass@1). With `score`, the reward actor scores the responses too (`rewards`:
        one float per response; rows' columns go to the reward functions). `index_offset`: the
        global index of prompts[0] (each prompt's seed and group id follow its global index), so
        a long list asked for in chunks gets the samples of one call. An actor lost on the way
        is restarted and the call redone (the generators at the committed version, the same
        seeds: the same samples). `attribute`: responses whose per-token logprobs and KL_t the
        reference computes (Responses.held_out, ppo_ray.attribution)."""
        rows = self._rows(prompts)
        prompt_ids = self._encode(rows.texts)
        columns = self._columns(rows, first=index_offset) if score else None
        kept: list[Optional[Generation]] = [None]

        def attempt(_) -> Responses:
            # a redo keeps a generation that survived and samples a lost one again; every replica
            # must hold the committed version (a restarted one raises StateLostError, never
            # samples the base model)
            if not self.roles.intact(kept[0]):
                kept[0] = self.roles.generate(prompt_ids, GenerateRequest(
                    seed_step, index_offset, self.version, samples_per_prompt=samples_per_prompt, greedy=greedy))
            generation = kept[0]
            generated = GenerationSummary.join(self.roles.fetch(generation.summaries))
            rewards = None
            if score:
                scores, _ = self.roles.score(generation.parts, seed_step, columns)
                rewards = self.roles.fetch(scores).tolist()
            held = None
            if attribute:
                held = self.roles.fetch(self.roles.held_out(generation.parts, list(attribute), self.config.kl_estimator))
            return Responses(generated.texts, generated.finish_reasons, generated.version, rewards, held)

        return self.supervisor.run(attempt, where="evaluation", step=self.step, recover=self._back_to_committed)

    def save_adapter(self, path: str | Path) -> Path:
        """Write the policy's LoRA adapter (PEFT format: PeftModel.from_pretrained and vLLM load
        it), the committed version's, here on the driver's node (the weights come through the
        object store: no storage shared with the learner's node is needed)."""
        from ppo_ray.modeling import write_lora_adapter

        weights = self.supervisor.run(lambda _: self.roles.fetch(self.committed.weights[self.version]), where="adapter",
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
        (order, rng), behaviour = self.pipeline.checkpoint()
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
        restored state never shadows them (ppo_ray.checkpoint.apply_changes)."""
        ckpt = resolve_checkpoint(path)
        if self.run_dir is not None:
            check_own_lineage(ckpt, self.run_dir)
        ckpt, learner_state, state = load_checkpoint(ckpt, self.config, run_dir=self.run_dir)
        saved = resumed_config(ckpt, self.run_dir or ckpt.parent.parent)
        learner_state = apply_changes(self.config, ckpt, saved, learner_state)
        self._learner_state = self.roles.store(learner_state)

        def load(attempt: int) -> int:  # a redo re-forms the learner group (a restarted member left it)
            version = self.roles.restore_learners(self._learner_state, reform=attempt > 0)[0]
            self.pipeline.restore({v: self.roles.store(w) for v, w in state["behaviour"].items()}, version,
                                  self.roles.store(learner_state.policy))
            self.version, self.step = version, int(state["step"])
            # the generators start afresh at the checkpoint's versions: its own and (max_staleness)
            # those of the batches that were in flight
            needed = self.pipeline.needed()
            oldest = min(needed)
            self.roles.load_adapter(oldest, needed[oldest], restore=True, retire_below=oldest)
            if len(needed) > 1:
                self.roles.bring_generators_to(needed)
            every = list(range(len(self.roles.generators)))
            for held in sorted(needed)[:-1]:  # the batches in flight's (the newest: the sync check)
                self.guard.check_loaded(held, every)
            return version

        self.supervisor.run(load, where="restore", step=int(state["step"]), recover=self.roles.wait_for_actors)
        self.guard.check(self.version)
        self.cursor.set_state((state["order"], state["data_rng"]))
        self.pipeline.inflight.clear()
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

    def _recover(self, current: Rollouts) -> None:
        """Back to the committed state after a failure before the commit point: wait for the
        restarts, re-form the learner group, restore every learner from the committed state
        (a learner may have stepped, or half-stepped, before the failure), and regenerate the
        step's rollouts if they were lost."""
        self.roles.wait_for_actors()
        self._restore_learners()
        self.pipeline.regenerate_lost([current])  # same prompts, seeds and version: the same samples (every round)

    def _back_to_committed(self) -> None:
        """Back to the committed state after a failure outside a step (the sync check, an
        evaluation, a checkpoint's or the adapter's fetch, a re-sync): wait for the restarts,
        every learner restored from the driver's copy of the committed state (a restarted one
        lost it; a live one holds it already: nothing changes) and every generator at the
        committed version (a restarted one is on the base model)."""
        self.roles.wait_for_actors()
        self._restore_learners()
        self.guard.bring_generators_to(self.pipeline.needed())

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
        self.pipeline.prompt_ids, self.pipeline.prompt_columns = self._prompt_ids[1], self._columns(rows)
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
        self.pipeline.target = target
        try:
            while self.step < target:
                current = self.pipeline.next()
                before = self.step
                try:
                    result = self._run_step(current)
                except BaseException:
                    # the batches drawn for what did not happen are drawn again next time
                    if self.step == before:
                        self.pipeline.put_back(current)
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
            self.pipeline.target = None
            self.pipeline.stop()  # a stopped run: the batches in flight are drawn again next time
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
        shown = self.config.attribution_rows if self.run_dir is not None else 0
        held: list[RolloutAttribution] = []
        if samples:
            rows, held = self._eval_samples(samples, result.step, pick_rows(len(samples), shown))
            finite = [r["reward"] for r in rows if math.isfinite(r["reward"])]
            result.extra["eval_reward_mean"] = sum(finite) / len(finite) if finite else math.nan
            runlog.samples(result.step, rows)
        if shown:  # the step's rollouts and the held-out samples, per token
            runlog.attribution((self.attribution(pick_rows(self.config.batch_size, shown), result.step) or []) + held)

    def attribution(self, rows: Sequence[int], step: int = 0) -> Optional[list[RolloutAttribution]]:
        """Rows `rows` of the last update's batch as the seeds' SA pairs, every number the step
        computed for each token (ppo_ray.attribution; a view: no forward, nothing of the step
        changes). None when the learner no longer holds that update's tensors (restarted)."""
        tensors = self.supervisor.run(lambda _: self.roles.attribution(list(rows)), where="evaluation", step=self.step,
                                      recover=self._back_to_committed)
        return None if tensors is None else sa_pairs(tensors, self.tokenizer.decode, step)

    def _eval_samples(self, prompts: list[str] | list[dict], step: int,
                      attribute: Sequence[int] = ()) -> tuple[list[dict], list[RolloutAttribution]]:
        """The current policy's responses to `prompts` (strings or rows: their columns go to the
        reward functions), scored by the reward actor. The same sampling seeds at every
        evaluation (common random numbers across steps). With them, the responses `attribute`
        per token (their logprobs and KL_t: held-out samples have no advantage)."""
        rows = self._rows(prompts)
        out = self.generate(rows, seed_step=EVAL_SEED_STEP, score=True, attribute=attribute)
        held = [] if out.held_out is None else sa_pairs(out.held_out, self.tokenizer.decode, step)
        for h in held:
            h.score = out.rewards[h.row]
        return ([{"step": step, "prompt": p, "response": t, "reward": r, "finish_reason": f}
                 for p, t, r, f in zip(rows.texts, out.texts, out.rewards, out.finish_reasons)], held)

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
