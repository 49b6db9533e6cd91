"""Multi-turn environments: the contract, the registry, and the episode loop over exact token ids.

The contract (docs/ENVIRONMENTS.md), the minimal form that must always work:

    class MyEnv:
        def reset(self, row: dict, seed: int) -> str: ...          # the first observation ("" = none)
        def step(self, action: str) -> tuple[str, float, bool]: ...  # (observation, reward, done)
        # optional: close(); stop_strings = ("</tool>",); max_turns = 4; max_episode_tokens = 256

`row` is the dataset row with all its columns; `action` is the model's turn as text, up to
and including the stop string that ended it. An environment is named in the config as
`environment: package.module:Class` or by a registered name (register_environment); one
instance serves one episode (it is made with no arguments, reset once, stepped, closed). It
must be deterministic given (row, seed): a retried or resumed step replays its episodes.

The episode loop (run_episodes) never re-tokenises the history. The prompt's ids, then each
model turn's sampled ids exactly as the sampler returned them, then each observation
tokenised once (no special tokens added) and appended: the ids the learner trains on are the
ids that were sampled (verl's docs: re-tokenising a chat history "made PPO not converge").
The observation's tokens are flagged as the environment's (RolloutBatch.env_mask): context
for the later turns, out of every loss (learner.experience). A model turn ends at EOS, at a
stop string, or at its token limit; then the environment steps on it. The episode ends when
the environment says done, when the model ended its turn with EOS (its last action: the
step's reward counts, its observation is not appended), at max_turns, or when the episode's
token budget (model and environment tokens after the prompt) is spent: an observation that
does not fit is cut to the budget.

Rewards: an episode's score is the sum of its steps' rewards, placed like a single-turn
response's score on the episode's last model token (learner.algos.shape_rewards, "summed at
the end"); GAE carries it back over the model's tokens across the environment's turns
(ppo_ray.batch.Packing), and the group estimators read it as the row's score.

Many episodes run at once: every turn round submits all live episodes' next turns together,
each as its exact prefix, so the engine batches them and its prefix cache serves what an
earlier turn already computed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable


class EnvError(ValueError):
    """A bad environment spec, or an environment that broke its contract (named)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict, seed: int) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


_REGISTRY: dict[str, Callable[[], Environment]] = {}
# The bundled environments, by name: "module:Class", imported when first named (their modules
# may sit in a higher layer or import more than this one needs).
BUILTIN: dict[str, str] = {
    "python": "ppo_ray.code_tool:PythonTool",          # a Python tool run in ppo_ray.sandbox
    "calculator": "ppo_ray.tasks.tool_mul:Calculator",  # task tool-mul's calculator tool
}


def register_environment(name: str) -> Callable:
    """Class decorator: `environment: name` in a config makes instances of it."""
    def register(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise EnvError(f"environment {name!r} is already registered as {_REGISTRY[name]!r}")
        _REGISTRY[name] = cls
        return cls
    return register


def environment_names() -> list[str]:
    return sorted({*_REGISTRY, *BUILTIN})


def load_environment(spec: str) -> Callable[[], Environment]:
    """The factory `spec` names: a registered name, or "package.module:Class" (imported from the
    module the user named, never from data). Checked: it makes objects with reset and step."""
    if spec in _REGISTRY:
        factory = _REGISTRY[spec]
    else:
        module_name, _, attr = BUILTIN.get(spec, spec).partition(":")
        if not module_name or not attr:
            raise EnvError(f"environment {spec!r} must be a registered name ({environment_names()}) "
                                    "or look like 'package.module:Class'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise EnvError(f"environment {spec!r}: cannot import module {module_name!r}: {e}") from e
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise EnvError(f"environment {spec!r}: module {module_name!r} has no class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
    if isinstance(factory, type) and missing:
        raise EnvError(f"environment {spec!r}: {factory.__name__} has no {' or '.join(missing)} method "
                                "(the contract: reset(row, seed) -> str, step(action) -> (str, float, bool))")
    return factory


@dataclass(frozen=True)
class EpisodeLimits:
    """An episode's limits: the environment's own attributes where it sets them, else these."""

    stop_strings: tuple[str, ...] = ()
    max_turns: int = 4
    max_episode_tokens: int = 256   # model and environment tokens after the prompt
    max_turn_tokens: int = 64       # one model turn's

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_episode_tokens", "max_turn_tokens"):
            if int(getattr(self, name)) < 1:
                raise EnvError(f"episode limit {name} must be >= 1, got {getattr(self, name)}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise EnvError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")

    def of(self, env) -> "EpisodeLimits":
        """These limits with the environment's own stop_strings / max_turns / max_episode_tokens
        (attributes of its class, or of an instance)."""
        own = {name: getattr(env, name) for name in ("stop_strings", "max_turns", "max_episode_tokens")
               if getattr(env, name, None) is not None}
        if "stop_strings" in own:
            own["stop_strings"] = tuple(own["stop_strings"])
        return EpisodeLimits(**{**self.__dict__, **own})


@dataclass
class Turn:
    """A sampled model turn: its token ids, their logprobs, and why it ended ("stop": EOS,
    "stop_string", "length")."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class Episode:
    """One episode's transcript after the prompt, token-exact, and what happened in it."""

    ids: list[int] = field(default_factory=list)          # every token after the prompt, in order
    env: list[bool] = field(default_factory=list)         # True on the environment's tokens
    logprobs: list[float] = field(default_factory=list)   # the sampler's on model tokens, 0 on the environment's
    segments: list[tuple[str, str]] = field(default_factory=list)  # ("model" | "env", text), for the reader
    rewards: list[float] = field(default_factory=list)    # each step's
    turns: int = 0
    end: str = ""             # "done", "eos", "max_turns", "budget", "failed"
    finish_reason: str = ""   # the last model turn's ("stop" = EOS, as a single-turn response's)
    tool_calls: int = 0       # steps that were tool calls (EnvOutcome.tool_call)
    tool_errors: int = 0
    env_seconds: float = 0.0  # the environment's own seconds (its holder's), resets included
    failure: str = ""         # end "failed": "timeout" or "exception"
    failure_message: str = ""

    @property
    def score(self) -> float:
        """The sum of the steps' rewards (a failed episode's: the caller's policy decides)."""
        return float(sum(self.rewards))

    @property
    def ended(self) -> bool:
        """The episode ended on its own (the environment's done, or the model's EOS), not at a limit
        or a failure: a single-turn response's finish reason "stop"."""
        return self.end in ("done", "eos")

    def add(self, ids: Sequence[int], env: bool, logprobs: Optional[Sequence[float]] = None) -> None:
        self.ids += list(ids)
        self.env += [env] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


# sample(requests) -> one Turn per request; a request is (exact token ids so far, seed, max tokens, stop strings)
Sampler = Callable[[list[tuple[list[int], int, int, tuple[str, ...]]]], list[Turn]]

FAILURES = ("error", "score", "drop")  # what a failed episode does (config.reward_failure, the episode's share)


@dataclass(frozen=True)
class EnvCall:
    """One call to an episode's environment: a reset (`actions` empty) or a step on the last of
    `actions`, which are every action of the episode so far in order. The history travels with
    each step so that any holder can rebuild the environment (reset with the same row and seed,
    then the earlier actions replayed) when it does not hold it: a replaced worker, a restart.
    Deterministic given (row, seed), the rebuilt environment is the one that was lost."""

    key: str                         # the episode's id, unique among the episodes alive at once
    row: dict                        # the dataset row, all its columns
    seed: int
    actions: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnvOutcome:
    """What a reset or a step gave: the observation, reward and done (a reset's reward is 0), the
    tool-call facts of the richer contract (step's optional 4th element, a dict with "tool_call"
    and "tool_error"; without it a step that answers with an observation and goes on counts as
    a tool call), or a failure ("timeout", "exception": the environment raised or broke its
    contract, `message` says which) and the seconds its holder spent."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False
    failure: str = ""                # "" = it worked
    message: str = ""
    seconds: float = 0.0


class EnvHolder:
    """The environments of the episodes alive in one process (an environment worker's, or the
    generator's own with env_workers 0): `call` runs an EnvCall on the episode's instance,
    rebuilding it first (a fresh instance, reset, the earlier actions replayed) when this holder
    does not hold it at exactly the call's history (the same seed and the same actions before the
    new one). Never raises for what an environment does: an exception or a broken contract is an
    EnvOutcome failure naming it, and the instance is dropped (closed)."""

    def __init__(self, make_env: Callable[[], Environment]):
        self.make_env = make_env
        # key -> (instance, its seed, the actions it has taken)
        self.live: dict[str, tuple[Environment, int, tuple[str, ...]]] = {}
        self.replays = 0  # instances rebuilt from a history (none where calls find their instance)

    def call(self, call: EnvCall) -> EnvOutcome:
        import time

        t0 = time.perf_counter()
        seed = int(call.seed)
        try:
            if not call.actions:
                env = self._fresh(call.key)
                observation = _checked_observation(env.reset(dict(call.row), seed), None, "reset")
                self.live[call.key] = (env, seed, ())
                return EnvOutcome(observation, seconds=time.perf_counter() - t0)
            env, held_seed, taken = self.live.get(call.key, (None, None, None))
            if held_seed != seed or taken != call.actions[:-1]:
                env = self._fresh(call.key)
                _checked_observation(env.reset(dict(call.row), seed), None, "reset")
                for action in call.actions[:-1]:
                    _checked_step(env.step(action), None)
                self.replays += 1
            outcome = _checked_step(env.step(call.actions[-1]), None)
            self.live[call.key] = (env, seed, tuple(call.actions))
            return replace(outcome, seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - a user's environment: its failure is the episode's
            self.release([call.key])
            what = str(e) if isinstance(e, EnvError) else f"{type(e).__name__}: {e}"
            return EnvOutcome(failure="exception", message=what, seconds=time.perf_counter() - t0)

    def _fresh(self, key: str) -> Environment:
        """A new instance for episode `key` (the one it replaces closed), not yet held."""
        self.release([key])
        return self.make_env()

    def release(self, keys: Sequence[str]) -> None:
        """Close and forget the episodes' environments (a close that raises is ignored: the
        episode is over)."""
        for key in keys:
            env = self.live.pop(key, (None,))[0]
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        """Close every environment held (the worker's end)."""
        self.release(list(self.live))


class EnvRunner(Protocol):
    """Where an episode's environment calls run: LocalEnvRunner (this process) or the
    environment-worker pool (ppo_ray.driver.env_pool.EnvWorkerPool: Ray actors, each call under
    env_timeout_s, a stuck or dead worker replaced)."""

    def run(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        """Each call's outcome, in order; waits for all (calls of one episode: at most one per round)."""
        ...

    def release(self, keys: list[str]) -> None:
        """The episodes are over: their environments are closed."""
        ...


class EnvWorker:
    """An environment worker's plain class (ppo_ray.driver.env_pool hosts it in a Ray actor): the
    environments of the episodes routed to it, in an EnvHolder."""

    def __init__(self, spec: str):
        self.holder = EnvHolder(load_environment(spec))

    def call(self, call: EnvCall) -> EnvOutcome:
        return self.holder.call(call)

    def release(self, keys: list[str]) -> None:
        self.holder.release(keys)

    def replays(self) -> int:
        return self.holder.replays

    def close(self) -> None:
        """Before the actor exits (end_actors): every environment it holds is closed."""
        self.holder.close()


class LocalEnvRunner:
    """Environment calls in this process, one after another, with no time limit of their own (a
    Python call cannot be stopped in its thread): env_workers 0."""

    def __init__(self, make_env: Callable[[], Environment]):
        self.holder = EnvHolder(make_env)

    def run(self, calls: list[EnvCall]) -> list[EnvOutcome]:
        return [self.holder.call(c) for c in calls]

    def release(self, keys: list[str]) -> None:
        self.holder.release(keys)


def run_episodes(prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict], seeds: Sequence[int],
                 envs: "EnvRunner | Callable[[], Environment]", sample: Sampler, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], limits: EpisodeLimits,
                 turn_seed: Callable[[int, int], int], *, failure: str = "error",
                 keys: Optional[Sequence[str]] = None) -> list[Episode]:
    """Episode i: prompt `prompt_ids[i]`, environment reset with (`rows[i]`, `seeds[i]`), model
    turns sampled (`sample`) with seed `turn_seed(i, turn)`, observations tokenised once
    (`encode`). All live episodes' turns go to `sample` together, round after round, and their
    environment calls to `envs` together (an EnvRunner, or an environment class: run here).
    `limits` are already the environment's own (EpisodeLimits.of its class). Every environment
    is released at the end, also when the loop raises.

    An environment call that fails (it raised, broke the contract, or ran past its time limit
    on a worker) ends its episode (end "failed", Episode.failure), by `failure`: "error" raises
    EnvError naming the episode and what happened; "score" and "drop" keep the episode as it is
    (its score is then the caller's: reward_failure_score, or NaN)."""
    if failure not in FAILURES:
        raise EnvError(f"failure policy {failure!r} must be one of {list(FAILURES)}")
    runner: EnvRunner = envs if hasattr(envs, "run") else LocalEnvRunner(envs)  # type: ignore[assignment]
    keys = [str(i) for i in range(len(prompt_ids))] if keys is None else [str(k) for k in keys]
    episodes = [Episode() for _ in prompt_ids]
    actions: list[list[str]] = [[] for _ in prompt_ids]

    def failed(i: int, outcome: EnvOutcome, what: str) -> bool:
        if not outcome.failure:
            return False
        ep = episodes[i]
        ep.end, ep.failure, ep.failure_message = "failed", outcome.failure, outcome.message
        if failure == "error":
            raise EnvError(f"episode {keys[i]}: the environment's {what} failed ({outcome.failure}): "
                           f"{outcome.message} (reward_failure: error; score or drop keep the step)")
        return True

    try:
        firsts = runner.run([EnvCall(keys[i], dict(row), int(seed)) for i, (row, seed) in enumerate(zip(rows, seeds))])
        for i, first in enumerate(firsts):
            episodes[i].env_seconds += first.seconds
            if not failed(i, first, "reset()") and first.observation:
                _observe(episodes[i], encode(first.observation), first.observation, limits)
        live = [i for i, ep in enumerate(episodes) if not ep.end]
        while live:
            requests = [([*prompt_ids[i], *episodes[i].ids], turn_seed(i, episodes[i].turns),
                         min(limits.max_turn_tokens, limits.max_episode_tokens - len(episodes[i].ids)),
                         limits.stop_strings) for i in live]
            turns = sample(requests)
            if len(turns) != len(live):
                raise RuntimeError(f"the sampler returned {len(turns)} turns for {len(live)} episodes")
            for i, turn in zip(live, turns):
                ep = episodes[i]
                ep.add(turn.ids, env=False, logprobs=turn.logprobs)
                ep.turns += 1
                ep.finish_reason = turn.finish_reason
                text = decode(turn.ids[:-1] if turn.finish_reason == "stop" else turn.ids)
                ep.segments.append(("model", text))
                actions[i].append(text)
            outcomes = runner.run([EnvCall(keys[i], dict(rows[i]), int(seeds[i]), tuple(actions[i])) for i in live])
            for i, outcome in zip(live, outcomes):
                ep = episodes[i]
                ep.env_seconds += outcome.seconds
                if failed(i, outcome, "step()"):
                    continue
                ep.rewards.append(outcome.reward)
                ep.tool_calls += int(outcome.tool_call)
                ep.tool_errors += int(outcome.tool_error)
                eos = ep.finish_reason == "stop"
                if outcome.done or eos or ep.turns >= limits.max_turns or len(ep.ids) >= limits.max_episode_tokens:
                    ep.end = "done" if outcome.done else "eos" if eos else "max_turns" \
                        if ep.turns >= limits.max_turns else "budget"
                    continue
                if outcome.observation:
                    _observe(ep, encode(outcome.observation), outcome.observation, limits)
            live = [i for i in live if not episodes[i].end]
    finally:
        runner.release(keys)
    return episodes


def _observe(ep: Episode, ids: list[int], text: str, limits: EpisodeLimits) -> None:
    """Append an observation's tokens (cut to the budget; the episode then ends)."""
    room = limits.max_episode_tokens - len(ep.ids)
    if len(ids) >= room:
        ids, ep.end = ids[:room], "budget"
    ep.add(ids, env=True)
    ep.segments.append(("env", text))


def _checked_observation(value, key, what: str) -> str:
    if not isinstance(value, str):
        raise EnvError(f"{_episode(key)}the environment's {what}() returned {type(value).__name__}, "
                       "not an observation string")
    return value


def _episode(key) -> str:
    return "" if key is None else f"episode {key}: "


def _checked_step(value, key) -> EnvOutcome:
    """step()'s return as an EnvOutcome: (observation, reward, done), or with a 4th element, a
    dict whose "tool_call" / "tool_error" say what the turn was (the richer contract)."""
    info: dict = {}
    try:
        if isinstance(value, tuple) and len(value) == 4:
            value, info = value[:3], value[3]
            if not isinstance(info, dict):
                raise TypeError(f"its 4th element is a {type(info).__name__}, not a dict")
        observation, reward, done = value
        reward = float(reward)
    except (TypeError, ValueError) as e:
        raise EnvError(f"{_episode(key)}the environment's step() must return (observation: str, reward: "
                       f"float, done: bool) or those and an info dict, got {value!r} ({e})") from e
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise EnvError(f"{_episode(key)}the environment's step() returned a non-finite reward {reward}")
    observation = _checked_observation(observation, key, "step")
    done = bool(done)
    tool_call = bool(info.get("tool_call", bool(observation) and not done))
    return EnvOutcome(observation, reward, done, tool_call=tool_call, tool_error=bool(info.get("tool_error", False)))
