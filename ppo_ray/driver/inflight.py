"""The rollout pipeline: which batches are drawn, which adapter version each is sampled with,
the batches in flight, their regeneration after a failure, and what a checkpoint keeps of them.

    pipeline = Pipeline(config, roles, supervisor, committed, cursor, load)
    current = pipeline.next()       # the step's batch: in flight already, or drawn now
    pipeline.start(current)         # 1-2. submitted, unless it is generating
    pipeline.fill(current)          # the next k steps' batches generate while the learner trains

Under max_staleness k the batch of step t (0-based) is sampled with adapter version
max(0, v - (s - t) - k) (version_for: v, s the committed version and step), and while the
learner trains on step t the generators sample the batches of steps t+1 .. t+k (fill). The
synchronous step is k = 0: nothing is in flight, each batch is drawn as its step starts and
sampled with the committed version, and the same code runs. The version is a function of the
step, not of timing, so a lost batch is regenerated exactly (regenerate_lost) and a resumed run
draws and samples the same batches: a checkpoint keeps the cursor before the oldest batch in
flight and the adapters those batches were sampled with (checkpoint), not the batches.

Dynamic sampling (DAPO) is a rollout mode of the pipeline: dynamic_sampling scores the step's
batch and draws more rounds while too few groups vary; the rows it picks are named by index
(ppo_ray.batch.RowPick) to the actors that take the batch, so no rollout tensor goes through
the driver. With batches in flight each batch draws its rounds from a window of its own, and
its rounds stream: while the learner trains (while_learning) a batch in flight is scored and
given its next round as its scores come in, so its extra rounds are off its step's path.

`load` is the sync guard's bring_generators_to (load the versions, then check them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from learner.algos import varying_groups
from ppo_ray.batch import RowPick
from ppo_ray.data import PromptColumns, PromptCursor
from ppo_ray.driver.prompt_feed import env_rows
from ppo_ray.driver.roles import Generation, Roles
from ppo_ray.stats import DynamicSampling, GenerateRequest, GenerationSummary, RewardStats


@dataclass
class Committed:
    """The committed state that the pipeline and the sync guard read (PPOTrainer's commit point
    writes it): steps done, the adapter version every generator holds, and the LoRA weights
    (ObjectRefs) of that version and of those that batches in flight were sampled with."""

    step: int
    version: int
    weights: dict = field(default_factory=dict)


@dataclass
class Rollouts:
    """One step's rollouts: what to generate, and (once submitted) the generation in flight.
    A retry reuses it while it is intact and regenerates it, with the same prompts, seeds and
    adapter version, when it is not. Under dynamic_sampling the step's extra generation rounds
    are Rollouts too, kept in its `rounds` as they are drawn, so a retry reuses (or
    regenerates) exactly them and draws no prompt twice."""

    prompt_ids: list[list[int]]
    step: int                                # the committed step before the step: the sampling seeds' step index
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
    # train()'s prompt list of the prompts its extra rounds take in order (Pipeline.draw); empty
    # in the synchronous step (they come from the cursor)
    window: list[int] = field(default_factory=list)
    # dynamic_sampling: (scores (B,), RewardStats) once fetched; a retry filters and trains on these
    scored: Optional[tuple] = None
    # dynamic_sampling: the refs of its score call in flight (not fetched yet), and once scored,
    # (each row's group as its position in the batch, each group's "scores vary" flag)
    scoring: Optional[tuple] = None
    groups: Optional[tuple[list[int], list[bool]]] = None

    def batches(self) -> list["Rollouts"]:
        """This batch and its extra rounds, in generation order."""
        return [self, *self.rounds]

    def forget(self) -> None:
        """Sample every round again (a re-sync: what the generators sampled is not to be used)."""
        for rollouts in self.batches():
            rollouts.generation, rollouts.scored, rollouts.scoring, rollouts.groups = None, None, None, None


@dataclass
class Picked:
    """dynamic_sampling's outcome (Pipeline.dynamic_sampling): the rows the step trains on,
    named by index, and what the driver reports of them."""

    parts: list                                # ObjectRefs of the rounds' RolloutBatches that hold picked rows
    pick: RowPick                              # which of their rows, in generation order
    scores: object                             # ObjectRef of the picked rows' (B,) scores: the ones the filter saw
    score_list: list[float]
    generated_scores: list[float]              # every round's scores: all the policy generated
    reward_stats: RewardStats                  # every round's score calls, joined
    generated: GenerationSummary               # the picked rows; seconds of every round's generation
    generated_tokens: int                      # response tokens of every round
    summaries: list[GenerationSummary]         # every round's replicas (the stale-version check)
    info: DynamicSampling


@dataclass
class Outcome:
    """What the driver reports of the rollouts a step trained on (Pipeline.outcome)."""

    generated: GenerationSummary               # the trained-on rows (dynamic_sampling: seconds of every round)
    scores: list[float]                        # their scores
    reward_stats: RewardStats
    generated_tokens: int                      # response tokens of every rollout generated (every round's)
    dynamic: Optional[DynamicSampling] = None
    generated_scores: Optional[list[float]] = None  # dynamic_sampling: every round's scores


@dataclass
class Sampled:
    """The rollouts a step trains on, as the reference and the learners take them
    (Pipeline.sampled): the replicas' batches, the rows picked from them (dynamic sampling;
    None: every row) and the ref of their scores; a plain step's reward stats and replica
    summaries are still refs, dynamic sampling's outcome is fetched already (`picked`)."""

    parts: list
    scores: object
    pick: Optional[RowPick] = None
    reward_stats: object = None
    summaries: object = None
    picked: Optional[Picked] = None


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


class Pipeline:
    """The batches of a run's steps, from drawing to the learner (module doc). `config` is the
    trainer's current config (PPOTrainer sets it again when its own changes); `committed` is
    the trainer's committed state, read here, changed by the commit point (keep) alone."""

    def __init__(self, config, roles: Roles, supervisor, committed: Committed, cursor: PromptCursor,
                 load: Callable[[dict], None]):
        self.config, self.roles, self.supervisor = config, roles, supervisor
        self.committed, self.cursor = committed, cursor
        self._load = load
        # train(): the next steps' batches, drawn and generating (step order), and the step train()
        # runs to (no batch is drawn for a step past it; None: ppo_step, nothing in flight)
        self.inflight: deque[Rollouts] = deque()
        self.target: Optional[int] = None
        # train()'s prompt list, encoded once, and its columns the reward functions take
        self.prompt_ids: list[list[int]] = []
        self.prompt_columns: Optional[PromptColumns] = None
        # dynamic_sampling with batches in flight: the rounds scored while their batch was in
        # flight (while_learning), over this pipeline's life
        self.streamed_rounds = 0

    # ------------------------------------------------------------------ versions
    def version_for(self, step: int) -> int:
        """The adapter version the batch of step index `step` (0-based: the sampling seeds' step)
        is sampled with: max_staleness versions before the one its step trains, never below
        the first. A function of the step alone, so a lost or resumed batch is generated
        again exactly."""
        c = self.committed
        rule = max(0, c.version - (c.step - step) - self.config.max_staleness)
        # a run resumed with a larger max_staleness than its checkpoint's has no older adapters
        return max(rule, min(c.weights))

    def keep_from(self, version: int) -> int:
        """The oldest adapter version the generators keep once `version` is loaded: the oldest a
        batch in flight can need (merged sync holds one: `version` itself)."""
        return self.config.sync_capabilities.oldest_kept(version, self.config.max_staleness)

    def needed(self) -> dict:
        """{version: weights} the generators must hold: the committed one and, with adapter or
        tensor sync, every one a batch in flight was sampled with."""
        keep = self.keep_from(self.committed.version)
        return {v: w for v, w in self.committed.weights.items() if v >= keep}

    def keep(self, version: int, weights) -> None:
        """The commit point's part: `version`'s weights kept, with those of the max_staleness
        versions before it (batches in flight were sampled with them); older ones dropped."""
        kept = self.committed.weights
        kept[version] = weights
        self.committed.weights = {v: w for v, w in kept.items() if v >= version - self.config.max_staleness}

    # ------------------------------------------------------------------ drawing
    @property
    def windowed(self) -> bool:
        """dynamic_sampling with batches in flight (max_staleness >= 1): each batch draws its
        window of (1 + dynamic_sampling_max_rounds) x prompts_per_step prompts at once."""
        return self.config.dynamic_sampling and self.config.max_staleness >= 1

    def next(self) -> Rollouts:
        """The batch of the committed step's next step: the oldest in flight, or drawn now."""
        return self.inflight.popleft() if self.inflight else self.draw(self.committed.step)

    def put_back(self, current: Rollouts) -> None:
        """A step that did not happen: its batch is the next one again."""
        self.inflight.appendleft(current)

    def stop(self) -> None:
        """train() ends: the batches in flight are drawn again next time (the cursor goes back to
        the one before the oldest)."""
        if self.inflight:
            self.cursor.set_state(self.inflight[0].cursor)
            self.inflight.clear()

    def draw(self, step: int) -> Rollouts:
        """The next config.prompts_per_step prompts (of train()'s list, encoded once: batch_size
        rollouts of samples_per_prompt samples each), as the rollouts of step index `step`
        (0-based), to be sampled with its version (version_for). Under dynamic_sampling with
        max_staleness >= 1 the batch draws its whole window: (1 + dynamic_sampling_max_rounds)
        x prompts_per_step consecutive prompts of the cursor, the first prompts_per_step its
        first round, the rest its extra rounds' in order (draw_round); the prompts of a window
        that its batch does not reach are not trained on in this epoch. The window, like the
        batch, is a function of the cursor before it: a resumed or retried run draws the same."""
        cursor = self.cursor.state()
        n = self.config.prompts_per_step
        width = n * (1 + self.config.dynamic_sampling_max_rounds) if self.windowed else n
        drawn = self.cursor.draw(len(self.prompt_ids), width)
        prompts, columns = self._drawn(drawn[:n])
        return Rollouts(prompts, step=step, version=self.version_for(step), cursor=cursor, window=drawn[n:],
                        columns=columns)

    def _drawn(self, indices: Sequence[int], first: int = 0) -> tuple[list[list[int]], Optional[PromptColumns]]:
        """The encoded prompts of train()'s list at `indices` and their columns (the first for
        group id `first`): a drawn batch's, so a batch drawn again gets the same."""
        columns = self.prompt_columns.take(indices, first) if self.prompt_columns is not None else None
        return [self.prompt_ids[i] for i in indices], columns

    def draw_round(self, current: Rollouts, r: int) -> Rollouts:
        """dynamic_sampling's extra round `r` (>= 1) of the step of `current`: as many prompts as
        the step's, sampled with its step's seeds at the global indices r * len(current.prompt_ids)
        + i and with its version. The synchronous step draws them from the cursor; under
        max_staleness >= 1 they are the next ones of the batch's window (draw), so that no
        batch's draws wait for, or depend on, another batch's scores."""
        n = len(current.prompt_ids)
        cursor = None
        if self.windowed:
            drawn = current.window[(r - 1) * n:r * n]
        else:
            cursor = self.cursor.state()
            drawn = self.cursor.draw(len(self.prompt_ids), n)
        prompts, columns = self._drawn(drawn, first=r * n)
        return Rollouts(prompts, step=current.step, version=current.version, index_offset=r * n, cursor=cursor,
                        columns=columns)

    # ------------------------------------------------------------------ generating
    def submit(self, rollouts: Rollouts) -> Rollouts:
        """1-2. Generate on every replica, not waited for. Each replica must hold
        rollouts.version (else StateLostError)."""
        segments = self._segments(rollouts)
        rollouts.generation = self.roles.generate(rollouts.prompt_ids, GenerateRequest(
            rollouts.step, rollouts.index_offset, rollouts.version, samples_per_prompt=self.config.samples_per_prompt,
            segment_versions=tuple(segments) if segments is not None else None,
            segment_tokens=self.config.partial_rollout_tokens, rows=env_rows(self.config, rollouts.columns)))
        return rollouts

    def _segments(self, rollouts: Rollouts) -> Optional[list[int]]:
        """partial_rollout continue: the adapter versions of a batch's successive segments of
        partial_rollout_tokens tokens, from its own up to the one before its step's synchronous
        version (which is loaded only as its step starts: waiting for it would put the tail
        back on the step's path); a function of the step, like the batch's version. None
        under finish."""
        if self.config.partial_rollout != "continue":
            return None
        newest = self.committed.version - (self.committed.step - rollouts.step) - 1
        return list(range(rollouts.version, max(rollouts.version, newest) + 1))

    def start(self, current: Rollouts) -> None:
        """1-2. The step's batch generating: submitted now unless it is in flight already (or
        kept from a failed attempt)."""
        if current.generation is not None:
            return
        if current.version != self.committed.version and not self.config.sync_capabilities.several_versions:
            # the first batch after a resume under max_staleness 1: merged sync holds one
            # version, so the batch's goes in first, and the committed one after it
            self.regenerate_lost([current])
        else:
            self.submit(current)

    def fill(self, current: Rollouts) -> None:
        """train() under max_staleness k: draw and submit the batches of the next k steps (up
        to train()'s last) that are not in flight yet, each with its version (version_for).
        k = 0, or ppo_step: none."""
        if self.target is None:
            return
        last = self.inflight[-1].step if self.inflight else current.step
        for step in range(last + 1, min(self.target, current.step + self.config.max_staleness + 1)):
            self.inflight.append(self.submit(self.draw(step)))

    def finish_prefetch(self) -> None:
        """Before the sync: wait for the batches in flight whose adapter version the sync
        retires (merged sync holds one version: all of them; adapter and tensor sync keep every
        version a batch in flight needs: none); the sync queues behind them anyway. Lost ones
        are regenerated with the version they were sampled with."""
        for rollouts in [r for r in self.inflight if r.version < self.keep_from(self.committed.version)]:
            self.supervisor.run(lambda _, r=rollouts: self.roles.fetch(r.generation.summaries), where="prefetch",
                                step=self.committed.step, recover=lambda: self.regenerate_lost([], hold=False))

    def regenerate_lost(self, also: list[Rollouts], hold: bool = True) -> None:
        """After a failure: every batch of `also` and of those in flight whose generation was
        lost is generated again (same prompts, seeds and version), oldest first; then (`hold`)
        every generator holds the versions the committed state needs (not before the sync,
        which loads the new one). A merged-sync generator holds one version: it is given each
        lost batch's before that batch is submitted (its calls run in order)."""
        self.roles.wait_for_actors()
        for rollouts in [r for batch in [*also, *self.inflight] for r in batch.batches()]:
            rollouts.scoring = None  # a score call in flight may be lost with its actor: asked again
            if self.roles.intact(rollouts.generation):
                continue
            if not self.config.sync_capabilities.several_versions:
                self._load({rollouts.version: self.committed.weights[rollouts.version]})
            else:
                self._load(self.needed())
            self.submit(rollouts)
        if hold:
            self._load(self.needed())  # queued behind those generations

    # ------------------------------------------------------------------ the step's rollouts
    def sampled(self, current: Rollouts) -> Sampled:
        """Step 4 on the step's batch (submitted: start): the score call, not waited for; under
        dynamic_sampling the rounds, scored and picked first (dynamic_sampling)."""
        if self.config.dynamic_sampling:
            picked = self.dynamic_sampling(current)
            return Sampled(picked.parts, picked.scores, pick=picked.pick, picked=picked)
        parts = current.generation.parts
        scores, reward_stats = self.roles.score(parts, current.step, current.columns)
        return Sampled(parts, scores, reward_stats=reward_stats, summaries=current.generation.summaries)

    def summaries(self, sampled: Sampled) -> list[GenerationSummary]:
        """The replicas' summaries of every batch the step's rollouts came from (the stale-version
        check reads their versions)."""
        return sampled.picked.summaries if sampled.picked is not None else self.roles.fetch(sampled.summaries)

    def outcome(self, sampled: Sampled, summaries: list[GenerationSummary]) -> Outcome:
        """What the driver reports of the step's rollouts (the scores and reward stats fetched)."""
        if sampled.picked is not None:
            p = sampled.picked
            return Outcome(p.generated, p.score_list, p.reward_stats, p.generated_tokens, p.info, p.generated_scores)
        scores, reward_stats = self.roles.fetch([sampled.scores, sampled.reward_stats])
        generated = GenerationSummary.join(summaries)
        return Outcome(generated, scores.tolist(), reward_stats, sum(generated.lengths))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> tuple[tuple, dict]:
        """What a checkpoint keeps of the pipeline: the cursor state (order, rng) before the
        oldest batch in flight (a resumed run draws them again) and {version: weights ref} of the
        versions older than the committed one that they were sampled with (the behaviour
        adapters)."""
        c = self.committed
        cursor = self.inflight[0].cursor if self.inflight else self.cursor.state()
        return cursor, {v: w for v, w in c.weights.items() if v < c.version}

    def restore(self, behaviour: dict, version: int, policy) -> None:
        """A checkpoint's versions: the behaviour adapters it kept and `version`'s weights
        (`policy`), as object store refs; nothing in flight."""
        self.committed.weights = dict(behaviour)
        self.committed.weights[version] = policy
        self.inflight.clear()

    # ------------------------------------------------------------------ dynamic sampling
    def dynamic_sampling(self, current: Rollouts) -> Picked:
        """DAPO's dynamic sampling (config dynamic_sampling; Yu et al. 2025, section 3.2): score
        the step's batch, keep the groups whose scores vary (learner.algos.varying_groups, on
        the scores and the rows' group ids: the small things the driver fetches), and while
        fewer than the batch's prompts vary and dynamic_sampling_max_rounds allows, draw the
        next prompts (train() only: ppo_step's caller gave its prompts), generate (seeds of
        their own: Rollouts.index_offset) and score them (advance). The step trains on the
        first varying groups in generation order, filled up with the first constant ones when
        the cap leaves too few (pick_groups); the rows are named by index (RowPick) to the
        reference and the learner, which take them from the rounds' batches themselves.

        Each round is recorded in current.rounds as it is drawn, and its scores once fetched,
        so a retry after an actor's death reuses them (a lost generation is regenerated by the
        recovery, identically) and draws only the rounds the first attempt had not reached: the
        retried step trains on the same rollouts, and the cursor holds every prompt drawn once.
        Under max_staleness >= 1 a batch's rounds may have run already while it was in flight
        (while_learning): the same rounds, by the same rule."""
        wanted = len(current.prompt_ids)
        self.advance(current, block=True)
        varies: list[bool] = []             # per group generated, in generation order
        n_rounds = 0
        for rollouts in current.batches():
            if rollouts.groups is None or sum(varies) >= wanted:
                break
            varies += rollouts.groups[1]
            n_rounds += 1
        rounds = current.batches()[:n_rounds]
        unused = current.rounds[n_rounds - 1:]
        if unused and unused[0].cursor is not None:
            # a retry that needs fewer rounds than an earlier attempt drew (a re-sync changed its
            # samples): the prompts of the rounds it does not use go back to the cursor
            self.cursor.set_state(unused[0].cursor)
            del current.rounds[n_rounds - 1:]
        return self._picked(rounds, varies, wanted)

    def advance(self, current: Rollouts, block: bool):
        """dynamic_sampling's rounds of the batch `current`, as far as they go: each round drawn
        (draw_round), generated and scored in order until enough of its groups vary or the cap
        is reached (ppo_step: its one round). `block`: until then; else only as far as the
        scores already in allow. Returns None once the batch has its rounds, else the ref of the
        score call it waits for."""
        wanted, varying = len(current.prompt_ids), 0
        for r in range(self.config.dynamic_sampling_max_rounds + 1):
            if r > len(current.rounds):
                if current.cursor is None:
                    return None  # ppo_step(prompts): no cursor to draw more from
                current.rounds.append(self.draw_round(current, r))  # recorded before anything can fail
            rollouts = current.batches()[r]
            if rollouts.generation is None:
                if r and self.windowed:
                    # the batch's version may be one the generators never loaded as an adapter
                    # (0, the base model, until the first sync): load what batches in flight need
                    self._load(self.needed())
                self.submit(rollouts)
            if rollouts.scored is None:
                if rollouts.scoring is None:
                    rollouts.scoring = self.roles.score(rollouts.generation.parts, rollouts.step, rollouts.columns)
                if not block and not self.roles.wait_any(rollouts.scoring[:1], timeout_s=0):
                    return rollouts.scoring[0]
                scored = tuple(self.roles.fetch(list(rollouts.scoring)))
                rollouts.groups = self._groups(rollouts, scored[0])
                rollouts.scored, rollouts.scoring = scored, None
                self.streamed_rounds += not block
            varying += sum(rollouts.groups[1])
            if varying >= wanted:
                return None
        return None

    def while_learning(self, update_refs: list) -> None:
        """While the learner trains on the step (until `update_refs` are ready): under dynamic
        sampling with batches in flight (windowed), each batch in flight goes on with its rounds
        as their scores come in, so that its extra rounds run off its step's path. What a
        round holds is a function of its batch and its index (prompts from the batch's window,
        seeds, the batch's version), never of when it runs, so the rounds are the ones its
        step would generate when it starts. Returns when the update is done, when every batch
        in flight has its rounds, or when a call's deadline passes (the guarded waits after
        this name the late call)."""
        if not self.windowed:
            return
        while True:
            waiting = [ref for ref in (self.advance(b, block=False) for b in self.inflight) if ref is not None]
            if not waiting:
                return
            ready = self.roles.wait_any(list(update_refs) + waiting)
            if not ready or set(ready) & set(update_refs):
                for batch in self.inflight:  # the rounds whose scores are in go on before the step's sync
                    self.advance(batch, block=False)
                return

    def _groups(self, rollouts: Rollouts, scores) -> tuple[list[int], list[bool]]:
        """A scored round's rows' groups (their positions in the round, by group id) and each
        group's flag: its scores vary (varying_groups, on the scores and the rows' group ids)."""
        summaries = self.roles.fetch(rollouts.generation.summaries)
        groups = [g for s in summaries for g in s.groups]  # (B,): each row's group id
        rows_vary = varying_groups(scores, torch.tensor(groups, dtype=torch.long)).tolist()  # (B,)
        position = _group_positions(groups)
        flags = [False] * (max(position) + 1)
        for row, group in enumerate(position):
            flags[group] = rows_vary[row]
        return position, flags

    def _picked(self, rounds: list[Rollouts], varies: list[bool], wanted: int) -> Picked:
        """The step's rows from its scored `rounds` (pick_groups on every group's flag, in
        generation order), named by index, with what the driver reports of them."""
        roles = self.roles
        per_round = [roles.fetch(r.generation.summaries) for r in rounds]  # per round, its replicas' summaries
        positions = [r.groups[0] for r in rounds]
        chosen, filled = pick_groups(varies, wanted)
        chosen = set(chosen)
        # the chosen groups' rows, round by round: the step's batch, in generation order
        parts, counts, picks, scores, picked_rows, first_group, first_row = [], [], [], [], [], 0, 0
        for position, rollouts in zip(positions, rounds):
            rows = [i for i, g in enumerate(position) if first_group + g in chosen]
            if rows:
                parts += rollouts.generation.parts
                counts.append(len(rollouts.generation.parts))
                picks.append(tuple(rows))
                scores.append(rollouts.scored[0][rows])
                picked_rows += [first_row + i for i in rows]
            first_group += max(position) + 1
            first_row += len(position)
        summaries = [s for replicas in per_round for s in replicas]
        joined = GenerationSummary.join(summaries)
        # each round's replicas run at once (its slowest one's seconds); the rounds one after another
        generated = replace(joined.select(picked_rows), seconds=sum(max(s.seconds for s in r) for r in per_round))
        selected_scores = torch.cat(scores)  # (B,)
        return Picked(parts=parts, pick=RowPick(tuple(counts), tuple(picks)), scores=roles.store(selected_scores),
                      score_list=selected_scores.tolist(),
                      generated_scores=torch.cat([r.scored[0] for r in rounds]).tolist(),
                      reward_stats=RewardStats.join([r.scored[1] for r in rounds], [len(p) for p in positions]),
                      generated=generated, generated_tokens=sum(joined.lengths), summaries=summaries,
                      info=DynamicSampling(rounds=len(rounds), kept_frac=sum(varies) / len(varies), filled=filled))
