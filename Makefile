# The two commands of the README, and their parts.
.PHONY: setup demo test test-fast bench

setup:
	bash scripts/setup.sh

# Install everything, then run the default experiment with flwr run (a few minutes on 2 cores).
demo: setup
	.venv/bin/fedmech run experiments/default.yaml

# The test suite (what .ci/run calls).
test:
	.venv/bin/python -m pytest -q

# The inner loop: unit and in-process tests, no real Flower/Ray launch and no big dataset.
test-fast:
	.venv/bin/python -m pytest -q -m "not integration"

bench:
	.venv/bin/python benchmarks/throughput.py
