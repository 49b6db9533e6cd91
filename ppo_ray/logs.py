"""Console logging: our own lines through Python logging, the libraries' quieted.

    setup_logging("info")          # launch.py, and each stage task on its worker
    env = quiet_env("info")        # environment of every actor / task process
    with console_log(run_dir, argv):   # launch.py: the console, also into <run_dir>/logs/
    log = actor_logger("info")     # in each PPO actor: its line per call, in its own Ray log

A run's console at the default level `info` is our lines (the run directory, the run tag,
one line per PPO step, stage progress, warnings) and little else: Ray's, vLLM's and
transformers' own messages are cut to errors and their progress bars turned off. At
`debug` everything comes back. Each PPO actor writes one line per call (tokens, losses,
rows, seconds) to its own log, which the dashboard's Actors page links; those stay off the
driver's console below `debug`. A variable the user set in the driver's environment always
wins (VLLM_LOGGING_LEVEL=INFO python launch.py ...).

Bottom layer: imports nothing of ours (StepResult only for its annotation), and not ray.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from ppo_ray.stats import StepResult

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"  # the date too: a run lasts days, and its job log keeps every line (local time)
# Libraries' loggers that talk at INFO in a healthy run (Ray's start-up, HTTP clients, filelock).
NOISY_LOGGERS = ("ray", "urllib3", "filelock", "httpx", "datasets", "transformers", "torch", "vllm", "absl")


def level_number(level: str) -> int:
    return getattr(logging, level.upper())


def setup_logging(level: str = "info", stream=None) -> None:
    """Root logger at `level`, one handler to stderr (replacing ours from an earlier call,
    never a caller's own handlers), libraries' loggers at WARNING unless `level` is debug."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_ppo_ray", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    handler._ppo_ray = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level_number(level))
    quiet = level_number(level) > logging.DEBUG
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)


def quiet_libraries(level: str = "info") -> None:
    """In a worker process, before the libraries are imported: their loggers at WARNING (or
    ERROR for vLLM) unless debug. Some of vLLM's import-time warnings are emitted before it
    configures its logger, and Python's last-resort handler would print them bare."""
    if level_number(level) <= logging.DEBUG:
        return
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR if name == "vllm" else logging.WARNING)


def quiet_env(level: str = "info") -> dict[str, str]:
    """Environment variables that keep the libraries in a worker process quiet at `level`
    (all of them back at debug); values already set in this process's environment win."""
    debug = level_number(level) <= logging.DEBUG
    env = {
        # vLLM's per-engine warnings (Triton, NUMA, eager mode, LoRA tokenizers) and loader bars
        "VLLM_LOGGING_LEVEL": "INFO" if debug else "ERROR",
        # ... on stderr, not vLLM's default stdout: Ray forwards an actor's stdout to the driver's,
        # where a command's results go (benchmarks.step's JSON)
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        # transformers' "Loading weights" bars and hub download bars
        "HF_HUB_DISABLE_PROGRESS_BARS": "0" if debug else "1",
        "TRANSFORMERS_VERBOSITY": "info" if debug else "error",
        # torch's C++ warnings (NUMA binding) and libraries' FutureWarnings
        "TORCH_CPP_LOG_LEVEL": "INFO" if debug else "ERROR",
        "PYTHONWARNINGS": "default" if debug else "ignore",
        # Rust tokenizers warn (and may deadlock) when a process forks after using them
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {key: os.environ.get(key, value) for key, value in env.items()}


def ray_logging_level(level: str) -> int:
    """Ray's own logger in the driver: its INFO start-up lines and the token-auth notice only
    at debug (we log the dashboard address ourselves)."""
    return logging.DEBUG if level_number(level) <= logging.DEBUG else logging.ERROR


# ----------------------------------------------------------------------------- the actors' own logs
ACTOR_LOGGER = "ppo_ray.actor"
ACTOR_MARK = f" INFO {ACTOR_LOGGER}: "  # in every line it writes at INFO (FORMAT)


def actor_logger(level: str = "info") -> logging.Logger:
    """In an actor process: the logger of its one line per call (generate, load, score,
    update), at `level`, to the process's stderr, which is Ray's worker-*.err file: the
    dashboard's per-actor Log link. It does not propagate: the root logger, and with it the
    other INFO lines of our modules and the libraries' in that process, stays as it was. Ray
    forwards every line of an actor's output to the driver as well; the driver drops these
    (cluster.keep_actor_lines_off_the_console), so its console stays one line per step."""
    logger = logging.getLogger(ACTOR_LOGGER)
    if not any(getattr(h, "_ppo_ray", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        handler._ppo_ray = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(level_number(level))
    return logger


def without_actor_lines(lines: Sequence[str]) -> list[str]:
    """`lines` less the actors' own INFO lines (ACTOR_MARK)."""
    return [line for line in lines if ACTOR_MARK not in line]


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def format_step(result: "StepResult", total: int | None = None, *, adaptive_kl: bool = False) -> str:
    """One PPO step's console line: step, reward (of every rollout generated; under dynamic
    sampling also that of the rollouts trained on), KL (and beta when it moves: `adaptive_kl`,
    the config's kl_target set; a fixed beta is the config's own), losses, the gold score and
    the eval reward when the step was evaluated (result.extra), stale versions (overlap mode),
    the rollout queue's depth (when not 0), dynamic sampling's rounds, kept share and filled
    groups (when it is on), the episodes' turns, tool-call rate, environment-token share and
    failed episodes (with an environment), step seconds, tokens/s of the step and, where
    measured, of the generation and the learner, and the learner's MFU."""
    learner, extra = result.learner, result.extra
    parts = [f"step {result.step}" + (f"/{total}" if total else ""),
             f"reward {_num(result.reward_mean, '+.4f')}"]
    if result.dynamic_sampling is not None:  # what it trained on: the kept groups (reward: all it generated)
        parts.append(f"trained {_num(result.reward_trained_mean, '+.4f')}")
    parts.append(f"kl {_num(learner.kl, '.4f')}")
    if adaptive_kl:
        parts.append(f"beta {_num(learner.kl_coef, '.4g')}")
    parts.append(f"policy_loss {_num(learner.policy_loss, '+.4f')}")
    if learner.value_loss is not None:  # an estimator without a critic has no value loss
        parts.append(f"value_loss {_num(learner.value_loss, '.4f')}")
    # evaluate()'s own dict (the pipeline's gold_val) and the eval samples' mean, on evaluated steps
    for key, label in (("gold_val", "gold_val"), ("eval_reward_mean", "eval_reward")):
        if key in extra:
            parts.append(f"{label} {_num(extra[key], '.3f')}")
    if learner.stale_versions:
        parts.append(f"stale {_num(learner.stale_versions, '.0f' if float(learner.stale_versions).is_integer() else '.2f')}")
    if result.queue_depth:
        parts.append(f"queue {_num(result.queue_depth, '.0f')}")
    if result.dynamic_sampling is not None:  # "rounds 2 kept 62%", and the filled groups when there are any
        ds = result.dynamic_sampling
        parts.append(f"rounds {ds.rounds} kept {_num(100 * ds.kept_frac, '.0f')}%"
                     + (f" filled {ds.filled}" if ds.filled else ""))
    if result.episodes is not None:  # "turns 2.4 tools 63% env 12%", and failures when there are any
        ep = result.episodes
        parts.append(f"turns {_num(ep.turns_mean, '.2f')} tools {_num(100 * ep.tool_call_rate, '.0f')}% "
                     f"env {_num(100 * ep.env_token_frac, '.0f')}%"
                     + (f" env_failed {ep.timeouts + ep.exceptions:.0f}" if ep.timeouts + ep.exceptions else ""))
    parts += [f"{_num(result.timing.step_s, '.2f')} s", f"{_rate(result.tokens_per_s)} tok/s"]
    # each phase's own rate where measured: "(gen 420, learn 310)", then the learner's MFU
    phases = [f"{label} {_rate(rate)}" for label, rate in (("gen", result.rollout_tokens_per_s),
                                                          ("learn", result.learner_tokens_per_s)) if _finite(rate)]
    if phases:
        parts[-1] += f" ({', '.join(phases)})"
    if _finite(result.learner_mfu):
        parts.append(f"mfu {_num(100 * result.learner_mfu, '.2g' if abs(result.learner_mfu) < 0.1 else '.0f')}%")
    return "  ".join(parts)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _rate(rate) -> str:
    """Tokens per second: whole numbers from 10 up, two significant digits below (a big model
    on a CPU: 0.37 tok/s, not "0 tok/s")."""
    return _num(rate, ".0f" if not isinstance(rate, (int, float)) or abs(rate) >= 10 else ".2g")


# ----------------------------------------------------------------------------- the console, kept
LOGS_DIR = "logs"
# Where the actor lines kept off the console go: the launch logs open now (console_log).
_OFF_CONSOLE: list["_LogFile"] = []


def log_off_console(data: dict, lines: Sequence[str]) -> None:
    """Lines Ray forwarded from an actor that the console does not print (its own line per
    call: cluster.keep_actor_lines_off_the_console) into the launch log, prefixed as Ray
    prefixes what it prints: (<actor name> pid=<pid>, ip=<node>)."""
    if not _OFF_CONSOLE or not lines:
        return
    name = data.get("actor_name") or data.get("task_name") or "worker"
    prefix = f"({name} pid={data.get('pid')}" + (f", ip={data['ip']}" if data.get("ip") else "") + ") "
    text = "".join(f"{prefix}{line}\n" for line in lines)
    for sink in list(_OFF_CONSOLE):
        sink.write(text, log_off_console)


class _Tee:
    """A text stream that writes to the console stream and, line by line, to a log file. A
    progress bar's carriage-return redraws keep only their last state in the file."""

    def __init__(self, stream, sink: "_LogFile"):
        self.stream, self.sink = stream, sink

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.sink.write(text, self)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.sink.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the console's
        return getattr(self.stream, name)


class _LogFile:
    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8", buffering=1)
        self.lock = threading.Lock()
        self.partial: dict[int, str] = {}  # per stream: the line not yet ended

    def write(self, text: str, source) -> None:
        with self.lock:
            pending = self.partial.pop(id(source), "") + text
            *lines, rest = pending.split("\n")
            for line in lines:
                self.file.write(line.rsplit("\r", 1)[-1] + "\n")
            if rest:
                self.partial[id(source)] = rest

    def flush(self) -> None:
        with self.lock:
            self.file.flush()

    def close(self) -> None:
        with self.lock:
            for rest in self.partial.values():
                self.file.write(rest.rsplit("\r", 1)[-1] + "\n")
            self.partial.clear()
            self.file.close()


@contextmanager
def console_log(run_dir: Path, argv: Sequence[str] = ()) -> Iterator[Path]:
    """Everything this process prints while inside, also in <run_dir>/logs/launch-<time>.log:
    our log lines, the lines of actors and stage tasks that Ray forwards to the driver
    (the actors' own line per call too, which the console leaves out: log_off_console), the
    final report and, when the block raises, the traceback. One file per invocation, so a
    resumed or re-applied job keeps the earlier attempts' logs; the run directory outlives
    the cluster (a RayJob's pods are deleted after the job). Yields the file's path."""
    folder = Path(run_dir) / LOGS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    stamp = f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    n = 1
    while (path := folder / f"{stamp}{'' if n == 1 else f'-{n}'}.log").exists():
        n += 1
    sink = _LogFile(path)
    sink.file.write(f"# {time.strftime(DATE_FORMAT)} pid {os.getpid()}: {' '.join(argv)}\n")
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(old[0], sink), _Tee(old[1], sink)
    # our logging handler writes to the stream it was given: the tee from now on
    moved = [h for h in logging.getLogger().handlers
             if isinstance(h, logging.StreamHandler) and h.stream in old]
    for handler in moved:
        handler.setStream(sys.stdout if handler.stream is old[0] else sys.stderr)
    _OFF_CONSOLE.append(sink)
    try:
        yield path
    except BaseException:
        sink.write("".join(traceback.format_exc()), None)  # the console gets it from the caller
        raise
    finally:
        _OFF_CONSOLE.remove(sink)
        for handler in moved:
            handler.setStream(old[0] if handler.stream is sys.stdout else old[1])
        sys.stdout, sys.stderr = old
        sink.close()
