"""README.md documents the product: short enough to read first, and without the project's
history (issue numbers, dates, "today's" runs). Details live in docs/ and measurements in
benchmarks/RESULTS.md, cited by section title."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_LINES = 450

# Each pattern: what it catches. Checked line by line so a failure names the line.
FORBIDDEN = {
    "issue": (r"\bissues?\s+#?\d+", "an issue number"),
    "number": (r"#\d{2,}", "an issue or pull-request number"),
    "date": (r"\b20\d\d-\d\d-\d\d\b", "a date"),
    "today": (r"\btoday\b", "'today'"),
}


def test_readme_is_at_most_450_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_LINES}): move reference material to docs/")


@pytest.mark.parametrize("kind", FORBIDDEN)
def test_readme_has_no_history(kind):
    pattern, what = FORBIDDEN[kind]
    hits = [f"README.md:{n}: {line.strip()}"
            for n, line in enumerate(README.read_text().splitlines(), 1)
            if re.search(pattern, line, re.I)]
    assert not hits, f"README.md has {what} (it documents the product, not its history):\n" + "\n".join(hits)
