"""The test suite's own rules (STYLE.md item 26).

* No test module imports another, and nothing imports conftest.py: a helper that more than one
  module uses lives in tests/helpers.py (or a topic module beside it: tolerances.py, exact.py,
  ...), a fixture in conftest.py. Read from every file's import statements with ast, as
  test_layers.py reads the product's; nothing is imported.
* The fast tier (`-m fast`, tests/fast_tier.py): derived from what a test uses, and a test left
  in it that starts Ray or builds a vLLM engine fails, whichever way it does so. Shown on planted
  test files run by a pytest of their own, with this folder's conftest.py.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import ROOT, TESTS_DIR


def imported_test_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each import of a test module (test_*) or of conftest in the file, at
    module level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        out += [(node.lineno, name) for name in names
                if name.split(".")[0] == "conftest" or name.split(".")[0].startswith("test_")]
    return out


def violations(tests_dir: Path) -> list[str]:
    """Every import of a test module or of conftest in the folder's Python files, as
    "file:line: import module"."""
    return [f"{path.name}:{line}: import {module}"
            for path in sorted(tests_dir.glob("*.py")) for line, module in imported_test_modules(path)]


def test_no_test_module_imports_another_or_conftest():
    assert violations(TESTS_DIR) == []


def test_a_planted_import_of_a_test_module_is_found(tmp_path):
    """The check is not vacuous: a copy of the folder with a test module importing another
    inside a function, and a helper module importing conftest, fails naming each file and line."""
    for path in TESTS_DIR.glob("*.py"):
        shutil.copy(path, tmp_path / path.name)
    logs = tmp_path / "test_logs.py"
    lines = logs.read_text().splitlines() + ["def _planted():", "    from test_stats import step_result",
                                             "    return step_result"]
    logs.write_text("\n".join(lines) + "\n")
    exact = tmp_path / "exact.py"
    exact.write_text(exact.read_text() + "\nimport conftest\n")
    n_exact = len(exact.read_text().splitlines())
    assert violations(tmp_path) == [f"exact.py:{n_exact}: import conftest",
                                    f"test_logs.py:{len(lines) - 1}: import test_stats"]


# --------------------------------------------------------------------------- the fast tier
PLANTED = '''
import subprocess
import sys
import types

import pytest

from fast_tier import heavy_fixture


@pytest.fixture
@heavy_fixture("planted")
def planted_heavy_fixture():
    return 1


@pytest.fixture
def needs_the_planted_heavy_fixture(planted_heavy_fixture):
    return planted_heavy_fixture


def test_plain(tmp_path):
    assert tmp_path.is_dir()


def test_on_the_shared_trainer(tiny_trainer):
    pass


def test_on_the_learners_model(special):
    pass


def test_on_a_heavy_fixture_of_its_module(needs_the_planted_heavy_fixture):
    pass


@pytest.mark.heavy("planted")
def test_marked_heavy():
    pass


@pytest.mark.slow
def test_slow():
    pass


def test_starts_ray():
    import ray

    ray.init(address="local", include_dashboard=False, num_cpus=1)


def test_starts_ray_and_swallows_the_error():
    import ray

    try:
        ray.init(address="local", include_dashboard=False, num_cpus=1)
    except Exception:
        pass


def test_uses_ray_without_init():
    import ray

    ray.get(ray.put(1))


def test_starts_ray_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "import ray; ray.init(address='local', include_dashboard=False, num_cpus=1)"],
                   capture_output=True, timeout=120)


def test_builds_a_vllm_engine(tmp_path):
    from actors.vllm_engine import build_llm

    build_llm(tmp_path)


def test_imports_vllm():
    # what an import of vllm leaves in sys.modules, without its ~10 s
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
'''


def run_planted(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """`pytest -m fast` on one planted test module beside copies of this folder's conftest.py
    and its helper modules (the planted folder is the inner run's rootdir)."""
    for path in TESTS_DIR.glob("*.py"):
        if not path.name.startswith("test_"):
            shutil.copy(path, tmp_path / path.name)
    (tmp_path / "test_planted.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-m", "fast", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), "--junitxml", str(tmp_path / "junit.xml"), *args, str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_fast_tier_is_what_needs_no_ray_and_a_test_in_it_that_starts_ray_fails(tmp_path):
    """Of the planted tests, -m fast runs those that use no heavy fixture (directly or not:
    tiny_trainer needs ray_session, special tiny_path; a fixture of the module's own), carry no
    heavy mark and are not slow; each of them that starts Ray (ray.init, caught or not; a Ray
    call that would start one; a subprocess's ray.init), builds a vLLM engine or imports vllm
    fails, naming what it did, and the plain one passes."""
    proc = run_planted(tmp_path, PLANTED)
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    outcomes = {case.get("name"): "failed" if case.find("failure") is not None or case.find("error") is not None
                else "passed" for case in suite.iter("testcase")}
    assert outcomes == {"test_plain": "passed", "test_starts_ray": "failed",
                        "test_starts_ray_and_swallows_the_error": "failed", "test_uses_ray_without_init": "failed",
                        "test_starts_ray_in_a_subprocess": "failed", "test_builds_a_vllm_engine": "failed",
                        "test_imports_vllm": "failed"}, \
        proc.stdout[-3000:] + proc.stderr[-2000:]
    messages = {case.get("name"): (case.find("failure").get("message") or "") for case in suite.iter("testcase")
                if case.find("failure") is not None}
    for name in ("test_starts_ray", "test_starts_ray_and_swallows_the_error", "test_uses_ray_without_init"):
        assert "is in the fast tier" in messages[name] and "started ray.init" in messages[name], messages[name]
    assert "a Ray instance (its session folder under RAY_TMPDIR" in messages["test_starts_ray_in_a_subprocess"]
    assert "a vLLM engine (actors.vllm_engine.build_llm)" in messages["test_builds_a_vllm_engine"]
    assert "started an import of vllm" in messages["test_imports_vllm"]
    assert int(suite.get("tests")) == 7 and "5 deselected" in proc.stdout, proc.stdout[-2000:]


def test_the_fast_marker_is_not_set_by_hand_and_heavy_says_why(tmp_path):
    for test, error in (("@pytest.mark.fast\ndef test_claims_to_be_fast():", "the fast marker is derived"),
                        ("@pytest.mark.heavy\ndef test_heavy_without_a_reason():", "heavy takes one argument")):
        proc = run_planted(tmp_path, f"import pytest\n\n\n{test}\n    pass\n")
        assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # pytest's usage error
        assert error in proc.stderr + proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_fast_test_that_patches_ray_leaves_the_real_ray_to_the_next_test(tmp_path):
    """In a mixed run, a fast test that monkeypatches ray.init and ray.is_initialized (pytest
    puts back, at its teardown, the guard's stand-ins it saw) leaves the real ones to the next
    test, heavy or fast (the guard puts them back first)."""
    planted = """
import pytest
import ray
import ray._private.worker as worker


def test_a_fast_one_patches_ray(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)


@pytest.mark.heavy("planted")
def test_a_heavy_one_after_it_sees_the_real_ray():
    assert ray.init is worker.init and ray.is_initialized is worker.is_initialized
"""
    proc = run_planted(tmp_path, planted, "-m", "")
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]

