"""ppo_ray/tasks/report_page.py: the run's report.html, without Ray. Run directories as the
pipeline leaves them (tests/report_run_dirs.py: each file by the code that writes it in a
run), finished and partial; the page is one self-contained file with the headline numbers,
the curves, the samples (escaped), the config, the environment and the timings. The last
tests render it in headless Chromium (skipped where there is none)."""

from __future__ import annotations

import base64
import html
import json
from html.parser import HTMLParser

import pytest
from report_run_dirs import SCRIPT, arith_run, plain_run, tldr_run

from benchmarks import report_page_browser as browser
from ppo_ray.tasks.report_page import fmt, main, parse_markdown_table, write_report_page

PNG = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """The page's tags and attributes, and the text of its table cells."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.cells: list[str] = []
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def names(self) -> list[str]:
        return [tag for tag, _ in self.tags]

    def images(self) -> list[bytes]:
        return [base64.b64decode(a["src"].removeprefix("data:image/png;base64,")) for t, a in self.tags if t == "img"]


def check_self_contained(page: Page) -> None:
    """One file: no script, no stylesheet or frame to fetch, every src/href inside the file."""
    assert not {"script", "link", "iframe", "object", "embed", "base"} & set(page.names())
    for tag, attrs in page.tags:
        for name in ("src", "href", "srcset", "data", "action"):
            if name in attrs:
                assert attrs[name].startswith(("data:image/png;base64,", "#")), (tag, attrs[name][:60])
        assert "http://" not in attrs.get("style", "") and "https://" not in attrs.get("style", "")
    for tag, attrs in page.tags:
        if tag == "img":
            assert attrs["src"].startswith("data:image/png;base64,")


def test_the_tldr_pipelines_page_holds_its_numbers_curves_samples_and_setting(tmp_path):
    run = tmp_path / "run"
    report = tldr_run(run)
    path = write_report_page(run)
    assert path == run / "report.html"
    text = path.read_text()
    page = Page(text)
    check_self_contained(page)
    # the curves: curves.png itself, embedded
    assert page.images() == [(run / "curves.png").read_bytes()]
    # the headline numbers, in the summary's tables
    for key in ("gold_test_sft", "gold_test_ppo", "win_rate_ppo_vs_sft", "win_rate_ppo_vs_reference", "final_kl",
                "sft_seconds", "rm_val_accuracy"):
        assert fmt(report[key]) in page.cells, key
    assert {"win_rate_ppo_vs_sft", "final_kl", "copy.all_right", "gold"} <= set(page.cells)
    # the samples, escaped: the hostile one is text, not a tag
    assert "SFT summary" in page.cells and SCRIPT in page.cells
    assert html.escape(SCRIPT, quote=True) in text and SCRIPT not in text
    assert "b" not in page.names()
    # the config, the environment (recorded in run.json), the timings
    assert "embedded:tldr" in page.cells and "config.yaml" in text
    env = json.loads((run / "run.json").read_text())["environment"]
    assert env["python"] in page.cells and env["versions"]["torch"] in page.cells and env["cpu"] in page.cells
    assert "update_s" in page.cells and "generate_s" in page.cells
    assert "PPO steps' seconds (sum of time/step_s)" in page.cells


def test_the_arith_pages_before_after_table_and_right_of_k(tmp_path):
    run = tmp_path / "run"
    report = arith_run(run)
    text = write_report_page(run).read_text()
    page = Page(text)
    check_self_contained(page)
    assert page.images() == [(run / "curves.png").read_bytes()]
    # pass@1 / pass@8 / sample accuracy, SFT beside RL, and their change
    cells = page.cells
    i = cells.index("pass1")
    assert cells[i:i + 5] == ["pass1", "test", fmt(report["pass1_test_sft"]), fmt(report["pass1_test_rl"]),
                              fmt(report["pass1_test_rl"] - report["pass1_test_sft"])]
    assert "pass8" in cells and "sample_accuracy" in cells and "RL" in cells
    # samples.md: greedy answers and right-of-k counts, a hostile answer (holding `|`) in one cell
    assert {"SFT greedy", "RL right of k", "70+27="} <= set(cells) and any(c.endswith("/8") for c in cells)
    assert repr(SCRIPT + " | 12") in cells and SCRIPT not in text
    assert "grpo" in cells  # the preset's estimator, from config.yaml


def test_a_run_from_the_base_model_names_it_before(tmp_path):
    """Task arith-chat (no SFT stage): report.json's *_base keys pair with *_rl under "base model"."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps({"pass1_test_base": 0.065, "pass1_test_rl": 0.5,
                                                 "pass8_test_base": 0.3, "pass8_test_rl": 0.8}))
    page = Page(write_report_page(run).read_text())
    cells = page.cells
    assert {"base model", "RL"} <= set(cells) and "SFT" not in cells
    i = cells.index("pass1")
    assert cells[i:i + 5] == ["pass1", "test", fmt(0.065), fmt(0.5), fmt(0.5 - 0.065)]


def test_the_token_attribution_is_a_heat_map_with_a_toggle_and_every_number(tmp_path):
    """The last evaluated step's rollouts (attribution.jsonl): one span per token, coloured by
    advantage or by KL (two CSS variables, a radio toggle: no script), its numbers in its title
    and in a table; then the held-out samples, KL_t in both colourings and no advantage; a group
    estimator's page shows the baseline and no value columns."""
    from ppo_ray.attribution import RolloutAttribution
    from ppo_ray.tasks.report_page import heat_colour

    run = tmp_path / "run"
    tldr_run(run, steps=6)
    text = write_report_page(run).read_text()
    page = Page(text)
    check_self_contained(page)
    lines = [json.loads(line) for line in (run / "attribution.jsonl").read_text().splitlines()]
    every = [RolloutAttribution.from_dict(r) for r in lines if r["step"] == 6]
    shown = [r for r in every if not r.held_out]
    held = [r for r in every if r.held_out]
    assert len(shown) == 4 and len(held) == 4 and "Step 6's first 4 training rollouts" in text
    assert "Held-out eval samples at step 6" in text and "then 4 held-out eval samples" in text
    tokens = [a for t, a in page.tags if t == "span" and "tok" in a.get("class", "").split()]
    pairs = [p for r in shown for p in r.pairs]
    held_pairs = [p for r in held for p in r.pairs]
    assert len(tokens) == len(pairs) + len(held_pairs)
    scale_adv = max(abs(p.advantage) for p in pairs)
    scale_kl = max(abs(p.kl) for p in pairs + held_pairs)
    for span, p in zip(tokens, pairs):
        assert span["style"] == (f"--adv:{heat_colour(p.advantage, scale_adv, 'adv')};"
                                 f"--kl:{heat_colour(p.kl, scale_kl, 'kl')}")
        assert f"A {p.advantage:.4g}" in span["title"] and f"KL_t {p.kl:.4g}" in span["title"]
        assert f"V {p.value:.4g}" in span["title"]
    for span, p in zip(tokens[len(pairs):], held_pairs):
        assert span["style"] == f"--adv:{heat_colour(p.kl, scale_kl, 'kl')};--kl:{heat_colour(p.kl, scale_kl, 'kl')}"
        assert f"KL_t {p.kl:.4g}" in span["title"] and "A " not in span["title"] and "r_t" not in span["title"]
        assert span["class"] == "tok"  # no dashed outline: none of them is in a loss
    radios = [a for t, a in page.tags if t == "input"]
    assert [(a["type"], a["id"]) for a in radios] == [("radio", "attr-adv"), ("radio", "attr-kl")]
    assert "checked" in radios[0] and "#attr-kl:checked ~ .attr-body .tok { background: var(--kl); }" in text
    assert {"KL_t", "V", "delta", "G", "in loss"} <= set(page.cells)
    assert html.escape("<script>", quote=True) in text and SCRIPT not in text  # the hostile response's tokens
    assert heat_colour(0.0, 1.0, "adv") == "#ffffff" and heat_colour(-1.0, 1.0, "adv") == "#4d85bd"
    assert heat_colour(2.0, 1.0, "kl") == "#b88148" and heat_colour(None, 1.0, "kl") == "transparent"

    arith = tmp_path / "arith"
    arith_run(arith)
    text = write_report_page(arith).read_text()
    cells = Page(text).cells
    assert "no value model (grpo)" in text and "group 0 baseline 0.25" in text
    assert "A" in cells and "V" not in cells and "delta" not in cells


def test_a_plain_ppo_runs_curves_are_drawn_from_its_metrics(tmp_path):
    """`launch.py ppo` with reward_funcs writes no curves.png and no samples.md."""
    run = tmp_path / "run"
    report = plain_run(run)
    page = Page(write_report_page(run).read_text())
    check_self_contained(page)
    text = (run / "report.html").read_text()
    [png] = page.images()
    assert png.startswith(PNG) and not (run / "curves.png").exists()
    assert "Drawn from metrics.jsonl" in text
    assert fmt(report["last_reward"]) in page.cells and "From report-ppo.json." in text
    assert "<h3>config-ppo.yaml</h3>" in text and "letter_e_fraction" in text
    # no samples.md: the last evaluation's samples are the section, the hostile prompt as text
    assert "<h3>Eval samples at step 4</h3>" in text and SCRIPT in page.cells and SCRIPT not in text


def test_a_multi_turn_runs_transcripts_mark_the_models_and_the_environments_turns(tmp_path):
    """Eval samples and the last step's episodes as whole transcripts: each turn a marked span
    (model / env), every text escaped (a tool's output holding <script> shows as text)."""
    run = tmp_path / "run"
    plain_run(run)
    segments = [["model", "<calc>3*4</calc>"], ["env", f"<out>12</out>{SCRIPT}"], ["model", "12"]]
    (run / "episodes.jsonl").write_text(json.dumps({"step": 4, "index": 0, "reward": 1.0, "transcript": segments})
                                        + "\n")
    samples = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    samples[-1].update(transcript=segments)
    (run / "eval_samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in samples))
    page = Page(write_report_page(run).read_text())
    check_self_contained(page)
    text = (run / "report.html").read_text()
    marked = ('<span class="turn model" title="model turn">&lt;calc&gt;3*4&lt;/calc&gt;</span>'
              '<span class="turn env" title="env turn">&lt;out&gt;12&lt;/out&gt;')
    assert text.count(marked) == 2  # the eval sample's and the step's episode
    assert "<h3>Episodes of step 4</h3>" in text and SCRIPT not in text


def test_a_partial_or_damaged_run_directory_still_gets_a_page(tmp_path):
    # only the config and a finished SFT stage: no report, metrics, samples or curves
    run = tmp_path / "partial"
    tldr = tmp_path / "full"
    tldr_run(tldr)
    run.mkdir()
    (run / "config.yaml").write_text((tldr / "config.yaml").read_text())
    from ppo_ray.driver.rundir import mark_done

    mark_done(run, "sft", {"sft_steps": 40, "sft_seconds": 61.3})
    page = Page(write_report_page(run).read_text())
    check_self_contained(page)
    assert page.images() == [] and "sft_seconds" in page.cells and "61.3" in page.cells
    assert "Samples" not in str(page.tags) and "embedded:tldr" in page.cells
    # an empty directory
    (tmp_path / "empty").mkdir()
    text = write_report_page(tmp_path / "empty").read_text()
    assert "No report yet" in text and "<h2>Environment" in text
    assert "The run recorded no environment" in text  # this machine's, said so
    # a damaged metrics.jsonl costs the sections that read it, named on the page, nothing else
    (tldr / "curves.png").unlink()
    with open(tldr / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "kl": \n')
    text = write_report_page(tldr).read_text()
    assert text.count("Could not be built: JSONDecodeError") == 2  # curves (drawn from it) and timings
    assert "win_rate_ppo_vs_sft" in Page(text).cells


def test_samples_md_tables_parse_back_to_their_cells(tmp_path):
    from ppo_ray.tasks.tldr_task import write_samples

    rows = [{"prompt": "P", "post": "a|b"}]
    write_samples(tmp_path / "s.md", rows, ["x <i>"], [0.25], ["z|w"], [0.5])
    title, header, body = parse_markdown_table((tmp_path / "s.md").read_text())
    assert title == "Held-out summaries before (SFT) and after PPO"
    assert header == ["#", "post (start)", "SFT summary", "gold", "PPO summary", "gold"]
    assert body == [["0", "a|b...", "x <i>", "0.25", "z|w", "0.50"]]


def test_the_command_rebuilds_a_page(tmp_path, capsys):
    run = tmp_path / "run"
    plain_run(run)
    assert main([str(run)]) == 0 and (run / "report.html").is_file()
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    assert main([str(tmp_path / "missing")]) == 2


def test_launch_writes_the_page_and_a_failure_to_costs_a_warning(tmp_path, caplog):
    import launch

    run = tmp_path / "run"
    plain_run(run)
    launch.write_page(run)
    assert (run / "report.html").is_file()
    launch.write_page(tmp_path / "missing")  # no run directory: a warning, the run's exit status stands
    assert "report page" in caplog.text and "python -m ppo_ray.tasks.report_page" in caplog.text


# ----------------------------------------------------------------------------- in a browser
needs_chromium = pytest.mark.skipif(browser.find_browser() is None,
                                    reason="no Chromium binary (Debian: apt-get install chromium; or set CHROMIUM)")


@needs_chromium
@pytest.mark.parametrize("build", [tldr_run, arith_run, plain_run])
def test_chromium_renders_the_page_its_image_and_tables(tmp_path, build):
    run = tmp_path / "run"
    build(run)
    facts = browser.render(write_report_page(run), tmp_path / "shot.png")
    assert browser.problems(facts, "ppo-ray run run") == []
    [image] = facts["images"]
    assert (image["w"], image["h"]) == (1200, 600)  # plot_curves: 12 x 6 inches at 100 dpi
    assert facts["tables"] >= 6 and facts["h2"][:2] == ["Summary", "Curves"]
    assert (tmp_path / "shot.png").read_bytes().startswith(PNG)


@needs_chromium
def test_the_browser_check_catches_a_broken_image_and_a_script(tmp_path):
    run = tmp_path / "run"
    plain_run(run)
    text = write_report_page(run).read_text()
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace("data:image/png;base64,iVBOR", "data:image/png;base64,AAAAA", 1)
                      .replace("</h1>", "</h1><script>document.title = 'ran'</script>", 1))
    found = browser.problems(browser.render(broken), "ppo-ray run run")
    assert any(p.startswith("image 0 not decoded") for p in found)
    assert "1 <script> element(s) in the page" in found and any("title changed" in p for p in found)
