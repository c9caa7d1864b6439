"""ListOps (LRA, Tay et al. 2021; Nangia & Bowman 2018): the seeded generator against the
official format and semantics, the TSV loader's errors, encoding, the CLI and one tiny run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import typer
from tasks_helpers import write
from typer.testing import CliRunner

from attnlab.tasks import DataFormatError, Task, get_task
from attnlab.tasks import listops as lo

TINY = {"num_train": 64, "num_valid": 16, "num_test": 16, "min_length": 5, "max_length": 40}
HEADER = "Source\tTarget\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    lo.write_listops(out, seed=3, **TINY)
    return out


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("source, value", [
    ("[MIN 3 1 4 ]", 1),
    ("[MAX 3 1 4 ]", 4),
    ("[MED 3 1 4 ]", 3),
    ("[MED 1 2 ]", 1),  # median 1.5 truncates to 1
    ("[MED 2 9 4 7 ]", 5),  # median of 2 4 7 9 is 5.5 -> 5
    ("[SM 9 8 7 ]", 4),  # 24 mod 10
    ("[SM 5 5 ]", 0),
    ("7", 7),
    ("[MAX 2 [MIN 9 5 ] [SM 3 4 ] ]", 7),
    ("[SM [MED 1 2 3 ] [MAX 0 [MIN 8 9 ] ] 1 ]", 1),  # 2 + 8 + 1 = 11
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),  # the official parenthesised form
])
def test_evaluate_tree_hand_written(source, value):
    assert lo.evaluate_tree(lo.parse_source(source)) == value


def test_median_matches_numpy_truncation():
    rng = random.Random(0)
    for _ in range(500):
        vals = [rng.randrange(10) for _ in range(rng.randint(1, 10))]
        assert lo.apply_op(lo.MED, vals) == int(np.median(vals))


def _official_binary(tree):
    """The official tuple tree: ((..((op, c1), c2).., ck), ']')."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    t = (op, _official_binary(children[0]))
    for c in children[1:]:
        t = (t, _official_binary(c))
    return (t, lo.END)


def _official_string(t):
    """Printing rule of the official to_string: '( ' + left + ' ' + right + ' )'."""
    if isinstance(t, (str, int)):
        return str(t)
    return "( " + _official_string(t[0]) + " " + _official_string(t[1]) + " )"


def test_official_parenthesised_format():
    assert lo.to_string(("[MAX", (2, 9))) == "( ( ( [MAX 2 ) 9 ) ] )"
    nested = ("[SM", (("[MIN", (3, 4)), 5))
    assert lo.to_string(nested) == "( ( ( [SM ( ( ( [MIN 3 ) 4 ) ] ) ) 5 ) ] )"
    assert lo.to_string(4) == "4"
    rng = random.Random(1)
    for _ in range(200):
        tree, _ = lo.generate_tree(1, rng, max_depth=5, max_args=5)
        assert lo.to_string(tree) == _official_string(_official_binary(tree))


def test_generated_rows_round_trip_and_targets_are_right():
    splits = lo.generate_listops(seed=5, **TINY)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [64, 16, 16]
    rows = [r for s in splits.values() for r in s]
    assert len({src for src, _ in rows}) == len(rows)  # dedup holds across splits
    for source, target in rows:
        tree = lo.parse_source(source)
        assert lo.to_string(tree) == source
        assert lo.evaluate_tree(tree) == target
        assert 5 < len(lo.tree_tokens(tree)) < 40
        assert len(source.replace("(", " ").replace(")", " ").split()) == len(lo.tree_tokens(tree))


def test_generator_is_seeded_and_files_are_byte_identical(tmp_path, tiny_dir):
    again = lo.write_listops(tmp_path / "a", seed=3, **TINY)
    other = lo.write_listops(tmp_path / "b", seed=4, **TINY)
    for split, path in again.items():
        assert path.read_bytes() == (tiny_dir / path.name).read_bytes(), split
    assert again["train"].read_bytes() != other["train"].read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "basic_test.tsv", "basic_train.tsv", "basic_val.tsv"]  # no temporary files left
    raw = again["dev"].read_bytes()
    assert raw.startswith(b"Source\tTarget\r\n")  # csv.writer rows, as the official files
    assert raw.count(b"\r\n") == 17


def test_generate_tree_draw_order_is_the_official_one():
    rng = random.Random(0)
    # first draw 0.844 > VALUE_P: a leaf, then choice(range(10))
    ref = random.Random(0)
    ref.random()
    assert lo.generate_tree(1, rng) == (ref.choice(range(10)), 1)
    assert lo.generate_tree(10, random.Random(0), max_depth=10)[1] == 1  # leaf forced


def test_generator_argument_checks():
    with pytest.raises(ValueError, match="strictly between"):
        lo.generate_listops(1, 0, 0, min_length=5, max_length=6)
    with pytest.raises(ValueError, match="never exceed"):
        lo.generate_listops(1, 0, 0, max_depth=2, max_args=3, min_length=5, max_length=50)
    with pytest.raises(RuntimeError, match="no new tree"):  # only 4*10*10 trees of length 4
        lo.generate_listops(500, 0, 0, max_depth=2, max_args=2, min_length=3, max_length=5,
                            max_stall=20_000)


# ----------------------------------------------------------------------------- loader


def test_load_splits_and_layouts(tiny_dir, tmp_path):
    task = get_task("listops")
    train = task.load("train", tiny_dir)
    dev = task.load("validation", tiny_dir)  # alias of dev -> basic_val.tsv
    assert len(train) == 64 and len(dev) == 16 and len(task.load("test", tiny_dir)) == 16
    rows = lo.generate_listops(seed=3, **TINY)["train"]
    assert [(e.text, e.label) for e in train] == [
        (" ".join(lo.tree_tokens(lo.parse_source(s))), t) for s, t in rows]
    assert "(" not in train[0].text and train[0].guid == "train-2"
    for sub in ("listops", "lra_release/listops-1000"):
        folder = tmp_path / sub
        folder.mkdir(parents=True)
        (folder / "basic_val.tsv").write_bytes((tiny_dir / "basic_val.tsv").read_bytes())
        assert task.load("dev", tmp_path) == dev


def test_in_memory_examples_match_the_loader(tiny_dir):
    rows = lo.generate_listops(seed=3, **TINY)["dev"]
    mem = lo.examples_from_rows(rows, "dev")
    assert [(e.text, e.label) for e in mem] == [
        (e.text, e.label) for e in get_task("listops").load("dev", tiny_dir)]


def test_missing_files_say_how_to_generate(tmp_path):
    task = get_task("listops")
    for data_dir in (tmp_path, None, "builtin"):
        with pytest.raises(FileNotFoundError, match="attnlab data listops --out"):
            task.load("train", data_dir)


@pytest.mark.parametrize("row, message", [
    ("[MAX 2 9 ]\t9\textra", "expected 2 tab-separated columns"),
    ("[MAX 2 9 ]", "found 1"),
    ("[MAX 2 9 ]\t12", "bad Target '12'"),
    ("[MAX 2 9 ]\tx", "bad Target 'x'"),
    ("( ( ( [MAX 2 ) 9 ) ]\t9", "unbalanced parentheses"),
    ("( ( [MAX 2 ) 9 ) ] ) )\t9", "unbalanced parentheses"),
    ("[MAX 2 [MIN 9 ]\t9", "operator\\(s\\) without"),
    ("[MAX 2 9 ] ]\t9", "']' without operator"),
    ("[MAX 2 [MOD 9 ] ]\t9", "unknown token '\\[MOD'"),
    ("[MAX 2 10 ]\t9", "unknown token '10'"),
    ("[MAX ]\t9", "no argument"),
    ("[MAX 2 ] 3\t2", "more than one top-level"),
    ("\t2", "empty Source"),
])
def test_malformed_rows_name_file_and_line(tmp_path, row, message):
    path = write(tmp_path / "basic_train.tsv", HEADER + "( ( ( [MIN 2 ) 9 ) ] )\t2\n" + row)
    with pytest.raises(DataFormatError, match=message) as info:
        get_task("listops").load("train", tmp_path)
    assert info.value.path == str(path) and info.value.line == 3
    assert str(info.value).startswith(f"{path}:3: ")


def test_bad_header_and_crlf(tmp_path):
    write(tmp_path / "basic_train.tsv", "Src\tTgt\n[MAX 2 9 ]\t9\n")
    with pytest.raises(DataFormatError, match="header") as info:
        get_task("listops").load("train", tmp_path)
    assert info.value.line == 1
    write(tmp_path / "basic_train.tsv", "Source\tTarget\r\n[MAX 2 9 ]\t9\r\n\r\n")
    [ex] = get_task("listops").load("train", tmp_path)
    assert (ex.text, ex.label) == ("[MAX 2 9 ]", 9)


# ----------------------------------------------------------------------------- encode


def test_task_metadata_and_protocol():
    task = get_task("listops")
    assert isinstance(task, Task) and task.head == "sequence-classification"
    assert task.num_labels == len(task.label_names) == 10 and task.main_metric == "accuracy"
    assert task.problem_type == "single_label_classification" and task.greater_is_better


def test_encode_one_id_per_symbol(tokenizer):
    task = get_task("listops")
    ids = lo.token_ids(tokenizer)
    assert len(set(ids.values())) == 15 and tokenizer.unk_token_id not in ids.values()
    for sym, word in lo.VOCAB_WORDS.items():
        assert tokenizer.convert_ids_to_tokens(ids[sym]) == word
        assert tokenizer.tokenize(word) == [word]  # a single known WordPiece
    [ex] = lo.examples_from_rows([("( ( ( [MED ( ( ( [SM 3 ) 4 ) ] ) ) 9 ) ] )", 8)])
    [f] = task.encode([ex], tokenizer, max_length=64)
    toks = tokenizer.convert_ids_to_tokens(f["input_ids"])
    assert toks == ["[CLS]", "median", "sum", "3", "4", "]", "9", "]", "[SEP]"]
    assert "(" not in toks and ")" not in toks
    assert f["attention_mask"] == [1] * 9 and f["token_type_ids"] == [0] * 9
    assert f["labels"] == 8 and f["example_index"] == 0
    [short] = task.encode([ex], tokenizer, max_length=5)
    assert tokenizer.convert_ids_to_tokens(short["input_ids"]) == [
        "[CLS]", "median", "sum", "3", "[SEP]"]
    assert len(short["attention_mask"]) == 5


def test_token_ids_reject_a_tokenizer_without_the_words():
    class Tok:
        unk_token_id = 0

        def convert_tokens_to_ids(self, tokens):
            return [0 if t == "median" else i + 1 for i, t in enumerate(tokens)]

    with pytest.raises(ValueError, match="lacks \\['median'\\]"):
        lo.token_ids(Tok())


def test_collate_and_metrics(tokenizer):
    task = get_task("listops")
    exs = lo.examples_from_rows([("[MAX 2 9 ]", 9), ("[MIN [SM 5 5 ] 4 ]", 0)])
    feats = task.encode(exs, tokenizer, max_length=16)
    batch = task.collator(tokenizer)(feats)
    assert batch["input_ids"].shape == (2, 9) and batch["labels"].tolist() == [9, 0]
    assert set(batch) <= {"input_ids", "attention_mask", "token_type_ids", "labels"}
    logits = np.eye(10)[[9, 3]]
    assert task.compute_metrics(list(logits), feats, exs) == {"accuracy": 0.5}


# ----------------------------------------------------------------------------- CLI and run


def test_cli_writes_the_files(tmp_path):
    from attnlab.cli_data import app

    root = typer.Typer()
    root.add_typer(app, name="data")
    out = tmp_path / "gen"
    args = ["data", "listops", "--out", str(out), "--seed", "3", "--num-train", "64",
            "--num-valid", "16", "--num-test", "16", "--min-length", "5", "--max-length", "40"]
    result = CliRunner().invoke(root, args)
    assert result.exit_code == 0, result.output
    assert f"{out / 'basic_train.tsv'}" in result.output and "64 rows" in result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "basic_test.tsv", "basic_train.tsv", "basic_val.tsv"]
    direct = lo.generate_listops(seed=3, **TINY)["test"]
    assert out.joinpath("basic_test.tsv").read_text().splitlines()[1] == "\t".join(
        map(str, direct[0]))
    bad = CliRunner().invoke(root, ["data", "listops", "--out", str(out), "--min-length", "9",
                                    "--max-length", "10"])
    assert bad.exit_code == 2 and "strictly between" in bad.output


def test_end_to_end_run_on_generated_data(tiny_dir, tmp_path):
    from attnlab.config import load_config
    from attnlab.recipes.finetune import run_experiment

    cfg = load_config(None, [
        "name=listops-smoke", f"output_dir={tmp_path}", "model.name=scratch:tiny",
        "model.max_length=48", "task.name=listops", f"task.data_dir={tiny_dir}",
        "train.batch_size=8", "train.max_steps=2", "train.eval_every=2", "eval.batch_size=16",
        "optim.lr=1e-3",
    ])
    summary = run_experiment(cfg)
    assert summary["task"] == "listops" and summary["steps"] == 2
    assert summary["main_metric"] == "accuracy"
    assert 0.0 <= summary["final_eval"]["accuracy"] <= 1.0
    assert summary["train_examples"] == 64
