"""The built user guide (``site/``, ``make docs``) in a real browser: every page in
headless Chromium at a desktop width (1280 px) and a phone's (390 px), failing where
something does not fit its screen.

    python tests/site_check.py [site] [--shots DIR]     # make site-check

Checked on each page and width:

- the page itself scrolls no wider than the window;
- every table fits its column (no sideways scroll hides a column), and no word in a
  table wraps inside itself (``checkpoin|t``), nor code at a hyphen (``mlp-/train``):
  a word of prose may wrap after its hyphen (``data-|dependent``);
- every figure is loaded and drawn inside the column;
- at the desktop width, every code block fits its box (no sideways scroll).

A code block on a phone scrolls sideways, as on every documentation site; its lines are
kept within the desktop's width by ``tests/test_doc_widths.py``. ``--shots DIR`` saves a
screenshot of every page at each width (``<page>-<width>.png``).

Needs Chromium and its driver (Debian's ``chromium`` and ``chromium-driver``, which
``make site-check`` installs) and selenium (the ``docs`` extra).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

WIDTHS = {"desktop": 1280, "phone": 390}

# Run in the page: what does not fit, one line each.
CHECK = r"""
const desktop = arguments[0];
const out = [];
const W = document.documentElement.clientWidth;
const page = document.documentElement.scrollWidth;
if (page > W + 1) out.push(`the page is ${page} px wide in a ${W} px window`);
const lines = (range) =>
  new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size;
// Whether a word of prose that wraps does so only after its hyphens (data-dependent).
const atHyphens = (node, m) => {
  let start = m.index;
  for (const piece of m[0].split(/(?<=-)/)) {
    const range = document.createRange();
    range.setStart(node, start);
    range.setEnd(node, start + piece.length);
    if (lines(range) > 1) return false;
    start += piece.length;
  }
  return true;
};
const name = (el) => (el.innerText || "").trim().split("\n")[0].slice(0, 50);
document.querySelectorAll("article table").forEach((t, i) => {
  const wrap = t.closest(".md-typeset__scrollwrap") || t.parentElement;
  if (t.scrollWidth > wrap.clientWidth + 1)
    out.push(`table ${i + 1} (${name(t)}): ${t.scrollWidth} px in a ${wrap.clientWidth} px column`);
  const walker = document.createTreeWalker(t, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const m of node.data.matchAll(/\S+/g)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      if (lines(range) > 1 && (node.parentElement.closest("code") || !atHyphens(node, m)))
        out.push(`table ${i + 1} (${name(t)}): "${m[0]}" wraps inside the word`);
    }
  }
});
const article = document.querySelector("article").getBoundingClientRect();
document.querySelectorAll("article img").forEach((img) => {
  const r = img.getBoundingClientRect();
  if (!img.complete || img.naturalWidth === 0) out.push(`figure ${img.src} did not load`);
  else if (r.left < article.left - 1 || r.right > article.right + 1) {
    const [w, column] = [Math.round(r.width), Math.round(article.width)];
    out.push(`figure ${img.src}: ${w} px, outside the ${column} px column`);
  }
});
if (desktop)
  document.querySelectorAll("article pre > code").forEach((c, i) => {
    if (c.scrollWidth > c.clientWidth + 1)
      out.push(`code block ${i + 1} (${name(c)}): ${c.scrollWidth} px in ${c.clientWidth} px`);
  });
return out;
"""


def driver(width: int):  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary:
        options.binary_location = binary
    found = shutil.which("chromedriver")
    service = Service(found) if found else Service()
    browser = webdriver.Chrome(options=options, service=service)
    screen(browser, width, 900)
    return browser


def screen(browser, width: int, height: int) -> None:  # type: ignore[no-untyped-def]
    """The page's viewport, exactly (a window cannot be narrower than 500 px; a phone's
    is emulated, as Chromium's device mode does)."""
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
    )


def check(site: pathlib.Path, shots: pathlib.Path | None) -> list[str]:
    pages = sorted(site.rglob("*.html"))
    pages = [p for p in pages if p.name != "404.html"]
    if not pages:
        raise SystemExit(f"no pages under {site}: build the guide first (make docs)")
    problems = []
    for label, width in WIDTHS.items():
        browser = driver(width)
        try:
            for page in pages:
                browser.get(page.resolve().as_uri())
                browser.execute_script("return document.fonts.ready")
                name = (
                    str(page.relative_to(site).parent) if page.name == "index.html" else page.stem
                )
                name = "home" if name == "." else name
                for line in browser.execute_script(CHECK, label == "desktop"):
                    problems.append(f"{name} at {width} px ({label}): {line}")
                if shots is not None:
                    height = browser.execute_script("return document.body.scrollHeight")
                    screen(browser, width, min(int(height), 16000))
                    browser.save_screenshot(str(shots / f"{name.replace('/', '-')}-{width}.png"))
                    screen(browser, width, 900)
        finally:
            browser.quit()
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default="site", type=pathlib.Path)
    parser.add_argument("--shots", type=pathlib.Path, help="save a screenshot of each page")
    args = parser.parse_args()
    if args.shots is not None:
        args.shots.mkdir(parents=True, exist_ok=True)
    problems = check(args.site, args.shots)
    pages = len([p for p in args.site.rglob("*.html") if p.name != "404.html"])
    if problems:
        print("\n".join(problems))
        print(f"{len(problems)} problem(s) on {pages} page(s) at {len(WIDTHS)} widths")
        sys.exit(1)
    print(f"{pages} page(s) fit their screen at {', '.join(f'{w} px' for w in WIDTHS.values())}")


if __name__ == "__main__":
    main()
