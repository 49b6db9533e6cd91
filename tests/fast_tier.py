"""The fast tier (``pytest -m fast``): the tests that need no Ray, no vLLM and no model run.

The marker is derived at collection (conftest.pytest_collection_modifyitems calls ``mark``),
never written by hand: a test is ``fast`` unless

* it is marked ``slow`` (the fast tier is a part of the default run, which skips those);
* it uses a heavy fixture, directly or through its own fixtures (pytest's fixture closure:
  ``tiny_trainer`` needs ``ray_session``). A fixture says so where it is defined, with
  ``@heavy_fixture("why")`` under its ``@pytest.fixture``: ``ray_session`` (Ray),
  ``vllm_llm`` (a vLLM engine), ``tiny_model_dir`` and ``tiny_path`` (the tiny model, which
  the learner, scorer and stage tests run: most of the time of the tests without Ray);
* it is marked ``heavy("why")``: it starts Ray or vLLM itself (``launch.main`` of a command
  that runs, a ``launch.py`` subprocess), or takes tens of seconds without them (the
  committed default model, torch.compile), which no fixture shows.

A test left fast that needs Ray or vLLM anyway fails, naming what it did (``guard``, around
its setup and its call): inside the fast tier ``ray.init`` and ``actors.vllm_engine.build_llm``
(the one place that builds an engine) raise, and ``ray.is_initialized`` answers False, so a
Ray that an earlier test of a mixed run left up is not used either (the test behaves as it
would in ``-m fast``). Ray's temporary folder (``RAY_TMPDIR``) is a trap, a path too long for
Ray's sockets: a Ray started by any other way, in this process or in a subprocess that
inherits the environment, fails within a second and leaves its session folder there, which
fails the test even when it caught the error. A test that imports vLLM (``vllm`` not yet
imported before it) fails too. Not caught: a Ray given a temp folder of its own
(``ray start --temp-dir``: test_deploy's ``ray_head``, a heavy fixture), a subprocess given an
environment without RAY_TMPDIR, and vLLM in a subprocess without Ray (the product builds an
engine only in a Ray actor).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

MARK = "fast"
HEAVY = "heavy"
MARKERS = (
    f"{MARK}: derived, never set by hand (tests/fast_tier.py): needs no Ray, no vLLM and no model run, and is "
    "not slow; `scripts/test.sh -m fast` runs these alone",
    f"{HEAVY}(why): left out of the fast tier: starts Ray or vLLM itself, or takes tens of seconds without them",
)
# fixture name -> why a test that uses it is not fast (heavy_fixture, where each is defined)
HEAVY_FIXTURES: dict[str, str] = {}


def heavy_fixture(why: str):
    """Under ``@pytest.fixture``: the tests that use this fixture are not in the fast tier."""
    def register(fixture_function):
        HEAVY_FIXTURES[fixture_function.__name__] = why
        return fixture_function
    return register


class FastTierError(Exception):
    """A test of the fast tier started Ray or built a vLLM engine."""


def is_fast(item: pytest.Item) -> bool:
    if item.get_closest_marker("slow") or item.get_closest_marker(HEAVY):
        return False
    return not HEAVY_FIXTURES.keys() & set(getattr(item, "fixturenames", ()))


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(MARK):
            raise pytest.UsageError(f"{item.nodeid}: the {MARK} marker is derived (tests/fast_tier.py); remove it, "
                                    f"or mark the test {HEAVY}('why') to leave it out")
        heavy = item.get_closest_marker(HEAVY)
        if heavy and not (len(heavy.args) == 1 and isinstance(heavy.args[0], str) and heavy.args[0]):
            raise pytest.UsageError(f"{item.nodeid}: {HEAVY} takes one argument, why the test is not fast")
        if is_fast(item):
            item.add_marker(MARK)


_TRAP_ROOT: Path | None = None


def _trap() -> Path:
    """A fresh RAY_TMPDIR for one phase of one test: its sockets' paths exceed AF_UNIX's 107
    bytes, so Ray fails at its start (validate_socket_filename), after it made its session
    folder here."""
    global _TRAP_ROOT
    if _TRAP_ROOT is None:
        _TRAP_ROOT = Path(tempfile.mkdtemp(prefix="ppo-ray-fast-tier-"))
        atexit.register(shutil.rmtree, _TRAP_ROOT, ignore_errors=True)
    trap = _TRAP_ROOT / ("no-ray-in-the-fast-tier-" + "x" * 100)
    shutil.rmtree(trap, ignore_errors=True)
    return trap


_ORIGINALS: dict = {}  # "saved": the real ray.init, ray.is_initialized, build_llm


def _not_initialized() -> bool:
    return False


_not_initialized.fast_tier_refusal = True


def _heal(ray, vllm_engine) -> None:
    """Put back the real ray.init, ray.is_initialized and build_llm where a stand-in of a fast
    test's guard is still in place: a fast test that monkeypatches one of them (test_placement)
    has pytest restore, at its teardown, the value it saw, the guard's stand-in."""
    current = (ray.init, ray.is_initialized, vllm_engine.build_llm)
    if "saved" in _ORIGINALS and any(getattr(f, "fast_tier_refusal", False) for f in current):
        ray.init, ray.is_initialized, vllm_engine.build_llm = _ORIGINALS["saved"]


@contextlib.contextmanager
def guard(item: pytest.Item, phase: str) -> Iterator[None]:
    """Around one phase (setup, call) of a fast test: Ray and vLLM raise FastTierError, and a
    Ray started or vLLM imported anyway fails the test (the module docstring). Nothing for
    another test, except that any phase first puts back what a fast test's guard left (_heal)."""
    import ray

    from actors import vllm_engine

    _heal(ray, vllm_engine)
    if not item.get_closest_marker(MARK):
        yield
        return
    started: list[str] = []

    def refuse(what: str):
        def refused(*args, **kwargs):
            started.append(what)
            raise FastTierError(f"{what} in a test of the fast tier")
        refused.fast_tier_refusal = True
        return refused

    trap = _trap()
    _ORIGINALS.setdefault("saved", (ray.init, ray.is_initialized, vllm_engine.build_llm))
    had_vllm = "vllm" in sys.modules
    saved = (ray.init, ray.is_initialized, vllm_engine.build_llm, os.environ.get("RAY_TMPDIR"))
    ray.init, ray.is_initialized = refuse("ray.init"), _not_initialized
    vllm_engine.build_llm = refuse("a vLLM engine (actors.vllm_engine.build_llm)")
    os.environ["RAY_TMPDIR"] = str(trap)
    try:
        yield
    finally:
        ray.init, ray.is_initialized, vllm_engine.build_llm, tmpdir = saved
        if tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = tmpdir
        if trap.exists():
            started.append(f"a Ray instance (its session folder under RAY_TMPDIR: {sorted(p.name for p in trap.iterdir())})")
            shutil.rmtree(trap, ignore_errors=True)
        if not had_vllm and "vllm" in sys.modules:
            started.append("an import of vllm")
        if started:
            pytest.fail(f"{item.nodeid} is in the fast tier (tests/fast_tier.py) but its {phase} started "
                        f"{'; '.join(dict.fromkeys(started))}: use a heavy fixture (ray_session, vllm_llm) or mark "
                        f"the test {HEAVY}('why')", pytrace=False)
