"""What one PPO step produced before its commit point (Uncommitted: PPOTrainer._until_commit
builds it), and the StepResult the step reports once it is committed and synced
(Uncommitted.result: texts, scores, the learner's stats, per-phase seconds, rates)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ppo_ray.driver.inflight import Outcome, Rollouts
from ppo_ray.driver.roles import Update
from ppo_ray.stats import EpisodeStats, LearnerStats, ReferenceStats, StepResult, StepTiming, SyncReport


@dataclass
class Uncommitted:
    """Everything a step produced before its commit point."""

    rollouts: Rollouts
    outcome: Outcome  # what the driver reports of the rollouts it trained on
    stats: LearnerStats
    update: Update    # its weights and state: ObjectRefs of the new LoRA and the learner's state
    reference_stats: ReferenceStats
    t_start: float
    t_update_done: float
    queue_depth: int  # batches in flight beyond this one while the learner trained

    def result(self, step: int, version: int, loads: list[SyncReport], check, resyncs: int,
               t_generation_done: float, t_sync_done: float) -> StepResult:
        """The committed step `step` (the adapter `version`), synced (`loads`: each replica's
        SyncReport) and checked (`check`: the SyncCheck, after `resyncs` re-syncs)."""
        outcome, stats = self.outcome, self.stats
        generated = outcome.generated
        timing = StepTiming(
            generate_s=generated.seconds,  # the slowest replica
            reference_s=self.reference_stats.seconds,
            reward_s=outcome.reward_stats.seconds,
            learner_forward_s=stats.learner_forward_s,
            update_s=stats.update_s,
            sync_s=t_sync_done - t_generation_done,
            sync_check_s=check.seconds,
            # max_staleness: how long the driver waited for the prefetched generation after the
            # learner finished (0 when generation is the faster of the two)
            prefetch_wait_s=t_generation_done - self.t_update_done,
            # the sync's parts on the generator side (the rest of sync_s is the object-store
            # transfer of the LoRA tensors and the actor call)
            sync_write_s=max(r.write_s for r in loads),
            sync_register_s=max(r.register_s + r.retire_s for r in loads),
            step_s=time.perf_counter() - self.t_start)
        return StepResult(
            step=step,
            generated_texts=generated.texts, finish_reasons=generated.finish_reasons,
            rewards=outcome.scores, generated_rewards=outcome.generated_scores, learner=stats,
            reward_parts=outcome.reward_stats.parts(), adapter_version=version,
            timing=timing, lora_sync_bytes=loads[0].nbytes, response_lengths=generated.lengths,
            sync_probe_gap=check.gap, sync_resyncs=resyncs,
            # tokens and FLOPs per second of the generation and the learner (StepResult.rates)
            **StepResult.rates(timing, stats, outcome.generated_tokens),
            queue_depth=float(self.queue_depth), dynamic_sampling=outcome.dynamic,
            episodes=EpisodeStats.of(generated.episodes) if generated.episodes is not None else None,
            transcripts=([[tuple(seg) for seg in e.segments] for e in generated.episodes]
                         if generated.episodes is not None else None))
