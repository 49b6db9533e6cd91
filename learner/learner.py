"""The learner: policy LoRA + (with a critic) value model, one PPO update per step.

Plain class, no Ray (ppo_ray.placement hosts it in an actor). Given one step's rollouts
(from the generator, sampled with LoRA version `self.version`), the reference logprobs and
the sequence scores, `update` runs the no-grad pass (step 1: old logprobs and values),
hands it to learner.experience.make_experience (steps 2-6: KL_t, shaped rewards, the
configured estimator's advantages, returns), runs the PPO epochs (steps 7-11), and returns
small stats and the new LoRA weights (version + 1) for the generator.

The math is learner.algos (pure functions; the advantage estimators are registered there);
this module is the forwards, the micro-batching, the optimisers and the bookkeeping.

Choices, and where they come from:
* Old logprobs use the generator's exact sampling distribution: logits / temperature,
  then the same top-k / top-p truncation (ppo_ray.logprobs.logprobs_from_logits mirrors
  vLLM). The PPO ratio is between two such truncated distributions, so the first
  minibatch has ratio == 1 exactly (float32, no dropout).
* The KL to the reference uses the full softmax at temperature for both sides, as the
  reference scorer does: a truncated policy vs an untruncated reference would bias KL_t
  upwards (the truncated policy renormalises its kept mass to 1).
* A sampled token that the learner's truncation drops (old logprob -inf: the generator
  and learner disagree at the nucleus boundary, e.g. vLLM's Triton top-k/top-p on GPU)
  has no defined ratio: it is left out of the policy loss (kept in the value loss and the
  KL) and counted in stats["truncated_tokens"].
* Two optimisers (separate learning rates, N+ / seeds), Adam with eps 1e-5 (N+), no
  weight decay. The value loss's gradient reaches only the value model, so a vf_coef
  would only rescale an Adam-normalised gradient: there is none.
* Gradient accumulation: every micro-batch loss is normalised by the minibatch's number
  of real tokens (rows, for seq_mean_token_mean), so the accumulated gradient equals the
  full minibatch's token mean (OpenRLHF tests/test_loss_aggregation.py).
* One host synchronisation per update for the stats (plus one after the scoring pass on a
  GPU, to time it); micro-batch trimming uses host-side row lengths read once.
* The speed options (ppo_ray.config's "learner speed" block: length-sorted micro-batches,
  the mask-free causal layout, chunked logprobs, fused LoRA / RMSNorm forwards, gradient
  checkpointing, torch.compile) change how the same quantities are computed, never which:
  tests/test_learner_speed.py holds them to the plain path within 1e-5 in float32. Why they
  exist: benchmarks/RESULTS.md ("The learner's update on the GPU").
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import Tensor

from learner.algos import adaptive_kl_coef, advantage_estimator, agg_loss, check_group_size, ppo_clip_loss, value_loss
from learner.buffer import Experience, ExperienceBuffer
from learner.experience import RolloutScores, make_experience, score_tensors
from learner.kernels import cached_casts, clear_casts
from learner.speed import SpeedPath
from learner.value_model import ValueHead, ValueModel
from ppo_ray.batch import RolloutBatch, TrimPlan, fresh_enough, rollout_micro_batches, staleness_limit
from ppo_ray.checkpoint import LearnerState
from ppo_ray.config import ConfigSlice, PPOConfig
from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, pick_device
from ppo_ray.stats import LearnerStats

ADAM_EPS = 1e-5  # N+ (summarize_from_feedback_details ppo.py: eps=1e-5)


class LRPlan:
    """The learning-rate factor at optimiser step t (torch's LambdaLR calls it): 1 for
    lr_scheduler constant; for linear, 1 - t / end, reaching 0 at `end` = the run's planned
    optimiser steps (the N+ recipe's anneal). A callable object, so LambdaLR's state_dict
    saves and restores `end` with the checkpoint. When the run's planned total changes (a
    resume with another `steps`, train() past it; the trainer logs it), `end` moves and the
    rate from then on is that of a run planned for the new total."""

    def __init__(self, kind: str, end: int):
        self.kind, self.end = kind, end

    def __call__(self, t: int) -> float:
        if self.kind == "constant":
            return 1.0
        return max(0.0, 1.0 - t / self.end) if self.end > 0 else 0.0


class StaleRolloutsError(RuntimeError):
    """Rollouts sampled with a LoRA version other than the learner's current one."""


class CheckpointMismatchError(ValueError):
    """A checkpoint whose tensors do not fit this learner (other model, LoRA rank or targets)."""


def disable_dropout(model: torch.nn.Module) -> None:
    """Set p = 0 in every dropout layer of `model` (PEFT's lora_dropout included): train mode
    then computes exactly what eval mode does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _to_cpu(obj):
    """A copy of a (nested) optimiser state with every tensor on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _check_tensors(what: str, mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if missing or extra:
        raise CheckpointMismatchError(
            f"checkpoint's {what} does not match this run: missing {missing[:3]}, unexpected {extra[:3]} "
            f"(different lora_target_modules or model?)")
    for k, v in mine.items():
        if tuple(theirs[k].shape) != tuple(v.shape):
            raise CheckpointMismatchError(
                f"checkpoint's {what} tensor {k} has shape {tuple(theirs[k].shape)}, this run needs "
                f"{tuple(v.shape)} (different lora_r or model?)")


def _tensors_to_cpu(tensors: dict[str, Tensor], flat: bool = False) -> dict[str, Tensor]:
    """Independent contiguous CPU copies of `tensors`. Tensors on an accelerator (or all,
    with flat=True) travel as one flat copy per dtype: one device-to-host transfer (one wait
    for the device) instead of one per tensor (392 for Qwen3-0.6B's adapter, measured:
    benchmarks/RESULTS.md)."""
    out: dict[str, Tensor] = {}
    groups: dict[torch.dtype, list[str]] = {}
    for k, v in tensors.items():
        if v.device.type == "cpu" and not flat:
            out[k] = v.to("cpu", copy=True).contiguous()
        else:
            groups.setdefault(v.dtype, []).append(k)
    for keys in groups.values():
        joined = torch.cat([tensors[k].reshape(-1) for k in keys]).cpu()
        for k, piece in zip(keys, joined.split([tensors[k].numel() for k in keys])):
            out[k] = piece.view(tensors[k].shape).clone()
    return {k: out[k] for k in tensors}


class Learner:
    """Policy (base + PEFT LoRA) and, for an estimator with a critic, the value model (own
    backbone + LoRA + head, or a head on the policy's trunk), PPO updates."""

    # The config fields the learner reads (and log_level, its actor host's): the learner actor
    # gets only these (PPOConfig.slice); effective_mini_batch_size is derived from two of them.
    CONFIG_FIELDS = (
        "seed", "dtype", "log_level", "steps", "batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs",
        "learning_rate", "value_learning_rate", "lr_scheduler", "max_grad_norm", "advantage_estimator",
        "samples_per_prompt", "grpo_norm_std", "gamma", "lam",
        "clip_epsilon",
        "value_clip", "vf_coef", "entropy_coef", "loss_agg", "whiten_advantages", "whiten_rewards", "kl_coef",
        "kl_estimator", "kl_target", "kl_horizon", "reward_shaping", "nonfinite_reward", "overlap_generation",
        "temperature", "top_k", "top_p", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
        "ppo_dropout", "value_model", "value_model_name", "learner_sort_by_length", "learner_layout",
        "logprob_chunk_size", "rms_norm_kernel", "gradient_checkpointing", "lora_kernel", "learner_compile",
        "learner_compile_scope",
        "old_logprobs", "old_logprobs_check_every")

    def __init__(self, config: PPOConfig | ConfigSlice, model_path: str, value_model_path: Optional[str] = None,
                 device: Optional[str] = None):
        from peft import LoraConfig, TaskType, get_peft_model

        self.config = config
        self.device = pick_device(device)
        # One seed for the adapters' init (policy, then value) and the dropout stream: the
        # global RNG is seeded here and then only consumed by LoRA dropout in update().
        torch.manual_seed(config.seed)
        base = load_causal_lm(model_path, config.dtype)
        self.policy = get_peft_model(base, LoraConfig(
            r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=list(config.lora_target_modules), bias="none", task_type=TaskType.CAUSAL_LM))
        # The advantage estimator (learner.algos' registry, GAE by default); one without a
        # critic gets no value model, value optimiser, value loss or value statistics.
        self.estimator = advantage_estimator(config.advantage_estimator)
        check_group_size(self.estimator, config.samples_per_prompt)
        self.critic = self.estimator.needs_critic
        self._shared = self.critic and config.value_model == "shared"
        self.value_model: Optional[torch.nn.Module] = None
        if self._shared:  # a head on the policy's trunk: one forward gives logprobs and values
            self.value_model = ValueHead(base.config.hidden_size)
        elif self.critic:
            self.value_model = ValueModel(
                value_model_path or config.value_model_name or model_path, lora_r=config.lora_r,
                lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                target_modules=config.lora_target_modules, dtype=config.dtype, seed=config.seed)
        self.models = [self.policy] + ([self.value_model] if self.critic else [])  # what trains
        if not config.ppo_dropout:
            # PPO's forwards without dropout (N+; TRL's disable_dropout): the old logprobs come
            # from a dropout-free pass, so dropout in the training forward alone would put the
            # first minibatch's ratio off 1. The adapters keep lora_dropout in their config.
            for model in self.models:
                disable_dropout(model)
        for model in self.models:
            model.to(self.device).eval()
        self.vocab_size = self.policy.get_input_embeddings().weight.shape[0]
        self.speed = SpeedPath(config, self.policy, self.value_model, self._shared)  # how token stats are computed

        self.policy_params = [p for p in self.policy.parameters() if p.requires_grad]
        self.value_params = self.value_model.trainable_parameters() if self.critic else []
        self.policy_optimizer = torch.optim.Adam(self.policy_params, lr=config.learning_rate, eps=ADAM_EPS)
        self.value_optimizer = (torch.optim.Adam(self.value_params, lr=config.value_learning_rate, eps=ADAM_EPS)
                                if self.critic else None)
        self.schedulers = self._lr_schedulers()
        # beta of the KL penalty: config.kl_coef, moved after every update by the adaptive
        # controller when config.kl_target is set (part of state_dict, so a retried or
        # resumed step uses the committed value)
        self.kl_coef = float(config.kl_coef)
        self.version = 0
        # Called with each update's Experience (the step's per-token tensors, on the device)
        # before the PPO epochs: for tests and benchmarks that inspect it; None = nothing kept.
        self.experience_hook: Optional[Callable[[Experience], None]] = None
        self.rank, self.world_size = 0, 1  # data parallelism: see join_group

    def reconfigure(self, config: PPOConfig | ConfigSlice) -> None:
        """Take a changed config on a built learner (benchmarks and tests switch the speed
        options on one learner): the learner and its speed path read it from now on."""
        self.config = config
        self.speed.configure(config)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The policy's optimiser, then the value model's (with a critic)."""
        return [self.policy_optimizer] + ([self.value_optimizer] if self.critic else [])

    @property
    def _ticks_per_step(self) -> int:
        cfg = self.config
        return cfg.ppo_epochs * (cfg.batch_size // cfg.effective_mini_batch_size)

    def _lr_schedulers(self) -> list:
        """The schedule (lr_scheduler: constant | linear, LRPlan) of both optimisers, one tick
        per optimiser step; linear reaches 0 after the run's planned steps x ppo_epochs x
        minibatches optimiser steps (the N+ recipe anneals both learning rates)."""
        total = self.config.steps * self._ticks_per_step
        return [torch.optim.lr_scheduler.LambdaLR(opt, LRPlan(self.config.lr_scheduler, total))
                for opt in self.optimizers]

    def plan_steps(self, steps: int) -> None:
        """Make the schedule end at PPO step `steps` (the run's planned total changed; the
        trainer logs it), from the next optimiser step on."""
        end = steps * self._ticks_per_step
        for scheduler in self.schedulers:
            plan = scheduler.lr_lambdas[0]
            if plan.end != end:
                plan.end = end
                for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                    group["lr"] = base * plan(scheduler.last_epoch)

    # ------------------------------------------------------------------ data parallelism
    def join_group(self, init_method: str, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
        """Become rank `rank` of a data-parallel group of `world_size` learners (gloo on the
        CPU, NCCL on GPUs), leaving any group this process was in (a re-formed group after a
        restart). Rank 0's trainable tensors are broadcast so every member starts equal.

        In update() each member then runs the no-grad pass on rows rank::world_size and the
        PPO epochs on its rows of every minibatch (the same seeded permutation everywhere);
        the per-token results of the pass and every minibatch's gradients are summed across
        the group (all_reduce). Losses are divided by the WHOLE minibatch's token (or row)
        count, so the summed gradient is exactly the one learner's token mean, uneven shards
        included; the update differs from one learner's only in float summation order."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world_size
        with torch.no_grad():
            for p in [*self.policy_params, *self.value_params]:
                dist.broadcast(p.data, src=0)

    def _sum_across_group(self, tensors: list[Tensor]) -> None:
        """In-place all_reduce(SUM) of same-dtype tensors through one flat buffer."""
        if self.world_size == 1 or not tensors:
            return
        import torch.distributed as dist

        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def _sum_gradients(self) -> None:
        """Sum the group's gradients of both models (a member without rows in a minibatch
        contributes zeros)."""
        if self.world_size == 1:
            return
        params = [*self.policy_params, *self.value_params]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            self._sum_across_group(grads)

    def _group_rollout_pass(self, batch: RolloutBatch, plan: TrimPlan, **what: bool) -> RolloutScores:
        """_rollout_pass over this member's rows (rank::world_size), the others' rows filled
        in by a sum across the group; the whole batch's pass for a single learner."""
        if self.world_size == 1:
            return self._rollout_pass(batch, plan, **what)
        rows = list(range(self.rank, len(batch), self.world_size))
        out = RolloutScores(*[torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=self.device)
                              if what.get(name) else None for name in ("logprobs", "full", "entropy", "values")])
        if rows:
            mine = self._rollout_pass(batch.select(rows), **what)
            for full, part in zip(score_tensors(out), score_tensors(mine)):
                if full is not None:
                    full[rows, :part.shape[1]] = part
        # Rows of other members are 0 here; -inf (tokens outside top-k/top-p) survives the sum.
        self._sum_across_group([t for t in score_tensors(out) if t is not None])
        return out

    # ------------------------------------------------------------------ LoRA export
    def lora_weights(self) -> LoraWeights:
        """The policy adapter as it travels to the generators and checkpoints: tensors in
        adapter_model.safetensors format (PEFT key names, e.g.
        base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight; CPU copies,
        contiguous, float32 master weights: the generator casts to its own dtype) and the
        spec of the policy's own PEFT config (r, lora_alpha, targets)."""
        from peft import get_peft_model_state_dict

        state = {k: v.detach() for k, v in get_peft_model_state_dict(self.policy).items()}
        return LoraWeights(_tensors_to_cpu(state), LoraSpec.of(self.policy.peft_config["default"]))

    # ------------------------------------------------------------------ checkpoints
    def _value_tensors(self) -> dict[str, Tensor]:
        """The value model's trainable tensors by name ({} without a critic)."""
        if not self.critic:
            return {}
        return {n: p for n, p in self.value_model.named_parameters() if p.requires_grad}

    def state_dict(self) -> LearnerState:
        """What a resumed run needs to continue exactly (ppo_ray.checkpoint.LearnerState): the
        policy adapter, the value model's trainable tensors (LoRA + head; {} without a
        critic), the optimisers and their learning-rate schedules (the value's None without a
        critic), the KL coefficient (adaptive KL), the global RNG (LoRA dropout) and the
        version. CPU tensors only; no model weights of the base."""
        value = {n: p.detach().to("cpu", copy=True) for n, p in self._value_tensors().items()}
        return LearnerState(
            version=self.version, policy=self.lora_weights(), value=value,
            policy_optimizer=_to_cpu(self.policy_optimizer.state_dict()),
            value_optimizer=_to_cpu(self.value_optimizer.state_dict()) if self.critic else None,
            policy_scheduler=self.schedulers[0].state_dict(),
            value_scheduler=self.schedulers[1].state_dict() if self.critic else None,
            kl_coef=self.kl_coef, rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [])

    def load_state_dict(self, state: LearnerState) -> None:
        """Restore `state_dict()`'s output. A checkpoint of another shape (LoRA rank, target
        modules, model) is refused naming the first mismatching tensor, one of another
        lora_alpha naming the two; nothing is changed then. lora_dropout may differ (it does
        not change what the tensors mean)."""
        from peft import set_peft_model_state_dict

        policy: LoraWeights = state.policy
        own = self.lora_weights()
        _check_tensors("policy adapter", own.tensors, policy.tensors)
        theirs = dataclasses.replace(policy.spec, lora_dropout=own.spec.lora_dropout)
        if theirs != own.spec:
            raise CheckpointMismatchError(f"checkpoint's policy adapter is {policy.spec}, this run's is {own.spec} "
                                          "(different lora_alpha or lora_target_modules?)")
        mine = self._value_tensors()
        _check_tensors("value model", {n: p.detach() for n, p in mine.items()}, state.value)
        result = set_peft_model_state_dict(self.policy, policy.tensors)
        if getattr(result, "unexpected_keys", None):
            raise CheckpointMismatchError(f"policy adapter: unexpected keys {result.unexpected_keys[:5]}")
        with torch.no_grad():
            for n, p in mine.items():
                p.copy_(state.value[n].to(p.device, p.dtype))
        self.policy_optimizer.load_state_dict(state.policy_optimizer)
        if self.critic:
            self.value_optimizer.load_state_dict(state.value_optimizer)
        if state.policy_scheduler is not None:  # checkpoints before lr_scheduler existed: constant lr
            self.schedulers[0].load_state_dict(state.policy_scheduler)
            if self.critic:
                self.schedulers[1].load_state_dict(state.value_scheduler)
        self.kl_coef = float(state.kl_coef if state.kl_coef is not None else self.config.kl_coef)
        torch.set_rng_state(state.rng)
        if self.device.type == "cuda" and state.cuda_rng:
            torch.cuda.set_rng_state_all(state.cuda_rng)
        self.version = int(state.version)

    # ------------------------------------------------------------------ scoring helpers
    def logprobs(self, batch: RolloutBatch) -> Tensor:
        """(B, T) float32 on the CPU: the policy's logprobs of batch.response_ids under the
        sampling distribution (temperature, top-k, top-p), no grad; 0 on padding."""
        return self._rollout_pass(batch, logprobs=True).logprobs.cpu()

    def full_logprobs(self, batch: RolloutBatch) -> Tensor:
        """(B, T) float32 on the CPU: full-softmax logprobs at temperature (no truncation)."""
        return self._rollout_pass(batch, full=True).full_logprobs.cpu()

    def sync_gap(self, batch: RolloutBatch) -> float:
        """The sync check (ppo_ray.trainer): the largest |generator - learner| logprob over the
        real tokens of a probe `batch` that the generator sampled untruncated at this
        version (Generator.probe): its logprobs are the full tempered softmax's, which
        full_logprobs recomputes. A non-finite logprob on either side is an infinite gap."""
        mask = batch.response_mask
        diff = (batch.gen_logprobs.float() - self.full_logprobs(batch)).abs()
        diff = torch.where(torch.isnan(diff), torch.full((), math.inf), diff)
        return float(torch.where(mask, diff, torch.zeros(())).amax()) if bool(mask.any()) else 0.0

    def values(self, batch: RolloutBatch) -> Tensor:
        """(B, T) float32 on the CPU: V(s_t) on real tokens, 0 on padding (with a critic)."""
        if not self.critic:
            raise ValueError(f"advantage_estimator {self.estimator.name!r} has no critic: there are no values")
        return self._rollout_pass(batch, values=True).values.cpu()

    @torch.no_grad()
    def _rollout_pass(self, batch: RolloutBatch, plan: Optional[TrimPlan] = None, *, logprobs: bool = False,
                      full: bool = False, entropy: bool = False, values: bool = False) -> RolloutScores:
        """Eval-mode, no-grad forwards over trimmed micro-batches (rows in order)."""
        cfg = self.config
        plan = plan or TrimPlan.of(batch)
        batch = batch.to(self.device)
        for model in self.models:
            model.eval()

        def zeros() -> Tensor:
            return torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=self.device)  # (B, T)

        out = RolloutScores(zeros() if logprobs else None, zeros() if full else None,
                            zeros() if entropy else None, zeros() if values else None)
        for rows, micro in rollout_micro_batches(batch, cfg.micro_batch_size, plan, sort=cfg.learner_sort_by_length):
            t = micro.response_ids.shape[1]
            self.speed.count(plan, rows)
            stats = self.speed.rollout_stats(micro, plan.seq_len(rows), plan.response_tokens(rows), logprobs=logprobs,
                                             full=full, entropy=entropy, values=values)
            for name, value in stats.items():
                getattr(out, name)[rows, :t] = value
        return out

    def recomputes_old_logprobs(self) -> bool:
        """Whether this version's update runs the policy's no-grad pass: always with
        old_logprobs: learner; with generator at versions 0, N, 2N, ... (N =
        old_logprobs_check_every), where the generator-vs-learner check runs (a function of
        the version, so a resumed or retried step does what the uninterrupted run did)."""
        cfg = self.config
        return cfg.old_logprobs == "learner" or self.version % cfg.old_logprobs_check_every == 0

    def _generator_logprobs(self, batch: RolloutBatch, fwd: RolloutScores) -> RolloutScores:
        """fwd (values only) completed from the generator's logprobs of the sampled tokens
        (old_logprobs: generator; untruncated sampling, so they are the full-softmax
        logprobs at temperature too), 0 on padding; entropy = their negation, whose mean over
        tokens is an unbiased estimate of the rollout policy's mean entropy (E_x~p[-log p(x)])."""
        gen = torch.where(batch.response_mask, batch.gen_logprobs.to(self.device, torch.float32),
                          torch.zeros((), device=self.device))  # (B, T)
        bad = (batch.response_mask & ~torch.isfinite(gen)).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"old_logprobs: generator: the generator's logprobs are not finite on real response "
                             f"tokens of rows {bad[:10]}")
        return replace(fwd, logprobs=gen, full_logprobs=gen, entropy=-gen)

    # ------------------------------------------------------------------ input checks
    def _check_inputs(self, batch: RolloutBatch, ref_logprobs: Tensor, scores: Tensor,
                      max_staleness: Optional[int] = None) -> None:
        allowed = max_staleness if max_staleness is not None else staleness_limit(self.config.overlap_generation)
        if not fresh_enough(batch.adapter_version, self.version, allowed):
            raise StaleRolloutsError(
                f"stale rollouts: the batch was sampled with LoRA adapter version {batch.adapter_version} "
                f"but the learner is at version {self.version}"
                + (" (overlap_generation allows one version behind)" if allowed else "")
                + "; the generator did not load the learner's latest weights (or the batch is from another step)")
        b, t = batch.response_ids.shape
        if b == 0:
            raise ValueError("Learner.update got an empty batch (0 rollouts)")
        if tuple(ref_logprobs.shape) != (b, t):
            raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, expected (B, T) = {(b, t)} "
                             f"like batch.response_ids")
        if tuple(scores.shape) != (b,):
            raise ValueError(f"scores has shape {tuple(scores.shape)}, expected (B,) = ({b},)")
        mask = batch.response_mask.cpu()
        bad = (mask & ~torch.isfinite(ref_logprobs.cpu())).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"ref_logprobs are not finite on real response tokens of rows {bad[:10]}")
        for name, ids, m in (("prompt_ids", batch.prompt_ids.cpu(), batch.prompt_mask.cpu()),
                             ("response_ids", batch.response_ids.cpu(), mask)):
            out_of_range = (m & ((ids < 0) | (ids >= self.vocab_size))).any(dim=1).nonzero().flatten().tolist()
            if out_of_range:
                raise ValueError(f"{name} of rows {out_of_range[:10]} hold token ids outside the "
                                 f"policy's vocabulary [0, {self.vocab_size})")

    def _drop_nonfinite(self, batch: RolloutBatch, scores: Tensor) -> tuple[RolloutBatch, Tensor, int]:
        """Non-finite scores: an error naming the rows, or (nonfinite_reward="drop", where the
        reward scorer sends NaN) the rows are masked out of every loss and counted."""
        scores = scores.detach().to("cpu", torch.float32)
        bad = ~torch.isfinite(scores)
        if not bool(bad.any()):
            return batch, scores, 0
        rows = bad.nonzero().flatten().tolist()
        if self.config.nonfinite_reward == "error":
            raise ValueError(f"non-finite scores for prompts {rows[:10]}: {scores[bad][:10].tolist()} "
                             f"(set nonfinite_reward=drop to mask such samples out)")
        keep = ~bad
        batch = replace(batch, response_mask=batch.response_mask & keep.unsqueeze(1).to(batch.response_mask.device))
        return batch, torch.where(keep, scores, torch.zeros(())), len(rows)

    # ------------------------------------------------------------------ the update
    def update(self, batch: RolloutBatch, ref_logprobs: Tensor, scores: Tensor,
               max_staleness: Optional[int] = None,
               planned_steps: Optional[int] = None) -> tuple[LearnerStats, Optional[LoraWeights]]:
        """One PPO update on one step's rollouts.

        Args:
            batch: the generator's rollouts, sampled with adapter version `self.version`.
            ref_logprobs: (B, T) reference logprobs of the response tokens (full softmax at
                temperature); padding ignored.
            scores: (B,) sequence scores (NaN = dropped sample when nonfinite_reward=drop).
            max_staleness: how many versions behind the learner the batch may be (the driver
                says; None = 1 with overlap_generation, else 0).
            planned_steps: the run's planned total of PPO steps, where the learning-rate
                schedule ends (the driver says; None = as planned so far, config.steps at first).

        Returns:
            (stats, lora_weights): the step's LearnerStats (ppo_ray/stats.py: the PPO
            epochs' losses and diagnostics, the rollouts' KL / rewards / advantages, the
            logprob checks, counts and seconds) and the new adapter (version + 1, see
            lora_weights).
        """
        cfg = self.config
        t_start = time.perf_counter()
        self.speed.token_counts = [0, 0]
        cuda = self.device.type == "cuda"
        if cuda:  # this update's peak, not the process's (LearnerStats.learner_peak_memory_gib)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._check_inputs(batch, ref_logprobs, scores, max_staleness)
        if planned_steps is not None:
            self.plan_steps(planned_steps)
        batch, scores, dropped = self._drop_nonfinite(batch, scores)
        plan = TrimPlan.of(batch)  # per-row extents on the host, read once
        n_tokens = int(batch.response_mask.sum())
        batch = batch.to(self.device)
        ref_logprobs = ref_logprobs.to(self.device, torch.float32)
        scores = scores.to(self.device)
        mask = batch.response_mask  # (B, T) bool
        rows_kept = mask.any(dim=1) if dropped else torch.ones(len(batch), dtype=torch.bool, device=self.device)

        # 1. Old logprobs / values: no-grad forward in eval mode. Truncated + tempered logprobs
        #    for the PPO ratio; full-softmax logprobs at temperature for the KL; old values.
        #    (old_logprobs: generator: the generator's logprobs stand in for the policy's, which
        #    the learner then recomputes only at every old_logprobs_check_every-th version.)
        recompute = self.recomputes_old_logprobs()
        with cached_casts(*self.models):  # no weight changes in this pass
            fwd = self._group_rollout_pass(batch, plan, logprobs=recompute, full=recompute, entropy=recompute,
                                           values=self.critic)
        if not recompute:
            fwd = self._generator_logprobs(batch, fwd)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # only to time the forward honestly
        forward_s = time.perf_counter() - t_start

        # 2-6. KL_t, shaped rewards, advantages (the configured estimator) and returns, with
        #      the rollouts' statistics (learner.experience). Overlap mode: rollouts one
        #      version behind, whose behaviour policy is the generator's.
        stale = self.version - batch.adapter_version
        experience, rollout_stats = make_experience(
            batch, fwd, ref_logprobs, scores, config=cfg, kl_coef=self.kl_coef, estimator=self.estimator,
            stale=stale, recomputed=recompute, rows_kept=rows_kept)
        if self.experience_hook is not None:
            self.experience_hook(experience)
        buffer = ExperienceBuffer(experience, cfg.effective_mini_batch_size, cfg.micro_batch_size, plan,
                                  sort=cfg.learner_sort_by_length)

        # 7. PPO epochs x shuffled minibatches x micro-batches: value loss and PPO-clip.
        learning_rate = self.policy_optimizer.param_groups[0]["lr"]  # the step's first (scheduled) lr
        with cached_casts(*self.models):  # cleared after every optimiser step
            ppo = self._ppo_epochs(buffer)

        # 8. New version; stats (one host sync) and the new adapter for the generator.
        self.version += 1
        tensors = {**ppo, **rollout_stats}
        names = list(tensors)
        numbers = torch.stack([tensors[k].detach().float().reshape(()) for k in names]).tolist()  # the sync
        done, real = self.speed.token_counts
        # the caching allocator's peak since the reset above (host-side bookkeeping: no device sync)
        peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else math.nan
        stats = LearnerStats(**dict(zip(names, numbers)), dropped_samples=float(dropped), tokens=float(n_tokens),
                             padded_token_ratio=done / max(real, 1), stale_versions=float(stale),
                             kl_coef=self.kl_coef, learning_rate=learning_rate, learner_forward_s=forward_s,
                             update_s=time.perf_counter() - t_start, learner_peak_memory_gib=peak_gib,
                             version=self.version)
        if cfg.kl_target is not None:  # 9. adaptive KL: the next step's beta from this step's KL
            self.kl_coef = adaptive_kl_coef(self.kl_coef, stats.kl, cfg.kl_target, cfg.kl_horizon, len(batch))
        # Every member holds the same adapter; only rank 0's copy goes to the generators.
        return stats, (self.lora_weights() if self.rank == 0 else None)

    # ------------------------------------------------------------------ step 7
    def _normalizer(self, mask: Tensor) -> Tensor:
        """What a minibatch's micro-batch losses are divided by (see learner.algos.agg_loss):
        its real tokens (token_mean) or its non-empty rows (seq_mean_token_mean)."""
        if self.config.loss_agg == "seq_mean_token_mean":
            return mask.any(dim=1).sum().clamp(min=1).float()
        return mask.sum().clamp(min=1).float()

    def _shuffle_generator(self) -> torch.Generator:
        # Seeded from (seed, version): the same step of the same run shuffles the same way.
        return torch.Generator().manual_seed((self.config.seed * 1_000_003 + self.version) % 2**63)

    def _ppo_epochs(self, buffer: ExperienceBuffer) -> dict[str, Tensor]:
        cfg = self.config
        exp = buffer.experience
        gen = self._shuffle_generator()
        zero = torch.zeros((), device=self.device)
        critic = self.critic
        sums = {k: zero.clone() for k in ("policy_loss", "value_loss", "approx_kl", "clipfrac", "ratio_mean", "outside_support_frac",
                                          "vf_clipfrac", "policy_grad_norm", "value_grad_norm")}
        pg_tokens, v_tokens = zero.clone(), zero.clone()
        first_ratio, first_tokens = zero.clone(), zero.clone()
        n_steps = 0
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf

        for model in self.models:  # dropout applies only with ppo_dropout (else the first ratio is exactly 1)
            model.train()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        for _ in range(cfg.ppo_epochs):
            for index in buffer.minibatch_indices(gen):
                # the whole minibatch's counts, also in a group (each member has a share of its rows)
                pg_norm = self._normalizer(exp.policy_mask[index])
                v_norm = self._normalizer(exp.mask[index])
                local = index[self.rank::self.world_size]  # this member's rows (all of them alone)
                for rows in (buffer.micro_rows(local) if len(local) else ()):
                    micro = buffer.micro_batch(rows)
                    self.speed.count(buffer.plan, rows)
                    pg_loss, v_loss, st = self._micro_backward(micro, pg_norm, v_norm)
                    n_pg = micro.policy_mask.sum()
                    n_v = micro.mask.sum()
                    sums["policy_loss"] += pg_loss.detach()
                    for k in ("approx_kl", "clipfrac", "ratio_mean", "outside_support_frac"):
                        sums[k] += st[k] * n_pg
                    if critic:
                        sums["value_loss"] += v_loss.detach()
                        sums["vf_clipfrac"] += st["vf_clipfrac"] * n_v
                    pg_tokens += n_pg
                    v_tokens += n_v
                    if n_steps == 0:  # before any optimiser step
                        first_ratio += st["ratio_mean"] * n_pg
                        first_tokens += n_pg
                # Per minibatch: sum the group's gradients, clip each model's gradient norm,
                # then step the optimisers (identically on every member).
                self._sum_gradients()
                sums["policy_grad_norm"] += torch.nn.utils.clip_grad_norm_(self.policy_params, max_norm)
                if critic:
                    sums["value_grad_norm"] += torch.nn.utils.clip_grad_norm_(self.value_params, max_norm)
                for optimizer in self.optimizers:
                    optimizer.step()
                for scheduler in self.schedulers:
                    scheduler.step()
                clear_casts(*self.models)  # the adapters just changed
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
                n_steps += 1
        for model in self.models:
            model.eval()
        # the group's sums of the per-token stats (grad norms are already the group's)
        self._sum_across_group([sums[k] for k in ("policy_loss", "value_loss", "approx_kl", "clipfrac", "ratio_mean",
                                                  "outside_support_frac", "vf_clipfrac")]
                               + [pg_tokens, v_tokens, first_ratio, first_tokens])

        out = {k: sums[k] / n_steps for k in ("policy_loss", "value_loss", "policy_grad_norm", "value_grad_norm")}
        for k in ("approx_kl", "clipfrac", "ratio_mean", "outside_support_frac"):
            out[k] = sums[k] / pg_tokens.clamp(min=1)
        out["vf_clipfrac"] = sums["vf_clipfrac"] / v_tokens.clamp(min=1)
        out["first_minibatch_ratio_mean"] = first_ratio / first_tokens.clamp(min=1)
        if not critic:
            for k in ("value_loss", "value_grad_norm", "vf_clipfrac"):
                del out[k]
        return out

    def _micro_backward(self, mb: Experience, pg_norm: Tensor, v_norm: Tensor) -> tuple[Tensor, Optional[Tensor], dict]:
        """Policy loss (PPO-clip - entropy bonus) and value loss of one trimmed micro-batch,
        each normalised by its minibatch's token (or row) count, and their gradients
        accumulated. With a separate value model the policy's backward runs before the value
        model's forward, so only one model's activations are alive at a time (the same
        gradients: the two losses share no graph); a shared trunk takes one backward of
        pg_loss + vf_coef * v_loss. Without a critic only the policy's loss (value loss None).
        Returns the detached losses and the stats."""
        pg_loss, stats, new_values = self._policy_loss(mb, pg_norm, v_norm)
        if not self.critic:
            pg_loss.backward()
            return pg_loss.detach(), None, stats
        if not self._shared:
            pg_loss.backward()
            new_values = self.speed.values(mb.rollouts, mb.seq_len)  # (b, t) float32, the value model's own
        v_loss, v_stats = value_loss(new_values, mb.returns, mb.mask, mb.values, self.config.value_clip,
                                     self.config.loss_agg, v_norm)
        # vf_coef weighs the value loss only on a shared trunk: separate models have an Adam each,
        # which would normalise a weight away
        (pg_loss + self.config.vf_coef * v_loss if self._shared else v_loss).backward()
        return pg_loss.detach(), v_loss.detach(), {**stats, **v_stats}

    def _policy_loss(self, mb: Experience, pg_norm: Tensor, v_norm: Tensor) -> tuple[Tensor, dict, Optional[Tensor]]:
        """One micro-batch's policy loss (PPO-clip - entropy bonus over all real tokens, v_norm)
        and its stats, and with a shared trunk the (b, t) float32 values from the same forward
        (else None)."""
        cfg = self.config
        logp, ent, values = self.speed.train_stats(mb.rollouts, mb.seq_len, mb.response_tokens, mb.policy_mask, mb.mask,
                                                   entropy=cfg.entropy_coef > 0)
        pg_loss, pg_stats = ppo_clip_loss(logp, mb.old_logprobs, mb.advantages, mb.policy_mask,
                                          cfg.clip_epsilon, cfg.loss_agg, pg_norm)
        if ent is not None:
            pg_loss = pg_loss - cfg.entropy_coef * agg_loss(ent, mb.mask, cfg.loss_agg, v_norm)
        return pg_loss, pg_stats, values
