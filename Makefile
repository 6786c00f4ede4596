# The two commands of the README, and their parts.
.PHONY: setup demo test test-fast bench

setup:
	bash scripts/setup.sh

# Install everything, then run the default experiment with flwr run (a few minutes on 2 cores).
demo: setup
	.venv/bin/fedmech run experiments/default.yaml

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
