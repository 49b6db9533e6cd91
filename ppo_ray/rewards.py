"""Reward sources: the reward-function type, the one check of a config's reward sources,
the HTTP verifier, what one guarded call of a reward function returns (and the plain class
that makes such calls: a reward worker's), and small programmatic reward functions, named in
configs as "ppo_ray.rewards:<name>".

A reward function is named "package.module:function" and called as
fn(prompts: list[str], completions: list[str], **columns) -> list[float]: one float per
completion. `columns` are per-row lists (actors.reward.reward_columns): finish_reasons, "stop"
where the response ended with EOS, "length" where it was cut at max_new_tokens, and the
dataset's other columns (each row its prompt's value: a verifier reads the row's answer
instead of parsing it out of the prompt). A function gets only those its signature names, or
all of them with **kwargs (TRL's convention for a dataset's extra columns), so
fn(prompts, completions) works as it always did. It is imported only from the module path the
user named (never from data). A reward_funcs entry that is an http:// or https:// URL is a
verifier service instead (HttpVerifier): the same call, answered by POSTing
{"prompts": [...], "responses": [...], "columns": {...}} and reading {"scores": [...]}, with no
redirect followed and no proxy but the config's.

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
import inspect
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence
from urllib.parse import SplitResult, urlsplit, urlunsplit

from ppo_ray.paths import resolve_model_path

RewardFn = Callable[..., Sequence[float]]  # fn(prompts, completions, **the columns it takes)


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
                         reward_weights: Sequence[float] = (), *, environment: Optional[str] = None,
                         **verifier_options) -> list[tuple[str, RewardFn]]:
    """The reward sources' checks, in one place (launch.py, PPOTrainer and the reward actor
    call it): at least one source (an `environment`'s reward counts as one), every reward function imports (a verifier's URL is well
    formed: nothing is sent), the reward model is one (check_reward_model: its config.json, no
    weights loaded), and reward_weights, when given, has one weight per source (reward model
    first, then reward_funcs). Returns the functions as (spec, fn) in config order (verifiers
    built with `verifier_options`); raises RewardError naming the bad source."""
    if reward_model_name is None and not reward_funcs and environment is None:
        raise RewardError("no reward source: set reward_model_name, reward_funcs and/or environment in the config")
    funcs = [(spec, import_reward_fn(spec, **verifier_options)) for spec in reward_funcs]
    if reward_model_name is not None:
        check_reward_model(reward_model_name)
    n = len(funcs) + (reward_model_name is not None)
    if reward_weights and len(reward_weights) != n:
        raise RewardError(f"reward_weights has {len(reward_weights)} entries for {n} reward sources "
                          "(reward model first, then reward_funcs)")
    return funcs


def columns_taken(fn: Callable, names: Sequence[str]) -> list[str]:
    """The per-row columns of `names` that `fn` takes: those its signature names as parameters
    (positional-or-keyword or keyword-only), or all of them when it has **kwargs; none when
    its signature cannot be read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return list(names)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [name for name in names if name in named]


def call_reward_fn(fn: Callable, prompts: list[str], completions: list[str], columns: dict[str, list]):
    """fn(prompts, completions, **the columns it takes): the one way a reward function is called
    (actors.reward's plain call, RewardWorker's guarded ones). Returns what fn returns."""
    taken = {name: list(columns[name]) for name in columns_taken(fn, list(columns))}
    return fn(list(prompts), list(completions), **taken)


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
class RewardCall:
    """One guarded call of a reward function on some rows, as it travels to whoever makes it
    (RewardWorker.call, in a worker actor or the reward actor): the rows' prompts and
    completions, and their per-row columns (each list in row order; the function gets those it
    takes: call_reward_fn)."""

    spec: str
    prompts: list[str]
    completions: list[str]
    columns: dict[str, list] = field(default_factory=dict)


@dataclass(frozen=True)
class CallResult:
    """One guarded call of a reward function on some rows: their scores, or why there are none."""

    values: Optional[list[float]]  # one per row, in the call's order; None when the call failed
    failure: str = ""              # "" (it answered), TIMEOUT or EXCEPTION
    message: str = ""              # what happened, for the RewardError of reward_failure: error


class RewardWorker:
    """The plain class a reward worker actor hosts (ppo_ray.driver.reward_pool.RewardWorkerPool), also
    the reward actor's own in-process caller: imports the reward functions once and makes one
    guarded call at a time. Imports nothing heavy (no torch), so a fresh worker starts fast."""

    def __init__(self, reward_funcs: Sequence[str], **verifier_options):
        self.funcs = {spec: import_reward_fn(spec, **verifier_options) for spec in reward_funcs}

    def call(self, call: RewardCall) -> CallResult:
        """The call's function on its rows (call_reward_fn) as a CallResult: its checked values
        (check_values), or the failure it raised (a RewardTimeout is a TIMEOUT: a verifier's call
        past its deadline)."""
        spec = call.spec
        try:
            values = call_reward_fn(self.funcs[spec], call.prompts, call.completions, call.columns)
            return CallResult(check_values(spec, values, len(call.prompts)))
        except RewardTimeout as e:
            return CallResult(None, TIMEOUT, str(e))
        except RewardError as e:  # unusable values, a verifier's failure: the message names it
            return CallResult(None, EXCEPTION, str(e))
        except Exception as e:  # noqa: BLE001 - a user's function: any failure is reported, not raised
            return CallResult(None, EXCEPTION, f"raised {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------- the HTTP verifier
def _http_url(url: str, what: str, schemes: tuple[str, ...] = ("http", "https")) -> SplitResult:
    """`url` split (urlsplit), or a RewardError naming `what` when it is not a URL of `schemes`
    with a host (and a valid port, if it has one)."""
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in schemes or not parts.hostname or not port_ok:
        names = " or ".join(f"{s}://" for s in schemes)
        raise RewardError(f"{what} {url!r} must be an {names} URL with a host (e.g. http://127.0.0.1:8000/score)")
    return parts


class _ConnectFailed(OSError):
    """The TCP connection to the verifier (or its proxy) could not be made: retried."""


class HttpVerifier:
    """A reward source served over HTTP: a user's sandbox that scores (prompt, response) pairs.

    Called as a reward function. It POSTs JSON {"prompts": [...], "responses": [...],
    "columns": {name: [...], ...}} to `url`, `batch_size` rows per request (0: all the call's
    rows in one), and reads {"scores": [...]}: one number per response (NaN / inf follow
    nonfinite_reward). "columns" holds every per-row column the call has, each a list of one
    value per response, in the responses' order: "finish_reasons" ("stop" / "length") and the
    dataset's other columns (a row's ground truth, e.g. "answer"); a service that ignores keys
    it does not know reads the request as before. `timeout_s` is the deadline of
    one call, all of it: connecting, sending, every read of every request, the retries and their
    waits; past it the call is a RewardTimeout naming the URL and the limit (a reply that
    trickles in cannot hold a call longer: the socket is shut at the deadline). A refused or
    reset connection and an HTTP 5xx are retried up to `retries` times after `backoff_s`, 2 x
    backoff_s, 4 x backoff_s, ... seconds (a wait that would end past the deadline is a
    RewardTimeout at once); a timeout is not retried (a service that hangs would hang again). A
    redirect (3xx) is not followed: it is a RewardError naming the URL and the Location it
    points to, as are a 4xx and a reply that is not JSON, has no "scores" list, the wrong count
    or a value that is not a number. The prompts and responses go to `url`'s host only: no
    proxy is used but `proxy` (an http://host:port URL; an https:// verifier is reached through
    a CONNECT tunnel in it), and no environment variable (http_proxy, https_proxy, no_proxy) is
    read. Standard library only: http.client, which follows no redirect and looks up no proxy."""

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 0.5,
                 batch_size: int = 0, proxy: Optional[str] = None):
        self.target = _http_url(url, "reward verifier")
        self.proxy = None if proxy is None else _http_url(proxy, "reward_verifier_proxy", ("http",))
        if self.proxy is not None and (self.proxy.username is not None or self.proxy.password is not None):
            raise RewardError(f"reward_verifier_proxy {self.proxy.hostname}: credentials in the URL are not "
                              "supported (the config is saved with the run)")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"HttpVerifier({self.url!r})"

    def __call__(self, prompts: list[str], completions: list[str], **columns: list) -> list[float]:
        bad = {name: len(v) for name, v in columns.items() if len(v) != len(prompts)}
        if len(prompts) != len(completions) or bad:
            raise RewardError(f"reward verifier {self.url}: {len(prompts)} prompts but {len(completions)} responses"
                              + "".join(f", {n} values of column {name!r}" for name, n in bad.items()))
        deadline = time.monotonic() + self.timeout_s  # the whole call's (reward_timeout_s)
        size = self.batch_size or max(len(prompts), 1)
        out: list[float] = []
        for start in range(0, len(prompts), size):
            rows = slice(start, start + size)
            out += self.post(prompts[rows], completions[rows], deadline,
                             {name: list(v[rows]) for name, v in columns.items()})
        return out

    def past_deadline(self, why: str = "") -> RewardTimeout:
        return RewardTimeout(f"reward verifier {self.url} did not answer within {self.timeout_s:g} s "
                             f"(reward_timeout_s: the whole call, retries included){why}")

    def post(self, prompts: list[str], completions: list[str], deadline: float,
             columns: Optional[dict[str, list]] = None) -> list[float]:
        """One request (with its retries), by `deadline` (time.monotonic()): the scores of these
        rows (`columns`: theirs, per column a list in row order)."""
        body = json.dumps({"prompts": list(prompts), "responses": list(completions),
                           "columns": dict(columns or {})}).encode()
        for attempt in range(self.retries + 1):
            try:
                status, reason, location, raw = self.exchange(body, deadline)
            except TimeoutError as e:
                raise self.past_deadline() from e
            except _ConnectFailed as e:
                why = f"cannot connect: {e}"
            except (OSError, http.client.HTTPException) as e:  # reset mid-reply, a reply cut short
                why = f"connection failed: {type(e).__name__}: {e}"
            else:
                if 200 <= status < 300:
                    return self.parse(raw, len(prompts))
                if 300 <= status < 400:
                    raise RewardError(f"reward verifier {self.url} answered HTTP {status} {reason}, a redirect to "
                                      f"{location!r}: redirects are not followed (name the URL that scores in "
                                      "reward_funcs)")
                if not 500 <= status < 600:
                    raise RewardError(f"reward verifier {self.url} answered HTTP {status} {reason}")
                why = f"HTTP {status} {reason}"
            if attempt < self.retries:
                wait = self.backoff_s * 2 ** attempt
                if time.monotonic() + wait >= deadline:
                    raise self.past_deadline(f"; attempt {attempt + 1} failed: {why}")
                time.sleep(wait)
        raise RewardError(f"reward verifier {self.url} failed after {self.retries + 1} attempts: {why}")

    def connection(self, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
        """A connection (not yet open) to the verifier, or to the proxy that reaches it, whose
        every socket operation has `timeout_s`, and the request's target: the path, or through
        a proxy to an http:// verifier the absolute URL (the proxy forwards it)."""
        target = self.target
        path = (target.path or "/") + (f"?{target.query}" if target.query else "")
        if self.proxy is None:
            cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
            return cls(target.hostname, target.port, timeout=timeout_s), path
        if target.scheme == "https":  # TLS to the verifier inside a CONNECT tunnel through the proxy
            conn = http.client.HTTPSConnection(self.proxy.hostname, self.proxy.port, timeout=timeout_s)
            conn.set_tunnel(target.hostname, target.port)
            return conn, path
        return http.client.HTTPConnection(self.proxy.hostname, self.proxy.port, timeout=timeout_s), \
            urlunsplit(target._replace(fragment=""))

    def exchange(self, body: bytes, deadline: float) -> tuple[int, str, Optional[str], bytes]:
        """One POST, all of it (connect, send, every read) by `deadline`: (status, reason,
        Location header, body). Past the deadline a TimeoutError, whatever the socket was doing:
        each socket operation has the time left when the connection opens, and a timer shuts
        the socket at the deadline (a reply trickling in, byte by byte within each operation's
        limit, is cut there). A connection that cannot be made is a _ConnectFailed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left")
        conn, target = self.connection(left)
        lock, state = threading.Lock(), {"done": False, "expired": False}

        def expire() -> None:  # the deadline: end what the socket is doing (connect, send or a read)
            with lock:
                if state["done"]:
                    return
                state["expired"] = True
                if conn.sock is not None:
                    try:
                        socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)  # the plain socket's, under TLS too
                    except OSError:
                        pass

        timer = threading.Timer(left, expire)
        timer.daemon = True
        timer.start()
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise
            except OSError as e:
                if state["expired"]:
                    raise TimeoutError("past the deadline") from e
                raise _ConnectFailed(*e.args) from e
            conn.request("POST", target, body=body, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            raw = reply.read()
            if state["expired"]:  # a reply read up to the socket's shutdown (no length given) is cut short
                raise TimeoutError("past the deadline")
            return reply.status, reply.reason, reply.getheader("Location"), raw
        except (OSError, http.client.HTTPException) as e:
            if state["expired"] or time.monotonic() >= deadline:
                raise TimeoutError("past the deadline") from e
            raise
        finally:
            with lock:
                state["done"] = True
            timer.cancel()
            conn.close()

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
