"""One task, two attention mechanisms, one table: the runner behind ``attnlab compare``.

Fine-tunes the embedded all-MiniLM-L6-v2 on CoLA (the CoLA-format sample shipped in the
package) twice, once with the model's own softmax attention everywhere and once with band
attention (window 8) in every head, then prints the two dev metrics side by side. Each run
writes its folder (config.yaml, plan.json, metrics.jsonl, summary.json) under
``runs/compare_two_mechanisms/<variant>/seed-0/`` in the current folder, beside the table
(comparison.md, .csv, .png). The same from the command line:

    attnlab compare --vary 'plan=baseline|all:all:band(window=8)' --seeds 1 ...

    python examples/compare_two_mechanisms.py            # 4 epochs each on the 400 sentences
    python examples/compare_two_mechanisms.py --tiny     # a few steps each (CI)
"""

import argparse

from attnlab.config import load_config
from attnlab.recipes.compare import run_compare
from attnlab.recipes.finetune import run_experiment
from attnlab.recipes.rundir import fresh_run

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="CI size: 48 sentences, 3 steps a run")
args = parser.parse_args()

tiny = ["task.train_limit=48", "task.eval_limit=32", "train.max_steps=3"]
cfg = load_config(base={  # the same keys as a YAML file under configs/
    "name": "compare_two_mechanisms",
    "model": {"name": "default", "max_length": 64},  # "default": the embedded MiniLM
    "task": {"name": "cola", "data_dir": "builtin"},  # "builtin": the shipped sample
    "optim": {"lr": 1e-4},
    "train": {"batch_size": 16, "epochs": 4},  # quickstart's sample recipe
}, overrides=tiny if args.tiny else [])  # key.sub=value, as on the command line
cfg, note = fresh_run(cfg)  # runs/compare_two_mechanisms-2 if the folder is taken
if note:
    print(note)

# plan values: "baseline" is the named plan that changes nothing; the other is a rule
# LAYERS:HEADS:SPEC (';' joins several). One seed each here (--seeds N in the command).
plans = {"softmax (baseline)": "baseline", "band(window=8)": "all:all:band(window=8)"}
rows, out = run_compare(cfg, [("plan", list(plans.values()))], seeds=1, run=run_experiment)

names = {plan: name for name, plan in plans.items()}
print(f"\n{'attention':<20} {rows[0]['metric']:>8}  {'s/step':>7}")
for row in rows:  # one per variant: mean/std over its seeds, parameters, time, memory
    print(f"{names[row['variant']]:<20} {row['mean']:>8.3f}  {row['sec_per_step']:>7.3f}")
print(f"tables and plot: {out}/comparison.md, comparison.csv, comparison.png")
