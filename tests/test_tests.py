"""The test suite's own rules (STYLE.md item 26).

* No test module imports another, and nothing imports conftest.py: a helper that more than one
  module uses lives in tests/helpers.py (or a topic module beside it: tolerances.py, exact.py,
  ...), a fixture in conftest.py. Read from every file's import statements with ast, as
  test_layers.py reads the product's; nothing is imported.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from helpers import TESTS_DIR


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

