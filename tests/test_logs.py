"""ppo_ray/logs.py: the one console line per step, the logging set-up, and the libraries'
levels (Ray's, vLLM's). No Ray."""

from __future__ import annotations

import datetime
import logging
import re
from dataclasses import replace

import pytest

from ppo_ray.logs import format_step, quiet_env, setup_logging
from ppo_ray.stats import StepResult
from helpers import learner_stats, step_result


def _step(tokens: int = 240, **extra) -> StepResult:
    """Step 3: reward +0.5, kl 1.25, beta 0.05, `tokens` response tokens in 2.5 s."""
    result = step_result(rewards=(0.5,), extra=dict(extra))
    return replace(result, learner=learner_stats(kl=1.25, kl_coef=0.05, policy_loss=-0.01, value_loss=0.2,
                                                 stale_versions=0.0),
                   timing=replace(result.timing, step_s=2.5), response_lengths=[tokens])


def test_one_log_line_per_step_names_the_numbers_a_user_watches():
    out = _step(gold_val=0.61)
    line = format_step(out, total=20, adaptive_kl=True)
    assert line == ("step 3/20  reward +0.5000  kl 1.2500  beta 0.05  policy_loss -0.0100  value_loss 0.2000  "
                    "gold_val 0.610  2.50 s  96 tok/s")
    not_evaluated = _step()
    assert "gold" not in format_step(not_evaluated) and format_step(not_evaluated).startswith("step 3  reward")
    # a 0.6B model on a CPU makes well under 1 token/s: two significant digits, not "0 tok/s"
    assert format_step(_step(tokens=1)).endswith("2.50 s  0.4 tok/s")
    assert format_step(_step(tokens=23)).endswith(" 9.2 tok/s")


def test_a_step_without_a_critic_has_no_value_loss_in_its_line():
    from ppo_ray.stats import CRITIC_FIELDS

    step = _step()
    no_critic = replace(step, learner=replace(step.learner, **{name: None for name in CRITIC_FIELDS}))
    assert "value_loss" not in format_step(no_critic) and "policy_loss -0.0100  2.50 s" in format_step(no_critic)


def test_beta_shows_only_when_the_adaptive_controller_moves_it():
    """kl_coef is in every step's stats; a fixed beta is the config's, so the line names it
    only with kl_target set (the adaptive controller)."""
    assert "beta" not in format_step(_step())
    assert "  beta 0.05  " in format_step(_step(), adaptive_kl=True)


@pytest.fixture
def root_logger():
    """The root logger's and the libraries' levels and handlers, put back afterwards."""
    root = logging.getLogger()
    saved = root.level, list(root.handlers), {n: logging.getLogger(n).level for n in ("ray", "vllm")}
    yield root
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_logging_setup_and_quiet_libraries(monkeypatch, capsys, root_logger):
    import io

    stream = io.StringIO()
    before = datetime.datetime.now().replace(microsecond=0)
    setup_logging("info", stream=stream)
    logging.getLogger("ppo_ray.trainer").info("hello")
    logging.getLogger("ray").info("ray's own start-up line")
    assert "INFO ppo_ray.trainer: hello" in stream.getvalue() and "start-up" not in stream.getvalue()
    # the time stamp carries the date (a run lasts days): "2026-11-27 15:40:01 INFO ppo_ray.trainer: hello"
    stamp = re.fullmatch(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) INFO ppo_ray\.trainer: hello\n", stream.getvalue())
    assert stamp and before <= datetime.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S") <= datetime.datetime.now()
    setup_logging("warning", stream=stream)  # replaces its own handler, does not add a second
    assert root_logger.level == logging.WARNING and sum(getattr(h, "_ppo_ray", False) for h in root_logger.handlers) == 1
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_STREAM", raising=False)
    assert quiet_env("info")["VLLM_LOGGING_LEVEL"] == "ERROR" and quiet_env("debug")["VLLM_LOGGING_LEVEL"] == "INFO"
    assert quiet_env("debug")["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"  # the driver's stdout stays its results'
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert quiet_env("info")["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's own setting wins


def test_console_log_keeps_everything_printed_in_the_run_directory(tmp_path, root_logger, capsys):
    """launch.py's console, also in <run_dir>/logs/: log lines, prints from any thread (Ray
    forwards actors' and stage tasks' lines from a thread of the driver), a progress bar's
    last state only, and the traceback of a failure; the console still gets everything and
    the streams and handlers are put back afterwards."""
    import sys
    import threading

    from ppo_ray.logs import console_log

    setup_logging("info")
    log = logging.getLogger("ppo_ray.test")
    before = sys.stdout, sys.stderr
    with pytest.raises(RuntimeError, match="the stage failed"):
        with console_log(tmp_path, ["ppo-ray", "--run_dir", str(tmp_path)]) as path:
            log.info("run directory: %s", tmp_path)
            print('{"report": 1}')
            forwarder = threading.Thread(target=lambda: print("(run_stage pid=42) epoch 1/2", file=sys.stderr))
            forwarder.start()
            forwarder.join()
            sys.stderr.write("sft:  10%|#   | 1/10\rsft: 100%|####| 10/10\n")
            sys.stderr.write("a line without its end")
            raise RuntimeError("the stage failed")
    assert (sys.stdout, sys.stderr) == before
    assert all(h.stream is sys.stderr for h in logging.getLogger().handlers if getattr(h, "_ppo_ray", False))
    assert path.parent == tmp_path / "logs" and re.fullmatch(r"launch-\d{8}-\d{6}-\d+(-\d+)?\.log", path.name)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# 20") and lines[0].endswith(f"ppo-ray --run_dir {tmp_path}")
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d INFO ppo_ray.test: run directory: {tmp_path}", lines[1])
    assert lines[2:6] == ['{"report": 1}', "(run_stage pid=42) epoch 1/2", "sft: 100%|####| 10/10",
                          "Traceback (most recent call last):"]
    assert lines[-1] == "a line without its end"  # an unfinished line is kept at the end
    text = path.read_text()
    assert "a line without its end" in text and "RuntimeError: the stage failed" in text and "10%" not in text
    out, err = capsys.readouterr()
    assert '{"report": 1}' in out and "run directory:" in err and "sft:  10%" in err  # the console is unchanged
    # a second invocation (a resumed run) writes its own file, the first one stays
    with console_log(tmp_path) as second:
        print("again")
    assert second != path and path.read_text() == text


def test_the_launch_log_keeps_the_actor_lines_the_console_leaves_out(tmp_path, capsys):
    """The actors' own lines that Ray forwards and the console leaves out
    (cluster.keep_actor_lines_off_the_console hands them to log_off_console) go to the
    launch log open at the time, prefixed as Ray prefixes what it prints; with none open,
    nowhere."""
    from ppo_ray.logs import ACTOR_MARK, console_log, log_off_console

    line = f"2026-11-30 02:00:00{ACTOR_MARK}step 1: scored 8 rollouts of adapter v0: reward +0.7228 (...), 0.01 s"
    data = {"actor_name": "ppo-1a2b3c4d/reward", "pid": 42, "ip": "10.0.1.7", "lines": [line]}
    with console_log(tmp_path) as path:
        log_off_console(data, [line])
        log_off_console({"task_name": "ppo/sft", "pid": 7}, ["epoch 1"])
    log_off_console(data, ["after the block"])
    lines = path.read_text().splitlines()
    assert lines[1:] == [f"(ppo-1a2b3c4d/reward pid=42, ip=10.0.1.7) {line}", "(ppo/sft pid=7) epoch 1"]
    out, err = capsys.readouterr()
    assert ACTOR_MARK not in out + err


def test_the_line_names_each_phases_rate_the_mfu_and_a_queue_where_measured():
    """After the step's tok/s: the generation's and the learner's own rates, then the
    learner's MFU, each only when measured (NaN: left out); the rollout queue when not empty."""
    out = replace(_step(), rollout_tokens_per_s=412.6, learner_tokens_per_s=8.25, learner_mfu=0.031)
    assert format_step(out).endswith("2.50 s  96 tok/s (gen 413, learn 8.2)  mfu 3.1%")
    assert format_step(replace(out, learner_mfu=0.42)).endswith("  mfu 42%")
    assert format_step(replace(out, learner_mfu=float("nan"), rollout_tokens_per_s=float("nan"))).endswith(
        "96 tok/s (learn 8.2)")
    assert format_step(_step()).endswith("2.50 s  96 tok/s")  # none measured
    assert "  queue 2  2.50 s" in format_step(replace(out, queue_depth=2.0)) and "queue" not in format_step(out)
