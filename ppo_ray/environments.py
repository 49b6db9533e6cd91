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
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable


class EnvError(ValueError):
    """A bad environment spec, or an environment that broke its contract (named)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict, seed: int) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


_REGISTRY: dict[str, Callable[[], Environment]] = {}


def register_environment(name: str) -> Callable:
    """Class decorator: `environment: name` in a config makes instances of it."""
    def register(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise EnvError(f"environment {name!r} is already registered as {_REGISTRY[name]!r}")
        _REGISTRY[name] = cls
        return cls
    return register


def environment_names() -> list[str]:
    return sorted(_REGISTRY)


def load_environment(spec: str) -> Callable[[], Environment]:
    """The factory `spec` names: a registered name, or "package.module:Class" (imported from the
    module the user named, never from data). Checked: it makes objects with reset and step."""
    if spec in _REGISTRY:
        factory = _REGISTRY[spec]
    else:
        module_name, _, attr = spec.partition(":")
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

    def of(self, env: Environment) -> "EpisodeLimits":
        """These limits with the environment's own stop_strings / max_turns / max_episode_tokens."""
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
    end: str = ""             # "done", "eos", "max_turns", "budget"
    finish_reason: str = ""   # the last model turn's ("stop" = EOS, as a single-turn response's)

    @property
    def score(self) -> float:
        return float(sum(self.rewards))

    def add(self, ids: Sequence[int], env: bool, logprobs: Optional[Sequence[float]] = None) -> None:
        self.ids += list(ids)
        self.env += [env] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


# sample(requests) -> one Turn per request; a request is (exact token ids so far, seed, max tokens, stop strings)
Sampler = Callable[[list[tuple[list[int], int, int, tuple[str, ...]]]], list[Turn]]


def run_episodes(prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict], seeds: Sequence[int],
                 make_env: Callable[[], Environment], sample: Sampler, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], limits: EpisodeLimits,
                 turn_seed: Callable[[int, int], int]) -> list[Episode]:
    """Episode i: prompt `prompt_ids[i]`, environment reset with (`rows[i]`, `seeds[i]`), model
    turns sampled (`sample`) with seed `turn_seed(i, turn)`, observations tokenised once
    (`encode`). All live episodes' turns go to `sample` together, round after round. Every
    environment made is closed, also when one raises (its error names the episode)."""
    envs: list[Environment] = []
    episodes = [Episode() for _ in prompt_ids]
    try:
        own: list[EpisodeLimits] = []
        for i, (row, seed) in enumerate(zip(rows, seeds)):
            env = make_env()
            envs.append(env)
            own.append(limits.of(env))
            first = _checked_observation(env.reset(dict(row), int(seed)), i, "reset")
            if first:
                _observe(episodes[i], encode(first), first, own[i])
        live = [i for i, ep in enumerate(episodes) if not ep.end]
        while live:
            requests = [([*prompt_ids[i], *episodes[i].ids], turn_seed(i, episodes[i].turns),
                         min(own[i].max_turn_tokens, own[i].max_episode_tokens - len(episodes[i].ids)),
                         own[i].stop_strings) for i in live]
            turns = sample(requests)
            if len(turns) != len(live):
                raise RuntimeError(f"the sampler returned {len(turns)} turns for {len(live)} episodes")
            for i, turn in zip(live, turns):
                ep = episodes[i]
                ep.add(turn.ids, env=False, logprobs=turn.logprobs)
                ep.turns += 1
                ep.finish_reason = turn.finish_reason
                eos = turn.finish_reason == "stop"
                text = decode(turn.ids[:-1] if eos else turn.ids)
                ep.segments.append(("model", text))
                observation, reward, done = _checked_step(envs[i].step(text), i)
                ep.rewards.append(reward)
                if done or eos or ep.turns >= own[i].max_turns or len(ep.ids) >= own[i].max_episode_tokens:
                    ep.end = "done" if done else "eos" if eos else "max_turns" if ep.turns >= own[i].max_turns \
                        else "budget"
                    continue
                if observation:
                    _observe(ep, encode(observation), observation, own[i])
            live = [i for i in live if not episodes[i].end]
    finally:
        for env in envs:
            close = getattr(env, "close", None)
            if callable(close):
                close()
    return episodes


def _observe(ep: Episode, ids: list[int], text: str, limits: EpisodeLimits) -> None:
    """Append an observation's tokens (cut to the budget; the episode then ends)."""
    room = limits.max_episode_tokens - len(ep.ids)
    if len(ids) >= room:
        ids, ep.end = ids[:room], "budget"
    ep.add(ids, env=True)
    ep.segments.append(("env", text))


def _checked_observation(value, i: int, what: str) -> str:
    if not isinstance(value, str):
        raise EnvError(f"episode {i}: the environment's {what}() returned {type(value).__name__}, "
                                "not an observation string")
    return value


def _checked_step(value, i: int) -> tuple[str, float, bool]:
    try:
        observation, reward, done = value
        reward = float(reward)
    except (TypeError, ValueError) as e:
        raise EnvError(f"episode {i}: the environment's step() must return (observation: str, reward: "
                                f"float, done: bool), got {value!r}") from e
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise EnvError(f"episode {i}: the environment's step() returned a non-finite reward {reward}")
    return _checked_observation(observation, i, "step"), reward, bool(done)
