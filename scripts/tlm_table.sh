#!/usr/bin/env bash
# The TLM table of docs/results.md ("TLM on CoLA and SST-2"): a small random BERT trained
# from scratch with external = bm25 (TLM) | random (as many random passages) | none (task
# data only), at equal steps, seeds 0-2, two runs at a time with one thread each (2-core CPU).
# Re-running continues: finished runs are skipped, interrupted ones resume.
#   bash scripts/tlm_table.sh [OUT]        (default OUT: runs/tlm-table)
set -euo pipefail
out=${1:-runs/tlm-table}
bin=${ATTNLAB:-attnlab}
mkdir -p "$out"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for task in cola sst2; do
  "$bin" tlm retrieve "configs/tlm_$task.yaml" "output_dir=$out"
done
one() {  # task seed external
  local dir="$out/tlm-$1/$3/seed-$2" extra=()
  [[ -f "$dir/summary.json" ]] && grep -q '"finished"' "$dir/summary.json" && return 0
  [[ -d "$dir" ]] && extra=(--resume)
  "$bin" tlm train "configs/tlm_$1.yaml" "seed=$2" "external=$3" "output_dir=$out" \
    "${extra[@]}" > "$out/log-$1-$3-$2.txt" 2>&1
}
export -f one; export out bin
for task in cola sst2; do for seed in 0 1 2; do for ext in bm25 random none; do
  echo "$task $seed $ext"; done; done; done | xargs -P 2 -L 1 bash -c 'one "$@"' _
for task in cola sst2; do
  "$bin" collect "$out/tlm-$task" --out "$out/table-$task"
done
