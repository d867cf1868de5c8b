"""Build the documentation site and check it in a real browser: every page opened in headless Chromium.

    python -m pip install -e ".[docs]"; apt-get install chromium      # once
    python docs/check_site.py [--screenshots DIR]

Builds with ``mkdocs build --strict`` (a broken link, a missing file or a page left out of the nav fails), serves
the site on a local port with nothing else reachable, and opens every page: no console error, no failed request
(every asset is served by the site itself: no CDN), every image loaded (naturalWidth > 0), every internal link
resolving to a page that exists (and to an anchor on it), the math rendered by KaTeX wherever the page has some.
Prints one line per page and exits non-zero on the first page that fails, naming it and what failed.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def build(site: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if run.returncode != 0:
        raise SystemExit(f"mkdocs build --strict failed:\n{run.stdout}{run.stderr}")


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def check_page(page, url: str, site: Path, base: str) -> list[str]:
    """What is wrong with the page at ``url`` (nothing: [])."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.goto(url, wait_until="networkidle")
    for src in page.eval_on_selector_all("img", "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0))"
                                                ".map(i => i.src)"):
        problems.append(f"image not loaded: {src}")
    for href in page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)"):
        if not href.startswith(base):
            continue  # another site: not fetched (the check runs offline)
        parsed = urllib.parse.urlparse(href)
        target = site / urllib.parse.unquote(parsed.path[1:])
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            problems.append(f"link to a missing page: {href}")
        elif parsed.fragment and target.suffix == ".html" and \
                f'id="{parsed.fragment}"' not in target.read_text(encoding="utf-8"):
            problems.append(f"link to a missing anchor: {href}")
    math = page.eval_on_selector_all(".arithmatex", "els => els.length")
    rendered = page.eval_on_selector_all(".arithmatex .katex", "els => els.length")
    if math and rendered < math:
        problems.append(f"math: {rendered} of {math} formulas rendered")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--screenshots", metavar="DIR", help="also save a full-page PNG of every page here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = next((c for c in CHROMIUM if os.path.exists(c)), None)
    if chromium is None:
        raise SystemExit("no Chromium found (apt-get install chromium)")
    site = Path(tempfile.mkdtemp(prefix="minipar-site-"))
    try:
        build(site)
        server, base = serve(site)
        pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
        failed = 0
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            for name in pages:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                problems = check_page(page, base + name, site, base)
                if args.screenshots:
                    os.makedirs(args.screenshots, exist_ok=True)
                    page.screenshot(path=os.path.join(args.screenshots, name.replace("/", "_") + ".png"), full_page=True)
                page.close()
                print(f"{'ok  ' if not problems else 'FAIL'} {name}" + "".join(f"\n     {p}" for p in problems),
                      flush=True)
                failed += bool(problems)
            browser.close()
        server.shutdown()
        print(f"{len(pages) - failed} of {len(pages)} pages passed in Chromium")
        if failed:
            raise SystemExit(1)
    finally:
        shutil.rmtree(site, ignore_errors=True)


if __name__ == "__main__":
    main()
