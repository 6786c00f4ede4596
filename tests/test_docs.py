"""The documentation site: its generated reference pages are those the code declares now,
and it builds with ``mkdocs build --strict`` (no broken link or anchor, every page in the
nav). What its pages show runs as shown: tests/test_docs_snippets.py."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO
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


def test_the_site_builds_strictly(tmp_path):
    """Every page in the nav, every link and anchor found (mkdocs-material, pinned in the
    ``docs`` extra: ``pip install -e '.[docs]'``, which ``make setup`` does)."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed (run `make docs` to see it):\n{proc.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "configuration.html").is_file()
