# The two commands of the README, and their parts.
.PHONY: setup demo test test-fast bench mutation docs docs-serve

setup:
	bash scripts/setup.sh

# Install everything, then run the default job beside its IID control (experiments/demo.yaml):
# a verdict on the console, and a page per run (4 min 37 s on 2 cores, install included).
demo: setup
	.venv/bin/fedmech sweep experiments/demo.yaml

# The test suite (what .ci/run calls), four tests at a time: the real launches spend much
# of their time waiting on other processes.
test:
	.venv/bin/python -m pytest -q -n 4 --dist worksteal

# The inner loop: unit and in-process tests, no real Flower/Ray launch and no big dataset,
# one worker per core.
test-fast:
	.venv/bin/python -m pytest -q -n auto -m "not integration"

bench:
	.venv/bin/python benchmarks/throughput.py

# The mutation runs of the FL methods' update rules (docs/results/mutation.md). First the
# catalogue of semantic (researcher-style) mutants, each applied in memory against the fast
# tests that must catch it; then mutmut, in a copy of the tree laid out as a wheel installs it
# (clients/ and strategies/ under fedmech_flwr/builtin/), so that mutmut's module names are
# those the tests import; `mutmut results` there lists survivors.
mutation:
	.venv/bin/pip install -q -e '.[dev]'
	nice -n 19 .venv/bin/python benchmarks/semantic_mutants.py
	rm -rf build/mutation && mkdir -p build/mutation/fedmech_flwr/builtin
	cp -r fedmech_flwr tests experiments pyproject.toml build/mutation/
	cp -r clients strategies diagnostics build/mutation/fedmech_flwr/builtin/
	cd build/mutation && nice -n 19 ../../.venv/bin/mutmut run --max-children 1

# The documentation site: regenerate the reference pages from the code, then build it into
# site/ (open site/index.html: the pages without search; `make docs-serve` has it); --strict
# fails on a broken link or anchor.
docs:
	.venv/bin/python -m fedmech_flwr.tools.reference
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict

# The site, live at http://127.0.0.1:8000, rebuilt as pages change.
docs-serve:
	.venv/bin/python -m fedmech_flwr.tools.reference
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs serve
