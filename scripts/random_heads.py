"""Plan rules that give SPEC to as many heads as a head analysis puts in class LIKE, drawn at
random (seeded) from the heads of no class in EXCLUDE: the control of docs/results.md
("Vertical heads replaced by band attention"). Prints ';'-joined ``LAYER:HEADS:SPEC`` rules
for ``plan=...``.

    python scripts/random_heads.py runs/heads-cola --like vertical \
        --exclude vertical,vertical+diagonal --spec "band(window=4)" --seed 0
"""

from __future__ import annotations

import argparse
import random

from attnlab.recipes.head_select import read_head_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("analysis", help="head_scores.json of `attnlab analyze heads` (or its folder)")
    ap.add_argument("--like", default="vertical", help="class whose head count is matched")
    ap.add_argument("--exclude", default="vertical,vertical+diagonal",
                    help="comma-separated classes never drawn")
    ap.add_argument("--spec", default="band(window=4)", help="mechanism of the drawn heads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    table = read_head_table(args.analysis)
    if table.classes is None:
        raise SystemExit(f"{table.source} has no head classes")
    excluded = set(args.exclude.split(","))
    heads = [(layer, h) for layer, row in enumerate(table.classes) for h, c in enumerate(row)]
    count = sum(c == args.like for row in table.classes for c in row)
    pool = [(la, h) for la, h in heads if table.classes[la][h] not in excluded]
    if count > len(pool):
        raise SystemExit(f"{count} {args.like} heads but only {len(pool)} heads to draw from")
    drawn = sorted(random.Random(args.seed).sample(pool, count))
    by_layer: dict[int, list[int]] = {}
    for layer, h in drawn:
        by_layer.setdefault(layer, []).append(h)
    print(";".join(f"{layer}:{','.join(map(str, hs))}:{args.spec}"
                   for layer, hs in by_layer.items()))


if __name__ == "__main__":
    main()
