"""The docs site: it builds strictly, its generated reference matches the code, and a reader's
browser shows every page without a console error or a broken image.

The browser is Debian's headless ``chromium`` driven by selenium (pinned in the ``docs``
extra) through ``chromedriver``: selenium starts and stops the driver, and its log API gives
the page's console messages, which plain CDP would need a websocket client and hand-written
protocol calls for. ``make browser`` (run by ``make test``) installs both packages.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dapo.config.fields import hints
from dapo.config.loading import all_keys
from dapo.config.schema import Config
from dapo.metrics.registry import METRICS

ROOT = Path(__file__).resolve().parent.parent
# The screenshots docs/development.md shows: refreshed with DAPO_SCREENSHOTS=docs/screenshots,
# else written to the test's temporary folder (a test run leaves the working tree as it was).
SCREENSHOTS_ENV = "DAPO_SCREENSHOTS"
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="the docs extra: pip install -e '.[docs]'"
)


def _reference() -> object:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _build(out: str) -> Path:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return Path(out)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs extra: pip install -e '.[docs]'")
    return _build(str(tmp_path_factory.mktemp("site")))


def _leaf_keys() -> list[str]:
    sections = set()

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                sections.add(prefix + f.name)
                walk(tp, prefix + f.name + ".")

    walk(Config, "")
    return [k for k in all_keys() if k not in sections]


def test_the_config_reference_has_every_key_with_its_paper_value_and_aliases() -> None:
    page = _reference().config_reference()
    keys = _leaf_keys()
    assert len(keys) > 100
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing
    # The paper's value and the TRL/verl names are in the key's own row.
    row = next(line for line in page.splitlines() if line.startswith("| `algorithm.clip_high` |"))
    assert "`0.28`" in row and "`epsilon_high`" in row and "`clip_ratio_high`" in row
    row = next(line for line in page.splitlines() if line.startswith("| `train.lr` |"))
    assert "`1e-6`" in row and "`learning_rate`" in row
    assert "one of `token-mean`" in page  # a Literal's choices


def test_the_metrics_reference_lists_the_registry_and_the_cli_reference_every_command() -> None:
    ref = _reference()
    page = ref.metrics_reference()
    assert all(f"| `{m.key}` |" in page for m in METRICS)
    cli_page = ref.cli_reference()
    # Every command `dapo --help` lists has its section (a new command added to the CLI
    # without its reference page fails here).
    usage = cli_page.split("usage: dapo {", 1)[1].split("}", 1)[0]
    assert ref.CLI_COMMANDS == (
        "train",
        "eval",
        "presets",
        "plot",
        "compare",
        "show",
        "verify",
        "vllm-serve",
    )
    assert set(usage.split(",")) == set(ref.CLI_COMMANDS)
    assert "usage: dapo show" in cli_page and "--last" in cli_page
    for command in ref.CLI_COMMANDS:
        assert f"## `dapo {command}`" in cli_page
    assert "--tensor-parallel-size" in cli_page and "--max-tokens" in cli_page
    assert "usage: dapo eval" in cli_page


@needs_mkdocs
def test_the_site_builds_strictly_with_the_generated_pages(site: Path) -> None:
    for page in ("index", "getting-started", "reference/config", "reference/metrics"):
        assert (site / f"{page}.html").is_file()
    api = (site / "reference" / "api.html").read_text()
    assert 'id="dapo.api.train"' in api  # mkdocstrings rendered the docstrings
    assert ":func:" not in api and ":class:" not in api  # the Sphinx roles are dropped
    algorithm = (site / "concepts" / "algorithm.html").read_text()
    assert "api.html#dapo.algorithms.aggregation.aggregate_loss" in algorithm
    # Offline: no page asks the web for fonts or scripts.
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, html


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("the docs extra")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "getting-started.md").open("a") as f:
        f.write("\n[gone](guides/no-such-page.md)\n")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode != 0 and "no-such-page.md" in done.stderr


# --------------------------------------------------------------------------- the browser


@pytest.fixture
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def _chromium(profile: Path):  # noqa: ANN202 - selenium is optional
    webdriver = pytest.importorskip("selenium.webdriver", reason="the docs extra (selenium)")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver: make browser")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


BROKEN_IMAGES = (
    "return Array.from(document.images)"
    ".filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"
)


@pytest.mark.slow
def test_every_page_loads_in_chromium_without_errors(
    site: Path, served: str, tmp_path: Path
) -> None:
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    pages = [p for p in pages if p != "404.html"]
    assert "guides/python-api.html" in pages and len(pages) > 20
    browser = _chromium(tmp_path / "profile")
    problems: list[str] = []
    try:
        for page in pages:
            browser.get(f"{served}/{page}")
            browser.execute_script("return document.readyState")
            for entry in browser.get_log("browser"):
                if entry["level"] in ("SEVERE", "ERROR"):
                    problems.append(f"{page}: console: {entry['message']}")
            problems += [
                f"{page}: broken image {src}" for src in browser.execute_script(BROKEN_IMAGES)
            ]
            if page in ("index.html", "guides/python-api.html"):
                shots = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path / "screenshots")
                shots.mkdir(parents=True, exist_ok=True)
                name = "home.png" if page == "index.html" else "guide-python-api.png"
                assert browser.save_screenshot(str(shots / name))
                assert (shots / name).stat().st_size > 10_000  # a rendered page, not a blank
        # The check itself: a page with a missing image and a script error is caught.
        bad = site / "broken-check.html"
        bad.write_text('<img src="no-such.png"><script>undefined_function()</script>')
        browser.get(f"{served}/broken-check.html")
        caught = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert any("undefined_function" in e["message"] for e in caught)
        assert browser.execute_script(BROKEN_IMAGES)
        bad.unlink()
    finally:
        browser.quit()
    assert not problems, "\n".join(problems)
