#!/usr/bin/env bash
# The GPU path, measured on a machine with an NVIDIA GPU after `make setup`, in at most
# 8 minutes (each step has its own time budget, and a step that overruns is stopped):
#
#   0. the GPU, as nvidia-smi and torch see it (none: exit 2 before any step);
#   1. local training on CUDA: a bare PyTorch loop, the engine, and the engine in Flower
#      (benchmarks/throughput.py --device cuda);
#   2. one CIFAR-10 cell of the v2 grid (experiments/paper/v2_misalignment.yaml, cell
#      cifar10_cnn_iid_s0) at its gpu preset, 4 clients per GPU (gpus_per_client 0.25),
#      cut to 3 rounds with its diagnostics after the last: how many clients trained at
#      once, and the circuits diagnostic's cost against the round's training
#      (benchmarks/circuits_round.py's table);
#   3. circuit discovery at the paper's setting, all 10 classes at once vs one class
#      after another (benchmarks/circuits.py --steps 300 --all-steps, on CUDA).
#
# Every figure is a ratio measured in this run. Run folders and logs stay in the folder the
# summary names. What has run on a GPU so far: docs/how-to/gpu.md.
#
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "error: no $PY in $(pwd); run make setup first" >&2
  exit 2
fi

# --- 0. the GPU ----------------------------------------------------------------------------
if ! TORCH_GPU=$("$PY" -c '
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}): {torch.cuda.device_count()} GPU(s); "
      f"GPU 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
' 2>&1); then
  SMI=$(nvidia-smi -L 2>/dev/null | head -n 1 || true)
  echo "error: ${TORCH_GPU##*$'\n'} (nvidia-smi: ${SMI:-not found}); this script measures the GPU path:" \
       "run it on a machine with an NVIDIA GPU (a driver new enough for that CUDA) after make setup" >&2
  exit 2
fi
echo "== the GPU"
nvidia-smi || echo "(nvidia-smi failed; torch's view below)"
echo "$TORCH_GPU"

OUT=$(mktemp -d "${TMPDIR:-/tmp}/fedmech-gpu-check-XXXXXX")
export FEDMECH_OUT="$OUT"
NAMES=() RESULTS=() SHOWN=()
TOTAL_STEPS=3

# step NAME SECONDS SUMMARY_LINES COMMAND...: run COMMAND within SECONDS, its output also in
# $OUT/step-N.log; the summary repeats its last SUMMARY_LINES lines (its table).
step() {
  local name=$1 budget=$2 lines=$3 n=$((${#NAMES[@]} + 1)) start=$SECONDS rc=0
  shift 3
  echo
  echo "== [$n/$TOTAL_STEPS] $name (at most ${budget}s)"
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$OUT/step-$n.log" || rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  case $rc in
    0) RESULTS+=("ok, ${took}s") ;;
    124 | 137) RESULTS+=("TIMED OUT after ${budget}s") ;;
    *) RESULTS+=("FAILED (exit $rc) after ${took}s") ;;
  esac
  NAMES+=("$name")
  SHOWN+=("$([ "$rc" = 0 ] && tail -n "$lines" "$OUT/step-$n.log" || echo "see $OUT/step-$n.log")")
}

# --- 2's driver: the cell's own overrides from the sweep file, then fewer rounds -----------
CELL_PY=$(cat <<'EOF'
import subprocess, sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from circuits_round import print_table, round_parts
from fedmech_flwr.spec.config import override
from fedmech_flwr.foundation.errors import ConfigError
from fedmech_flwr.artifacts.folder import read_records
from fedmech_flwr.tools.sweep import load_sweep

out, preset, rounds, extra = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
try:
    plan = load_sweep("experiments/paper/v2_misalignment.yaml", preset, [0],
                      {"data.dataset": ["cifar10"], "model": ["cnn"]})
except ConfigError as err:  # CIFAR-10 absent: the loader says where it looked and where to put it
    sys.exit(f"the cell cannot start: {err}")
cell = next(c for c in plan.cells if c.name == "cifar10_cnn_iid_s0")
last = [{**{k: v for k, v in d.items() if k != "every"}, "rounds": [rounds]}
        for d in cell.config.to_plain()["diagnostics"]]
sets = [*cell.overrides, f"federation.num_rounds={rounds}", override("diagnostics", last), *extra]
cmd = [sys.executable, "-m", "fedmech_flwr.tools.cli", "run", str(plan.base), "--out", str(out)]
if subprocess.run(cmd + [x for s in sets for x in ("--set", s)]).returncode:
    sys.exit("the cell failed: see its output above")
(run,) = out.iterdir()
clients = read_records(run, "client")
share = cell.config.simulation.gpus_per_client
print(f"\ncell {cell.name}, {preset} preset, {rounds} rounds: the clients' training seconds over the round's "
      f"(how many trained at once{f'; at most {1 / share:.0f} per GPU' if share else ''})")
print(f"{'round':>5} {'round s':>9} {'clients training s':>19} {'ratio':>7}")
for e in read_records(run, "eval"):
    if e["round"] > 0:
        train = sum(c["train_seconds"] for c in clients if c["round"] == e["round"])
        seconds = e["train_round_seconds"]
        print(f"{e['round']:>5} {seconds:>9.1f} {train:>19.1f} {train / seconds:>7.2f}")
print("the circuits diagnostic (its gates as the preset sets them) against the round's training:")
print_table(round_parts(run))
EOF
)

step "local training on CUDA: bare PyTorch vs the engine vs in Flower" 110 5 \
  "$PY" benchmarks/throughput.py --device cuda
step "a CIFAR-10 cell of the v2 grid, gpu preset, 4 clients per GPU, 3 rounds" 270 8 \
  "$PY" -c "$CELL_PY" "$OUT/cell" gpu 3
step "circuit discovery at the paper's setting on CUDA" 60 5 \
  "$PY" benchmarks/circuits.py --device cuda --steps 300 --all-steps

echo
echo "== summary: $TORCH_GPU; ${SECONDS}s in all; logs and run folders in $OUT"
failed=0
for i in "${!NAMES[@]}"; do
  echo "[$((i + 1))/$TOTAL_STEPS] ${NAMES[$i]}: ${RESULTS[$i]}"
  echo "${SHOWN[$i]}" | sed 's/^/    /'
  [[ ${RESULTS[$i]} == ok* ]] || failed=1
done
exit "$failed"
