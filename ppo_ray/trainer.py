"""PPOTrainer: the driver-side orchestration of one PPO step (seed steps 1-11) on Ray.

    trainer = PPOTrainer(PPOConfig(...))
    out = trainer.ppo_step(prompts)        # one step: generated_texts, rewards, losses, kl, ...
    history = trainer.train(prompts, steps=100)

Data between actors travels as ObjectRefs; the driver pulls only small things (texts,
B scores, stats). The generator reports the adapter version it sampled with and the
learner refuses rollouts from any other version, so a lost LoRA sync is an error, never
a silent off-policy step; and the generator's logprobs of its samples are checked against
the learner's at every step (logprob_gap_check).

Faults: each step has one commit point (_commit), after the learner's update returned its
stats, the new adapter and its state. Until then an actor's death is recovered by retrying
the step from the committed state (the learners restored from the driver's object-store
copy of their state, lost rollouts regenerated identically); after it, only the sync is
redone. No step is lost, doubled or restarted, and no checkpoint is needed (ppo_ray.faults,
tests/test_faults.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import ray
import torch

from ppo_ray.batch import fresh_enough, staleness_limit
from ppo_ray.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ppo_ray.config import PPOConfig
from ppo_ray.data import check_chat_template, encode_prompts
from ppo_ray.faults import Fault, StateLostError
from ppo_ray.logs import format_step
from ppo_ray.metrics import TrainingMetrics
from ppo_ray.modeling import check_context_length, load_tokenizer, resolve_model_path
from ppo_ray.placement import Roles, create_roles, form_learner_group, init_ray, split_evenly
from ppo_ray.rewards import check_reward_sources
from ppo_ray.tracking import Trackers, check_trackers, update_run_file


log = logging.getLogger(__name__)

# An actor died or is restarting (ActorDiedError and ActorUnavailableError are subclasses).
ACTOR_ERRORS = (ray.exceptions.RayActorError,)
# What a retry from the last committed step recovers from: those, and an actor that came
# back from a restart without the state the step needs.
RETRYABLE = (*ACTOR_ERRORS, StateLostError)


class StaleAdapterError(RuntimeError):
    """A generator sampled with a LoRA version other than the one the step expects."""


class LogprobGapError(RuntimeError):
    """The generator's logprobs of its own samples differ from the learner's for the same
    adapter version (logprob_gap_check: error): the rollouts came from another policy."""


class PromptCursor:
    """Which prompts the next batches hold: the rest of this epoch's shuffled order and the
    RNG (seeded with the run seed) that shuffles the next epoch. Checkpointed with the run."""

    def __init__(self, seed: int):
        self.order: list[int] = []
        self.rng = torch.Generator().manual_seed(seed)

    def draw(self, n_prompts: int, batch_size: int) -> list[int]:
        """`batch_size` prompt indices, drawn without replacement, reshuffled every epoch."""
        while len(self.order) < batch_size:
            self.order += torch.randperm(n_prompts, generator=self.rng).tolist()
        rows, self.order = self.order[:batch_size], self.order[batch_size:]
        return rows

    def state(self) -> tuple[list[int], torch.Tensor]:
        return list(self.order), self.rng.get_state()

    def set_state(self, state: tuple[list[int], torch.Tensor]) -> None:
        self.order = list(state[0])
        self.rng.set_state(state[1])


@dataclass
class Rollouts:
    """One step's rollouts: what to generate, and (once submitted) the generators' ObjectRefs.
    A retry reuses them while they are intact and regenerates them, with the same prompts,
    seeds and adapter version, when they are not."""

    prompt_ids: list[list[int]]
    step: int                                # PPOTrainer.step before the step: the sampling seeds' step index
    version: int                             # the adapter version they are (to be) sampled with
    cursor: Optional[tuple] = None           # the prompt cursor before this batch was drawn
    parts: list = field(default_factory=list)      # ObjectRef[RolloutBatch] per generator replica
    summaries: list = field(default_factory=list)  # ObjectRef[dict] per replica (texts, version, seconds)


@dataclass
class _Uncommitted:
    """Everything a step produced before its commit point."""

    rollouts: Rollouts
    upcoming: Optional[Rollouts]
    summaries: list[dict]
    stats: dict
    weights: Any        # ObjectRef: the new LoRA weights
    state: Any          # ObjectRef: the learner's state after the update
    scores: torch.Tensor
    reward_stats: dict
    reference_s: float
    t_start: float
    t_update_done: float


class PPOTrainer:
    def __init__(self, config: PPOConfig, *, run_dir: str | Path | None = None):
        self.config = config
        # Everything that can fail cheaply fails before any actor starts.
        # the reward sources (RewardError naming one): its config.json refuses a causal LM here
        check_reward_sources(config.reward_model_name, config.reward_funcs, config.reward_weights)
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

        init_ray(log_level=config.log_level)
        # The run tag: Ray namespace of the actors and the `run` label of every Prometheus series.
        self.namespace = f"ppo-{uuid.uuid4().hex[:8]}"
        self.metrics = TrainingMetrics(run=self.namespace)  # Prometheus gauges, tagged run=namespace
        log.info("run tag %s (Prometheus label run=\"%s\", Ray namespace of the actors)", self.namespace,
                 self.namespace)
        self.roles: Roles = create_roles(
            config, model_dir=self.model_dir, ref_model_dir=self.ref_model_dir,
            reward_model_dir=self.reward_model_dir, value_model_dir=self.value_model_dir,
            namespace=self.namespace)
        # The committed state: steps done, the adapter version every generator holds, and the
        # driver's copy of the learner's state (ObjectRefs in the object store, never pulled
        # here): a learner that dies is restored from it, checkpoint or not.
        version_ref, weights_ref = self.roles.learner.current_weights.remote()
        self.step = 0
        self.version: int = ray.get(version_ref)
        self._weights = {self.version: weights_ref}  # LoRA weights of the committed version and the one before
        self._learner_state = self.roles.learner.state_dict.remote()
        self.cursor = PromptCursor(config.seed)
        self._prompts_key: Optional[str] = None
        self._cursor_from_checkpoint = False
        self._pending: Optional[Rollouts] = None  # overlap mode: the next step's rollouts, already generating
        self._faults: list[Fault] = []
        self._last_checkpoint = time.monotonic()
        self.retries: list[dict] = []  # {"step", "role", "where"} of every actor failure survived

    # ------------------------------------------------------------------ one step
    def ppo_step(self, prompts: Sequence[str]) -> dict:
        """One PPO step on `prompts` (one rollout each). Returns texts, scores, losses,
        KL, the PPO diagnostics and per-phase seconds (all small Python values). A step
        whose actor dies is retried from the last committed step (see _run_step)."""
        current = Rollouts(self._encode(prompts), step=self.step, version=self.version)
        return self._run_step(current)[0]

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        cfg = self.config
        return encode_prompts(self.tokenizer, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation,
                              chat_template=cfg.apply_chat_template)

    def _submit(self, rollouts: Rollouts) -> Rollouts:
        """1-2. Generate on every replica (prompt order kept; seeds follow the global index),
        not waited for. Each replica must hold rollouts.version (else StateLostError)."""
        gens = self.roles.generators
        chunks = [(s, e) for s, e in split_evenly(len(rollouts.prompt_ids), len(gens)) if e > s]
        rollouts.parts, rollouts.summaries = [], []
        for gen, (s, e) in zip(gens, chunks):
            batch_ref, summary_ref = gen.generate.remote(rollouts.prompt_ids[s:e], rollouts.step, s,
                                                         expected_version=rollouts.version)
            rollouts.parts.append(batch_ref)
            rollouts.summaries.append(summary_ref)
        return rollouts

    def _run_step(self, current: Rollouts, upcoming: Optional[Rollouts] = None) -> tuple[dict, Optional[Rollouts]]:
        """One step, supervised: attempts until one reaches the commit point, then the
        committed step's sync. `upcoming` (overlap mode) is the next step's batch, generated
        while the learner trains. Returns (step output, upcoming rollouts in flight or done).

        Before the commit point an actor that dies (or comes back without its state) costs a
        retry of the step from the committed state: every learner is restored from the
        driver's copy of its state, intact rollouts are reused and lost ones regenerated with
        the same prompts, seeds and adapter version, so the retried step computes exactly
        what the first attempt would have. After it, nothing retries the step: a generator
        lost in the sync or the prefetch is restarted and brought to the committed version."""
        cfg = self.config
        self._prepare_faults(self.step + 1, current)
        for attempt in range(cfg.max_step_retries + 1):
            try:
                step = self._until_commit(current, upcoming, time.perf_counter())
                break
            except RETRYABLE as e:
                if attempt == cfg.max_step_retries:
                    raise
                self._count_retry(e, "step")
                current = self._recover(current)
            except Exception:
                # Not an actor failure (a stale sync, bad rewards, the logprob guard): the step
                # fails, and the learners go back to the committed state, so the trainer stays
                # usable at its version (a learner may have stepped already).
                self._restore_learners(best_effort=True)
                raise
        self._commit(step)  # ---------------- the commit point: from here on the step is done
        upcoming = self._finish_prefetch(step.upcoming)
        t_generation_done = time.perf_counter()
        loads = self._sync_generators(self.version)
        return self._output(step, loads, t_generation_done), upcoming

    def _until_commit(self, current: Rollouts, upcoming: Optional[Rollouts], t_start: float) -> _Uncommitted:
        """Steps 1-11 up to the commit point: everything the step produces, nothing committed."""
        roles = self.roles
        if not current.summaries:
            self._submit(current)
        parts = current.parts
        # 3-4. Reference logprobs and rewards, concurrently, straight from the object store.
        ref_logprobs = roles.reference.logprobs.remote(*parts)
        reference_s = roles.reference.last_seconds.remote()
        scores_ref, reward_stats_ref = roles.reward.score.remote(*parts)
        # 5-11. The learner: old logprobs/values, KL, shaped rewards, TD, GAE, returns, PPO.
        # Every learner of the group gets the same refs and takes its own shard of the rows;
        # rank 0's stats, weights and state speak for the group (all hold the same adapter).
        limit = staleness_limit(self.config.overlap_generation)
        updates = [learner.update.remote(ref_logprobs, scores_ref, *parts, expected_version=self.version,
                                         max_staleness=limit) for learner in roles.learners]
        if upcoming is not None:  # overlap: the next step generates while the learner trains
            upcoming = self._submit(replace(upcoming, version=self.version))

        summaries = ray.get(current.summaries)
        versions = {s["version"] for s in summaries}
        if versions != {current.version} or not fresh_enough(current.version, self.version, limit):
            raise StaleAdapterError(f"generators sampled with adapter versions {sorted(versions)} "
                                    f"but the learner is at version {self.version}")
        stats = self._learner_stats([u[0] for u in updates])  # raises a learner's own error (e.g. stale rollouts)
        scores, reward_stats, ref_s = ray.get([scores_ref, reward_stats_ref, reference_s])
        t_update_done = time.perf_counter()
        self._check_logprob_gap(stats)
        return _Uncommitted(current, upcoming, summaries, stats, updates[0][1], updates[0][2], scores, reward_stats,
                            ref_s, t_start, t_update_done)

    def _commit(self, step: _Uncommitted) -> None:
        """The step's one commit point: the step count, the version, the learner's state."""
        new_version = int(step.stats["version"])
        self._weights = {self.version: self._weights[self.version], new_version: step.weights}
        self.step += 1
        self.version = new_version
        self._learner_state = step.state

    def _finish_prefetch(self, upcoming: Optional[Rollouts]) -> Optional[Rollouts]:
        """Wait for the prefetched rollouts (the sync queues behind them anyway); lost ones
        are regenerated with the version they were sampled with (the one before the commit)."""
        if upcoming is None:
            return None
        for attempt in range(self.config.max_step_retries + 1):
            try:
                ray.get(upcoming.summaries)
                return upcoming
            except RETRYABLE as e:
                if attempt == self.config.max_step_retries:
                    raise
                self._count_retry(e, "prefetch", step=self.step)
                self._wait_for_actors()
                self._ensure_generators_at(upcoming.version)
                self._submit(upcoming)
        raise AssertionError("unreachable")  # pragma: no cover

    def _sync_generators(self, version: int) -> list[dict]:
        """The committed LoRA goes from the learner's object store entry to every replica; a
        replica that dies here is restarted and given it."""
        weights = self._weights[version]
        for attempt in range(self.config.max_step_retries + 1):
            try:
                loads = ray.get([g.load_adapter.remote(version, weights, attempt > 0) for g in self.roles.generators])
                break
            except RETRYABLE as e:
                if attempt == self.config.max_step_retries:
                    raise
                self._count_retry(e, "sync", step=self.step)
                self._wait_for_actors()
        bad = [r["version"] for r in loads if r["version"] != version]
        if bad:
            raise StaleAdapterError(f"generators report adapter versions {bad} after loading {version}")
        return loads

    def _output(self, step: _Uncommitted, loads: list[dict], t_generation_done: float) -> dict:
        summaries, stats, reward_stats = step.summaries, step.stats, step.reward_stats
        sync_s = time.perf_counter() - t_generation_done
        wall = time.perf_counter() - step.t_start
        tokens = sum(s["tokens"] for s in summaries)
        return {
            "step": self.step,
            "generated_texts": [t for s in summaries for t in s["texts"]],
            "finish_reasons": [f for s in summaries for f in s["finish_reasons"]],
            "rewards": step.scores.tolist(),
            "reward_mean": _nanmean(step.scores),
            # the learner's reward_mean is the shaped (score - beta*KL) return per sequence
            **{("shaped_reward_mean" if k == "reward_mean" else k): v for k, v in stats.items()
               if not isinstance(v, (list, dict))},
            **{k: v for k, v in reward_stats.items() if k != "reward_s"},
            "adapter_version": self.version,
            "time/generate_s": max(s["generate_s"] for s in summaries),
            "time/reference_s": step.reference_s,
            "time/reward_s": reward_stats["reward_s"],
            "time/learner_forward_s": stats.get("learner_forward_s", math.nan),
            "time/update_s": stats.get("update_s", math.nan),
            "time/sync_s": sync_s,
            # overlap mode: how long the driver waited for the prefetched generation after the
            # learner finished (0 when generation is the faster of the two)
            "time/prefetch_wait_s": t_generation_done - step.t_update_done,
            # the sync's parts on the generator side (the rest of sync_s is the object-store
            # transfer of the LoRA tensors and the actor call)
            "time/sync_write_s": max(r["write_s"] for r in loads),
            "time/sync_register_s": max(r["register_s"] + r["retire_s"] for r in loads),
            "lora_sync_bytes": loads[0]["bytes"],
            "time/step_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else math.nan,
            "response_tokens": tokens,
        }

    def _check_logprob_gap(self, stats: dict) -> None:
        """The generator and the learner must give a sampled token the same logprob at the
        same version (stale rollouts in overlap mode report NaN: another policy by design)."""
        cfg = self.config
        gap = stats.get("gen_logprob_max_abs_diff", math.nan)
        if cfg.logprob_gap_check == "off" or not math.isfinite(gap) or gap <= cfg.logprob_gap_limit:
            return
        message = (f"step {self.step + 1}: the generator's logprobs of its own samples differ from the learner's "
                   f"at the same adapter version {self.version} by up to {gap:.3g} nats (logprob_gap_tolerance "
                   f"{cfg.logprob_gap_limit:g} for {cfg.dtype}), lora_sync={cfg.lora_sync}: the rollouts came from "
                   "another policy (stale KV cache? a lost sync?)")
        self.metrics.record_logprob_gap(cfg.lora_sync)
        if cfg.logprob_gap_check == "error":
            raise LogprobGapError(message)
        log.warning(message)

    # ------------------------------------------------------------------ evaluation
    def generate(self, prompts: Sequence[str], seed_step: int = 10**9, *, score: bool = False) -> dict:
        """Sample one response per prompt with the current policy (no training). A fixed
        `seed_step` gives every prompt the same sampling seed before and after training,
        so comparisons of two policies use common random numbers. With `score`, the reward
        actor scores the responses too ("rewards": one float per prompt)."""
        gens = self.roles.generators
        prompt_ids = self._encode(prompts)
        chunks = [(s, e) for s, e in split_evenly(len(prompt_ids), len(gens)) if e > s]
        calls = [gen.generate.remote(prompt_ids[s:e], seed_step, s) for gen, (s, e) in zip(gens, chunks)]
        summaries = ray.get([summary for _, summary in calls])
        out = {"texts": [t for s in summaries for t in s["texts"]],
               "finish_reasons": [f for s in summaries for f in s["finish_reasons"]],
               "version": summaries[0]["version"]}
        if score:
            scores, _ = self.roles.reward.score.remote(*[batch for batch, _ in calls])
            out["rewards"] = ray.get(scores).tolist()
        return out

    def save_adapter(self, path: str | Path) -> Path:
        """Write the policy's LoRA adapter (PEFT format: PeftModel.from_pretrained and vLLM load
        it), the committed version's, here on the driver's node (the weights come through the
        object store: no storage shared with the learner's node is needed)."""
        from ppo_ray.modeling import write_lora_adapter

        return write_lora_adapter(path, ray.get(self._weights[self.version]), base_model=self.model_dir)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write <run_dir>/checkpoints/step-NNNNNN atomically (see ppo_ray.checkpoint): the
        committed learner state (both adapters and the value head, both optimisers, the RNG
        states), the step, the adapter version and the data cursor. The driver writes it, so
        the run directory only has to be reachable from the driver's node."""
        if self.run_dir is None:
            raise ValueError("save_checkpoint needs the trainer's run_dir (PPOTrainer(config, run_dir=...))")
        learner_state = ray.get(self._learner_state)
        # overlap mode: the next step's batch is already drawn (and generated); a resumed run
        # draws it again and generates it with the checkpoint's adapter
        order, rng = self._pending.cursor if self._pending is not None else self.cursor.state()
        path = save_checkpoint(self.run_dir, config=self.config, learner_state=learner_state,
                               model_dir=self.model_dir, keep=self.config.keep_checkpoints, trainer_state={
                                   "step": self.step, "order": order, "data_rng": rng,
                                   "prompts_sha256": self._prompts_key})
        self._last_checkpoint = time.monotonic()
        return path

    def restore(self, path: str | Path) -> Path:
        """Continue from a checkpoint (a step-NNNNNN directory, or a run directory: its
        newest intact one). Refuses one written with an incompatible config (CheckpointError)."""
        ckpt, learner_state, state = load_checkpoint(path, self.config)
        self._learner_state = ray.put(learner_state)
        versions = ray.get([learner.load_state_dict.remote(self._learner_state) for learner in self.roles.learners])
        version = versions[0]
        self._weights = {version: ray.put(learner_state["policy"])}
        ray.get([g.load_adapter.remote(version, self._weights[version], True) for g in self.roles.generators])
        self.version, self.step = version, int(state["step"])
        self.cursor.set_state((state["order"], state["data_rng"]))
        self._pending = None
        self._prompts_key = state.get("prompts_sha256")
        self._cursor_from_checkpoint = self._prompts_key is not None
        log.info("resumed from %s (step %d, adapter version %d)", ckpt, self.step, self.version)
        return ckpt

    # ------------------------------------------------------------------ faults
    def inject_faults(self, faults: Sequence[Fault]) -> None:
        """Tests: make actors die at named points of named steps (ppo_ray.faults). Each
        fault fires once, when its step runs."""
        names = set(self.roles.names())
        for fault in faults:
            if fault.role not in names:
                raise ValueError(f"fault role {fault.role!r}: this run's roles are {sorted(names)}")
        self._faults = list(faults)

    def _prepare_faults(self, step: int, current: Rollouts) -> None:
        """Arm this step's faults in their actors (they die in the named call); an idle fault
        kills its actor now and waits for Ray to restart it, so that the step's first call to
        it finds a fresh process."""
        actors = dict(zip(self.roles.names(), self.roles.all()))
        for fault in [f for f in self._faults if f.step == step]:
            actor = actors[fault.role]
            if fault.phase == "idle":
                try:
                    ray.get(actor.exit_now.remote())
                except ACTOR_ERRORS:
                    pass  # it died, as asked
                self._wait_for_actors()
                continue
            if fault.phase == "generate" and current.summaries:
                raise ValueError(f"{fault}: step {step}'s rollouts were generated during step {step - 1} "
                                 f"(overlap_generation): use phase 'prefetch' at step {step - 1}")
            # this step's own generate call comes first when its rollouts are not prefetched
            call = 2 if fault.phase == "prefetch" and not current.summaries else 1
            ray.get(actor.arm_fault.remote(fault.method, fault.when, call))

    def _learner_stats(self, refs: list) -> dict:
        """Rank 0's update stats. In a learner group a member that dies mid-update makes the
        others' collectives fail (a RayTaskError from a live member); the death is the cause,
        so it is what is raised (an actor error: restart, re-form the group, restore)."""
        try:
            return ray.get(refs)[0]
        except ray.exceptions.RayTaskError as error:
            if len(refs) > 1 and not isinstance(error, RETRYABLE):
                for ref in refs:
                    try:
                        ray.get(ref, timeout=300)
                    except RETRYABLE as died:
                        raise died from error
                    except Exception:  # noqa: BLE001 - a member's own collective failure: look further
                        pass
            raise

    def _role_name(self, error: BaseException) -> str:
        role = getattr(error, "role", None)  # StateLostError names its role
        if role:
            return role
        actor_id = getattr(error, "actor_id", None)
        for name, actor in zip(self.roles.names(), self.roles.all()):
            if actor_id and actor._actor_id.hex() == actor_id:
                return name
        return "unknown"

    def _count_retry(self, error: BaseException, where: str, step: Optional[int] = None) -> None:
        role = self._role_name(error)
        step = self.step + 1 if step is None else step
        self.metrics.record_retry(role)
        self.retries.append({"step": step, "role": role, "where": where})
        log.warning("step %d: actor ppo/%s failed in the %s (%s); waiting for its restart and %s",
                    step, role, where, type(error).__name__,
                    "retrying the step" if where == "step" else "redoing the committed step's " + where)

    def _wait_for_actors(self, timeout_s: float = 900.0) -> None:
        """Block until every role answers again (Ray re-runs a dead actor's constructor, up to
        config.max_actor_restarts times; a role out of restarts raises here)."""
        deadline = time.monotonic() + timeout_s
        for actor in self.roles.all():
            died = 0
            while True:
                try:
                    ray.get(actor.__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    pass
                except ray.exceptions.ActorDiedError:
                    # Just after a death the caller may not yet know that a restart is under
                    # way; an actor out of restarts keeps answering ActorDiedError.
                    died += 1
                    if died > 5:
                        raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"actors did not come back within {timeout_s:g} s")
                time.sleep(1.0)

    def _ensure_generators_at(self, version: int) -> None:
        """Give every generator that holds another version (a restarted one: the base model)
        the committed adapter `version` (the current one or, overlap mode, the one before)."""
        gens = self.roles.generators
        versions = ray.get([g.version.remote() for g in gens])
        stale = [g for g, v in zip(gens, versions) if v != version]
        if stale:
            ray.get([g.load_adapter.remote(version, self._weights[version], True) for g in stale])

    def _recover(self, current: Rollouts) -> Rollouts:
        """Back to the committed state after a failure before the commit point: wait for the
        restarts, re-form the learner group, restore every learner from the committed state
        (a learner may have stepped, or half-stepped, before the failure), and regenerate the
        step's rollouts if they were lost. Returns the rollouts to retry with."""
        self._wait_for_actors()
        self._restore_learners()
        if not self._intact(current):
            self._ensure_generators_at(current.version)
            self._submit(current)  # same prompts, seeds and version: the same samples
        self._ensure_generators_at(self.version)  # queued behind that generation
        return current

    def _restore_learners(self, best_effort: bool = False) -> None:
        """Every learner back to the committed state (re-forming the group first: a restarted
        member left it, and the others' collectives failed)."""
        try:
            if len(self.roles.learners) > 1:
                form_learner_group(self.roles)
            ray.get([learner.load_state_dict.remote(self._learner_state) for learner in self.roles.learners])
        except Exception:  # noqa: BLE001 - on the way out of a failed step: its own error is the one to raise
            if not best_effort:
                raise
            log.exception("could not put the learners back to the committed state after a failed step")

    @staticmethod
    def _intact(rollouts: Rollouts) -> bool:
        if not rollouts.summaries:
            return False
        try:
            ray.get(rollouts.summaries)
            return True
        except RETRYABLE:
            return False

    # ------------------------------------------------------------------ many steps
    def _draw(self, prompts: Sequence[str], ahead: int = 0) -> Rollouts:
        """The next config.batch_size prompts, as rollouts of step self.step + ahead + 1 to be
        sampled with the current version."""
        cursor = self.cursor.state()
        rows = self.cursor.draw(len(prompts), self.config.batch_size)
        return Rollouts(self._encode([prompts[i] for i in rows]), step=self.step + ahead, version=self.version,
                        cursor=cursor)

    def _checkpoint_due(self) -> bool:
        cfg = self.config
        by_steps = bool(cfg.checkpoint_every) and self.step % cfg.checkpoint_every == 0
        by_time = bool(cfg.checkpoint_every_minutes) and \
            time.monotonic() - self._last_checkpoint >= 60.0 * cfg.checkpoint_every_minutes
        return by_steps or by_time

    def train(self, prompts: Sequence[str], steps: Optional[int] = None, *, progress: bool = True,
              metrics_path: str | Path | None = None,
              evaluate: Optional[Callable[["PPOTrainer", int], dict]] = None,
              eval_prompts: Optional[Sequence[str]] = None) -> list[dict]:
        """Run PPO steps on batches of config.batch_size prompts drawn without replacement
        from `prompts`, reshuffled every epoch with the run seed: `steps` more steps, or by
        default until the run's step count reaches config.steps (so after restore() it
        continues the run). Each finished step is logged as one line (logging, INFO) unless
        `progress` is False. `evaluate(trainer, step)`, if given, runs every
        config.eval_every steps and at the end; its (small) dict is merged into that step's
        metrics. At the same steps the first config.eval_samples of `eval_prompts` are
        sampled with the current policy and scored by the reward actor: appended to
        <run_dir>/eval_samples.jsonl and the trackers, their mean as eval_reward_mean. With a
        run_dir, a checkpoint is written every config.checkpoint_every steps, every
        config.checkpoint_every_minutes and at the end, and the trackers of
        config.report_to (TensorBoard event files in <run_dir>/tensorboard) get every step.
        An actor that dies is restarted and its step retried from the committed state (see
        _run_step): no step is lost, doubled or restarted. metrics_path keeps one line per
        step: lines past the current step (a resumed run) are dropped before appending, in
        eval_samples.jsonl too."""
        if not prompts:
            raise ValueError("train() needs a non-empty list of prompts")
        key = _fingerprint(prompts)
        if self._prompts_key is not None and self._prompts_key != key:
            if self._cursor_from_checkpoint:
                raise CheckpointError(f"train() got a different prompt list ({len(prompts)} prompts) from the one "
                                      "the checkpoint's data cursor indexes: resume with the run's dataset")
            self.cursor.order = []  # a new prompt list: a new epoch over it
        self._prompts_key, self._cursor_from_checkpoint = key, False
        target = self.step + steps if steps is not None else self.config.steps
        history: list[dict] = []
        every = self.config.eval_every
        samples = list(eval_prompts or [])[: self.config.eval_samples]
        samples_path = self.run_dir / EVAL_SAMPLES if self.run_dir is not None else None
        saved_at = None
        for path in (metrics_path, samples_path):
            if path:
                _truncate_metrics(Path(path), self.step)
        trackers = Trackers()
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tags = read_run_tags(self.run_dir)  # one per process that trained in this run directory
            update_run_file(self.run_dir, run_tag=self.namespace,
                            run_tags=tags if tags[-1:] == [self.namespace] else [*tags, self.namespace])
            trackers = Trackers.open(self.run_dir, self.config.report_to, self.config.to_dict(), self.namespace,
                                     first_step=self.step + 1)
        self._last_checkpoint = time.monotonic()
        try:
            while self.step < target:
                current, self._pending = self._pending or self._draw(prompts), None
                upcoming = (self._draw(prompts, ahead=1)
                            if self.config.overlap_generation and self.step + 1 < target else None)
                before = self.step
                try:
                    out, self._pending = self._run_step(current, upcoming)
                except BaseException:
                    # the batches drawn for what did not happen are drawn again next time
                    lost = current if self.step == before else upcoming
                    if lost is not None and lost.cursor is not None:
                        self.cursor.set_state(lost.cursor)
                    raise
                if (every and out["step"] % every == 0) or out["step"] == target:
                    if evaluate:
                        out.update(evaluate(self, out["step"]))
                    if samples:
                        rows = self._eval_samples(samples, out["step"])
                        out["eval_reward_mean"] = _nanmean(torch.tensor([r["reward"] for r in rows]))
                        if samples_path is not None:
                            with open(samples_path, "a") as f:
                                f.writelines(json.dumps(r) + "\n" for r in rows)
                        trackers.log_samples(out["step"], rows)
                history.append(out)
                self.metrics.record_step(out)
                trackers.log_step(out)
                if metrics_path:
                    small = {k: v for k, v in out.items() if not isinstance(v, list)}
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(small) + "\n")
                if self.run_dir is not None and self._checkpoint_due():
                    self.save_checkpoint()
                    saved_at = self.step
                if progress:
                    log.info(format_step(out, target))
            if self.run_dir is not None and saved_at != self.step and history:
                self.save_checkpoint()
        finally:
            trackers.close()
            if self._pending is not None:  # a stopped run: its prefetched batch is drawn again next time
                self.cursor.set_state(self._pending.cursor)
                self._pending = None
        return history

    def _eval_samples(self, prompts: list[str], step: int) -> list[dict]:
        """The current policy's responses to `prompts`, scored by the reward actor. The same
        sampling seeds at every evaluation (common random numbers across steps)."""
        out = self.generate(prompts, seed_step=EVAL_SEED_STEP, score=True)
        return [{"step": step, "prompt": p, "response": t, "reward": r, "finish_reason": f}
                for p, t, r, f in zip(prompts, out["texts"], out["rewards"], out["finish_reasons"])]

    def shutdown(self) -> None:
        """Kill the actors and remove their placement group (its reserved resources are freed)."""
        self.roles.release()


EVAL_SAMPLES = "eval_samples.jsonl"
EVAL_SEED_STEP = 10**9 + 1  # sampling seeds of the eval samples: a step index no training step reaches


def read_run_tags(run_dir: Path) -> list[str]:
    from ppo_ray.tracking import read_run_file

    return list(read_run_file(run_dir).get("run_tags", []))


def _fingerprint(prompts: Sequence[str]) -> str:
    h = hashlib.sha256(str(len(prompts)).encode())
    for p in prompts:
        h.update(hashlib.sha256(p.encode()).digest())
    return h.hexdigest()


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics lines of steps after `step` (atomically: temp file + os.replace)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(keep) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _nanmean(x: torch.Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return float(finite.mean()) if len(finite) else math.nan
