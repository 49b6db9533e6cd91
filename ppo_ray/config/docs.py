"""docs/CONFIG.md's field tables, generated from the fields' declarations and docs."""

from __future__ import annotations

import typing
from pathlib import Path

from ppo_ray.config.fields import PPOConfig, field_docs, field_sections
from ppo_ray.config.knobs import default_text, type_name


def fields_markdown() -> str:
    """docs/CONFIG.md's configuration tables: one per section, every field with its type, default
    and doc (tests/test_config.py checks that docs/CONFIG.md holds exactly this)."""
    hints, docs = typing.get_type_hints(PPOConfig), field_docs()
    out = []
    for title, fields in field_sections():
        out += [f"**{title}**", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        rows = [(f"`{f.name}`", f"`{type_name(hints[f.name])}`", f"`{default_text(f)}`", docs[f.name])
                for f in fields]
        out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
        out.append("")
    return "\n".join(out)


CONFIG_DOCS_MARKERS = ("<!-- config-fields: begin -->\n", "<!-- config-fields: end -->")


def write_config_docs(path: str | Path = "docs/CONFIG.md") -> None:
    """Put fields_markdown() between docs/CONFIG.md's markers (after a field, a registered
    parameter or a doc changed): python -c 'from ppo_ray.config import write_config_docs; write_config_docs()'."""
    path = Path(path)
    begin, end = CONFIG_DOCS_MARKERS
    head, rest = path.read_text().split(begin, 1)
    path.write_text(head + begin + fields_markdown() + "\n" + end + rest.split(end, 1)[1])
