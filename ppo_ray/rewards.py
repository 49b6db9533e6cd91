"""Reward sources: the reward-function type, the one check of a config's reward sources,
the HTTP verifier, what one guarded call of a reward function returns (and the plain class
that makes such calls: a reward worker's), and small programmatic reward functions, named in
configs as "ppo_ray.rewards:<name>".

A reward function is named "package.module:function" and called as
fn(prompts: list[str], completions: list[str]) -> list[float]: one float per completion.
It is imported only from the module path the user named (never from data). A reward_funcs
entry that is an http:// or https:// URL is a verifier service instead (HttpVerifier): the
same call, answered by POSTing {"prompts": [...], "responses": [...]} and reading
{"scores": [...]}.

`check_reward_sources` is the one home of the reward-source checks: launch.py (before
anything is written), PPOTrainer (before any actor starts) and the reward actor
(actors/reward.py) all call it, and every problem it finds is a RewardError naming the bad
source (a reward-model path that is not a model directory is a FileNotFoundError from
ppo_ray.paths.resolve_model_path, like every model path).

This module imports nothing heavy at import time (a reward function named here is imported
by the reward actor and by launch.py's checks); the reward model's check loads transformers
when called. The functions at the bottom are for smoke runs and tests of the loop itself (a
signal any policy can climb); the bundled TL;DR task's reward model and gold judge live
with the task.
"""

from __future__ import annotations

import http.client
import importlib
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional, Sequence
from urllib.parse import urlsplit

from ppo_ray.paths import resolve_model_path

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward source failed or returned unusable values; the message names it."""


class RewardTimeout(RewardError):
    """A reward source did not answer within its time limit (reward_timeout_s)."""


def is_verifier_spec(spec: str) -> bool:
    """Whether a reward_funcs entry names an HTTP verifier (an http:// or https:// URL)."""
    return spec.startswith(("http://", "https://"))


def guarded_calls(reward_workers: int, reward_failure: str, reward_funcs: Sequence[str]) -> bool:
    """Whether reward functions run as guarded calls (actors.reward.RewardScorer.guarded_scores,
    whose steps report RewardFailures): with reward workers, a failure policy other than
    "error", or a verifier among them. Otherwise each runs as one plain call on the batch."""
    return reward_workers > 0 or reward_failure != "error" or any(is_verifier_spec(s) for s in reward_funcs)


def import_reward_fn(spec: str, **verifier_options) -> RewardFn:
    """Import "package.module:function" (only that module, as the user named it); a URL is an
    HttpVerifier with `verifier_options` (its keyword arguments)."""
    if is_verifier_spec(spec):
        return HttpVerifier(spec, **verifier_options)
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise RewardError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward function {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: module {module_name!r} has no callable {fn_name!r}")
    return fn


def check_reward_model(name: str) -> None:
    """Cheap checks of reward_model_name from its config.json alone (no weights loaded), so a
    path that is not a reward model fails before any actor starts: a directory without
    config.json or a file (FileNotFoundError, from resolve_model_path), an unreadable config
    (RewardError "is not a loadable model"), num_labels != 1, or a checkpoint saved as
    anything but *ForSequenceClassification (a causal LM: RewardError)."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RewardError(f"reward model {name!r} is not a loadable model: {e}") from e
    archs = list(getattr(cfg, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardError(
            f"reward model {name!r} is a {'/'.join(archs)} checkpoint, not a sequence-classification reward "
            "model: loading it as one would give it a randomly initialised score head, whose scores are noise. "
            "Name a checkpoint saved from AutoModelForSequenceClassification (num_labels=1), e.g. the rm/ "
            "directory of `launch.py rm`")
    # after the architecture: transformers gives a config without id2label num_labels=2
    if getattr(cfg, "num_labels", 1) != 1:
        raise RewardError(f"reward model {name!r} has num_labels={cfg.num_labels}; a reward model needs 1")


def check_reward_sources(reward_model_name: Optional[str], reward_funcs: Sequence[str],
                         reward_weights: Sequence[float] = (), **verifier_options) -> list[tuple[str, RewardFn]]:
    """The reward sources' checks, in one place (launch.py, PPOTrainer and the reward actor
    call it): at least one source, every reward function imports (a verifier's URL is well
    formed: nothing is sent), the reward model is one (check_reward_model: its config.json, no
    weights loaded), and reward_weights, when given, has one weight per source (reward model
    first, then reward_funcs). Returns the functions as (spec, fn) in config order (verifiers
    built with `verifier_options`); raises RewardError naming the bad source."""
    if reward_model_name is None and not reward_funcs:
        raise RewardError("no reward source: set reward_model_name and/or reward_funcs in the config")
    funcs = [(spec, import_reward_fn(spec, **verifier_options)) for spec in reward_funcs]
    if reward_model_name is not None:
        check_reward_model(reward_model_name)
    n = len(funcs) + (reward_model_name is not None)
    if reward_weights and len(reward_weights) != n:
        raise RewardError(f"reward_weights has {len(reward_weights)} entries for {n} reward sources "
                          "(reward model first, then reward_funcs)")
    return funcs


def check_values(spec: str, values, n: int) -> list[float]:
    """A reward function's return value as n floats, or a RewardError naming the function (not
    numbers, or not n of them). Non-finite numbers pass: nonfinite_reward decides about them."""
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward function {spec!r} must return a list of {n} numbers: {e}") from e
    if len(values) != n:
        raise RewardError(f"reward function {spec!r} returned {len(values)} values for {n} prompts")
    return values


# ----------------------------------------------------------------------------- guarded calls
# What a failed call was, in RewardFailures' words: it ran past its time limit, or it raised
# (or returned unusable values, or its worker process died).
TIMEOUT, EXCEPTION = "timeout", "exception"


@dataclass(frozen=True)
class CallResult:
    """One guarded call of a reward function on some rows: their scores, or why there are none."""

    values: Optional[list[float]]  # one per row, in the call's order; None when the call failed
    failure: str = ""              # "" (it answered), TIMEOUT or EXCEPTION
    message: str = ""              # what happened, for the RewardError of reward_failure: error


class RewardWorker:
    """The plain class a reward worker actor hosts (ppo_ray.placement.RewardWorkerPool), also
    the reward actor's own in-process caller: imports the reward functions once and makes one
    guarded call at a time. Imports nothing heavy (no torch), so a fresh worker starts fast."""

    def __init__(self, reward_funcs: Sequence[str], **verifier_options):
        self.funcs = {spec: import_reward_fn(spec, **verifier_options) for spec in reward_funcs}

    def call(self, spec: str, prompts: list[str], completions: list[str]) -> CallResult:
        """fn(prompts, completions) as a CallResult: its checked values (check_values), or the
        failure it raised (a RewardTimeout is a TIMEOUT: a verifier's request past its limit)."""
        try:
            return CallResult(check_values(spec, self.funcs[spec](list(prompts), list(completions)), len(prompts)))
        except RewardTimeout as e:
            return CallResult(None, TIMEOUT, str(e))
        except RewardError as e:  # unusable values, a verifier's failure: the message names it
            return CallResult(None, EXCEPTION, str(e))
        except Exception as e:  # noqa: BLE001 - a user's function: any failure is reported, not raised
            return CallResult(None, EXCEPTION, f"raised {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------- the HTTP verifier
class HttpVerifier:
    """A reward source served over HTTP: a user's sandbox that scores (prompt, response) pairs.

    Called as a reward function. It POSTs JSON {"prompts": [...], "responses": [...]} to `url`,
    `batch_size` rows per request (0: all the call's rows in one), and reads {"scores": [...]}:
    one number per response (NaN / inf follow nonfinite_reward). Each request has `timeout_s`
    (connect and each read; past it: RewardTimeout, not retried, since a service that hangs
    would hang again); a refused or reset connection and an HTTP 5xx are retried up to
    `retries` times after `backoff_s`, 2 x backoff_s, 4 x backoff_s, ... seconds; a 4xx, a reply
    that is not JSON, has no "scores" list, the wrong count or a value that is not a number
    are RewardErrors naming the URL. Standard library only (urllib)."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5,
                 batch_size: int = 0):
        parts = urlsplit(url)
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise RewardError(f"reward verifier {url!r} must be an http:// or https:// URL with a host "
                              "(e.g. http://127.0.0.1:8000/score)")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"HttpVerifier({self.url!r})"

    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise RewardError(f"reward verifier {self.url}: {len(prompts)} prompts but {len(completions)} responses")
        size = self.batch_size or max(len(prompts), 1)
        out: list[float] = []
        for start in range(0, len(prompts), size):
            out += self.post(prompts[start:start + size], completions[start:start + size])
        return out

    def post(self, prompts: list[str], completions: list[str]) -> list[float]:
        """One request (with its retries): the scores of these rows."""
        body = json.dumps({"prompts": list(prompts), "responses": list(completions)}).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    raw = reply.read()
                return self.parse(raw, len(prompts))
            except urllib.error.HTTPError as e:
                if not 500 <= e.code < 600:
                    raise RewardError(f"reward verifier {self.url} answered HTTP {e.code} {e.reason}") from e
                why = f"HTTP {e.code} {e.reason}"
            except (TimeoutError, socket.timeout) as e:
                raise RewardTimeout(f"reward verifier {self.url} did not answer within {self.timeout_s:g} s "
                                    "(reward_timeout_s)") from e
            except urllib.error.URLError as e:
                if isinstance(e.reason, (TimeoutError, socket.timeout)):
                    raise RewardTimeout(f"reward verifier {self.url} did not answer within {self.timeout_s:g} s "
                                        "(reward_timeout_s)") from e
                why = f"cannot connect: {e.reason}"
            except (ConnectionError, http.client.HTTPException) as e:  # reset mid-reply, a reply cut short
                why = f"connection failed: {type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2 ** attempt)
        raise RewardError(f"reward verifier {self.url} failed after {self.retries + 1} attempts: {why}")

    def parse(self, raw: bytes, n: int) -> list[float]:
        """The reply's scores, checked: a JSON object whose "scores" is a list of n numbers."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RewardError(f"reward verifier {self.url} sent a reply that is not JSON: {raw[:80]!r}") from e
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list):
            raise RewardError(f'reward verifier {self.url} must reply with {{"scores": [...]}}; got {raw[:80]!r}')
        if len(scores) != n:
            raise RewardError(f"reward verifier {self.url} sent {len(scores)} scores for {n} responses")
        bad = [i for i, v in enumerate(scores) if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise RewardError(f"reward verifier {self.url} sent a score that is not a number at position {bad[0]} "
                              f"of its reply: {scores[bad[0]]!r}")
        return [float(v) for v in scores]


# ----------------------------------------------------------------------------- reward functions
def letter_e_fraction(prompts: list[str], completions: list[str]) -> list[float]:
    """Fraction of the completion's characters that are the letter "e" (0 for empty)."""
    return [c.count("e") / len(c) if c else 0.0 for c in completions]


def brevity(prompts: list[str], completions: list[str]) -> list[float]:
    """Minus the completion's length in characters divided by 100 (shorter is better)."""
    return [-len(c) / 100.0 for c in completions]
