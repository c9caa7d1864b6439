#!/usr/bin/env bash
# The checks and benchmarks that need a CUDA GPU, in one run of at most DEADLINE seconds
# (default 540): the CUDA tests, then the GPU sections of docs/benchmarks.md, then one
# short `bench lra --device cuda` (steps: tests sparse lra jat lra4k). Each step gets what
# is left of the deadline, so a slow step cannot starve the ones before it; a step cut
# off leaves its partial output.
#
#   bash scripts/gpu_checks.sh OUT_DIR      # from the repository root, on the GPU machine
#   STEPS="tests lra" bash scripts/gpu_checks.sh OUT_DIR   # some steps only
#
# Runs from a tree without installing it (PYTHONPATH=src); a copied tree names its commit
# in ATTNLAB_GIT_COMMIT. Logs and results land in OUT_DIR (results.tgz holds the
# recorded docs/bench/<id>/ folders, to be copied back before `bench record --render-only`).
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
end=$(( $(date +%s) + ${DEADLINE:-540} ))
left() { local s=$(( end - $(date +%s) )); (( s > $1 )) && echo "$1" || echo $(( s > 5 ? s : 5 )); }
py=$(command -v python3 || command -v python)

{ nvidia-smi -L; "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$out/env.log"

step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  [[ " ${STEPS:-tests sparse lra jat lra4k} " == *" $name "* ]] || return 0
  local t; t=$(left "$max")
  echo "== $name (timeout ${t}s): $*" | tee -a "$out/steps.log"
  local s0; s0=$(date +%s)
  timeout "$t" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? after $(( $(date +%s) - s0 ))s" | tee -a "$out/steps.log"
  tail -n 25 "$out/$name.log"
  tar czf "$out/results.tgz" docs/bench/*cuda* runs/lra-cuda 2>/dev/null  # after each step
}

xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n 8")
step tests 180 "$py" -m pytest -q -p no:cacheprovider $xdist tests/mechanisms/test_cuda.py \
  tests/mechanisms/test_sparse_flex.py -k cuda
step sparse 160 "$py" -m attnlab bench record --only sparse-cuda --rerun
step lra 150 "$py" -m attnlab bench lra --device cuda \
  --mechanisms "softmax,band,linear_elu,mega(chunk=128)" --task listops --length 512 \
  --steps 20 --batch-size 8 --eval-size 64 --out runs/lra-cuda
step jat 100 "$py" -m attnlab bench record --only jat-cuda --rerun
step lra4k 330 "$py" -m attnlab bench record --only lra-4k-cost-cuda --rerun
ls -la "$out"
