"""The optimisation of one PPO step (the seeds' steps 10-11), from the step's Experience.

`PPOOptimiser` owns the optimisers (Adam, one per trained model), their learning-rate
schedules, and the PPO epochs: shuffled minibatches (one optimiser step each) split into
micro-batches (one forward/backward each), the PPO-clip policy loss with the entropy
bonus and, with a critic, the clipped value loss. The experience it trains on is
learner.experience's (steps 3, 5 and 7-9); the forwards are learner.speed's; the math is
learner.algos'. `DataGroup` is the data-parallel group the sums go through (one learner:
no-ops).

Choices, and where they come from:
* Two optimisers (separate learning rates, N+ / seeds), Adam with eps 1e-5 (N+), no
  weight decay. The value loss's gradient reaches only the value model, so a vf_coef
  would only rescale an Adam-normalised gradient: there is none (except on a shared
  trunk, where one backward takes pg_loss + vf_coef * v_loss).
* Gradient accumulation: every micro-batch loss is normalised by the minibatch's number
  of real tokens (rows, for seq_mean_token_mean), so the accumulated gradient equals the
  full minibatch's token mean (OpenRLHF tests/test_loss_aggregation.py).
* The minibatch order is seeded from (seed, version): a retried or resumed step shuffles
  as the uninterrupted run did.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from learner.algos import value_loss
from learner.buffer import Experience, ExperienceBuffer, micro_row_groups
from learner.kernels import clear_casts
from learner.losses import LossInputs, policy_loss, policy_objective
from learner.speed import SpeedPath
from ppo_ray.batch import RolloutBatch, TrimPlan

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


class DataGroup:
    """The data-parallel group a learner belongs to: rank 0 of 1 until `join`. Sums go
    through all_reduce (gloo on the CPU, NCCL on GPUs); alone, they are no-ops."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def join(self, init_method: str, rank: int, world_size: int, device: torch.device, timeout_s: float,
             params: Sequence[Tensor]) -> None:
        """Become rank `rank` of `world_size`, leaving any group this process was in (a
        re-formed group after a restart); rank 0's `params` are broadcast so every member
        starts equal."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world_size
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def sum(self, tensors: list[Tensor]) -> None:
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

    def sum_gradients(self, params: Sequence[Tensor]) -> None:
        """Sum the group's gradients of `params` (a member without rows in a minibatch
        contributes zeros)."""
        if self.world_size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            self.sum(grads)


class PPOOptimiser:
    """Steps 10-11 of one PPO update (value and policy training): optimisers, schedules, epochs.

    Args:
        config: the learner's config (ppo_epochs, minibatch sizes, learning rates,
            lr_scheduler, steps, max_grad_norm, clip_epsilon, value_clip, vf_coef,
            entropy_coef, loss_agg, seed).
        speed: the learner's speed path (the training forwards' token statistics).
        policy_params: the policy's trainable parameters (the LoRA adapter).
        value_params: the value model's trainable parameters ([] without a critic).
        critic: whether there is a value model to train.
        shared: the value head sits on the policy's trunk (one forward, one backward).
        group: the data-parallel group (gradients and statistics are summed across it).
    """

    def __init__(self, config, speed: SpeedPath, policy_params: list[Tensor], value_params: list[Tensor], *,
                 critic: bool, shared: bool, group: DataGroup):
        self.config, self.speed, self.group = config, speed, group
        self.policy_params, self.value_params = policy_params, value_params
        self.critic, self.shared = critic, shared
        self.loss = policy_loss(config.policy_loss)  # the registered policy loss, and its knobs' values
        self.loss_params = {p.name: getattr(config, p.name) for p in self.loss.params}
        self.policy_optimizer = torch.optim.Adam(policy_params, lr=config.learning_rate, eps=ADAM_EPS)
        self.value_optimizer = (torch.optim.Adam(value_params, lr=config.value_learning_rate, eps=ADAM_EPS)
                                if critic else None)
        self.schedulers = self.lr_schedulers()

    # ------------------------------------------------------------------ optimisers and schedules
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The policy's optimiser, then the value model's (with a critic)."""
        return [self.policy_optimizer] + ([self.value_optimizer] if self.critic else [])

    @property
    def params(self) -> list[Tensor]:
        """Every trainable parameter: the policy's, then the value model's."""
        return [*self.policy_params, *self.value_params]

    @property
    def ticks_per_step(self) -> int:
        """Optimiser steps per PPO step: ppo_epochs x minibatches."""
        cfg = self.config
        return cfg.ppo_epochs * (cfg.batch_size // cfg.effective_mini_batch_size)

    def lr_schedulers(self) -> list:
        """The schedule (lr_scheduler: constant | linear, LRPlan) of the optimisers, one tick
        per optimiser step; linear reaches 0 after the run's planned steps x ppo_epochs x
        minibatches optimiser steps (the N+ recipe anneals both learning rates)."""
        total = self.config.steps * self.ticks_per_step
        return [torch.optim.lr_scheduler.LambdaLR(opt, LRPlan(self.config.lr_scheduler, total))
                for opt in self.optimizers]

    def plan_steps(self, steps: int) -> None:
        """Make the schedule end at PPO step `steps` (the run's planned total changed; the
        trainer logs it), from the next optimiser step on."""
        end = steps * self.ticks_per_step
        for scheduler in self.schedulers:
            plan = scheduler.lr_lambdas[0]
            if plan.end != end:
                plan.end = end
                self._set_rates(scheduler)

    def apply_config_rates(self) -> None:
        """The config's learning rates and schedule kind over a restored state: the optimisers'
        and schedules' state dicts carry the rates and kind of the run that saved them, which
        would otherwise silently win over a resume's --learning_rate / --value_learning_rate /
        --lr_scheduler (the trainer logs such changes). The schedule's position (its tick)
        and end are the restored ones."""
        rates = [self.config.learning_rate] + ([self.config.value_learning_rate] if self.critic else [])
        for scheduler, rate in zip(self.schedulers, rates):
            scheduler.base_lrs = [rate] * len(scheduler.optimizer.param_groups)
            for group in scheduler.optimizer.param_groups:
                group["initial_lr"] = rate
            scheduler.lr_lambdas[0].kind = self.config.lr_scheduler
            self._set_rates(scheduler)

    @staticmethod
    def _set_rates(scheduler) -> None:
        """Each group's rate = its base rate x the schedule's factor at its current tick."""
        plan = scheduler.lr_lambdas[0]
        for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * plan(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

    @property
    def learning_rate(self) -> float:
        """The policy's current (scheduled) learning rate."""
        return self.policy_optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------------ steps 10-11: the epochs
    def normalizer(self, mask: Tensor) -> Tensor:
        """What a minibatch's micro-batch losses are divided by (see learner.algos.agg_loss):
        its real tokens (token_mean), its non-empty rows (seq_mean_token_mean,
        seq_mean_token_sum) or its rows x the constant per row (token_sum_norm:
        PPOConfig.loss_agg_norm_tokens)."""
        agg = self.config.loss_agg
        if agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
            return mask.any(dim=1).sum().clamp(min=1).float()
        if agg == "token_sum_norm":
            n = self.config.loss_agg_tokens or self.config.max_new_tokens
            return torch.tensor(float(mask.shape[0] * n), device=mask.device)
        return mask.sum().clamp(min=1).float()

    def shuffle_generator(self, version: int) -> torch.Generator:
        """Seeded from (seed, version): the same step of the same run shuffles the same way."""
        return torch.Generator().manual_seed((self.config.seed * 1_000_003 + version) % 2**63)

    def value_pass(self, batch: RolloutBatch, plan: TrimPlan, version: int,
                   returns_of: Callable[[list[int], Tensor], Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """old_values: update. The first epoch's value forwards and backwards, run before the
        experience exists: with one minibatch per epoch (the whole batch, in run()'s seeded
        order and micro-batches; this member's rows of it in a group) no optimiser step comes
        before them, so their outputs are the old values. Each micro-batch's returns come from
        `returns_of(rows, old_values)` ((b, t), the estimator's per-row advantages + the old
        values); its value loss (normalised by the minibatch's count, unclipped: the clip is
        around these same values, a no-op) is backpropagated and the gradient kept for run().

        Returns the (B, T) float32 old values (0 on padding; summed across the group, so every
        member has every row's) and the pass's sums for run() (value_loss, v_tokens)."""
        cfg = self.config
        mask = batch.loss_mask  # the value targets' tokens: the model's
        device = mask.device
        index = torch.randperm(len(batch), generator=self.shuffle_generator(version))  # run()'s first minibatch
        v_norm = self.normalizer(mask[index])
        local = index[self.group.rank::self.group.world_size]
        values = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        sums = {"value_loss": torch.zeros((), device=device), "v_tokens": torch.zeros((), device=device)}
        self.speed.value_model.train()
        self.value_optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            for rows in micro_row_groups(local.tolist(), plan, cfg.micro_batch_size, cfg.learner_sort_by_length):
                micro = batch.select(rows).trimmed(*plan.widths(rows))
                self.speed.count(plan, rows)
                new_values = self.speed.values(micro, plan.seq_len(rows))  # (b, t) float32, with grad
                m = micro.loss_mask
                old = torch.where(m, new_values.detach(), torch.zeros((), device=device))
                v_loss, _ = value_loss(new_values, returns_of(rows, old), m, None, None, cfg.loss_agg, v_norm)
                v_loss.backward()
                values[rows, :old.shape[1]] = old
                sums["value_loss"] += v_loss.detach()
                sums["v_tokens"] += m.sum()
        self.group.sum([values])  # the other members' rows are 0 here
        return values, sums

    def run(self, buffer: ExperienceBuffer, models: Sequence[torch.nn.Module], version: int,
            kl_coef: float = 0.0, value_pass: Optional[dict[str, Tensor]] = None) -> dict[str, Tensor]:
        """ppo_epochs x shuffled minibatches x micro-batches over `buffer`, one optimiser step
        per minibatch (gradients summed across the group, each model's norm clipped);
        `models` train (dropout only with ppo_dropout) and are back in eval mode after.
        kl_coef: the step's beta, for kl_in_loss's term. value_pass: value_pass()'s sums when
        it ran (old_values: update): the value model's gradient of the first minibatch is
        already there, so that minibatch's micro-batches train the policy only.

        Returns the epochs' statistics as 0-dim tensors (no host sync): the mean losses and
        gradient norms per optimiser step, the policy's per-token stats over its tokens, the
        first minibatch's mean ratio and, with a critic, the value loss's clip fraction."""
        cfg = self.config
        exp = buffer.experience
        gen = self.shuffle_generator(version)
        device = exp.mask.device
        rank, world = self.group.rank, self.group.world_size
        zero = torch.zeros((), device=device)
        critic = self.critic
        sums = {k: zero.clone() for k in ("policy_loss", "value_loss", "kl_loss", "vf_clipfrac", "policy_grad_norm",
                                          "value_grad_norm")}
        # the loss's stats (its dataclass's fields, token means) summed x tokens: every field is summed
        # (one list for the group's sum); returned: those without a default (every loss's, reported
        # also by a member without rows) and the optional ones the loss set (its options' stats)
        token_stats = {f.name: zero.clone() for f in dataclasses.fields(self.loss.stats)}
        reported = {f.name for f in dataclasses.fields(self.loss.stats) if f.default is dataclasses.MISSING}
        pg_tokens, v_tokens = zero.clone(), zero.clone()
        first_ratio, first_tokens = zero.clone(), zero.clone()
        n_steps = 0
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf

        for model in models:  # dropout applies only with ppo_dropout (which moves the first ratio off 1)
            model.train()
        self.policy_optimizer.zero_grad(set_to_none=True)
        if critic and value_pass is None:
            self.value_optimizer.zero_grad(set_to_none=True)
        elif critic:  # the first minibatch's value loss, from value_pass
            sums["value_loss"] += value_pass["value_loss"]
            v_tokens += value_pass["v_tokens"]
        for _ in range(cfg.ppo_epochs):
            for index in buffer.minibatch_indices(gen):
                # the whole minibatch's counts, also in a group (each member has a share of its rows)
                pg_norm = self.normalizer(exp.policy_mask[index])
                v_norm = self.normalizer(exp.mask[index])
                local = index[rank::world]  # this member's rows (all of them alone)
                for rows in (buffer.micro_rows(local) if len(local) else ()):
                    micro = buffer.micro_batch(rows)
                    self.speed.count(buffer.plan, rows)
                    train_value = value_pass is None or n_steps > 0
                    pg_loss, v_loss, st = self.micro_backward(micro, pg_norm, v_norm, kl_coef, value=train_value)
                    n_pg = micro.policy_mask.sum()
                    sums["policy_loss"] += pg_loss.detach()
                    if cfg.kl_in_loss:
                        sums["kl_loss"] += st["kl_loss"]
                    for k, v in st["loss"].items():
                        token_stats[k] += v * n_pg
                        reported.add(k)
                    if v_loss is not None:
                        n_v = micro.mask.sum()
                        sums["value_loss"] += v_loss
                        sums["vf_clipfrac"] += st["vf_clipfrac"] * n_v
                        v_tokens += n_v
                    pg_tokens += n_pg
                    if n_steps == 0:  # before any optimiser step
                        first_ratio += st["loss"].ratio_mean * n_pg
                        first_tokens += n_pg
                # Per minibatch: sum the group's gradients, clip each model's gradient norm,
                # then step the optimisers (identically on every member).
                self.group.sum_gradients(self.params)
                sums["policy_grad_norm"] += torch.nn.utils.clip_grad_norm_(self.policy_params, max_norm)
                if critic:
                    sums["value_grad_norm"] += torch.nn.utils.clip_grad_norm_(self.value_params, max_norm)
                for optimizer in self.optimizers:
                    optimizer.step()
                for scheduler in self.schedulers:
                    scheduler.step()
                clear_casts(*models)  # the adapters just changed
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
                n_steps += 1
        for model in models:
            model.eval()
        # the group's sums of the per-token stats (grad norms are already the group's)
        self.group.sum([sums[k] for k in ("policy_loss", "value_loss", "kl_loss", "vf_clipfrac")] + list(token_stats.values())
                       + [pg_tokens, v_tokens, first_ratio, first_tokens])

        out = {k: sums[k] / n_steps for k in ("policy_loss", "value_loss", "kl_loss", "policy_grad_norm",
                                               "value_grad_norm")}
        for k, v in token_stats.items():
            if k in reported:
                out[k] = v / pg_tokens.clamp(min=1)
        out["vf_clipfrac"] = sums["vf_clipfrac"] / v_tokens.clamp(min=1)
        out["first_minibatch_ratio_mean"] = first_ratio / first_tokens.clamp(min=1)
        if not critic:
            for k in ("value_loss", "value_grad_norm", "vf_clipfrac"):
                del out[k]
        if not cfg.kl_in_loss:
            del out["kl_loss"]
        return out

    # ------------------------------------------------------------------ one micro-batch
    def micro_backward(self, mb: Experience, pg_norm: Tensor, v_norm: Tensor,
                       kl_coef: float = 0.0, value: bool = True) -> tuple[Tensor, Optional[Tensor], dict]:
        """Policy loss (PPO-clip - entropy bonus) and value loss of one trimmed micro-batch,
        each normalised by its minibatch's token (or row) count, and their gradients
        accumulated. With a separate value model the policy's backward runs before the value
        model's forward, so only one model's activations are alive at a time (the same
        gradients: the two losses share no graph); a shared trunk takes one backward of
        pg_loss + vf_coef * v_loss. Without a critic only the policy's loss (value loss None).
        kl_coef: beta of kl_in_loss's term; value: False = the policy's loss alone (a separate
        value model already trained on these rows: value_pass). Returns the detached losses
        and the stats."""
        pg_loss, stats, new_values = self.policy_loss(mb, pg_norm, v_norm, kl_coef)
        if not self.critic or not (value or self.shared):
            pg_loss.backward()
            return pg_loss.detach(), None, stats
        if not self.shared:
            pg_loss.backward()
            new_values = self.speed.values(mb.rollouts, mb.seq_len)  # (b, t) float32, the value model's own
        v_loss, v_stats = value_loss(new_values, mb.returns, mb.mask, mb.values, self.config.value_clip,
                                     self.config.loss_agg, v_norm)
        # vf_coef weighs the value loss only on a shared trunk: separate models have an Adam each,
        # which would normalise a weight away
        (pg_loss + self.config.vf_coef * v_loss if self.shared else v_loss).backward()
        return pg_loss.detach(), v_loss.detach(), {**stats, **v_stats}

    def policy_loss(self, mb: Experience, pg_norm: Tensor, v_norm: Tensor,
                    kl_coef: float = 0.0) -> tuple[Tensor, dict, Optional[Tensor]]:
        """One micro-batch's policy objective (learner.losses.policy_objective: the configured
        policy_loss over the policy's tokens, pg_norm, with is_correction's weights; plus, with
        kl_in_loss, kl_coef x the k3 KL to the reference over the same tokens; minus the
        entropy bonus over all real tokens, v_norm), its stats ({"loss": the loss's stats,
        "kl_loss": with kl_in_loss}) and with a shared trunk the (b, t) float32 values from the
        same forward (else None)."""
        cfg = self.config
        logp, ent, values = self.speed.train_stats(mb.rollouts, mb.seq_len, mb.response_tokens, mb.policy_mask, mb.mask,
                                                   entropy=cfg.entropy_coef > 0)
        pg_loss, loss_stats, kl_loss = policy_objective(
            self.loss, LossInputs(logp, mb.old_logprobs, mb.advantages, mb.policy_mask, cfg.clip_epsilon),
            self.loss_params, loss_agg=cfg.loss_agg, normalizer=pg_norm, is_weights=mb.is_weights,
            kl_coef=kl_coef, ref_logprobs=mb.ref_logprobs if cfg.kl_in_loss else None,
            entropy=ent, entropy_coef=cfg.entropy_coef, entropy_mask=mb.mask, entropy_normalizer=v_norm)
        stats = {"loss": loss_stats} if kl_loss is None else {"loss": loss_stats, "kl_loss": kl_loss}
        return pg_loss, stats, values
