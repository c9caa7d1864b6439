"""The task registry and protocol: every registered task answers the same interface."""

from __future__ import annotations

import pytest
import torch

from attnlab.core import RegistryError
from attnlab.tasks import TASKS, DataFormatError, Task, get_task, label_maps, list_tasks
from attnlab.tasks.base import canonical_split, unpad

HEADS = {"sequence-classification", "token-classification", "question-answering", "masked-lm"}


def test_builtin_tasks_are_registered():
    assert set(list_tasks()) == {"cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte",
                                 "wnli", "conll2003", "squad", "squad_v2", "mlm", "wikitext2",
                                 "listops", "recall", "text"}
    with pytest.raises(RegistryError, match="unknown task 'colaa'.*'cola'"):
        get_task("colaa")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_follows_the_protocol(name):
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    assert task.head in HEADS
    assert task.train_split in task.splits and set(task.eval_splits) <= set(task.splits)
    assert isinstance(task.main_metric, str) and isinstance(task.greater_is_better, bool)
    if task.head in ("sequence-classification", "token-classification"):
        assert task.problem_type in ("single_label_classification", "regression")
        assert task.num_labels == (len(task.label_names) or 1)
    else:
        assert task.problem_type is None


def test_known_metadata():
    assert get_task("cola").main_metric == "mcc"
    assert get_task("mnli").eval_splits == ("dev_matched", "dev_mismatched")
    assert get_task("mlm").greater_is_better is False
    assert label_maps(get_task("rte")) == ({0: "entailment", 1: "not_entailment"},
                                           {"entailment": 0, "not_entailment": 1})
    assert get_task("conll2003").label_names[:3] == ("O", "B-PER", "I-PER")


def test_data_format_error_message():
    e = DataFormatError("/x/train.tsv", 7, "bad label 'z'")
    assert str(e) == "/x/train.tsv:7: bad label 'z'" and isinstance(e, ValueError)
    no_line = DataFormatError("/x/a.json", None, "data[0]: missing")
    assert str(no_line) == "/x/a.json: data[0]: missing"


def test_split_aliases():
    assert canonical_split("validation", ("train", "dev"), "t") == "dev"
    assert canonical_split("valid", ("train", "dev"), "t") == "dev"
    with pytest.raises(ValueError, match="available splits: train, dev"):
        canonical_split("tset", ("train", "dev"), "t")


def test_unpad_handles_left_and_right_padding():
    values = torch.arange(8).reshape(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    assert [r.tolist() for r in unpad(values, {"attention_mask": mask})] == [[0, 1, 2], [6, 7]]
