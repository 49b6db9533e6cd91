"""PPOTrainer: the driver-side orchestration of one PPO step (seed steps 1-11) on Ray.

    trainer = PPOTrainer(PPOConfig(...))
    out = trainer.ppo_step(prompts)        # one step: generated_texts, rewards, losses, kl, ...
    history = trainer.train(prompts, steps=100)

Prompts are strings, or rows: dicts whose config.prompt_column ("prompt") holds the text and
whose other keys are the dataset's columns (ppo_ray.data.prompt_rows). The driver keeps the
rows; each score call takes its prompts' values of the columns the reward functions take
(ppo_ray.data.PromptColumns, one entry per prompt, found on the reward side by the batch's
group ids), so they reach fn(prompts, completions, **columns) and never the learner (nor the
generators, except with an environment, whose episodes are reset with the whole row). A batch's columns follow its drawn prompts, so a retried or resumed step gets the same.

Data between actors travels as ObjectRefs; the driver pulls only small things (texts,
B scores, stats). The generator reports the adapter version it sampled with and the
learner refuses rollouts from any other version, so a lost LoRA sync is an error, never
a silent off-policy step. After every sync, in every mode, the sync check compares what
the generators compute with what the learner computes at the same version (a small fixed
probe); on fresh steps the rollouts' own logprobs are compared too. A gap beyond
logprob_gap_tolerance re-syncs and checks again by default (logprob_gap_check): nothing is
sampled for training from a generator that failed the check (ppo_ray.driver.sync_guard).

Which batch each step trains on, the adapter version it is sampled with, the batches in flight
under max_staleness and their regeneration are ppo_ray.driver.inflight's (the synchronous step is its
k = 0 case); this module keeps the step, its commit point, train, generate and restore.

Faults: each step has one commit point (_commit), after the learner's update returned its
stats, the new adapter and its state. Until then an actor's death is recovered by retrying
the step from the committed state (the learners restored from the driver's object-store
copy of their state, lost rollouts regenerated identically); after it, only the sync is
redone. Every other call to an actor (the sync check, the evaluations, a checkpoint's state
fetch, a restore; ppo_ray.driver.supervisor.PLACES) goes through the same retry rule: the lost actor
is restarted, brought back to the committed state, and the call redone. No step is lost,
doubled or restarted, and no checkpoint is needed (tests/test_faults.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from ppo_ray.attribution import RolloutAttribution, sa_pairs
from ppo_ray.batch import fresh_enough
from ppo_ray.driver.checkpoint import (Lineage, apply_changes, branch_from, check_fresh_run, check_own_lineage,
                                checkpoint_root, load_checkpoint, model_fingerprints, resolve_checkpoint,
                                resumed_config, save_checkpoint)
from ppo_ray.driver.cluster import init_ray
from ppo_ray.config import PPOConfig
from ppo_ray.driver.creation import ModelDirs, create_roles
from ppo_ray.data import PromptCursor, check_chat_template
from ppo_ray.driver.eval_samples import evaluate_step
from ppo_ray.environments import load_environment
from ppo_ray.driver.hosts import HOSTS
from ppo_ray.driver.inflight import Committed, Pipeline, Rollouts, pick_groups
from ppo_ray.driver.metrics import TrainingMetrics
from ppo_ray.modeling import load_tokenizer
from ppo_ray.driver.prompt_feed import PromptFeed, env_rows
from ppo_ray.rewards import check_reward_sources, guarded_calls
from ppo_ray.driver.roles import (EXIT_TIMEOUT_S, RETRYABLE, SAMPLING_SEED_STEP, Generation, Roles,
                           role_names)
from ppo_ray.driver.runlock import RunLock
from ppo_ray.driver.runlog import RunLog, new_run_tag
from ppo_ray.stats import GenerateRequest, GenerationSummary, Responses, StepResult, SyncReport
from ppo_ray.driver.step_report import Uncommitted
from ppo_ray.driver.supervisor import Supervisor
from ppo_ray.driver.sync_guard import (TRUNCATED_TOKENS_LIMIT, LogprobGapError, StaleAdapterError, SyncCheck, SyncGuard,
                                sync_probe_prompts)
from ppo_ray.tracking import check_trackers

# Importable from here, as before the pipeline and the sync guard had modules of their own.
__all__ = ["PPOTrainer", "StaleAdapterError", "LogprobGapError", "SyncCheck", "TRUNCATED_TOKENS_LIMIT", "Rollouts",
           "pick_groups", "sync_probe_prompts"]

log = logging.getLogger(__name__)


class PPOTrainer:
    # The Ray actor class of each role kind (ppo_ray.driver.hosts.HOSTS); a subclass may name
    # subclasses of them.
    hosts: Mapping[str, type] = HOSTS

    def __init__(self, config: PPOConfig, *, run_dir: str | Path | None = None):
        self._config = config
        # Everything that can fail cheaply fails before any actor starts.
        # the reward sources (RewardError naming one): its config.json refuses a causal LM here
        reward_fns = check_reward_sources(config.reward_model_name, config.reward_funcs, config.reward_weights,
                                          environment=config.environment, proxy=config.reward_verifier_proxy)
        if config.environment is not None:  # it imports, and has reset and step (EnvError naming it)
            load_environment(config.environment)
        self.model_dir, self.ref_model_dir, self.reward_model_dir, self.value_model_dir = ModelDirs.of(config)
        self.tokenizer = load_tokenizer(self.model_dir)
        if config.apply_chat_template:
            check_chat_template(self.tokenizer, config.model_name)
        self.feed = PromptFeed(config, self.tokenizer, [fn for _, fn in reward_fns])
        check_trackers(config.report_to if run_dir else ())
        self.run_dir = Path(run_dir) if run_dir else None
        # One writer per run directory (ppo_ray.driver.runlock; re-entrant: launch.py holds it already),
        # released by shutdown(). What the run's models hold, for its checkpoints: a resume
        # onto models re-trained since is refused (ppo_ray.driver.checkpoint.check_fingerprints).
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
                                                                     config.reward_funcs),
                                       env_failures=config.environment is not None)
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

    # The committed state (ppo_ray.driver.inflight.Committed, which the pipeline and the guard read).
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
        for part in (getattr(self, "pipeline", None), getattr(self, "guard", None), getattr(self, "feed", None)):
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
        rows = self.feed.rows(prompts)
        current = Rollouts(self.feed.encode(rows.texts), step=self.step, version=self.version,
                           columns=self.feed.columns(rows))
        return self._run_step(current)

    def _run_step(self, current: Rollouts) -> StepResult:
        """One step, supervised: attempts until one reaches the commit point, then the
        committed step's sync. Under max_staleness k (in train()) the next k steps' batches
        are drawn and generating while the learner trains (ppo_ray.driver.inflight.Pipeline.fill).

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
        return step.result(self.step, self.version, loads, check, self.guard.resyncs, t_generation_done, t_sync_done)

    def _until_commit(self, current: Rollouts, t_start: float) -> Uncommitted:
        """Steps 1-11 up to the commit point: everything the step produces, nothing committed."""
        roles, pipeline, limit = self.roles, self.pipeline, self.config.max_staleness
        pipeline.start(current)  # 1-2. Rollouts (in flight already when prefetched or kept from a failed attempt)
        # 4. Their rewards (dynamic_sampling first: the rewards pick the rows the step trains on,
        # named to the actors by index), and 3. the reference logprobs, from the object store.
        sampled = pipeline.sampled(current)
        ref_logprobs, reference_stats = roles.reference_logprobs(sampled.parts, pick=sampled.pick)
        # 5-11 in the learner, with its old logprobs (step 2) and KL_t (step 3): values, rewards, GAE, PPO.
        update = roles.update(ref_logprobs, sampled.scores, sampled.parts, expected_version=self.version,
                              max_staleness=limit, planned_steps=self.planned_steps,
                              gap_limit=self.config.logprob_gap_limit, pick=sampled.pick)
        pipeline.fill(current)  # max_staleness: the next steps generate while the learner trains
        queue_depth = len(pipeline.inflight)
        pipeline.while_learning([call.stats for call in update.calls])
        summaries = pipeline.summaries(sampled)
        versions = {s.version for s in summaries}
        if versions != {current.version} or not fresh_enough(current.version, self.version, limit):
            raise StaleAdapterError(f"generators sampled with adapter versions {sorted(versions)} "
                                    f"but the learner is at version {self.version}")
        stats = roles.learner_stats(update)  # raises a learner's own error (e.g. stale rollouts)
        outcome = pipeline.outcome(sampled, summaries)
        reference_stats = roles.fetch(reference_stats)
        t_update_done = time.perf_counter()
        self.guard.check_rollouts(stats)
        return Uncommitted(current, outcome, stats, update, reference_stats, t_start, t_update_done, queue_depth)

    def _commit(self, step: Uncommitted) -> None:
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
        rows = self.feed.rows(prompts)
        prompt_ids = self.feed.encode(rows.texts)
        columns = self.feed.columns(rows, first=index_offset) if score or self.config.environment else None
        kept: list[Optional[Generation]] = [None]

        def attempt(_) -> Responses:
            # a redo keeps a generation that survived and samples a lost one again; every replica
            # must hold the committed version (a restarted one raises StateLostError, never
            # samples the base model)
            if not self.roles.intact(kept[0]):
                kept[0] = self.roles.generate(prompt_ids, GenerateRequest(
                    seed_step, index_offset, self.version, samples_per_prompt=samples_per_prompt, greedy=greedy,
                    rows=env_rows(self.config, columns)))
            generation = kept[0]
            generated = GenerationSummary.join(self.roles.fetch(generation.summaries))
            rewards = None
            if score:
                scores, _ = self.roles.score(generation.parts, seed_step, columns)
                rewards = self.roles.fetch(scores).tolist()
            held = None
            if attribute:
                held = self.roles.fetch(self.roles.held_out(generation.parts, list(attribute), self.config.kl_estimator))
            return Responses(generated.texts, generated.finish_reasons, generated.version, rewards, held,
                             generated.episodes)

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
        """Write <run_dir>/checkpoints/step-NNNNNN atomically (see ppo_ray.driver.checkpoint): the
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
                                              "prompts_sha256": self.feed.key,
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
        abandons: moved to checkpoints/abandoned/ (ppo_ray.driver.checkpoint.branch_from), and their
        metric lines beside them when train() starts. Fields of this trainer's config that
        differ from the checkpoint's are named in the log and apply from the next step; the
        restored state never shadows them (ppo_ray.driver.checkpoint.apply_changes)."""
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
        self.feed.restored(state.get("prompts_sha256"))
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
        self.pipeline.prompt_ids, self.pipeline.prompt_columns = self.feed.use(prompts, self.cursor)
        check_fresh_run(self.step, self.lineage, self.run_dir, metrics_path)
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
                    evaluate_step(self, result, evaluate, eval_prompts, runlog)
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

    def _eval_due(self, step: int, target: int) -> bool:
        every = self.config.eval_every
        return bool(every and step % every == 0) or step == target

    def attribution(self, rows: Sequence[int], step: int = 0) -> Optional[list[RolloutAttribution]]:
        """Rows `rows` of the last update's batch as the seeds' SA pairs, every number the step
        computed for each token (ppo_ray.attribution; a view: no forward, nothing of the step
        changes). None when the learner no longer holds that update's tensors (restarted)."""
        tensors = self.supervisor.run(lambda _: self.roles.attribution(list(rows)), where="evaluation", step=self.step,
                                      recover=self._back_to_committed)
        return None if tensors is None else sa_pairs(tensors, self.tokenizer.decode, step)

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
