"""ppo_ray/logs.py: the one console line per step, the logging set-up, and the libraries'
levels (Ray's, vLLM's). No Ray."""

from __future__ import annotations

import logging

import pytest

from ppo_ray.logs import format_step, quiet_env, setup_logging


def test_one_log_line_per_step_names_the_numbers_a_user_watches():
    out = {"step": 3, "reward_mean": 0.5, "kl": 1.25, "kl_coef": 0.05, "policy_loss": -0.01, "value_loss": 0.2,
           "gold_val": 0.61, "time/step_s": 2.5, "tokens_per_s": 96.0}
    line = format_step(out, total=20)
    assert line == ("step 3/20  reward +0.5000  kl 1.2500  beta 0.05  policy_loss -0.0100  value_loss 0.2000  "
                    "gold_val 0.610  2.50 s  96 tok/s")
    not_evaluated = {k: v for k, v in out.items() if k != "gold_val"}
    assert "gold" not in format_step(not_evaluated) and format_step(not_evaluated).startswith("step 3  reward")


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
    setup_logging("info", stream=stream)
    logging.getLogger("ppo_ray.trainer").info("hello")
    logging.getLogger("ray").info("ray's own start-up line")
    assert "INFO ppo_ray.trainer: hello" in stream.getvalue() and "start-up" not in stream.getvalue()
    setup_logging("warning", stream=stream)  # replaces its own handler, does not add a second
    assert root_logger.level == logging.WARNING and sum(getattr(h, "_ppo_ray", False) for h in root_logger.handlers) == 1
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_STREAM", raising=False)
    assert quiet_env("info")["VLLM_LOGGING_LEVEL"] == "ERROR" and quiet_env("debug")["VLLM_LOGGING_LEVEL"] == "INFO"
    assert quiet_env("debug")["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"  # the driver's stdout stays its results'
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert quiet_env("info")["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's own setting wins
