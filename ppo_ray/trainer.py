"""PPOTrainer: the driver-side orchestration of one PPO step (seed steps 1-11) on Ray.

    trainer = PPOTrainer(PPOConfig(...))
    out = trainer.ppo_step(prompts)        # one step: generated_texts, rewards, losses, kl, ...
    history = trainer.train(prompts, steps=100)

Data between actors travels as ObjectRefs; the driver pulls only small things (texts,
B scores, stats). The generator reports the adapter version it sampled with and the
learner refuses rollouts from any other version, so a lost LoRA sync is an error, never
a silent off-policy step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import ray
import torch

from ppo_ray.checkpoint import CheckpointError, checkpoint_root, load_checkpoint, resolve_checkpoint, save_checkpoint
from ppo_ray.config import PPOConfig
from ppo_ray.data import encode_prompts
from ppo_ray.metrics import TrainingMetrics
from ppo_ray.modeling import load_tokenizer, resolve_model_path
from ppo_ray.placement import Roles, create_roles, form_learner_group, init_ray, split_evenly


log = logging.getLogger(__name__)

# An actor died or is restarting (ActorDiedError and ActorUnavailableError are subclasses).
ACTOR_ERRORS = (ray.exceptions.RayActorError,)


class StaleAdapterError(RuntimeError):
    """A generator sampled with a LoRA version other than the learner's."""


class PPOTrainer:
    def __init__(self, config: PPOConfig, *, run_dir: str | Path | None = None):
        self.config = config
        # Everything that can fail cheaply fails before any actor starts.
        from actors.reward import check_reward_model, import_reward_fn

        for spec in config.reward_funcs:
            import_reward_fn(spec)
        if config.reward_model_name is None and not config.reward_funcs:
            raise ValueError("no reward source: set reward_model_name and/or reward_funcs in the config")
        if config.reward_model_name is not None:
            check_reward_model(config.reward_model_name)  # its config.json: a causal LM is refused here
        self.model_dir = resolve_model_path(config.model_name)
        self.ref_model_dir = resolve_model_path(config.ref_model_name or config.model_name)
        self.reward_model_dir = resolve_model_path(config.reward_model_name) if config.reward_model_name else None
        self.value_model_dir = resolve_model_path(config.value_model_name) if config.value_model_name else None
        self.tokenizer = load_tokenizer(self.model_dir)
        self.run_dir = Path(run_dir) if run_dir else None

        init_ray()
        self.namespace = f"ppo-{uuid.uuid4().hex[:8]}"
        self.metrics = TrainingMetrics(run=self.namespace)  # Prometheus gauges, tagged run=namespace
        self.roles: Roles = create_roles(
            config, model_dir=self.model_dir, ref_model_dir=self.ref_model_dir,
            reward_model_dir=self.reward_model_dir, value_model_dir=self.value_model_dir,
            namespace=self.namespace)
        self.version = ray.get(self.roles.learner.version.remote())
        self.step = 0
        # The data cursor (checkpointed): prompts still to be drawn this epoch, and the RNG
        # that shuffles the next epoch; plus a fingerprint of the prompt list they index.
        self._order: list[int] = []
        self._data_rng = torch.Generator().manual_seed(config.seed)
        self._prompts_key: Optional[str] = None
        self._cursor_from_checkpoint = False
        self._checkpoint_cursor: Optional[tuple] = None  # overlap mode: the cursor before the prefetched batch
        self.retries: list[dict] = []  # {"step", "role", "where"} of every actor failure survived

    # ------------------------------------------------------------------ one step
    def ppo_step(self, prompts: Sequence[str]) -> dict:
        """One PPO step on `prompts` (one rollout each). Returns texts, scores, losses,
        KL, the PPO diagnostics and per-phase seconds (all small Python values)."""
        t_start = time.perf_counter()
        return self._train_step(self._generate(self._encode(prompts), self.step), t_start)[0]

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        cfg = self.config
        return encode_prompts(self.tokenizer, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation)

    def _generate(self, prompt_ids: list[list[int]], step: int) -> tuple[list, list]:
        """1-2. Generate on every replica (prompt order kept; seeds follow the global index):
        (batch refs, summary refs), not waited for."""
        gens = self.roles.generators
        chunks = [(s, e) for s, e in split_evenly(len(prompt_ids), len(gens)) if e > s]
        parts, summaries = [], []
        for gen, (s, e) in zip(gens, chunks):
            batch_ref, summary_ref = gen.generate.remote(prompt_ids[s:e], step, s)
            parts.append(batch_ref)
            summaries.append(summary_ref)
        return parts, summaries

    def _train_step(self, rollouts: tuple[list, list], t_start: float,
                    prefetch: Optional[tuple[list[list[int]], int]] = None) -> tuple[dict, Optional[tuple]]:
        """Steps 3-11 and the sync on rollouts from _generate. With `prefetch` (prompt ids,
        step) the next step's generation is submitted before waiting for the learner, so it
        runs while the learner trains (overlap mode; it samples with the current adapter,
        one version behind the update in flight). Returns (step output, prefetched rollouts)."""
        cfg, roles = self.config, self.roles
        parts, summaries = rollouts

        # 3-4. Reference logprobs and rewards, concurrently, straight from the object store.
        ref_logprobs = roles.reference.logprobs.remote(*parts)
        scores_ref, reward_stats_ref = roles.reward.score.remote(*parts)

        # 5-11. The learner: old logprobs/values, KL, shaped rewards, TD, GAE, returns, PPO.
        # Every learner of the group gets the same refs and takes its own shard of the rows;
        # rank 0's stats and weights speak for the group (all hold the same adapter).
        updates = [learner.update.remote(ref_logprobs, scores_ref, *parts) for learner in roles.learners]
        stats_ref, weights_ref = updates[0]
        next_rollouts = self._generate(*prefetch) if prefetch is not None else None

        summaries = ray.get(summaries)
        versions = {s["version"] for s in summaries}
        behind = {self.version - v for v in versions}
        if len(versions) != 1 or not behind <= ({0, 1} if cfg.overlap_generation else {0}):
            raise StaleAdapterError(f"generators sampled with adapter versions {sorted(versions)} "
                                    f"but the learner is at version {self.version}")
        stats = self._learner_stats([u[0] for u in updates])  # raises a learner's own error (e.g. stale rollouts)
        t_update_done = time.perf_counter()
        if next_rollouts is not None:  # the sync queues behind the prefetched generation
            ray.get(next_rollouts[1])
        t_generation_done = time.perf_counter()

        # Sync: the new LoRA goes from the learner's object store entry to every replica.
        # The learner has already stepped: a generator that dies here is restarted and given
        # the new adapter, and the step is kept (redoing it would update twice).
        new_version = int(stats["version"])
        try:
            loads = ray.get([g.load_adapter.remote(new_version, weights_ref) for g in roles.generators])
        except ACTOR_ERRORS as e:
            self._count_retry(e, "sync")
            self._wait_for_actors()
            loads = ray.get([g.load_adapter.remote(new_version, weights_ref, True) for g in roles.generators])
        bad = [r["version"] for r in loads if r["version"] != new_version]
        if bad:
            raise StaleAdapterError(f"generators report adapter versions {bad} after loading {new_version}")
        sync_s = time.perf_counter() - t_generation_done
        self.version = new_version

        scores, reward_stats = ray.get([scores_ref, reward_stats_ref])
        ref_s = ray.get(roles.reference.last_seconds.remote())
        self.step += 1
        wall = time.perf_counter() - t_start
        tokens = sum(s["tokens"] for s in summaries)
        out = {
            "step": self.step,
            "generated_texts": [t for s in summaries for t in s["texts"]],
            "finish_reasons": [f for s in summaries for f in s["finish_reasons"]],
            "rewards": scores.tolist(),
            "reward_mean": _nanmean(scores),
            # the learner's reward_mean is the shaped (score - beta*KL) return per sequence
            **{("shaped_reward_mean" if k == "reward_mean" else k): v for k, v in stats.items()
               if not isinstance(v, (list, dict))},
            **{k: v for k, v in reward_stats.items() if k != "reward_s"},
            "adapter_version": self.version,
            "time/generate_s": max(s["generate_s"] for s in summaries),
            "time/reference_s": ref_s,
            "time/reward_s": reward_stats["reward_s"],
            "time/learner_forward_s": stats.get("learner_forward_s", math.nan),
            "time/update_s": stats.get("update_s", math.nan),
            "time/sync_s": sync_s,
            # overlap mode: how long the driver waited for the prefetched generation after the
            # learner finished (0 when generation is the faster of the two)
            "time/prefetch_wait_s": t_generation_done - t_update_done,
            # the sync's parts on the generator side (the rest of sync_s is the object-store
            # transfer of the LoRA tensors and the actor call)
            "time/sync_write_s": max(r["write_s"] for r in loads),
            "time/sync_register_s": max(r["register_s"] + r["retire_s"] for r in loads),
            "lora_sync_bytes": loads[0]["bytes"],
            "time/step_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else math.nan,
            "response_tokens": tokens,
        }
        return out, next_rollouts

    # ------------------------------------------------------------------ evaluation
    def generate(self, prompts: Sequence[str], seed_step: int = 10**9) -> dict:
        """Sample one response per prompt with the current policy (no training). A fixed
        `seed_step` gives every prompt the same sampling seed before and after training,
        so comparisons of two policies use common random numbers."""
        cfg, gens = self.config, self.roles.generators
        prompt_ids = encode_prompts(self.tokenizer, list(prompts), cfg.max_prompt_length, cfg.prompt_truncation)
        chunks = [(s, e) for s, e in split_evenly(len(prompt_ids), len(gens)) if e > s]
        refs = [gen.generate.remote(prompt_ids[s:e], seed_step, s)[1] for gen, (s, e) in zip(gens, chunks)]
        summaries = ray.get(refs)
        return {"texts": [t for s in summaries for t in s["texts"]],
                "finish_reasons": [f for s in summaries for f in s["finish_reasons"]],
                "version": summaries[0]["version"]}

    def save_adapter(self, path: str | Path) -> Path:
        """Write the policy's LoRA adapter (PEFT format: PeftModel.from_pretrained and vLLM load it).
        The path must be reachable from the learner's node (local runs: any path)."""
        return Path(ray.get(self.roles.learner.save_adapter.remote(str(path))))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write <run_dir>/checkpoints/step-NNNNNN atomically (see ppo_ray.checkpoint): both
        adapters and the value head, both optimisers, the RNG states, the step, the adapter
        version and the data cursor. The driver writes it, so the run directory only has to
        be reachable from the driver's node."""
        if self.run_dir is None:
            raise ValueError("save_checkpoint needs the trainer's run_dir (PPOTrainer(config, run_dir=...))")
        learner_state = ray.get(self.roles.learner.state_dict.remote())
        # overlap mode: the next step's batch is already drawn (and being generated); a resumed
        # run draws it again and generates it with the checkpoint's adapter
        order, rng = self._checkpoint_cursor or self._cursor()
        return save_checkpoint(self.run_dir, config=self.config, learner_state=learner_state, model_dir=self.model_dir,
                               keep=self.config.keep_checkpoints, trainer_state={
                                   "step": self.step, "order": order, "data_rng": rng,
                                   "prompts_sha256": self._prompts_key})

    def restore(self, path: str | Path) -> Path:
        """Continue from a checkpoint (a step-NNNNNN directory, or a run directory: its
        latest). Refuses one written with an incompatible config (CheckpointError)."""
        ckpt, learner_state, state = load_checkpoint(path, self.config)
        versions = ray.get([learner.load_state_dict.remote(learner_state) for learner in self.roles.learners])
        version = versions[0]
        weights = ray.put(learner_state["policy"])
        ray.get([g.load_adapter.remote(version, weights, True) for g in self.roles.generators])
        self.version, self.step = version, int(state["step"])
        self._order = list(state["order"])
        self._data_rng.set_state(state["data_rng"])
        self._prompts_key = state.get("prompts_sha256")
        self._cursor_from_checkpoint = self._prompts_key is not None
        log.info("resumed from %s (step %d, adapter version %d)", ckpt, self.step, self.version)
        return ckpt

    # ------------------------------------------------------------------ faults
    def _learner_stats(self, refs: list) -> dict:
        """Rank 0's update stats. In a learner group a member that dies mid-update makes the
        others' collectives fail (a RayTaskError from a live member); the death is the cause,
        so it is what is raised (an actor error: restart, re-form the group, roll back)."""
        try:
            return ray.get(refs)[0]
        except ray.exceptions.RayTaskError as error:
            if len(refs) > 1:
                for ref in refs:
                    try:
                        ray.get(ref, timeout=300)
                    except ACTOR_ERRORS as died:
                        raise died from error
                    except Exception:  # noqa: BLE001 - a member's own collective failure: look further
                        pass
            raise

    def _role_name(self, error: BaseException) -> str:
        actor_id = getattr(error, "actor_id", None)
        names = dict(zip(self.roles.names(), self.roles.all()))
        for name, actor in names.items():
            if actor_id and actor._actor_id.hex() == actor_id:
                return name
        return "unknown"

    def _count_retry(self, error: BaseException, where: str) -> None:
        role = self._role_name(error)
        self.metrics.record_retry(role)
        self.retries.append({"step": self.step + 1, "role": role, "where": where})
        log.warning("step %d: actor ppo/%s failed (%s); waiting for its restart and retrying",
                    self.step + 1, role, type(error).__name__)

    def _wait_for_actors(self, timeout_s: float = 900.0) -> None:
        """Block until every role answers again (Ray re-runs a dead actor's constructor, up to
        config.max_actor_restarts times; a role out of restarts raises here)."""
        deadline = time.monotonic() + timeout_s
        for actor in self.roles.all():
            while True:
                try:
                    ray.get(actor.__ray_ready__.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)

    def _recover(self) -> bool:
        """After an actor died mid-step: wait for the restarts, give restarted generators the
        current adapter, and if the learner lost its state roll the run back to the last
        checkpoint (or to step 0 without one). Returns True if the run was rolled back."""
        self._wait_for_actors()
        learner_versions = ray.get([learner.version.remote() for learner in self.roles.learners])
        if any(v != self.version for v in learner_versions):  # a fresh learner
            latest = None
            if self.run_dir is not None:
                try:
                    latest = resolve_checkpoint(self.run_dir)
                except CheckpointError:
                    latest = None
            if latest is None and len(self.roles.learners) > 1:
                # no checkpoint: only the initial state is common ground, which the survivors
                # no longer hold, so every member restarts
                for learner in self.roles.learners:
                    ray.kill(learner, no_restart=False)
                self._wait_for_actors()
            # a restarted member left the group (and the others' collectives failed): re-form it
            form_learner_group(self.roles)
            if latest is not None:
                self.restore(latest)  # every member loads the same checkpoint
            else:  # no checkpoint yet: the restarted learner is the run's initial state
                version, weights = ray.get(self.roles.learner.current_weights.remote())
                ray.get([g.load_adapter.remote(version, weights, True) for g in self.roles.generators])
                self.version, self.step, self._order = version, 0, []
                self._data_rng = torch.Generator().manual_seed(self.config.seed)
                log.warning("learner restarted with no checkpoint in %s: the run restarts from step 0", self.run_dir)
            return True
        versions = ray.get([g.version.remote() for g in self.roles.generators])
        stale = [g for g, v in zip(self.roles.generators, versions) if v != self.version]
        if stale:
            version, weights = ray.get(self.roles.learner.current_weights.remote())
            ray.get([g.load_adapter.remote(version, weights, True) for g in stale])
        return False

    def _step_with_retries(self, batch: Sequence[str]) -> Optional[dict]:
        """ppo_step, retried after an actor failure (config.max_step_retries times). None
        when the learner was restarted and the run rolled back to a checkpoint."""
        for attempt in range(self.config.max_step_retries + 1):
            try:
                return self.ppo_step(batch)
            except ACTOR_ERRORS as e:
                if attempt == self.config.max_step_retries:
                    raise
                self._count_retry(e, "step")
                if self._recover():
                    return None
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ many steps
    def _cursor(self) -> tuple[list[int], torch.Tensor]:
        return list(self._order), self._data_rng.get_state()

    def _set_cursor(self, cursor: tuple[list[int], torch.Tensor]) -> None:
        self._order = list(cursor[0])
        self._data_rng.set_state(cursor[1])

    def _sync_steps(self, prompts: Sequence[str], target: int) -> Iterator[Optional[dict]]:
        while self.step < target:
            yield self._step_with_retries(self._next_batch(prompts))

    def _overlap_steps(self, prompts: Sequence[str], target: int) -> Iterator[Optional[dict]]:
        """overlap_generation: step k+1's rollouts are generated while the learner trains on
        step k's. After an actor failure the pipeline restarts at the failed step with fresh
        (on-policy) rollouts of the same prompts."""
        pending = None  # (prompts, rollouts) of step self.step + 1, generated with the previous adapter
        failures = 0
        while self.step < target:
            t_start = time.perf_counter()
            start = self._cursor()  # before this step's batch is drawn: where a retry restarts
            if pending is None:
                current = self._generate(self._encode(self._next_batch(prompts)), self.step)
            else:
                current, pending = pending, None
            prefetch = None
            if self.step + 1 < target:
                # a checkpoint after this step must resume before the prefetched batch
                self._checkpoint_cursor = self._cursor()
                prefetch = (self._encode(self._next_batch(prompts)), self.step + 1)
            try:
                out, pending = self._train_step(current, t_start, prefetch)
            except ACTOR_ERRORS as e:
                self._checkpoint_cursor = None
                if failures == self.config.max_step_retries:
                    raise
                failures += 1
                self._count_retry(e, "step")
                pending = None
                if self._recover():
                    yield None
                else:
                    self._set_cursor(start)
                continue
            failures = 0
            yield out
        self._checkpoint_cursor = None

    def _next_batch(self, prompts: Sequence[str]) -> list[str]:
        """config.batch_size prompts drawn without replacement, reshuffled every epoch."""
        bs = self.config.batch_size
        while len(self._order) < bs:
            self._order += torch.randperm(len(prompts), generator=self._data_rng).tolist()
        rows, self._order = self._order[:bs], self._order[bs:]
        return [prompts[i] for i in rows]

    def train(self, prompts: Sequence[str], steps: Optional[int] = None, *, progress: bool = True,
              metrics_path: str | Path | None = None,
              evaluate: Optional[Callable[["PPOTrainer", int], dict]] = None) -> list[dict]:
        """Run PPO steps on batches of config.batch_size prompts drawn without replacement
        from `prompts`, reshuffled every epoch with the run seed: `steps` more steps, or by
        default until the run's step count reaches config.steps (so after restore() it
        continues the run). `evaluate(trainer, step)`, if given, runs every
        config.eval_every steps and at the end; its (small) dict is merged into that step's
        metrics. With a run_dir, a checkpoint is written every config.checkpoint_every steps
        and at the end. A dead actor is restarted and its step retried; a dead learner rolls
        the run back to the last checkpoint. metrics_path keeps one line per step: lines
        past the current step (a resumed or rolled-back run) are dropped before appending."""
        from tqdm.auto import tqdm

        if not prompts:
            raise ValueError("train() needs a non-empty list of prompts")
        key = _fingerprint(prompts)
        if self._prompts_key is not None and self._prompts_key != key:
            if self._cursor_from_checkpoint:
                raise CheckpointError(f"train() got a different prompt list ({len(prompts)} prompts) from the one "
                                      "the checkpoint's data cursor indexes: resume with the run's dataset")
            self._order = []  # a new prompt list: a new epoch over it
        self._prompts_key, self._cursor_from_checkpoint = key, False
        target = self.step + steps if steps is not None else self.config.steps
        history: list[dict] = []
        every, ckpt_every = self.config.eval_every, self.config.checkpoint_every
        saved_at = None
        if metrics_path:
            _truncate_metrics(Path(metrics_path), self.step)
        bar = tqdm(total=target, initial=self.step, desc="PPO", disable=not progress, dynamic_ncols=True)
        steps_iter = (self._overlap_steps if self.config.overlap_generation else self._sync_steps)(prompts, target)
        try:
            for out in steps_iter:
                if out is None:  # rolled back: forget the steps after the checkpoint
                    history = [h for h in history if h["step"] <= self.step]
                    if metrics_path:
                        _truncate_metrics(Path(metrics_path), self.step)
                    bar.n = self.step
                    bar.refresh()
                    continue
                if evaluate and ((every and out["step"] % every == 0) or out["step"] == target):
                    out.update(evaluate(self, out["step"]))
                history.append(out)
                self.metrics.record_step(out)
                if metrics_path:
                    small = {k: v for k, v in out.items() if not isinstance(v, list)}
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(small) + "\n")
                if self.run_dir is not None and ckpt_every and self.step % ckpt_every == 0:
                    self.save_checkpoint()
                    saved_at = self.step
                bar.update(1)
                bar.set_postfix(reward=f"{out['reward_mean']:.3f}", kl=f"{out.get('kl', math.nan):.3f}",
                                step_s=f"{out['time/step_s']:.1f}")
            if self.run_dir is not None and saved_at != self.step and history:
                self.save_checkpoint()
        finally:
            bar.close()
        return history

    def shutdown(self) -> None:
        """Kill the actors and remove their placement group (its reserved resources are freed)."""
        self.roles.release()


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
