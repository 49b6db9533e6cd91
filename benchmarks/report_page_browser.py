"""A run's report page (ppo_ray/tasks/report_page.py) in a real browser: headless Chromium.

    python -m benchmarks.report_page_browser RUN_DIR [--screenshot /tmp/report_page.png] [--no-rebuild]

(Re)builds RUN_DIR/report.html, renders it with Chromium, and checks what the browser made
of it: every image decoded (natural size > 0), the tables there, no <script> element, the
document title unchanged (a sample's `<script>` did not run). Prints the facts as JSON; exit
status 1 when a check fails, 2 without a Chromium binary (Debian: apt-get install chromium;
or set CHROMIUM to its path). The screenshot is the page at 1200 px wide, to look at.

How: Chromium's --dump-dom serialises the DOM, which has no natural sizes, so a copy of the
page in a temporary folder gets a probe script appended that writes them (and the counts) into
the DOM on the load event; the page itself has no script. tests/test_report_page.py calls
render() on the bundled tasks' run directories.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PROBE_ID = "__report_page_probe__"
# runs in the copy only: what the browser rendered, written into the DOM that --dump-dom prints
PROBE = f"""<script id="{PROBE_ID}-script">
window.addEventListener("load", function () {{
  var facts = {{
    title: document.title,
    images: Array.from(document.images).map(function (i) {{
      return {{w: i.naturalWidth, h: i.naturalHeight, complete: i.complete, src: i.src.slice(0, 30)}}; }}),
    tables: document.querySelectorAll("table").length,
    table_rows: document.querySelectorAll("tr").length,
    scripts: document.querySelectorAll("script").length - 1,
    h2: Array.from(document.querySelectorAll("h2")).map(function (h) {{ return h.textContent; }}),
    body_width: document.body.scrollWidth,
    body_height: document.body.scrollHeight
  }};
  var pre = document.createElement("pre");
  pre.id = "{PROBE_ID}";
  pre.textContent = JSON.stringify(facts);
  document.body.appendChild(pre);
}});
</script>"""


def find_browser() -> Optional[str]:
    """$CHROMIUM, else the first of BROWSERS on PATH; None when there is none."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def _chromium(browser: str, profile: Path, *args: str, timeout_s: float = 120) -> str:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    return out.stdout


def render(page: Path, screenshot: Optional[Path] = None, browser: Optional[str] = None,
           window: tuple[int, int] = (1200, 2000)) -> dict:
    """What Chromium rendered of `page` (the probe's facts), and a screenshot of the page
    itself at `window` size when `screenshot` is given."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium binary (" + ", ".join(BROWSERS) + "; or set CHROMIUM)")
    page = Path(page).resolve()
    with tempfile.TemporaryDirectory(prefix="report-page-") as tmp:
        tmp = Path(tmp)
        probe = tmp / "probe.html"
        probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
        dom = _chromium(browser, tmp / "profile", "--dump-dom", probe.as_uri())
        if screenshot is not None:
            _chromium(browser, tmp / "profile", f"--screenshot={Path(screenshot).resolve()}",
                      f"--window-size={window[0]},{window[1]}", page.as_uri())
    m = re.search(rf'<pre id="{PROBE_ID}">(.*?)</pre>', dom, re.S)
    if m is None:
        raise RuntimeError(f"the probe wrote nothing: the page did not load in {browser} ({len(dom)} bytes of DOM)")
    facts = json.loads(html.unescape(m.group(1)))
    facts["browser"] = browser
    return facts


def problems(facts: dict, title: str) -> list[str]:
    """What is wrong with a rendered page (empty: nothing)."""
    out = []
    if not facts["images"]:
        out.append("no image")
    out += [f"image {i} not decoded: {img}" for i, img in enumerate(facts["images"]) if not (img["w"] and img["h"])]
    if facts["tables"] == 0:
        out.append("no table")
    if facts["scripts"]:
        out.append(f"{facts['scripts']} <script> element(s) in the page")
    if facts["title"] != title:
        out.append(f"the title changed to {facts['title']!r} (a script ran?)")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--screenshot", type=Path, default=Path("/tmp/report_page.png"))
    p.add_argument("--window", default="1200,2000", help="width,height of the screenshot")
    p.add_argument("--no-rebuild", action="store_true", help="render the report.html the run directory holds")
    args = p.parse_args(argv)
    from ppo_ray.tasks.report_page import PAGE, write_report_page

    page = args.run_dir / PAGE if args.no_rebuild else write_report_page(args.run_dir)
    if find_browser() is None:
        print("error: no Chromium binary (Debian: apt-get install chromium; or set CHROMIUM)", file=sys.stderr)
        return 2
    width, height = (int(x) for x in args.window.split(","))
    facts = render(page, args.screenshot, window=(width, height))
    title = f"ppo-ray run {args.run_dir.resolve().name}"
    found = problems(facts, title)
    print(json.dumps({**facts, "page": str(page), "screenshot": str(args.screenshot), "problems": found}, indent=1))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
