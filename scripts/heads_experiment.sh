#!/usr/bin/env bash
# Heads as modules, docs/results.md: (a) the embedded MiniLM's vertical heads replaced by
# band(window=4), against as many random non-vertical heads replaced, against the baseline;
# (c) wo_sparse and mae against full fine-tuning. CoLA and MRPC, seeds 0-2, the quickstart
# recipe (3 epochs; MRPC at max_length 128; one epoch leaves most seeds predicting one
# class). Head classes from the pretrained model on each task's dev split. Re-running
# continues (compare --resume). TASKS="cola" and TASKS="mrpc" may run side by side (one
# process each, one thread by default); PARTS="a" or "c" runs one part.
#   [TASKS="cola mrpc"] [PARTS="a c"] bash scripts/heads_experiment.sh [OUT] [PARALLEL]
#   (default OUT runs/heads-exp, PARALLEL 1)
set -euo pipefail
out=${1:-runs/heads-exp}
par=${2:-1}
bin=${ATTNLAB:-attnlab}
py=${PYTHON:-python}
data=${DATA:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$out"
tasks=${TASKS:-cola mrpc}
parts=${PARTS:-a c}
declare -A extra=([cola]="" [mrpc]="model.max_length=128 train.eval_every=58")
if [[ " $parts " == *" a "* ]]; then for task in $tasks; do
  "$bin" analyze heads --task "$task" --data-dir "$data" --out "$out/heads-$task" > /dev/null
  random=$("$py" scripts/random_heads.py "$out/heads-$task" --seed 0)
  # shellcheck disable=SC2086
  "$bin" compare configs/quickstart.yaml "name=$task-heads" "task.name=$task" \
    "task.data_dir=$data" "output_dir=$out" "analysis=$out/heads-$task" ${extra[$task]} \
    --vary "plan=baseline|all:class:vertical:band(window=4)|$random" --seeds 3 \
    --parallel "$par" --resume
done; fi
if [[ " $parts " == *" c "* ]]; then for task in $tasks; do
  # shellcheck disable=SC2086
  "$bin" compare configs/quickstart.yaml "name=$task-tuners" "task.name=$task" \
    "task.data_dir=$data" "output_dir=$out" ${extra[$task]} \
    --vary "tuning.method=wo_sparse,mae" --seeds 3 --parallel "$par" --resume
done; fi
