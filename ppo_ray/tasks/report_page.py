"""The run's report page: <run_dir>/report.html, one self-contained file to open in a browser.

    python -m ppo_ray.tasks.report_page RUN_DIR     # (re)build it for a run directory

launch.py writes it at the end of `all` and `ppo`, from what the run directory holds; the same
function rebuilds it for any run directory, finished or partial (a piece that is missing is
left out, and one that cannot be read is named on the page, never a crash):
- the headline numbers: report.json (or report-ppo.json, or run.json's finished stages), the
  SFT -> PPO/RL pairs (`<metric>_<test|val>_<sft|ppo|rl>`) side by side;
- the curves: curves.png (pipeline.plot_curves), or drawn from metrics.jsonl when the run
  wrote none (a plain `launch.py ppo`, a run stopped mid-PPO);
- the held-out samples (samples.md's table: summaries with gold scores, or arith's greedy
  answers and right-of-k counts) and the last evaluation's samples (eval_samples.jsonl); a
  multi-turn run's (environment) as whole transcripts, the model's and the environment's turns
  marked, and its last evaluated step's episodes (episodes.jsonl);
- the token attribution (attribution.jsonl, ppo_ray.attribution): the last evaluated step's
  training rollouts as a heat map over their tokens, coloured by advantage or by KL_t (a
  CSS-only toggle: two radio buttons), each token's numbers on hover and in a table; then
  the step's held-out eval samples, coloured by KL_t (they have no advantage);
- the config (config*.yaml), the environment the run recorded in run.json (launch.py:
  ppo_ray.machine.machine_info) and the timings (stage seconds, PPO step times from
  metrics.jsonl).

Self-contained: the image is a data: URI, the CSS is inline (the heat map's toggle too), there is no script and no link
to anything outside the file. Every text from the run directory is HTML-escaped: a sample
that holds `<script>` shows as text.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import logging
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ppo_ray.atomic import atomic_write_text

log = logging.getLogger(__name__)

PAGE = "report.html"
# report files, most complete first: the pipeline's (stage all), then a single stage's
REPORTS = ("report.json", "report-ppo.json", "report-rm.json", "report-sft.json")
# a before/after pair of report.json: gold_test_sft / gold_test_ppo, pass1_val_sft / pass1_val_rl, ...
PAIR = re.compile(r"^(?P<metric>.+)_(?P<split>test|val)_(?P<who>sft|base|ppo|rl)$")
# the config's fields a reader looks for first (the whole file follows them)
KEY_FIELDS = ("task", "model_name", "seed", "steps", "batch_size", "samples_per_prompt", "advantage_estimator",
              "policy_loss", "learning_rate", "kl_coef", "max_new_tokens", "temperature", "dtype",
              "num_generators", "num_learners", "sft_dataset", "reward_funcs")
EVAL_SAMPLE_ROWS = 8
PROMPT_CHARS = 400  # eval samples' prompts are cut to this many characters on the page

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1150px;
       padding: 0 16px; color: #1d1d1f; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { font-size: 1.25em; margin-top: 1.6em;
     border-bottom: 1px solid #ccc; padding-bottom: 0.2em; } h3 { font-size: 1.05em; }
.meta { color: #555; font-size: 0.92em; }
table { border-collapse: collapse; margin: 0.6em 0 1em; font-size: 0.92em; }
th, td { border: 1px solid #c8c8c8; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f5; } tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.samples td { white-space: pre-wrap; overflow-wrap: anywhere; max-width: 420px; }
table.samples td.num { white-space: nowrap; }
table.samples { width: 100%; }
img.curves { max-width: 100%; height: auto; border: 1px solid #ddd; }
pre { background: #f6f8fa; border: 1px solid #ddd; padding: 8px; overflow-x: auto; font-size: 0.85em; }
.note { color: #8a4b00; } details summary { cursor: pointer; margin: 0.4em 0; }
.cols { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
.heat { white-space: pre-wrap; overflow-wrap: anywhere; font-family: ui-monospace, Menlo, Consolas, monospace;
        font-size: 0.9em; border: 1px solid #ddd; padding: 6px; margin: 0.3em 0 0.2em; line-height: 1.7; }
.heat .prompt { color: #777; }
.turn.env { background: #e8f0fe; border: 1px solid #9ab3e0; border-radius: 3px; color: #1a3f7a; padding: 0 2px; }
.turn.env::before { content: "env"; font-size: 0.7em; color: #5471a8; margin-right: 3px; vertical-align: super; }
.tok { background: var(--adv); border-radius: 2px; box-shadow: inset -1px 0 rgba(255, 255, 255, 0.7); } .tok.out { outline: 1px dashed #999; }
#attr-kl:checked ~ .attr-body .tok { background: var(--kl); }
.attr-legend { display: inline-block; width: 160px; height: 0.8em; vertical-align: middle; margin: 0 6px; }
.attr-legend.kl { display: none; } #attr-kl:checked ~ .attr-legend.kl { display: inline-block; }
#attr-kl:checked ~ .attr-legend.adv { display: none; }
"""


# ----------------------------------------------------------------------------- reading the run directory
def _read_json(path: Path) -> Optional[Any]:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    from ppo_ray.tasks.pipeline import read_metrics

    return read_metrics(path)


def headline(run_dir: Path) -> tuple[Optional[str], dict]:
    """(where the numbers come from, the report): the first of REPORTS present, else the
    statistics of the stages run.json records as finished (a run stopped before its report)."""
    for name in REPORTS:
        report = _read_json(run_dir / name)
        if isinstance(report, dict):
            return name, report
    from ppo_ray.tracking import read_run_file

    done = read_run_file(run_dir).get("stages_done") or {}
    merged = {k: v for stats in done.values() if isinstance(stats, dict) for k, v in stats.items()}
    return ("run.json (finished stages: " + ", ".join(done) + ")" if merged else None), merged


def split_pairs(report: dict) -> tuple[list[tuple[str, str, Any, Any, str]], dict]:
    """The report's before/after pairs as rows (metric, split, SFT (or base) value, after value, after's
    name: PPO or RL), a dict value's numbers each a row of its own (copy_test_sft's all_right:
    metric `copy.all_right`), and the rest of the report."""
    pairs: dict[tuple[str, str], dict] = {}
    rest = {}
    for key, value in report.items():
        m = PAIR.match(key)
        if m is None:
            rest[key] = value
            continue
        # a dict's fractions (copy_test_sft's all_right), not its counts (n)
        flat = {m["metric"]: value} if not isinstance(value, dict) else \
            {f"{m['metric']}.{k}": v for k, v in value.items() if isinstance(v, float)}
        for metric, v in flat.items():
            pairs.setdefault((metric, m["split"]), {})[m["who"]] = v
    rows = []
    for (metric, split), by in pairs.items():
        after = "rl" if "rl" in by else "ppo"
        rows.append((metric, split, by.get("sft", by.get("base")), by.get(after), after.upper()))
    rows.sort(key=lambda r: (r[1] != "test", r[0].startswith("copy."), r[0].count("."), r[0]))
    return rows, rest


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def parse_markdown_table(text: str) -> tuple[Optional[str], list[str], list[list[str]]]:
    """(the first `# ` heading, header cells, body rows) of a markdown file holding one table
    (samples.md: tldr_task.write_samples; cells escape `|` as `\\|`)."""
    title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), None)
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip("|"))]
        if all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
            continue  # the separator row
        rows.append(cells)
    return title, (rows[0] if rows else []), rows[1:]


# ----------------------------------------------------------------------------- HTML pieces
def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    """A report value as text: floats to 4 significant digits (thousands with one decimal)."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{value:,}"


NUMBER_TEXT = re.compile(r"-?\d+(,\d{3})*(\.\d+)?(e[-+]?\d+)?(/\d+)?")  # a number as text (samples.md's 0.67, 7/8)


class Markup(str):
    """A table cell that is HTML already (built here from escaped parts), not text to escape."""


def transcript_html(segments) -> Markup:
    """A multi-turn transcript's ("model" | "env", text) segments, each turn marked: the model's
    as they are, the environment's boxed and labelled (every text escaped)."""
    parts = []
    for role, text in segments:
        kind = "env" if role == "env" else "model"
        parts.append(f'<span class="turn {kind}" title="{kind} turn">{esc(text)}</span>')
    return Markup("".join(parts))


def table(header: list[str], rows: list[list[Any]], cls: str = "") -> str:
    """An HTML table; numbers (and cells that read as one) right-aligned and formatted (fmt),
    every cell escaped but Markup's (HTML built here). A header of empty names is left out."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for v in row:
            if isinstance(v, Markup):
                cells.append(f"<td>{v}</td>")
                continue
            number = (isinstance(v, (int, float)) and not isinstance(v, bool)) or \
                (isinstance(v, str) and NUMBER_TEXT.fullmatch(v) is not None)
            cells.append(f'<td class="num">{esc(fmt(v))}</td>' if number else f"<td>{esc(fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    attr = f' class="{cls}"' if cls else ""
    thead = f"<thead><tr>{head}</tr></thead>" if any(header) else ""
    return f"<table{attr}>{thead}<tbody>{''.join(body)}</tbody></table>"


def png_img(data: bytes, alt: str) -> str:
    return (f'<img class="curves" alt="{esc(alt)}" src="data:image/png;base64,'
            f'{base64.b64encode(data).decode("ascii")}">')


# ----------------------------------------------------------------------------- sections
def section_summary(run_dir: Path) -> str:
    source, report = headline(run_dir)
    if source is None:
        return "<h2>Summary</h2><p class=\"note\">No report yet: the run has not finished a stage.</p>"
    pairs, rest = split_pairs(report)
    out = [f"<h2>Summary</h2><p class=\"meta\">From {esc(source)}.</p>"]
    if pairs:
        after = pairs[0][4]
        # a task with no SFT stage starts from the base model (keys <metric>_<split>_base)
        before = "base model" if any((m := PAIR.match(k)) and m["who"] == "base" for k in report) else "SFT"
        out.append(f"<h3>Before ({esc(before)}) and after ({esc(after)}), held-out prompts</h3>")
        out.append(table(["metric", "split", before, after, "change"],
                         [[m, s, a, b, (b - a) if _numbers(a, b) else None] for m, s, a, b, _ in pairs]))
    # the headline first; the SFT and reward-model stages' own statistics beside it
    groups: dict[str, list] = {"Headline numbers": [], "SFT stage": [], "Reward-model stage": []}
    for key, value in rest.items():
        if _is_scalar(value) and key not in ("run_dir", "run_tag"):  # those two head the page
            group = "SFT stage" if key.startswith("sft_") else "Reward-model stage" if key.startswith("rm_") \
                else "Headline numbers"
            groups[group].append([key, value])
    tables = [f"<div><h3>{esc(name)}</h3>{table(['key', 'value'], rows)}</div>"
              for name, rows in groups.items() if rows]
    if tables:
        out.append('<div class="cols">' + "".join(tables) + "</div>")
    nested = {k: v for k, v in rest.items() if not _is_scalar(v)}
    if nested:
        out.append("<details><summary>Other statistics of the report (nested)</summary>"
                   f"<pre>{esc(json.dumps(nested, indent=1))}</pre></details>")
    return "".join(out)


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def section_curves(run_dir: Path) -> str:
    png = run_dir / "curves.png"
    if png.is_file():
        return "<h2>Curves</h2>" + png_img(png.read_bytes(), "the run's curves (curves.png)")
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        return ""
    from ppo_ray.tasks.pipeline import plot_curves

    keys = {k for r in rows for k in r}
    if "gold_val" in keys:
        panel = {}
    elif "pass1_val" in keys:
        panel = dict(gold_key="pass1_val", gold_title="pass@1 (held-out validation, greedy)",
                     reward_title="verifier reward (share right)")
    else:
        panel = dict(gold_key="eval_reward_mean", gold_title="reward on the eval prompts", reward_title="reward")
    buf = io.BytesIO()
    plot_curves(run_dir / "metrics.jsonl", buf, **panel)
    return ("<h2>Curves</h2><p class=\"meta\">Drawn from metrics.jsonl (the run wrote no curves.png).</p>"
            + png_img(buf.getvalue(), "the run's curves, from metrics.jsonl"))


def section_samples(run_dir: Path) -> str:
    out = []
    md = run_dir / "samples.md"
    if md.is_file():
        title, header, rows = parse_markdown_table(md.read_text())
        out.append(f"<h3>{esc(title or 'samples.md')}</h3>")
        if header:
            out.append(table(header, rows, cls="samples"))
        else:
            out.append(f"<pre>{esc(md.read_text())}</pre>")
        if (run_dir / "held_out.jsonl").is_file():
            out.append('<p class="meta">Every held-out sample behind the numbers: held_out.jsonl.</p>')
    evals = _read_jsonl(run_dir / "eval_samples.jsonl")
    if evals:
        last = max(r.get("step", 0) for r in evals)
        shown = [r for r in evals if r.get("step", 0) == last][:EVAL_SAMPLE_ROWS]
        rows = [[_cut(r.get("prompt", "")), transcript_html(r["transcript"]) if r.get("transcript") else
                 r.get("response", ""), r.get("reward"), r.get("finish_reason")] for r in shown]
        inner = (f'<p class="meta">The policy at step {esc(last)}, sampled with the evaluation\'s fixed seeds '
                 f"(eval_samples.jsonl; prompts cut to {PROMPT_CHARS} characters).</p>"
                 + table(["prompt", "response", "reward", "finish"], rows, cls="samples"))
        if out:  # the held-out table is the main one; these fold away
            out.append(f"<details><summary>Eval samples at step {esc(last)}</summary>{inner}</details>")
        else:
            out.append(f"<h3>Eval samples at step {esc(last)}</h3>{inner}")
    episodes = section_episodes(run_dir)
    if episodes:
        out.append(episodes)
    return "<h2>Samples</h2>" + "".join(out) if out else ""


def section_episodes(run_dir: Path) -> str:
    """A multi-turn run's last evaluated step: its first episodes' whole transcripts, the model's
    and the environment's turns marked, with their scores (episodes.jsonl)."""
    lines = _read_jsonl(run_dir / "episodes.jsonl")
    if not lines:
        return ""
    last = max(line.get("step", 0) for line in lines)
    rows = [[line.get("index"), transcript_html(line.get("transcript", [])), line.get("reward")]
            for line in lines if line.get("step", 0) == last][:EVAL_SAMPLE_ROWS]
    return (f"<h3>Episodes of step {esc(last)}</h3><p class=\"meta\">Whole transcripts after the prompt "
            "(episodes.jsonl): <span class=\"turn model\">the model's turns</span> and <span class=\"turn env\">"
            "the environment's</span>, which are context only, never trained on.</p>"
            + table(["#", "transcript", "score"], rows, cls="samples"))


# The heat map's colours: negative values toward the first colour, positive toward the second,
# white at 0, full strength at the largest |value| shown (per quantity, over the step's rollouts).
HEAT = {"adv": ((33, 102, 172), (178, 24, 43)), "kl": ((1, 133, 113), (166, 97, 26))}
ATTRIBUTION_COLUMNS = (("t", "position"), ("token", "action"), ("id", "action_id"), ("logprob", "logprob"),
                       ("old", "old_logprob"), ("ref", "ref_logprob"), ("KL_t", "kl"), ("r_t", "reward"),
                       ("V", "value"), ("delta", "td_error"), ("A", "advantage"), ("G", "return_"),
                       ("in loss", "in_loss"))


def heat_colour(value: Optional[float], scale: float, which: str) -> str:
    """The CSS colour of `value` on the `which` scale (HEAT), |value| / scale its strength."""
    if value is None or not math.isfinite(value) or scale <= 0:
        return "transparent"
    strength = 0.8 * min(abs(value) / scale, 1.0)  # at most 80%: the token stays readable
    rgb = HEAT[which][value > 0]
    mixed = [round(255 + (c - 255) * strength) for c in rgb]
    return "#" + "".join(f"{c:02x}" for c in mixed)


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4g}"


def _token_title(p) -> str:
    parts = [f"t={p.position} {p.action!r} (id {p.action_id})", f"logprob {_g(p.logprob)} (old {_g(p.old_logprob)}, "
             f"ref {_g(p.ref_logprob)})", f"KL_t {_g(p.kl)}" + ("" if p.reward is None else f"  r_t {_g(p.reward)}")]
    if p.value is not None:
        parts.append(f"V {_g(p.value)}  delta {_g(p.td_error)}  G {_g(p.return_)}")
    if p.advantage is not None:
        parts.append(f"A {_g(p.advantage)}" + ("" if p.in_loss else "  (not in the loss)"))
    return "\n".join(parts)


def _scale(values) -> float:
    return max((abs(v) for v in values if v is not None and math.isfinite(v)), default=0.0)


def _heat_rows(rollouts, columns, scale_adv: float, scale_kl: float, head) -> list[str]:
    """Each rollout as a line of coloured token spans (hover: its numbers) and a folded table."""
    out = []
    for r in rollouts:
        spans = "".join(  # a held-out sample has no advantage: KL_t in either colouring
            f'<span class="tok{"" if p.in_loss or r.held_out else " out"}" style="--adv:'
            f'{heat_colour(p.kl, scale_kl, "kl") if r.held_out else heat_colour(p.advantage, scale_adv, "adv")};'
            f'--kl:{heat_colour(p.kl, scale_kl, "kl")}" title="{esc(_token_title(p))}">{esc(p.action or "∅")}</span>'
            for p in r.pairs)
        out.append(f"<h3>{esc(' · '.join(head(r)))}</h3>"
                   f'<div class="heat"><span class="prompt">{esc(_cut(r.prompt))}</span>{spans}</div>')
        rows = [[repr(getattr(p, name)) if name == "action" else getattr(p, name) for _, name in columns]
                for p in r.pairs]
        out.append(f"<details><summary>{'Sample' if r.held_out else 'Row'} {esc(r.row)}'s {len(r.pairs)} tokens, "
                   "every number</summary>" + table([h for h, _ in columns], rows) + "</details>")
    return out


def section_attribution(run_dir: Path) -> str:
    """The last evaluated step's training rollouts and held-out samples, per token
    (attribution.jsonl): the rollouts coloured by advantage or KL_t, the held-out samples
    (no advantage) by KL_t."""
    from ppo_ray.attribution import ATTRIBUTION, RolloutAttribution

    lines = _read_jsonl(run_dir / ATTRIBUTION)
    if not lines:
        return ""
    last = max(r.get("step", 0) for r in lines)
    every = [RolloutAttribution.from_dict(r) for r in lines if r.get("step", 0) == last]
    rollouts = [r for r in every if not r.held_out]
    held = [r for r in every if r.held_out]
    pairs = [p for r in every for p in r.pairs]
    scale_adv = _scale(p.advantage for p in pairs)
    scale_kl = _scale(p.kl for p in pairs)
    first = (rollouts or held)[0]
    critic = any(p.value is not None for p in pairs)
    what = ("value V(s_t), TD error and return per token" if critic else
            f"no value model ({esc(first.estimator)}): each rollout's group baseline and its advantage")
    out = ["<h2>Token attribution</h2>",
           f'<p class="meta">Step {esc(last)}\'s first {len(rollouts)} training rollouts as the update saw them '
           f"(attribution.jsonl; advantage estimator {esc(first.estimator)}, beta {esc(fmt(first.kl_coef))}"
           f"{', advantages whitened' if first.whitened else ''}; {what}), then {len(held)} held-out eval samples "
           "(the generator's and the reference's logprobs and KL_t: no advantage). Hover a token for its numbers; "
           "the tables below hold them all. A dashed token is outside the policy loss.</p>",
           '<div class="attr">',
           '<input type="radio" name="attr-colour" id="attr-adv" checked> <label for="attr-adv">colour by advantage '
           f"A_t (max |A| {esc(fmt(scale_adv))})</label> ",
           '<input type="radio" name="attr-colour" id="attr-kl"> <label for="attr-kl">colour by KL_t '
           f"(max |KL_t| {esc(fmt(scale_kl))})</label>",
           f'<span class="attr-legend adv" style="background: linear-gradient(to right, '
           f'{heat_colour(-1, 1, "adv")}, #ffffff, {heat_colour(1, 1, "adv")})"></span>',
           f'<span class="attr-legend kl" style="background: linear-gradient(to right, '
           f'{heat_colour(-1, 1, "kl")}, #ffffff, {heat_colour(1, 1, "kl")})"></span>',
           '<span class="meta">negative · 0 · positive</span>',
           '<div class="attr-body">']

    def rollout_head(r) -> list[str]:
        head = [f"row {r.row}", f"score {fmt(r.score)}"]
        if r.baseline is not None or not critic:
            head.append(f"group {r.group} baseline {fmt(r.baseline)}")
        return head + [f"sampled with adapter v{r.version}"]

    columns = [(h, name) for h, name in ATTRIBUTION_COLUMNS if critic or name not in ("value", "td_error", "return_")]
    out += _heat_rows(rollouts, columns, scale_adv, scale_kl, rollout_head)
    if held:
        out.append(f"<h3>Held-out eval samples at step {esc(last)}</h3>"
                   '<p class="meta">No update trained on these: they show KL_t in either colouring.</p>')
        held_columns = [(h, name) for h, name in ATTRIBUTION_COLUMNS
                        if name in ("position", "action", "action_id", "logprob", "ref_logprob", "kl")]
        out += _heat_rows(held, held_columns, scale_adv, scale_kl,
                          lambda r: [f"eval sample {r.row}", f"reward {fmt(r.score)}", f"adapter v{r.version}"])
    out.append("</div></div>")
    return "".join(out)


def _cut(text: str) -> str:
    return text if len(text) <= PROMPT_CHARS else text[:PROMPT_CHARS] + "…"


def section_config(run_dir: Path) -> str:
    import yaml

    files = sorted(run_dir.glob("config*.yaml"))
    if not files:
        return ""
    out = ["<h2>Config</h2>"]
    for path in files:
        text = path.read_text()
        data = yaml.safe_load(text)
        if isinstance(data, dict):
            rows = [[k, json.dumps(data[k]) if not _is_scalar(data[k]) else data[k]] for k in KEY_FIELDS if k in data]
            out.append(f"<h3>{esc(path.name)}</h3>" + table(["field", "value"], rows))
        out.append(f"<details><summary>{esc(path.name)}, whole ({len(text.splitlines())} lines)</summary>"
                   f"<pre>{esc(text)}</pre></details>")
    return "".join(out)


def section_environment(run_dir: Path) -> str:
    from ppo_ray.tracking import read_run_file

    env = read_run_file(run_dir).get("environment")
    note = ""
    if not isinstance(env, dict):
        from ppo_ray.machine import machine_info

        env = machine_info()
        note = ('<p class="note">The run recorded no environment (run.json); this is the machine that built '
                "the page.</p>")
    rows = [["python", env.get("python")]]
    rows += [[pkg, v] for pkg, v in (env.get("versions") or {}).items()]
    rows += [["host", env.get("host")], ["CPU", env.get("cpu")], ["CPUs (usable)", env.get("cpus")],
             ["memory (GiB)", env.get("mem_gib")]]
    gpus = env.get("gpus") or []
    rows += [[f"GPU {i}", f"{g.get('name')}, {g.get('memory_mib')} MiB, driver {g.get('driver')}"]
             for i, g in enumerate(gpus)] or [["GPUs", "none"]]
    when = f" (recorded {esc(env['recorded'])})" if env.get("recorded") else ""
    return f"<h2>Environment{when}</h2>{note}" + table(["", ""], rows)


def section_timings(run_dir: Path) -> str:
    out = []
    stage_rows = []
    for name in REPORTS:
        report = _read_json(run_dir / name)
        if isinstance(report, dict):
            for key in ("sft_seconds", "rm_seconds"):
                if key in report and key not in [r[0] for r in stage_rows]:
                    stage_rows.append([key, report[key]])
            if "seconds" in report:
                stage_rows.append([f"{name}: the command's seconds", report["seconds"]])
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    steps = [r["time/step_s"] for r in rows if _numbers(r.get("time/step_s"))]
    if steps:
        stage_rows.append(["PPO steps' seconds (sum of time/step_s)", sum(steps)])
    if stage_rows:
        out.append(table(["stage", "seconds"], stage_rows))
    if steps:
        q = statistics.quantiles(steps, n=10, method="inclusive") if len(steps) >= 2 else [steps[0]] * 9
        out.append("<h3>Per PPO step (metrics.jsonl)</h3>" + table(
            ["steps", "mean s", "median s", "min s", "p90 s", "max s"],
            [[len(steps), statistics.fmean(steps), statistics.median(steps), min(steps), q[8], max(steps)]]))
        # in the rows' order (StepTiming's); sub-phases overlap (sync_write_s is part of sync_s)
        phases = list(dict.fromkeys(k for r in rows for k in r if k.startswith("time/") and k != "time/step_s"))
        total = statistics.fmean(steps)
        phase_rows = []
        for key in phases:
            values = [r[key] for r in rows if _numbers(r.get(key))]
            if values:
                mean = statistics.fmean(values)
                phase_rows.append([key.removeprefix("time/"), mean, 100 * mean / total if total else None])
        rates = [[key, statistics.median(v)] for key in ("tokens_per_s", "rollout_tokens_per_s",
                                                         "learner_tokens_per_s", "learner_mfu")
                 if (v := [r[key] for r in rows if _numbers(r.get(key))])]
        out.append('<div class="cols">')
        if phase_rows:
            out.append("<div><h3>Phases, mean per step (they overlap)</h3>"
                       + table(["phase", "mean s", "% of step"], phase_rows) + "</div>")
        if rates:
            out.append("<div><h3>Throughput, median over steps</h3>" + table(["rate", "median"], rates) + "</div>")
        out.append("</div>")
    return "<h2>Timings</h2>" + "".join(out) if out else ""


def section_files(run_dir: Path) -> str:
    rows = []
    for p in sorted(run_dir.iterdir()):
        if p.name.startswith(".") or p.name == PAGE:
            continue
        size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        rows.append([p.name + ("/" if p.is_dir() else ""), size])
    return "<h2>Files in the run directory</h2>" + table(["name", "bytes"], rows) if rows else ""


SECTIONS: tuple[tuple[str, Callable[[Path], str]], ...] = (
    ("summary", section_summary), ("curves", section_curves), ("samples", section_samples),
    ("attribution", section_attribution),
    ("config", section_config), ("environment", section_environment), ("timings", section_timings),
    ("files", section_files))


# ----------------------------------------------------------------------------- the page
def build_page(run_dir: Path) -> str:
    """The page's HTML for `run_dir`. A section that cannot be read (a damaged file) is a line
    naming the error; the other sections are unaffected."""
    run_dir = Path(run_dir)
    from ppo_ray.tracking import read_run_file

    run = read_run_file(run_dir)
    meta = [f"Run directory <code>{esc(run_dir.resolve())}</code>"]
    if run.get("run_tag"):
        meta.append(f"run tag <code>{esc(run['run_tag'])}</code>")
    if run.get("stages_done"):
        meta.append("stages finished: " + esc(", ".join(run["stages_done"])))
    meta.append(f"page written {esc(time.strftime('%Y-%m-%d %H:%M:%S'))}")
    parts = []
    for name, section in SECTIONS:
        try:
            parts.append(section(run_dir))
        except Exception as e:  # noqa: BLE001 (one unreadable file costs its section, not the page)
            log.warning("report page of %s: the %s section failed: %r", run_dir, name, e)
            parts.append(f'<h2>{esc(name.capitalize())}</h2><p class="note">Could not be built: '
                         f"{esc(type(e).__name__)}: {esc(e)}</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>ppo-ray run {esc(run_dir.name)}</title><style>{CSS}</style></head><body>"
            f"<h1>ppo-ray run {esc(run_dir.name)}</h1><p class=\"meta\">{' · '.join(meta)}</p>"
            + "".join(parts) + "</body></html>\n")


def write_report_page(run_dir: str | Path) -> Path:
    """Write <run_dir>/report.html (atomically) from what the run directory holds; returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a run directory")
    path = run_dir / PAGE
    atomic_write_text(path, build_page(run_dir))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppo_ray.tasks.report_page",
                                     description="(Re)build a run directory's report.html.")
    parser.add_argument("run_dir", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for run_dir in args.run_dir:
        try:
            print(write_report_page(run_dir))
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
