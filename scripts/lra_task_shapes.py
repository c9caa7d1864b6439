"""What the text and recall data of ``attnlab bench lra`` look like at each length.

Builds each task's data as ``bench lra --task T --length L`` does (``bench.lra_data``, seed
0) and prints, per split, for ``text`` the bytes per document and the share that is the
marked sentence alone (``tasks.bytetext``: target ``L // 2 - 1`` to ``L - 2`` bytes), and
for ``recall`` where the queries sit (the key-value pairs open the sequence; ``tasks.recall``):

    python scripts/lra_task_shapes.py --data ../shared/data --lengths 128,512,4096
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from attnlab.bench.lra_data import DATA_SEED, recall_vocab
from attnlab.tasks import bytetext as bt
from attnlab.tasks import recall as rc


def text_shapes(data: str, length: int, train: int, dev: int) -> None:
    low, high = length // 2 - 1, length - 2
    docs = bt.generate_text(data, train, dev, min_bytes=low, max_bytes=high, seed=DATA_SEED)
    for split, rows in docs.items():
        sizes = [len(d.text.encode("utf-8")) for d in rows]
        alone = sum(d.text.startswith(bt.MARK_OPEN) and d.text.endswith(bt.MARK_CLOSE)
                    for d in rows)
        below = sum(s < low for s in sizes)
        print(f"text L={length} {split}: {len(rows)} documents, bytes median "
              f"{statistics.median(sizes):g} (min {min(sizes)}, max {max(sizes)}), "
              f"{below / len(rows):.1%} below the target's {low}, "
              f"{alone / len(rows):.1%} the marked sentence alone")


def recall_shapes(length: int, train: int, dev: int) -> None:
    n = length - length % 2
    splits = rc.generate_recall(train, dev, 0, vocab_size=recall_vocab(length),
                                input_seq_len=n, seed=DATA_SEED)
    for split in ("train", "dev"):
        pos = [p for ex in splits[split] for p, _ in ex.queries]
        print(f"recall L={length} {split}: {len(splits[split])} examples, "
              f"{rc.NUM_KV_PAIRS} pairs at positions 0-{2 * rc.NUM_KV_PAIRS - 1}, query "
              f"position median {statistics.median(pos):g}, 90th percentile "
              f"{np.percentile(pos, 90):.0f}, max {max(pos)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--lengths", default="128,512,4096")
    parser.add_argument("--tasks", default="text,recall")
    parser.add_argument("--train", type=int, default=2000, help="training examples")
    parser.add_argument("--dev", type=int, default=512, help="dev examples")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    for length in (int(x) for x in args.lengths.split(",")):
        if "text" in tasks:
            text_shapes(args.data, length, args.train, args.dev)
        if "recall" in tasks:
            recall_shapes(length, args.train, args.dev)


if __name__ == "__main__":
    main()
