"""The documentation site: its generated reference pages are those the code declares now,
it builds with ``mkdocs build --strict`` (no broken link or anchor, every page in the
nav), and its search finds pages where the README says to read it (``make docs-serve``).
What its pages show runs as shown: tests/test_docs_snippets.py."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading

import pytest

from conftest import CHROMIUM, REPO, browser_page
from fedmech_flwr.tools import reference


def test_the_generated_reference_pages_are_up_to_date():
    """In a fresh interpreter: other tests in this process register plug-ins of their own."""
    done = subprocess.run([sys.executable, "-m", "fedmech_flwr.tools.reference", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (f"docs/reference/ is out of date ({(done.stdout + done.stderr).strip()}): the config docstrings, the "
                                  f"registered plug-ins or the CLI changed. Regenerate the pages: `{reference.COMMAND}` "
                                  "(or `make docs`), and commit them")


def test_the_reference_names_every_registered_plugin_and_config_section():
    pages = reference.pages()
    for name in ("fedavg", "scaffold", "misalignment", "circuits", "simple_cnn", "dirichlet", "fashion_mnist"):
        assert f"### `{name}`" in pages["plugins.md"]
    for key in ("`federation.num_clients`", "`simulation.ray_address`", "`train.max_samples_per_round`",
                "`pruning.target_sparsity`", "`data.audit_per_class`"):
        assert key in pages["configuration.md"]
    assert "## sweep {#sweep}" in pages["cli.md"] and "```yaml\nbase: ../misalignment_fmnist.yaml" in pages["files.md"]


def test_check_mode_names_the_stale_page_and_the_command(tmp_path, capsys):
    reference.write(tmp_path)
    assert reference.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "plugins.md").write_text("edited by hand\n")
    assert reference.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "plugins.md" in err and reference.COMMAND in err


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as ``make docs`` builds it: strictly, into a folder of this test's."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed (run `make docs` to see it):\n{proc.stderr[-4000:]}"
    return out


def test_the_site_builds_strictly(site):
    """Every page in the nav, every link and anchor found (mkdocs-material, pinned in the
    ``docs`` extra: ``pip install -e '.[docs]'``, which ``make setup`` does)."""
    assert (site / "index.html").is_file()
    assert (site / "reference" / "configuration.html").is_file()


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="the page tests open pages in Debian's Chromium")
def test_search_finds_pages_on_the_served_site(site):
    """Served over HTTP, as ``make docs-serve`` serves it (the README's way to read it:
    Material hides its search on a page opened from the file system), typing a word in the
    search box lists the pages that hold it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with browser_page() as page:
            page.set_viewport_size({"width": 1400, "height": 900})
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
            page.locator("input.md-search__input").click()
            page.keyboard.type("resume")
            page.wait_for_selector(".md-search-result__item", timeout=30000)
            found = [a.get_attribute("href") for a in page.locator(".md-search-result__item a").all()]
    finally:
        server.shutdown()
    assert any("how-to/running.html" in href for href in found), found  # "Run and resume"
