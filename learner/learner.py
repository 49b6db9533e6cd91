"""The learner: policy LoRA + (with a critic) value model, one PPO update per step.

Plain class, no Ray (ppo_ray.driver.hosts hosts it in an actor). Given one step's rollouts
(from the generator, sampled with LoRA version `self.version`), the reference logprobs and
the sequence scores (step 4, the reward actor's), `update` runs the no-grad pass (the
seeds' step 2, the sampled tokens' old logprobs, and step 6, the value predictions, each
where its config does not take it from elsewhere: old_logprobs, old_values), hands it to
learner.experience.make_experience (steps 3, 5 and 7-9: KL_t, shaped rewards, TD errors
and the configured estimator's advantages, returns; with old_values: update the value
model's first-epoch training pass gives step 6's values there), has
learner.optimise.PPOOptimiser run the PPO epochs (steps 10-11), and returns small stats and
the new LoRA weights (version + 1) for the generator. The numbers are the seeds' eleven
steps throughout (docs/ARCHITECTURE.md).

The math is learner.algos (pure functions; the advantage estimators are registered there);
the optimisation is learner.optimise; how token statistics are computed is learner.speed;
this module is the models, the no-grad pass, checkpoints and the bookkeeping.

Choices, and where they come from:
* Old logprobs use the generator's exact sampling distribution: logits / temperature,
  then the same top-k / top-p truncation (ppo_ray.logprobs.logprobs_from_logits mirrors
  vLLM). The PPO ratio is between two such truncated distributions, so the first
  minibatch's ratio is 1 up to the rounding of the no-grad pass against the training
  forward (no dropout; float32: exactly 1 where they batch the rows alike), or within the
  generator-learner gap with the generator's old logprobs (PPOConfig.old_logprobs).
* The KL to the reference uses the full softmax at temperature for both sides, as the
  reference scorer does: a truncated policy vs an untruncated reference would bias KL_t
  upwards (the truncated policy renormalises its kept mass to 1).
* A sampled token that the learner's truncation drops (old logprob -inf: the generator
  and learner disagree at the nucleus boundary, e.g. vLLM's Triton top-k/top-p on GPU)
  has no defined ratio: it is left out of the policy loss (kept in the value loss and the
  KL) and counted in stats["truncated_tokens"].
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
import re
import time
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import Tensor

from learner.algos import AdvantageInputs, adaptive_kl_coef, advantage_estimator, compute_td_errors
from learner.buffer import Experience, ExperienceBuffer
from learner.experience import RolloutScores, make_experience, score_tensors
from learner.flops import decoder_shape, device_peak_flops, update_flops
from learner.kernels import cached_casts
from learner.optimise import DataGroup, PPOOptimiser
from learner.speed import SpeedPath
from learner.value_model import ValueHead, ValueModel
from ppo_ray.attribution import AttributionRows, check_rows, select_rows
from ppo_ray.batch import RolloutBatch, TrimPlan, fresh_enough, rollout_micro_batches
from ppo_ray.config import LEARNER, ConfigSlice, PPOConfig, role_fields
from ppo_ray.modeling import LoraSpec, LoraWeights, load_causal_lm, pick_device
from ppo_ray.stats import LearnerState, LearnerStats

class StaleRolloutsError(RuntimeError):
    """Rollouts sampled with a LoRA version other than the learner's current one."""


class CheckpointMismatchError(ValueError):
    """A checkpoint whose tensors do not fit this learner (other model, LoRA rank or targets)."""


# The dropout layers: their probability is `p`.
DROPOUT_LAYERS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                  torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
# Float attributes (of a module or a model config) that hold the probability or scale of
# noise a model applies only in train mode ("functional dropout"): HF's attention passes
# dropout=self.attention_dropout if self.training (Qwen3, Llama, Mistral), OPT/BART use
# p=self.dropout / self.activation_dropout and skip layers with self.layerdrop, Phi reads
# resid_pdrop / embd_pdrop, MoE routers add self.jitter_noise while training.
FUNCTIONAL_DROPOUT = re.compile(r"drop|jitter")


def _zero_dropout_attributes(obj) -> None:
    """Set every float attribute of `obj` whose name matches FUNCTIONAL_DROPOUT to 0.0."""
    for name, value in list(vars(obj).items()):
        if type(value) is float and value != 0.0 and FUNCTIONAL_DROPOUT.search(name.lower()):
            setattr(obj, name, 0.0)


def disable_dropout(model: torch.nn.Module) -> None:
    """Turn off every dropout of `model`, so that train mode computes exactly what eval mode
    does (TRL's and N+'s disable_dropout set the layers' p only, which leaves HF's attention
    dropout on: a tiny Qwen3 with attention_dropout 0.3 gave logits 8 apart in train and eval
    mode after it). Three forms are covered:

    * dropout layers (DROPOUT_LAYERS: PEFT's lora_dropout and the models' nn.Dropout): p = 0;
    * functional dropout, a probability a module keeps as a float attribute and applies only
      while self.training (FUNCTIONAL_DROPOUT: attention_dropout, dropout, resid_pdrop,
      layerdrop, jitter_noise, ...): set to 0.0 on the module;
    * the models' configs (every PretrainedConfig a module holds, and the configs nested in
      it): the same fields set to 0.0, for modules that read them at forward time.

    The PEFT adapters' own configs (peft_config) keep their lora_dropout: the adapter is
    saved with what the user asked for. Train mode itself stays available (HF's gradient
    checkpointing runs only in train mode)."""
    from transformers import PretrainedConfig

    configs: dict[int, PretrainedConfig] = {}
    for module in model.modules():
        if isinstance(module, DROPOUT_LAYERS):
            module.p = 0.0
        _zero_dropout_attributes(module)
        config = vars(module).get("config")
        if isinstance(config, PretrainedConfig):
            configs[id(config)] = config
    while configs:
        _, config = configs.popitem()
        _zero_dropout_attributes(config)
        configs.update({id(v): v for v in vars(config).values() if isinstance(v, PretrainedConfig)})


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
    # gets only these (PPOConfig.slice); each field declares its roles (ppo_ray.config.knob).
    CONFIG_FIELDS = role_fields(LEARNER)

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
        # (its rules were checked with the config: PPOConfig validates every config it builds)
        self.estimator = advantage_estimator(config.advantage_estimator)
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
            # PPO's forwards without dropout (N+; TRL's disable_dropout, which misses functional
            # dropout such as HF's attention_dropout): the old logprobs come from a dropout-free
            # pass, so dropout in the training forward alone would put the first minibatch's
            # ratio off 1, and old_values: update would take a dropout sample as the old values.
            # The adapters keep lora_dropout in their config.
            for model in self.models:
                disable_dropout(model)
        for model in self.models:
            model.to(self.device).eval()
        self.vocab_size = self.policy.get_input_embeddings().weight.shape[0]
        # The model shapes an update's FLOPs are counted from (learner.flops; None: a model
        # those rules do not count, whose learner_flops is NaN), and the device's peak rate,
        # measured on the CPU at the first update (peak_flops_per_s).
        self._flop_shapes = (decoder_shape(base.config),
                             decoder_shape(self.value_model.backbone.get_base_model().config)
                             if self.critic and not self._shared else None)
        self._peak_flops: Optional[float] = None
        self.speed = SpeedPath(config, self.policy, self.value_model, self._shared)  # how token stats are computed

        # Steps 10-11 (learner.optimise): the optimisers, their schedules and the PPO epochs.
        self.group = DataGroup()  # data parallelism: see join_group
        self.optimiser = PPOOptimiser(
            config, self.speed, [p for p in self.policy.parameters() if p.requires_grad],
            self.value_model.trainable_parameters() if self.critic else [], critic=self.critic, shared=self._shared,
            group=self.group)
        # beta of the KL penalty: config.kl_coef, moved after every update by the adaptive
        # controller when config.kl_target is set (part of state_dict, so a retried or
        # resumed step uses the committed value)
        self.kl_coef = float(config.kl_coef)
        self.version = 0
        # Called with each update's Experience (the step's per-token tensors, on the device)
        # before the PPO epochs: for tests and benchmarks that inspect it; None = nothing kept.
        self.experience_hook: Optional[Callable[[Experience], None]] = None
        # The last update's Experience and its reward beta, kept (a reference: no copy, no
        # work) until the next update starts, for attribution(); None before the first, or
        # after a restart (the tensors are not part of the state).
        self._last_update: Optional[tuple[Experience, float]] = None

    def reconfigure(self, config: PPOConfig | ConfigSlice) -> None:
        """Take a changed config on a built learner (benchmarks and tests switch the speed
        options on one learner): the learner and its speed path read it from now on."""
        self.config = self.optimiser.config = config
        self.speed.configure(config)

    def plan_steps(self, steps: int) -> None:
        """Make the learning-rate schedules end at PPO step `steps` (the run's planned total
        changed; the trainer logs it), from the next optimiser step on."""
        self.optimiser.plan_steps(steps)

    # ------------------------------------------------------------------ data parallelism
    def join_group(self, init_method: str, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
        """Become rank `rank` of a data-parallel group of `world_size` learners (gloo on the
        CPU, NCCL on GPUs; learner.optimise.DataGroup), leaving any group this process was in
        (a re-formed group after a restart). Rank 0's trainable tensors are broadcast so every
        member starts equal.

        In update() each member then runs the no-grad pass on rows rank::world_size and the
        PPO epochs on its rows of every minibatch (the same seeded permutation everywhere);
        the per-token results of the pass and every minibatch's gradients are summed across
        the group (all_reduce). Losses are divided by the WHOLE minibatch's token (or row)
        count, so the summed gradient is exactly the one learner's token mean, uneven shards
        included; the update differs from one learner's only in float summation order."""
        self.group.join(init_method, rank, world_size, self.device, timeout_s, self.optimiser.params)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def _grouprollout_scores(self, batch: RolloutBatch, plan: TrimPlan, **what: bool) -> RolloutScores:
        """rollout_scores over this member's rows (rank::world_size), the others' rows filled
        in by a sum across the group; the whole batch's pass for a single learner."""
        if self.world_size == 1:
            return self.rollout_scores(batch, plan, **what)
        rows = list(range(self.rank, len(batch), self.world_size))
        out = RolloutScores(*[torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=self.device)
                              if what.get(name) else None for name in ("logprobs", "full", "entropy", "values")])
        if rows:
            mine = self.rollout_scores(batch.select(rows), **what)
            for full, part in zip(score_tensors(out), score_tensors(mine)):
                if full is not None:
                    full[rows, :part.shape[1]] = part
        # Rows of other members are 0 here; -inf (tokens outside top-k/top-p) survives the sum.
        self.group.sum([t for t in score_tensors(out) if t is not None])
        return out

    # ------------------------------------------------------------------ token attribution
    @torch.no_grad()
    def attribution(self, rows: list[int]) -> Optional[AttributionRows]:
        """Rows `rows` of the last update's per-token tensors (its Experience, as the PPO epochs
        used it), on the CPU, for inspection (ppo_ray.attribution: the seeds' SA pairs): no
        forward, nothing of the step changed. The TD errors (with a critic) and the group
        baseline (an estimator that registered one) are computed from the same tensors with the
        functions the estimator uses. None when no update's tensors are here (none yet, or the
        learner was restarted since)."""
        if self._last_update is None:
            return None
        exp, kl_coef = self._last_update
        cfg = self.config
        rows = check_rows(rows, len(exp))
        baselines = None
        if self.estimator.baseline is not None:
            baselines = self.estimator.baseline(AdvantageInputs(
                rewards=exp.rewards, mask=exp.mask, scores=exp.scores, values=exp.values, gamma=cfg.gamma,
                lam=cfg.lam, groups=exp.rollouts.groups, kl=exp.kl, kl_coef=kl_coef))  # (B,) over the whole batch
        sub = exp.select(rows)
        sub = sub.trimmed(*TrimPlan.of(sub.rollouts).widths(range(len(rows))))
        td = None if sub.values is None else compute_td_errors(sub.rewards, sub.values, sub.mask, cfg.gamma)
        def cpu(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x.cpu()

        batch = sub.rollouts
        return AttributionRows(
            rows=rows, version=batch.adapter_version, prompt_ids=cpu(batch.prompt_ids),
            prompt_mask=cpu(batch.prompt_mask), response_ids=cpu(batch.response_ids), mask=cpu(sub.mask),
            loss_mask=cpu(sub.policy_mask), gen_logprobs=cpu(batch.gen_logprobs.float()),
            old_logprobs=cpu(sub.old_logprobs), ref_logprobs=cpu(sub.ref_logprobs), kl=cpu(sub.kl),
            rewards=cpu(sub.rewards), advantages=cpu(sub.advantages), scores=cpu(sub.scores), values=cpu(sub.values),
            td_errors=cpu(td), returns=cpu(sub.returns), baselines=select_rows(baselines, rows),
            groups=select_rows(exp.rollouts.groups, rows), estimator=self.estimator.name, kl_coef=float(kl_coef),
            whitened=bool(cfg.whiten_advantages and not self.estimator.normalized))

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
        """What a resumed run needs to continue exactly (ppo_ray.stats.LearnerState): the
        policy adapter, the value model's trainable tensors (LoRA + head; {} without a
        critic), the optimisers and their learning-rate schedules (the value's None without a
        critic), the KL coefficient (adaptive KL), the global RNG (LoRA dropout) and the
        version. CPU tensors only; no model weights of the base."""
        value = {n: p.detach().to("cpu", copy=True) for n, p in self._value_tensors().items()}
        opt = self.optimiser
        return LearnerState(
            version=self.version, policy=self.lora_weights(), value=value,
            policy_optimizer=_to_cpu(opt.policy_optimizer.state_dict()),
            value_optimizer=_to_cpu(opt.value_optimizer.state_dict()) if self.critic else None,
            policy_scheduler=opt.schedulers[0].state_dict(),
            value_scheduler=opt.schedulers[1].state_dict() if self.critic else None,
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
        opt = self.optimiser
        opt.policy_optimizer.load_state_dict(state.policy_optimizer)
        if self.critic:
            opt.value_optimizer.load_state_dict(state.value_optimizer)
        if state.policy_scheduler is not None:  # checkpoints before lr_scheduler existed: constant lr
            opt.schedulers[0].load_state_dict(state.policy_scheduler)
            if self.critic:
                opt.schedulers[1].load_state_dict(state.value_scheduler)
        opt.apply_config_rates()  # the config's rates and schedule kind; the state's position in it
        # The state's coefficient is the adaptive controller's (kl_target set): it continues. A
        # fixed coefficient is the config's kl_coef, whatever the state says.
        adaptive = state.kl_coef is not None and self.config.kl_target is not None
        self.kl_coef = float(state.kl_coef if adaptive else self.config.kl_coef)
        torch.set_rng_state(state.rng)
        if self.device.type == "cuda" and state.cuda_rng:
            torch.cuda.set_rng_state_all(state.cuda_rng)
        self.version = int(state.version)

    # ------------------------------------------------------------------ scoring helpers
    def sync_gap(self, batch: RolloutBatch, weights: Optional[LoraWeights] = None) -> float:
        """The sync check (ppo_ray.trainer): the largest |generator - learner| logprob over the
        real tokens of a probe `batch` that the generator sampled untruncated at this
        version (Generator.probe): its logprobs are the full tempered softmax's, which the
        full-softmax scores recompute. A non-finite logprob on either side is an infinite gap.
        `weights`: the probe was sampled with this older version of the policy adapter (one a
        batch in flight needs, loaded again into a restarted replica): the policy takes those
        tensors for the scores and its own back after, bit for bit."""
        if weights is not None:
            from peft import set_peft_model_state_dict

            own = self.lora_weights()
            _check_tensors("policy adapter", own.tensors, weights.tensors)
            set_peft_model_state_dict(self.policy, weights.tensors)
            try:
                return self.sync_gap(batch)
            finally:
                set_peft_model_state_dict(self.policy, own.tensors)
        mask = batch.loss_mask  # the model's tokens: an environment's have no sampling logprob
        diff = (batch.gen_logprobs.float() - self.rollout_scores(batch, full=True).full_logprobs.cpu()).abs()
        diff = torch.where(torch.isnan(diff), torch.full((), math.inf), diff)
        return float(torch.where(mask, diff, torch.zeros(())).amax()) if bool(mask.any()) else 0.0

    @torch.no_grad()
    def rollout_scores(self, batch: RolloutBatch, plan: Optional[TrimPlan] = None, *, logprobs: bool = False,
                       full: bool = False, entropy: bool = False, values: bool = False) -> RolloutScores:
        """Steps 2 and 6's pass over `batch`: eval-mode, no-grad forwards over trimmed micro-batches
        (rows in order). Each asked-for field of the result is (B, T) float32 on the
        learner's device, 0 on padding: logprobs (the sampling distribution: temperature,
        top-k, top-p), full_logprobs (full softmax at temperature), entropy, values (with a
        critic)."""
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
        return cfg.old_logprobs_source == "learner" or self.version % cfg.old_logprobs_check_every == 0

    def values_in_update(self, rows: int) -> bool:
        """Whether the old values of a `rows`-row batch come from the PPO epochs' first value
        forward (old_values: update, or auto where it applies: PPOConfig.old_values_source,
        with a critic whose estimator is per_row and one minibatch over these rows) instead of
        the value model's no-grad pass. old_values: update where it cannot apply is an error."""
        cfg = self.config
        source = cfg.old_values_source
        if not self.critic or source == "forward":
            return False
        why = None
        if not self.estimator.per_row:
            why = f"advantage_estimator {self.estimator.name!r} is not per_row (its returns need every row's values)"
        elif rows > cfg.effective_mini_batch_size:
            why = f"the batch's {rows} rows are more than one minibatch ({cfg.effective_mini_batch_size})"
        if why and cfg.old_values == "update":
            raise ValueError(f"old_values: update does not apply: {why}; use forward or auto")
        return why is None

    def peak_flops_per_s(self) -> float:
        """The peak FLOP/s of this learner's device in its dtype (learner.flops.device_peak_flops:
        a GPU's datasheet rate, NaN for a card not listed; on the CPU one large float32 matmul
        timed on the learner's threads, ~0.05 s), found once per learner and cached."""
        if self._peak_flops is None:
            self._peak_flops = device_peak_flops(self.device, self.config.dtype)
        return self._peak_flops

    def count_flops(self, plan: TrimPlan, recomputed: bool, values_in_update: bool) -> float:
        """Model FLOPs of an update of the rows of `plan` (the whole batch, every member's
        rows: a learner group's total) as it ran: the no-grad pass that ran (recomputed, the
        value model's pass unless values_in_update) and ppo_epochs x forward and backward of
        the policy and the value model, on the real tokens (learner.flops' rules). NaN when the
        policy's or a separate value model's shape is not one those rules count."""
        policy, value = self._flop_shapes
        separate = self.critic and not self._shared
        if policy is None or (separate and value is None):
            return math.nan
        spec = LoraSpec.of(self.policy.peft_config["default"])
        prompt_lens = [plan.prompt_len - start for start in plan.prompt_start]
        flops = update_flops(policy, prompt_lens, plan.response_end, ppo_epochs=self.config.ppo_epochs,
                             lora_r=spec.r, lora_targets=spec.target_modules,
                             value_model="separate" if separate else "shared" if self._shared else "none",
                             values_in_update=values_in_update, recomputed=recomputed, value_shape=value)
        return flops["learner_forward"] + flops["update"]

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
        allowed = max_staleness if max_staleness is not None else self.config.max_staleness
        if not fresh_enough(batch.adapter_version, self.version, allowed):
            raise StaleRolloutsError(
                f"stale rollouts: the batch was sampled with LoRA adapter version {batch.adapter_version} "
                f"but the learner is at version {self.version}"
                + (f" (max_staleness allows {allowed} behind)" if allowed else "")
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
        kept = keep.unsqueeze(1).to(batch.response_mask.device)
        batch = replace(batch, response_mask=batch.response_mask & kept,
                        env_mask=None if batch.env_mask is None else batch.env_mask & kept)
        return batch, torch.where(keep, scores, torch.zeros(())), len(rows)

    # ------------------------------------------------------------------ the update
    def update(self, batch: RolloutBatch, ref_logprobs: Tensor, scores: Tensor,
               max_staleness: Optional[int] = None, planned_steps: Optional[int] = None,
               gap_limit: Optional[float] = None) -> tuple[LearnerStats, Optional[LoraWeights]]:
        """One PPO update on one step's rollouts.

        Args:
            batch: the generator's rollouts, sampled with adapter version `self.version`.
            ref_logprobs: (B, T) reference logprobs of the response tokens (full softmax at
                temperature); padding ignored.
            scores: (B,) sequence scores (NaN = dropped sample when nonfinite_reward=drop).
            max_staleness: how many versions behind the learner the batch may be (the driver
                says; None = config.max_staleness).
            planned_steps: the run's planned total of PPO steps, where the learning-rate
                schedule ends (the driver says; None = as planned so far, config.steps at first).
            gap_limit: the rollout check's logprob_gap_limit, over which a sampled token's
                generator-learner gap is counted (gen_logprob_gap_tokens; the driver says, as
                its config may change; None = none counted).

        Returns:
            (stats, lora_weights): the step's LearnerStats (ppo_ray/stats.py: the PPO
            epochs' losses and diagnostics, the rollouts' KL / rewards / advantages, the
            logprob checks, counts and seconds) and the new adapter (version + 1, see
            lora_weights).
        """
        cfg = self.config
        peak_flops = self.peak_flops_per_s() * self.world_size  # measured once, off the update's clock
        t_start = time.perf_counter()
        self.speed.token_counts = [0, 0]
        cuda = self.device.type == "cuda"
        if cuda:  # this update's peak, not the process's (LearnerStats.learner_peak_memory_gib)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._last_update = None  # freed before this update allocates: its peak memory is unchanged
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

        # 2 and 6. Old logprobs / values: no-grad forward in eval mode. Truncated + tempered logprobs
        #    for the PPO ratio; full-softmax logprobs at temperature for the KL; old values.
        #    (old_logprobs: generator: the generator's logprobs stand in for the policy's, which
        #    the learner then recomputes only at every old_logprobs_check_every-th version.)
        #    (old_values: update: the value model's first training forward gives the old values,
        #    below; its no-grad pass does not run.)
        recompute = self.recomputes_old_logprobs()
        values_in_update = self.values_in_update(len(batch))
        fwd = RolloutScores(None, None, None, None)
        if recompute or (self.critic and not values_in_update):
            with cached_casts(*self.models):  # no weight changes in this pass
                fwd = self._grouprollout_scores(batch, plan, logprobs=recompute, full=recompute, entropy=recompute,
                                               values=self.critic and not values_in_update)
        if not recompute:
            fwd = self._generator_logprobs(batch, fwd)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # only to time the forward honestly
        forward_s = time.perf_counter() - t_start

        # 3, 5, 7-9. KL_t, shaped rewards, TD errors and advantages (the configured
        #      estimator) and returns, with the rollouts' statistics (learner.experience). Overlap mode: rollouts one
        #      version behind, whose behaviour policy is the generator's.
        #      old_values: update: the value model trains on the first minibatch (the whole
        #      batch) within, once the rewards are shaped: learner.optimise.value_pass.
        stale = self.version - batch.adapter_version  # the batch's oldest version: what the rules read
        # what is reported: the versions behind, per response token (partial_rollout continue: a
        # response's later tokens come from newer versions), averaged over the step's tokens
        model = batch.loss_mask  # the model's tokens: an environment's were not sampled by any version
        stale_mean = float(stale) if batch.token_versions is None or not model.any() else \
            float((self.version - batch.token_versions)[model].double().mean())
        trained: dict[str, Tensor] = {}

        def value_pass(returns_of) -> Tensor:
            values, sums = self.optimiser.value_pass(batch, plan, self.version, returns_of)
            trained.update(sums)
            return values

        with cached_casts(*self.models):
            experience, rollout_stats = make_experience(
                batch, fwd, ref_logprobs, scores, config=cfg, kl_coef=self.kl_coef, estimator=self.estimator,
                stale=stale, recomputed=recompute, rows_kept=rows_kept,
                value_pass=value_pass if values_in_update else None,
                gap_limit=math.inf if gap_limit is None else gap_limit)
        if self.experience_hook is not None:
            self.experience_hook(experience)
        self._last_update = (experience, 0.0 if cfg.kl_in_loss else self.kl_coef)
        buffer = ExperienceBuffer(experience, cfg.effective_mini_batch_size, cfg.micro_batch_size, plan,
                                  sort=cfg.learner_sort_by_length)

        # 10-11. PPO epochs x shuffled minibatches x micro-batches: value loss and PPO-clip.
        learning_rate = self.optimiser.learning_rate  # the step's first (scheduled) lr
        with cached_casts(*self.models):  # cleared after every optimiser step
            ppo = self.optimiser.run(buffer, self.models, self.version, self.kl_coef,
                                     value_pass=trained if values_in_update else None)

        # After step 11: new version; stats (one host sync) and the new adapter for the generator.
        self.version += 1
        tensors = {**ppo, **rollout_stats}
        names = list(tensors)
        numbers = torch.stack([tensors[k].detach().float().reshape(()) for k in names]).tolist()  # the sync
        done, real = self.speed.token_counts
        # the caching allocator's peak since the reset above (host-side bookkeeping: no device sync)
        peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else math.nan
        values = dict(zip(names, numbers))
        known = {f.name for f in dataclasses.fields(LearnerStats)}
        extra = {k: values.pop(k) for k in list(values) if k not in known}  # the loss's own stats (learner.losses)
        flops, update_s = self.count_flops(plan, recompute, values_in_update), time.perf_counter() - t_start
        if self.device.type == "cpu" and update_s > 0 and flops / update_s > peak_flops:
            # The CPU's peak is one matmul timed at the first update: timed while other processes
            # held the cores, it is too low. An update that ran faster shows the cores' rate is at
            # least its own: that becomes the peak (learner_mfu never exceeds 1).
            self._peak_flops = flops / update_s / self.world_size
            peak_flops = self._peak_flops * self.world_size
        stats = LearnerStats(**values, loss_extra=extra, dropped_samples=float(dropped), tokens=float(n_tokens),
                             padded_token_ratio=done / max(real, 1), learner_flops=flops,
                             learner_peak_flops_per_s=peak_flops, stale_versions=stale_mean,
                             kl_coef=self.kl_coef, learning_rate=learning_rate, learner_forward_s=forward_s,
                             update_s=update_s, learner_peak_memory_gib=peak_gib,
                             version=self.version)
        if cfg.kl_target is not None:  # 9. adaptive KL: the next step's beta from this step's KL
            self.kl_coef = adaptive_kl_coef(self.kl_coef, stats.kl, cfg.kl_target, cfg.kl_horizon, len(batch))
        # Every member holds the same adapter; only rank 0's copy goes to the generators.
        return stats, (self.lora_weights() if self.rank == 0 else None)
