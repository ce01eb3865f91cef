#!/usr/bin/env bash
# gtx on one CUDA GPU, in one go: the `cuda` test suite, then attention and training cells beside
# plain torch (SDPA is_causal, FlexAttention called directly) and the attention-free ceiling
# (bench/gpu_cells.py, every row in one process). Each phase writes its logs and CSVs into OUT and has a time
# limit, so that a phase that runs long costs only itself.
#
#   bash bench/gpu.sh OUT [PHASES]      PHASES: comma-separated, default tests,cells (about 5 minutes);
#                                       attention, train: `gtx bench attention` and `gtx bench train`
#                                       (a process per row, each compiling again: minutes; their CSVs
#                                       gathered in OUT/attention.csv, OUT/train.csv); frontier: the
#                                       recall frontier (its own call)
#
# Runs from a checkout without installing it (PYTHONPATH), on the machine's own torch; dgl is not
# needed (its backends report themselves unavailable). Environment: LENGTHS (attention, default
# 4096,16384), LONG (one more length for the sparse patterns, default 65536; empty: none), PATTERNS
# (separated by ';'), TRAIN_RUNS (precision:length pairs, default every pair of float32 or bfloat16
# and 4096 or 16384; the last also measures peak memory), BASELINE (train: --baseline adds the
# plain-torch rows, default --no-baseline), FRONTIER_LENGTHS (default 1024: about 6 minutes on an H200),
# FRONTIER_FAMILIES (separated by ';'), FRONTIER_SEEDS (default 0-2), FRONTIER_SETTINGS (the runs'
# options), FRONTIER_JOBS (cells at once on the card, default 8), FRONTIER_FROM (a results folder of an
# earlier frontier's runs, copied into OUT/f first: its finished cells are kept, the rest run), and seconds per command:
# TRAIN_CELLS (bench/gpu_cells.py train's rows), TESTS_LIMIT, CELLS_LIMIT (each of two), ATTENTION_LIMIT (per pattern), TRAIN_LIMIT (per run), FRONTIER_LIMIT (per length).
set -uo pipefail
out=$(realpath -m "${1:?usage: bash bench/gpu.sh OUT [PHASES]}")
phases=${2:-tests,cells}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 GTX_LOAD_PLUGINS=""
py=${PYTHON:-python3}
has() { [[ ",$phases," == *",$1,"* ]]; }
started=$SECONDS
stamp() { echo "== $1 ($((SECONDS - started)) s)"; }

stamp "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
  # the commit, and how many files differ from it (a copied working tree may carry an older .git)
  echo "commit $(git rev-parse HEAD 2>/dev/null) with $(git status --porcelain 2>/dev/null | wc -l) files changed"
  date -u +'date %F %T UTC'; } 2>&1 | tee "$out/machine.txt"

if has tests; then
  stamp "cuda tests"
  rm -f "$out/cuda-errors.csv"
  GTX_CUDA_REPORT="$out/cuda-errors.csv" timeout "${TESTS_LIMIT:-240}" "$py" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider \
    -v --durations=8 2>&1 | tee "$out/cuda-tests.log" | grep -v PASSED | tail -40
fi

if has cells; then
  stamp "attention cells"
  timeout "${CELLS_LIMIT:-150}" "$py" bench/gpu_cells.py attention --csv "$out/attention-cells.csv" 2>&1 | grep -v Warning | tee "$out/attention-cells.log"
  stamp "training cells"  # docs/gpu.md's training table; p: a profile of that row
  timeout "${CELLS_LIMIT:-150}" "$py" bench/gpu_cells.py train --csv "$out/train-cells.csv" ${TRAIN_CELLS:-none/float32/- local:w=256/float32/- none/bfloat16/- \
    local:w=256/bfloat16/- moba:b=64,k=4/bfloat16/p nsa/bfloat16/p dsa:dense=0/bfloat16/-} > "$out/train-cells.log" 2>&1
  grep -E "^TRAIN|done" "$out/train-cells.log"
fi

if has attention; then
  lengths=${LENGTHS:-4096,16384}
  long=${LONG-65536}
  IFS=';' read -ra patterns <<< "${PATTERNS:-causal;local:w=256;bigbird;local:w=128|strided:l=128}"
  for pattern in "${patterns[@]}"; do
    stamp "bench attention: $pattern"
    n=$lengths; [[ $pattern != causal ]] && n="$lengths${long:+,$long}"  # causal's edges at 65536 would be 2^31 pairs
    timeout "${ATTENTION_LIMIT:-120}" "$py" -m gtx.cli bench attention --pattern "$pattern" --lengths "$n" \
      --backends sdpa,auto,flex,flexattention --no-plot --format csv --results "$out/r" >> "$out/attention.log" 2>&1
    pkill -f gtx.measure.bench  # a cell a timeout left running
  done
  grep -h " ms " "$out/attention.log"
fi

if has train; then
  runs=${TRAIN_RUNS:-float32:4096 float32:16384 bfloat16:4096 bfloat16:16384}
  for run in $runs; do
    precision=${run%:*} n=${run#*:}
    stamp "bench train: $precision, $n tokens"
    memory=--no-memory  # peak memory (a fresh process per row) where it matters: the last run
    [[ $run == "${runs##* }" ]] && memory=--memory
    timeout "${TRAIN_LIMIT:-100}" "$py" -m gtx.cli bench train --task text --model lm --backends auto --steps 3 --rounds 2 $memory \
      ${BASELINE:---no-baseline} --set layers=2 --set heads=4 --set dim=128 --set dim_ff=512 --set batch_size=1 --set context="$n" \
      --set precision="$precision" --pattern causal --pattern local:w=256 --pattern moba:b=64,k=4 --pattern nsa --pattern dsa:dense=0 \
      --format csv --results "$out/r" > "$out/train-$precision-$n.log" 2>&1
    pkill -f gtx.measure.reference
    grep -v "^round" "$out/train-$precision-$n.log" | tail -14
  done
fi

if has frontier; then
  [[ -n ${FRONTIER_FROM:-} ]] && mkdir -p "$out/f" && cp -r "$FRONTIER_FROM"/. "$out/f"/
  IFS=';' read -ra families <<< "${FRONTIER_FAMILIES:-local:w=64,128,256;moba:b=64,k=2,4,8;nsa:n=4,8,16;dsa:k=64,128,256}"
  family_args=(); for f in "${families[@]}"; do family_args+=(--family "$f"); done
  IFS=',' read -ra flengths <<< "${FRONTIER_LENGTHS:-1024}"
  for n in "${flengths[@]}"; do  # one frontier per length: a length that runs out of time costs only itself
    stamp "frontier: $n tokens"
    # shellcheck disable=SC2086  # FRONTIER_SETTINGS is a list of options
    timeout "${FRONTIER_LIMIT:-420}" "$py" -m gtx.cli frontier --task recall --model lm --lengths "$n" "${family_args[@]}" \
      --seeds "${FRONTIER_SEEDS:-0-2}" ${FRONTIER_SETTINGS:---set n_train=512 --epochs 2 --batch-size 4 --dim 64 --heads 4 --dim-ff 128 --set dropout=0} \
      -j "${FRONTIER_JOBS:-8}" --format csv --results "$out/f" > "$out/frontier-$n.log" 2>&1
    echo "exit $?"; tail -4 "$out/frontier-$n.log"
  done
fi

# one CSV per benchmark kind, from the tables the commands saved
"$py" - "$out" <<'PY'
import glob, sys
import pandas as pd
for kind, pattern in (("attention", "r/bench/attention-*.csv"), ("train", "r/bench/train-*.csv"), ("frontier", "f/frontiers/*.csv")):
    tables = [pd.read_csv(p) for p in sorted(glob.glob(f"{sys.argv[1]}/{pattern}"))]
    if tables:
        pd.concat(tables).to_csv(f"{sys.argv[1]}/{kind}.csv", index=False)
PY
stamp "done"
