"""The sync guard: every check that the generators hold the learner's policy, and the one rule
for a check that fails.

    guard = SyncGuard(config, roles, supervisor, metrics, probe_ids, committed, recover)
    guard.sync(version, keep)            # the committed LoRA into every replica (SyncReport each)
    guard.check(version)                 # the probe after the sync: SyncCheck
    guard.bring_generators_to(weights)   # a restarted replica or a resume: load, then check_loaded
    guard.check_rollouts(stats)          # the rollouts' own logprobs against the learner's

Three checks compare what a generator computes with what the learner computes at the same
adapter version: the probe after every sync (check: a small fixed set of random-token prompts,
sync_probe_prompts), the probe of a version loaded again into some replicas (check_loaded: a
restarted replica, a resume, the versions batches in flight need), and the step's rollouts
(check_rollouts, on fresh steps). A gap beyond the tolerance goes through one rule, `verdict`,
by logprob_gap_check: warn logs it, error raises LogprobGapError, resync loads the version again
and checks once more (the rollouts: PPOTrainer re-syncs and samples the step again), and a gap
that persists after a re-sync is a LogprobGapError.

The guard reads the committed state (ppo_ray.driver.inflight.Committed: the step, the version, the
kept weights) and never changes it; `recover` is the trainer's way back to it after an actor's
death outside a step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ppo_ray.stats import LearnerStats, SyncReport

if TYPE_CHECKING:
    from ppo_ray.driver.inflight import Committed

log = logging.getLogger("ppo_ray.trainer")  # the driver's log, as ppo_ray.driver.roles'

# The rollout check's share of sampled tokens that the learner's truncation may drop: a token
# at the top-k/top-p boundary can flip sides by rounding (rare: well under 1e-3 of the tokens
# in float32), while a generator holding another policy samples many outside the support.
TRUNCATED_TOKENS_LIMIT = 0.01


class StaleAdapterError(RuntimeError):
    """A generator sampled with a LoRA version other than the one the step expects."""


class LogprobGapError(RuntimeError):
    """The generator's logprobs differ from the learner's for the same adapter version beyond
    logprob_gap_tolerance (logprob_gap_check: error, or resync when a re-sync did not mend
    it): the generator holds another policy."""


@dataclass(frozen=True)
class SyncCheck:
    """One sync check (SyncGuard.check)."""

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


def verdict(logprob_gap_check: str, again: bool) -> str:
    """The one rule for a gap beyond the tolerance, by logprob_gap_check: "warn" (log it and go
    on), "error" (raise LogprobGapError), or "resync" (load the version again and check once
    more). `again`: a re-sync was tried already, so a gap under resync is an error."""
    if logprob_gap_check == "warn":
        return "warn"
    if logprob_gap_check == "error" or again:
        return "error"
    return "resync"


def rollout_gap(config, stats: LearnerStats) -> str | None:
    """How the step's rollouts fail the rollout check (SyncGuard.check_rollouts), None when they
    pass. Without is_correction the largest gap of one token is held to logprob_gap_tolerance
    (under top_p < 1, plus log(1 / top_p) for the few tokens at the nucleus's edge). With it,
    the share of tokens whose ratio is outside the correction's band [1/is_cap, is_cap]
    (is_outside_frac) is held to logprob_gap_outside_tolerance: the correction absorbs a
    mismatch that moves a few tokens far, and the largest gap of one token grows with the
    number of tokens (long bfloat16 responses). A lost or corrupted sync is still caught by the
    probe (SyncGuard.check), whose rule is the largest gap whatever is_correction is.
    A sampled token that the learner's top-k/top-p truncation drops has no logprob to compare;
    such tokens count too: beyond TRUNCATED_TOKENS_LIMIT of the step's tokens the two
    truncations disagree by more than a tie at the boundary explains."""
    cfg = config
    gap = stats.gen_logprob_max_abs_diff
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
        return None
    return how


class SyncGuard:
    """Load, probe, the rollout check, and the one rule (`verdict`) for a gap (module doc).

    `config` is the trainer's current config (PPOTrainer sets it again when its own changes).
    `resyncs` counts the re-syncs of the current step (StepResult.sync_resyncs; the trainer
    resets it as a step starts)."""

    def __init__(self, config, roles, supervisor, metrics, probe_ids: list[list[int]], committed: "Committed",
                 recover: Callable[[], None]):
        self.config, self.roles, self.supervisor, self.metrics = config, roles, supervisor, metrics
        self.probe_ids = probe_ids
        self.committed = committed
        self._recover = recover  # back to the committed state after a death outside a step
        self.resyncs = 0

    def _gap(self, message: str, again: bool, suffix: str) -> bool:
        """A gap beyond the tolerance, counted, then `verdict`: warn logs `message` and returns
        False (go on), error raises LogprobGapError (with `suffix` when `again`), resync returns
        True (the caller loads the version again and checks once more)."""
        self.metrics.record_logprob_gap(self.config.lora_sync_mode)
        rule = verdict(self.config.logprob_gap_check, again)
        if rule == "warn":
            log.warning(message)
            return False
        if rule == "error":
            raise LogprobGapError(message + (suffix if again else ""))
        return True

    def resamples(self, error: BaseException) -> bool:
        """Whether a failed step's error is a rollout gap that the rule mends by a re-sync and a
        new sample of the step (resync, and no re-sync tried in this step yet)."""
        again = self.resyncs > 0
        return isinstance(error, LogprobGapError) and verdict(self.config.logprob_gap_check, again) == "resync"

    # ------------------------------------------------------------------ load
    def sync(self, version: int, keep: int) -> list[SyncReport]:
        """The committed LoRA goes from the learner's object store entry to every replica; a
        replica that dies here is restarted and given it. `keep`: the oldest version a batch in
        flight needs (the pipeline's keep_from)."""
        weights = self.committed.weights[version]
        # max_staleness with adapter or tensor sync: first retire the versions no batch in flight
        # needs (otherwise the load replaces the previous version once it is in place)
        loads = self.supervisor.run(lambda attempt: self.roles.load_adapter(version, weights, restore=attempt > 0,
                                                                            retire_below=keep if keep < version else None),
                                    where="sync", step=self.committed.step, recover=self.roles.wait_for_actors)
        bad = [r.version for r in loads if r.version != version]
        if bad:
            raise StaleAdapterError(f"generators report adapter versions {bad} after loading {version}")
        return loads

    def bring_generators_to(self, weights: dict) -> None:
        """Roles.bring_generators_to, then the check of every version it loaded, on the replicas
        that loaded it, before they sample with it (check_loaded)."""
        for version, replicas in sorted(self.roles.bring_generators_to(weights).items()):
            self.check_loaded(version, replicas)

    def check_loaded(self, version: int, replicas: list[int]) -> None:
        """The check of `version` loaded again into generator `replicas` (a restarted replica, a
        resume): older than the learner's version (one a batch in flight needs), the learner
        scores the probe with that version's adapter, which the driver holds
        (Learner.sync_gap). No step is reported for it; a gap over logprob_gap_limit goes
        through the rule (resync: loaded again and checked once more). Unsupervised: it runs
        inside a supervised place's recovery or attempt, whose failure handling covers it."""
        cfg, committed = self.config, self.committed
        if cfg.logprob_gap_check == "off":
            return
        gens = [self.roles.generators[i] for i in replicas]
        weights = None if version == committed.version else committed.weights[version]
        for again in (False, True):
            gaps = self.roles.sync_gaps(self.probe_ids, version, weights=weights, generators=gens)
            bad = [i for i, g in zip(replicas, gaps) if g > cfg.logprob_gap_limit]
            if not bad:
                return
            message = (f"after step {committed.step}: generator replica(s) {bad}, given adapter version {version} "
                       f"again, compute logprobs up to {max(gaps):.3g} nats away from the learner's with that version "
                       f"(logprob_gap_tolerance {cfg.logprob_gap_limit:g} for {cfg.dtype}, "
                       f"lora_sync={cfg.lora_sync_mode}): the load did not deliver it")
            if not self._gap(message, again, "; it persists after loading it again"):
                return
            log.warning("%s; loading it again", message)
            self.resyncs += 1
            gens = [self.roles.generators[i] for i in bad]
            replicas = bad
            self.roles.load_adapter(version, committed.weights[version], restore=True, generators=gens)

    # ------------------------------------------------------------------ probe
    def check(self, version: int) -> SyncCheck:
        """The sync check, after every sync in every mode: each generator samples the fixed
        probe prompts (sync_probe_prompts) with the version it just loaded, untruncated at the
        PPO temperature, and the learner at the same version recomputes those tokens'
        logprobs (Roles.sync_gaps). The largest gap within logprob_gap_limit passes, with or
        without is_correction: the probe is small and fixed (4 prompts x PROBE_NEW_TOKENS), so
        its largest gap does not grow with the run's responses as the rollouts' does, and it
        is what catches a lost or corrupted sync when is_correction relaxes the rollout check
        (rollout_gap). Beyond it, the rule: resync (the default) loads the version again into
        the replicas that failed (a new adapter, or merged weights rebuilt from the base) and
        checks again, and a gap that persists is a LogprobGapError; error raises at once; warn
        logs it. Either way the step's gap is reported (StepResult.sync_probe_gap)."""
        cfg = self.config
        if cfg.logprob_gap_check == "off":
            return SyncCheck(math.nan, 0.0)
        t0 = time.perf_counter()
        resyncs = 0
        while True:
            # a generator or the learner lost during the check comes back in the committed state
            gaps = self.supervisor.run(lambda _: self.roles.sync_gaps(self.probe_ids, version), where="sync check",
                                       step=self.committed.step, recover=self._recover)
            gap = max(gaps)
            if gap <= cfg.logprob_gap_limit:
                return SyncCheck(gap, time.perf_counter() - t0)
            bad = [i for i, g in enumerate(gaps) if g > cfg.logprob_gap_limit]
            message = (f"after step {self.committed.step}: generator replica(s) {bad} compute logprobs up to "
                       f"{gap:.3g} nats away from the learner's at the same adapter version {version} "
                       f"(logprob_gap_tolerance {cfg.logprob_gap_limit:g} for {cfg.dtype}, "
                       f"lora_sync={cfg.lora_sync_mode}): the sync did not deliver the learner's policy")
            if not self._gap(message, resyncs > 0, "; it persists after a re-sync"):
                return SyncCheck(gap, time.perf_counter() - t0)
            log.warning("%s; re-syncing them", message)
            self.resync(version, bad)
            resyncs += 1

    def resync(self, version: int, replicas: list[int]) -> None:
        """Load `version` again into generator `replicas` (a new adapter registration, or the
        merged weights rebuilt from the base)."""
        self.resyncs += 1
        gens = [self.roles.generators[i] for i in replicas]
        self.supervisor.run(lambda _: self.roles.load_adapter(version, self.committed.weights[version], restore=True,
                                                              generators=gens),
                            where="sync", step=self.committed.step, recover=self._recover)

    # ------------------------------------------------------------------ the rollouts
    def check_rollouts(self, stats: LearnerStats) -> None:
        """The generator and the learner must give a sampled token the same logprob at the
        same version (stale rollouts in overlap mode report NaN: another policy by design):
        rollout_gap says how they may differ. Beyond it, the rule: warn logs it; error and
        resync raise LogprobGapError (resync: PPOTrainer re-syncs and samples the step again
        unless it has re-synced in this step already: resamples)."""
        cfg = self.config
        if cfg.logprob_gap_check == "off" or not math.isfinite(stats.gen_logprob_max_abs_diff):
            return
        how = rollout_gap(cfg, stats)
        if how is None:
            return
        message = (f"step {self.committed.step + 1}: the generator's logprobs of its own samples differ from the "
                   f"learner's at the same adapter version {self.committed.version} {how}, and "
                   f"{stats.truncated_tokens:.0f} of its {stats.tokens:.0f} sampled tokens are outside the learner's "
                   f"top-k/top-p support (at most {TRUNCATED_TOKENS_LIMIT:.0%}), lora_sync={cfg.lora_sync_mode}: the "
                   "rollouts came from another policy (stale KV cache? a lost sync?)")
        if self._gap(message, False, ""):
            raise LogprobGapError(message)  # resync: the step's caller re-syncs and samples again (resamples)
