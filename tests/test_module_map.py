"""tests/MODULES.md, the map from each source module to its test files, is the generated
one, and every module has a test file or a reason for none (tests/module_map.py)."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO
from module_map import MAP_FILE, module_map, problems, render


def test_the_committed_map_is_generated_and_every_module_has_a_test_file():
    wrong = problems(REPO)
    assert not wrong, "\n".join(wrong)


def test_the_report_package_s_parts_are_mapped_to_test_report():
    found = module_map(REPO)
    for part in ("sections", "render", "comparisons"):
        assert "test_report.py" in found[f"fedmech_flwr.tools.report.{part}"]


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_each_rule_maps_a_module_and_a_stale_map_or_an_untested_module_fails(tmp_path):
    write(tmp_path, {
        "pyproject.toml": '[tool.setuptools]\npackages = ["pkg", "pkg.parts", "pkg.builtin"]\n'
                          '[tool.setuptools.package-dir]\n"pkg.builtin" = "plugins"\n',
        "pkg/__init__.py": '"""Only a docstring: not in the map."""\n',
        "pkg/imported.py": "",
        "pkg/patched.py": "",
        "pkg/lonely.py": "",
        "pkg/export.py": "",
        "pkg/parts/__init__.py": "from pkg.parts import page\n",
        "pkg/parts/page.py": "",
        "plugins/__init__.py": "",
        "plugins/median.py": 'STRATEGIES.register("median", object)\n',
        "tests/test_export.py": "",
        "tests/test_x.py": "from pkg import imported\nimport pkg.parts\n"
                           'PATCH = "pkg.patched.load_model"\nRUN = ["strategy.name=median"]\n',
    })
    assert module_map(tmp_path) == {
        "pkg.builtin.median": ["test_x.py"], "pkg.export": ["test_export.py"], "pkg.imported": ["test_x.py"],
        "pkg.lonely": [], "pkg.parts": ["test_x.py"], "pkg.parts.page": ["test_x.py"], "pkg.patched": ["test_x.py"]}

    untested = {"pkg.lonely": "a reason", "pkg.gone": "a module no more"}
    (tmp_path / MAP_FILE).write_text(render(module_map(tmp_path), untested))
    assert problems(tmp_path, untested) == ["UNTESTED names pkg.gone, which has a test file or is no module: remove it"]

    (tmp_path / "pkg/fresh.py").write_text("")
    assert problems(tmp_path, {"pkg.lonely": "a reason"}) == [
        "pkg.fresh has no test file: write one, or say why in UNTESTED (tests/module_map.py)",
        "tests/MODULES.md is not the generated map: run `python tests/module_map.py --write` and commit it"]
