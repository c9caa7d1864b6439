"""Which attention heads of a model are vertical, diagonal, block or heterogeneous?

Runs a few sentences through a model, captures every head's attention maps, scores each
head by where its rows put their maximum (on [CLS]/[SEP]: vertical; on the previous or
next token: diagonal; inside its own sentence of a pair: block) and prints how many heads
of each class every layer has (Kovaleva et al. 2019's classes, the rule in
``attnlab.analysis.heads.ClassRule``). The model is the embedded all-MiniLM-L6-v2, or a
finished run folder (``--model runs/NAME``: rebuilt with its plan and tuned weights).
``--out DIR`` also writes the tables and figures of ``attnlab analyze heads``.

    python examples/analyse_heads.py                 # the 150 CoLA sample dev sentences
    python examples/analyse_heads.py --tiny          # 6 sentences (CI)
"""

import argparse
from pathlib import Path

from attnlab.analysis import class_counts
from attnlab.recipes.analyze import TextSource, analyze_model, load_model, write_analysis

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default="default", help="'default' or a run/model folder")
parser.add_argument("--tiny", action="store_true", help="CI size: 6 hand-written sentences")
parser.add_argument("--out", type=Path, help="also write tables and figures here")
args = parser.parse_args()

if args.tiny:  # a text file, one sentence per line
    Path("sentences.txt").write_text("\n".join([
        "The cat sat on the mat.", "She gave him the book that he wanted.",
        "Attention heads often look at the separator token.", "Birds fly south in winter.",
        "The committee has not yet reached a decision.", "Where did you put the keys?",
    ]) + "\n")
    source = TextSource(text_file="sentences.txt", max_length=32)
else:  # the dev split of the CoLA-format sample shipped in the package
    source = TextSource(task="cola", data_dir="builtin", max_length=64)

loaded = load_model(args.model)
result = analyze_model(loaded, source, batch_size=16)
classes = result.analysis.classes  # [layer][head] -> class name
counts = class_counts(classes)  # class -> heads per layer

print(f"{loaded.name}: {result.meta['examples']} sentences ({source.describe()}), "
      f"{result.meta['layers']} layers x {result.meta['heads']} heads")
print("layer " + " ".join(counts))  # one column per class, as wide as its name
for layer in range(len(classes)):
    print(f"{layer:>5} " + " ".join(f"{counts[c][layer]:>{len(c)}}" for c in counts))
print("total " + " ".join(f"{sum(counts[c]):>{len(c)}}" for c in counts))
if args.out:
    write_analysis(result, args.out)
    print(f"wrote {args.out}/")
