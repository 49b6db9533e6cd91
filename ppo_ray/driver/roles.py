"""The running actors of one PPO run, and every call the driver makes to them.

`Roles` holds the handles (ppo_ray.driver.creation.create_roles makes them) and is the one place
where the driver calls an actor or waits on one: the trainer reads like the algorithm,
these methods say which actor does each part and what travels as an ObjectRef. Nothing
large comes back to the driver: rollouts, reference logprobs, scores, LoRA weights and the
learner's state stay in the object store and are passed on by reference.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, remove_placement_group

from ppo_ray.batch import RowPick
from ppo_ray.data import PromptColumns
from ppo_ray.deadlines import CallTimeout, Deadlines
from ppo_ray.faults import StateLostError
from ppo_ray.stats import GenerateRequest, LearnerStats, SyncReport

log = logging.getLogger("ppo_ray.trainer")

# An actor died or is restarting (ActorDiedError and ActorUnavailableError are subclasses).
ACTOR_ERRORS = (ray.exceptions.RayActorError,)
# What a retry from the last committed step recovers from: those, an actor that came back
# from a restart without the state the step needs, and an actor killed past a call's deadline.
RETRYABLE = (*ACTOR_ERRORS, StateLostError, CallTimeout)
# Sampling-seed steps from here up are no training step's: PPOTrainer.generate and the eval samples.
SAMPLING_SEED_STEP = 10**9
EVAL_SEED_STEP = SAMPLING_SEED_STEP + 1  # sampling seeds of the eval samples: a step index no training step reaches
# How long a normal end waits for the actors to exit on their own (end_actors).
EXIT_TIMEOUT_S = 30.0


def call_label(seed_step: int) -> str:
    """What an actor's log line calls a generate or score call of sampling-seed step
    `seed_step`: "step N" (1-based) for a training step, "eval" for the eval samples (the
    same prompts and seeds at every evaluation), "samples" for PPOTrainer.generate."""
    if seed_step < SAMPLING_SEED_STEP:
        return f"step {seed_step + 1}"
    return "eval" if seed_step == EVAL_SEED_STEP else "samples"


def end_actors(actors: Sequence[Optional[ActorHandle]], graceful_s: float = 0.0) -> list[ActorHandle]:
    """End `actors` (None entries skipped), no restarts. graceful_s > 0: each is first asked
    to close (its `close` method, where it has one: an actor that owns others ends them) and
    then to exit (Ray's __ray_terminate__: after the calls queued before it, exit code 0; the
    dashboard and the state API then say it exited, INTENDED_USER_EXIT, not "killed by
    ray.kill"); those still alive after graceful_s seconds are killed. graceful_s 0 (an
    error or an interrupt unwinds: an actor may be stuck in a call) kills them all at once.
    Returns the actors that had to be killed."""
    actors = [a for a in actors if a is not None]
    left = list(actors)
    if graceful_s > 0 and actors:
        exits = {}
        for actor in actors:
            try:
                if hasattr(actor, "close"):
                    actor.close.remote()
                exits[actor.__ray_terminate__.remote()] = actor
            except Exception:  # noqa: BLE001 - already dead: nothing to ask
                pass
        done, _ = ray.wait(list(exits), num_returns=len(exits), timeout=graceful_s)
        left = [a for ref, a in exits.items() if ref not in done]
    for actor in left:
        ray.kill(actor, no_restart=True)
    return left


def role_names(num_generators: int, num_learners: int) -> list[str]:
    """Role names in Roles.all()'s order, as in the actor names <run tag>/<role>."""
    learners = ["learner"] if num_learners == 1 else [f"learner-{i}" for i in range(num_learners)]
    return [f"generator-{i}" for i in range(num_generators)] + ["reference", "reward", *learners]


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges that split n items into `parts` contiguous chunks (prompt order kept)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


@dataclass
class Generation:
    """One generation call across the replicas: per replica, the ObjectRef of its
    RolloutBatch (rows in prompt order) and of its GenerationSummary (texts, version, seconds)."""

    parts: list[ray.ObjectRef]      # RolloutBatch per replica, in prompt order
    summaries: list[ray.ObjectRef]  # GenerationSummary per replica


class UpdateCall(NamedTuple):
    """One learner's update in flight: the refs of its three results."""

    stats: ray.ObjectRef    # LearnerStats
    weights: ray.ObjectRef  # the new LoRA weights (version + 1)
    state: ray.ObjectRef    # LearnerState after the update


@dataclass
class Update:
    """One learner-group update in flight, per member in rank order. Rank 0's weights and
    state speak for the group."""

    calls: list[UpdateCall]

    @property
    def weights(self) -> ray.ObjectRef:
        return self.calls[0].weights

    @property
    def state(self) -> ray.ObjectRef:
        return self.calls[0].state


@dataclass(eq=False)
class _Call:
    """One call the driver made to an actor, for its deadline (ppo_ray.deadlines): its kind,
    its actor, one of its results (all of a call's results are ready together), its rows, the
    calls it waits for before it can start (those whose results it takes, and on an actor that
    runs one call at a time, the call before it), and when it was submitted and seen done."""

    kind: str
    role: str
    actor: ActorHandle
    ref: ray.ObjectRef
    rows: int
    after: list["_Call"]
    submitted: float
    done: Optional[float] = None  # time.monotonic() when seen finished (or killed)
    # False once an actor died or was killed while it ran: its time (a failure passed on from
    # its inputs, seen after the recovery) sets no pace
    timed: bool = True


@dataclass
class Roles:
    generators: list[ActorHandle]
    reference: ActorHandle
    reward: ActorHandle
    learners: list[ActorHandle]  # rank order; rank 0 exports the LoRA weights
    placement_group: Optional[PlacementGroup] = None  # holds every actor's resources; release() removes it
    model_store: Optional[ActorHandle] = None  # holds the shipped models' files (multi-node runs)
    # every call's deadline (ppo_ray.deadlines), and whether a generator runs one call at a time
    # (False: streaming generators take the calls of every batch in flight at once)
    deadlines: Deadlines = field(default_factory=Deadlines)
    sequential_generators: bool = True
    # the calls in flight or not yet waited for, by each of their results; per actor id, the last
    # call made to it (actors that run one call at a time)
    _calls: dict = field(default_factory=dict, init=False, repr=False)
    _last: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def learner(self) -> ActorHandle:
        """Rank 0 of the learner group (the only learner when num_learners is 1)."""
        return self.learners[0]

    def names(self) -> list[str]:
        """Role names in all()'s order, as in the actor names <run tag>/<role>."""
        return role_names(len(self.generators), len(self.learners))

    def all(self) -> list[ActorHandle]:
        return [*self.generators, self.reference, self.reward, *self.learners]

    # ------------------------------------------------------------------ calls and their deadlines
    def _track(self, kind: str, actor: ActorHandle, result, after: Sequence = (), rows: Optional[int] = None):
        """Record a call just made to `actor` (`result`: its ObjectRef, or a tuple of them) for
        its deadline; `after`: the ObjectRefs it takes as arguments. Its rows: `rows`, or those
        of the batches it takes (the generations'). Returns `result`."""
        refs = list(result) if isinstance(result, (tuple, list)) else [result]
        after = [r for r in after if isinstance(r, ray.ObjectRef)]  # a value passed as it is needs no wait
        deps = list({id(c): c for c in (self._calls.get(r) for r in after) if c is not None}.values())
        if rows is None:
            rows = sum(c.rows for c in deps if c.kind in ("generate", "evaluation"))
        key = actor._actor_id.hex()
        sequential = self.sequential_generators or not any(actor is g for g in self.generators)
        prev = self._last.get(key) if sequential else None
        if prev is not None and prev.done is None and prev not in deps:
            deps.append(prev)
        call = _Call(kind, self._role_name(actor), actor, refs[0], max(int(rows), 1), deps, time.monotonic())
        if sequential:
            self._last[key] = call
        if len(self._calls) > 1024:  # forget the calls seen finished
            self._calls = {r: c for r, c in self._calls.items() if c.done is None}
        for ref in refs:
            self._calls[ref] = call
        return result

    def _role_name(self, actor: ActorHandle) -> str:
        for name, a in zip(self.names(), self.all()):
            if a is actor:
                return name
        return "unknown"

    def _tracked(self, refs: Sequence) -> list[_Call]:
        """The tracked calls among `refs` not seen finished, each once."""
        calls = {id(c): c for c in (self._calls.get(r) for r in refs if isinstance(r, ray.ObjectRef))
                 if c is not None and c.done is None}
        return list(calls.values())

    def _wait(self, refs: Sequence) -> None:
        """Wait until the tracked calls among `refs` have finished, each within its deadline
        (_wait_calls)."""
        self._wait_calls(self._tracked(refs))

    def _wait_calls(self, calls: list[_Call], get: Optional[list] = None):
        """Wait for `calls`: first for the calls each waits for (each within its own deadline,
        so a hang is blamed on the call that hangs), then for them, each within its deadline
        from the moment it could start (ppo_ray.deadlines). Those past it: their actors are
        killed (Ray restarts them) and CallTimeout names them. With `get` (ObjectRefs that
        include the calls' results, small things), their values are returned, each fetched as
        it is ready: a call that failed raises at once, not once the others finish (a sibling
        may wait for what only the driver's next call brings: a partial rollout's next version;
        ray.get of a list waits for every one first)."""
        pending = list({id(c): c for c in calls if c.done is None}.values())  # two calls may share a dependency
        if not pending and get is None:
            return None
        self._wait_calls([d for c in pending for d in c.after])
        starts = {id(c): max([c.submitted] + [d.done for d in c.after]) for c in pending}
        limits = {id(c): self.deadlines.limit(c.kind, c.role, c.rows) for c in pending}
        left = list(dict.fromkeys(get)) if get is not None else []  # ray.wait refuses a ref twice
        got: dict = {}
        while pending or left:
            timeout = max(0.0, min(starts[id(c)] + limits[id(c)][0] for c in pending) - time.monotonic()) \
                if pending else None
            refs = list(dict.fromkeys(c.ref for c in pending))
            if left:
                for ref in ray.wait(left, num_returns=1, timeout=timeout)[0]:
                    got[ref] = ray.get(ref)  # a failed call's error is raised here
                left = [r for r in left if r not in got]
                ready = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) if refs else set()
            else:
                ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)[0])
            now = time.monotonic()
            for c in pending:
                if c.ref in ready:
                    c.done = now
                    if c.timed:
                        self.deadlines.record(c.kind, c.role, now - starts[id(c)], c.rows)
                    c.after = []
            pending = [c for c in pending if c.done is None]
            late = [c for c in pending if now >= starts[id(c)] + limits[id(c)][0]]
            if late:
                self._kill_late(late, now, starts, limits)
        return [got[r] for r in get] if get is not None else None

    def _kill_late(self, late: list[_Call], now: float, starts: dict, limits: dict) -> None:
        """Kill the actors of calls past their deadlines (Ray restarts them) and raise CallTimeout."""
        for c in late:
            waited, (limit, rule) = now - starts[id(c)], limits[id(c)]
            log.warning("the %s actor's %s call has run %.0f s, past its deadline of %.0f s (%s): killing it "
                        "(Ray restarts it)", c.role, c.kind, waited, limit, rule)
            ray.kill(c.actor, no_restart=False)
            self.restarted(c.role)
            c.done, c.after = now, []  # its results are the actor's death now
        first = late[0]
        raise CallTimeout(first.kind, [c.role for c in late], now - starts[id(first)], limits[id(first)][0],
                          limits[id(first)][1])

    def restarted(self, role: str) -> None:
        """`role`'s actor died or was killed ("unknown": any): its next calls are first calls
        (their deadline allows for its start-up), none waits for its calls before it, and the
        calls in flight set no pace when they finish (one that took a lost input fails only
        when it is next waited for, perhaps after the recovery)."""
        self.deadlines.restarted(role)
        for call in self._calls.values():  # in flight across a death: their times are no pace
            if call.done is None:
                call.timed = False
        for key, call in list(self._last.items()):
            if role in (call.role, "unknown"):
                del self._last[key]

    # ------------------------------------------------------------------ the object store
    def fetch(self, refs):
        """Wait for ObjectRef(s) and return their values (small things only: the driver
        pulls texts, scores and stats, never rollouts or weights during a step). A call that
        made them and runs past its deadline is a CallTimeout (its actor killed)."""
        return self._get(refs)

    def _get(self, refs):
        """fetch(), for the Roles methods that wait for their own calls."""
        listed = list(refs) if isinstance(refs, (list, tuple)) else [refs]
        values = self._wait_calls(self._tracked(listed), get=listed)
        return values if isinstance(refs, (list, tuple)) else values[0]

    def wait_any(self, refs: Sequence, timeout_s: Optional[float] = None) -> list:
        """The refs among `refs` that are ready: at once with timeout_s 0, else once one is, or
        [] when the earliest deadline of the calls that make them passes (counted from their
        submission: the guarded waits that follow, fetch and learner_stats, name and kill a late
        call) or timeout_s does. Nothing is fetched."""
        refs = list(dict.fromkeys(refs))
        if timeout_s is None:
            ends = [c.submitted + self.deadlines.limit(c.kind, c.role, c.rows)[0] for c in self._tracked(refs)]
            timeout_s = max(0.0, min(ends) - time.monotonic()) if ends else None
        return ray.wait(refs, num_returns=1, timeout=timeout_s, fetch_local=False)[0] if refs else []

    def store(self, value):
        """Put a small driver-side value (a restored checkpoint's state, the scores dynamic
        sampling picked) into the object store."""
        return ray.put(value)

    # ------------------------------------------------------------------ the step's calls
    def generate(self, prompt_ids: Sequence[Sequence[int]], request: GenerateRequest) -> Generation:
        """Steps 1-2 on every replica, not waited for: contiguous chunks of the prompts (order
        kept), each replica's call the request with its chunk's prompt_offset (request.part:
        each prompt's sampling seed follows (request.step, its global index)), each prompt
        sampled samples_per_prompt times (contiguous rows; group id = its global index, so a
        group never spans replicas). A replica that holds another adapter version than
        request.version raises StateLostError (stats.GenerateRequest: the options)."""
        chunks = [(s, e) for s, e in split_evenly(len(prompt_ids), len(self.generators)) if e > s]
        kind = "generate" if request.step < SAMPLING_SEED_STEP else "evaluation"
        calls = [self._track(kind, gen, gen.generate.remote(list(prompt_ids[s:e]), request.part(s, e)),
                             rows=(e - s) * request.samples_per_prompt)
                 for gen, (s, e) in zip(self.generators, chunks)]
        return Generation([batch for batch, _ in calls], [summary for _, summary in calls])

    def reference_logprobs(self, parts: list, pick: Optional[RowPick] = None) -> tuple[Any, Any]:
        """Step 3, not waited for: refs of the (B, T) reference logprobs and of its ReferenceStats.
        `pick`: the rows of `parts` the step trains on (dynamic sampling), taken by the actor."""
        return self._track("reference", self.reference, self.reference.logprobs.remote(*parts, pick=pick), after=parts,
                           rows=None if pick is None else len(pick))

    def held_out(self, parts: list, rows: list[int], kl_estimator: str) -> Any:
        """Ref of the per-token view (ppo_ray.attribution.AttributionRows) of rows `rows` of an
        evaluation's generation `parts`: the reference's logprobs of them and KL_t, on the
        reference actor (the samples never pass through the driver)."""
        return self._track("reference", self.reference,
                           self.reference.held_out.remote(*parts, rows=list(rows), kl_estimator=kl_estimator),
                           after=parts, rows=len(rows))

    def score(self, parts: list, seed_step: int, columns: Optional[PromptColumns] = None) -> tuple[Any, Any]:
        """Step 4, not waited for: refs of the (B,) scores and of the RewardStats; the rollouts
        were sampled with `seed_step`'s seeds (the reward actor's log line names the call).
        `columns`: the dataset's columns of their prompts, by value (small: one entry per
        prompt), for the reward functions; they go to the reward actor alone."""
        return self._track("score", self.reward, self.reward.score.remote(*parts, label=call_label(seed_step),
                                                                          columns=columns), after=parts)

    def update(self, ref_logprobs, scores, parts: list, expected_version: int, max_staleness: int,
               planned_steps: int, gap_limit: Optional[float] = None, pick: Optional[RowPick] = None) -> Update:
        """The learner's steps on every learner, not waited for (its old logprobs when it
        recomputes step 2's, KL_t of step 3 with the reference's logprobs, and steps 5-11):
        each gets the same refs and takes its own shard of the rows. `pick`: the rows of `parts`
        the step trains on (dynamic sampling), taken by each learner."""
        return Update([UpdateCall(*self._track("update", learner, learner.update.remote(
            ref_logprobs, scores, *parts, expected_version=expected_version, max_staleness=max_staleness,
            planned_steps=planned_steps, gap_limit=gap_limit, pick=pick), after=[ref_logprobs, scores, *parts],
            rows=None if pick is None else len(pick)))
            for learner in self.learners])

    def learner_stats(self, update: Update) -> LearnerStats:
        """Wait for the update; rank 0's stats. In a learner group a member that dies
        mid-update makes the others' collectives fail (a RayTaskError from a live member);
        the death is the cause, so it is what is raised."""
        refs = [call.stats for call in update.calls]
        self._wait(refs)  # each member within its deadline (those past it are killed together)
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

    def load_adapter(self, version: int, weights, restore: bool = False,
                     generators: Optional[list[ActorHandle]] = None,
                     retire_below: Optional[int] = None) -> list[SyncReport]:
        """The LoRA sync: every replica (or the given ones) loads adapter `version` from the
        object store entry `weights`, first retiring the versions below `retire_below` (no batch
        in flight needs them); waited for. Their load reports (version, bytes, seconds)."""
        gens = self.generators if generators is None else generators
        return self._get([self._track("sync", g, g.load_adapter.remote(version, weights, restore, retire_below),
                                       after=[weights]) for g in gens])

    def sync_gaps(self, probe_ids: list[list[int]], version: int, weights=None,
                  generators: Optional[list[ActorHandle]] = None) -> list[float]:
        """The sync check: every replica (or the given ones) samples the probe prompts with
        `version`; rank 0's learner, at the same version, recomputes their logprobs (`weights`:
        the object store entry of `version`'s adapter when it is older than the learner's).
        Per replica, the largest gap (the probe rollouts go replica -> learner by reference)."""
        gens = self.generators if generators is None else generators
        rows = len(probe_ids)
        parts = [self._track("probe", g, g.probe.remote(probe_ids, expected_version=version), rows=rows) for g in gens]
        return self._get(self._track("probe", self.learner, self.learner.sync_gaps.remote(
            *parts, expected_version=version, weights=weights), after=[*parts, weights], rows=rows * len(gens)))

    def generator_versions(self) -> list[list[int]]:
        """The adapter versions each replica holds (ascending)."""
        return self._get([self._track("query", g, g.versions.remote()) for g in self.generators])

    def bring_generators_to(self, weights: dict[int, Any]) -> dict[int, list[int]]:
        """Give every generator the adapter versions `weights` names ({version: object store
        entry}) that it does not hold (a restarted one holds the base model only), oldest first,
        so the newest is the one it samples with by default (merged sync holds one version:
        name one). Returns {version: the replicas (indices) that loaded it}."""
        held = self.generator_versions()
        loaded = {}
        for version in sorted(weights):
            missing = [i for i, h in enumerate(held) if version not in h]
            if missing:
                self.load_adapter(version, weights[version], restore=True,
                                  generators=[self.generators[i] for i in missing])
                loaded[version] = missing
        return loaded

    def intact(self, generation: Optional[Generation]) -> bool:
        """Whether a generation's results are all still there (no replica died making them, or
        was killed past its deadline)."""
        if generation is None:
            return False
        try:
            self._get(generation.summaries)
            return True
        except RETRYABLE:
            return False

    def current_weights(self) -> tuple[int, Any]:
        """(the policy's version, ref of its LoRA weights) from rank 0."""
        version_ref, weights_ref = self._track("state", self.learner, self.learner.current_weights.remote())
        return self._get(version_ref), weights_ref

    def attribution(self, rows: list[int]):
        """Rank 0's per-token tensors of `rows` of its last update (ppo_ray.attribution.AttributionRows,
        a few rows on the CPU), or None when it has none (restarted since the update)."""
        return self._get(self._track("query", self.learner, self.learner.attribution.remote(rows), rows=len(rows)))

    def learner_state(self):
        """Ref of rank 0's state (adapters, value head, optimisers, RNG), left in the store."""
        return self._track("state", self.learner, self.learner.state_dict.remote())

    def restore_learners(self, state, reform: bool = True) -> list[int]:
        """Every learner loads `state` (a ref, or the dict), re-forming the group first (a
        restarted member left it, and the others' collectives failed). Returns their versions."""
        if reform and len(self.learners) > 1:
            form_learner_group(self)
        return self._get([self._track("state", learner, learner.load_state_dict.remote(state), after=[state])
                           for learner in self.learners])

    # ------------------------------------------------------------------ restarts
    def wait_for_actors(self, timeout_s: float = 900.0) -> None:
        """Block until every role answers again (Ray re-runs a dead actor's constructor, up to
        config.max_actor_restarts times; a role out of restarts raises here)."""
        deadline = time.monotonic() + timeout_s
        for actor in self.all():
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

    def role_of(self, error: BaseException) -> str:
        """The role an actor error came from ("unknown" when it names no actor of the run)."""
        role = getattr(error, "role", None)  # StateLostError names its role
        if role:
            return role
        actor_id = getattr(error, "actor_id", None)
        for name, actor in zip(self.names(), self.all()):
            if actor_id and actor._actor_id.hex() == actor_id:
                return name
        return "unknown"

    def actor(self, role: str) -> ActorHandle:
        return dict(zip(self.names(), self.all()))[role]

    def release(self, graceful_s: float = 0.0) -> list[str]:
        """End every actor (end_actors: with graceful_s > 0 each closes and exits on its own,
        the rest are killed; no restarts) and remove the placement group, which frees the
        resources it reserved. Returns the names of the actors that were killed. Safe to call
        twice."""
        named = dict(zip(self.all(), self.names()))
        killed = end_actors([*self.all(), self.model_store], graceful_s)
        self.model_store = None
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        return [named.get(a, "models") for a in killed]


def form_learner_group(roles: Roles, timeout_s: float = 120.0) -> None:
    """Join the learners into one torch.distributed group (rank = position in roles.learners;
    rank 0's node hosts the rendezvous). Also re-forms it after a learner was restarted (each
    member leaves its old group first). No-op for a single learner."""
    if len(roles.learners) == 1:
        return
    address = ray.get(roles.learners[0].rendezvous_address.remote())
    ray.get([actor.join_group.remote(address, rank, len(roles.learners), timeout_s)
             for rank, actor in enumerate(roles.learners)])

