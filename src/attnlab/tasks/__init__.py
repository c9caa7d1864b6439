"""Tasks: loaders, preprocessing, collators and metrics, registered by name.

``get_task("cola")`` ... ``list_tasks()``; see ``base`` for the protocol a training loop
uses. Importing this package registers: the nine GLUE tasks (cola, sst2, mrpc, stsb, qqp,
mnli, qnli, rte, wnli), conll2003, squad, squad_v2, mlm, wikitext2, listops, recall (MQAR)
and text (byte-level, from SST-2). transformers is imported only inside ``collator`` (and
``datasets`` only for the hub fallback).
"""

from .base import (
    BUILTIN,
    MODEL_INPUT_KEYS,
    TASKS,
    DataFormatError,
    Feature,
    HeadType,
    ProblemType,
    Task,
    get_task,
    label_maps,
    list_tasks,
    register_task,
)
from .bytetext import ByteTextExample, ByteTextTask
from .conll import ConllTask, NerExample, iob1_to_iob2, read_conll
from .glue import GLUE_TASKS, GlueExample, GlueTask
from .listops import ListOpsExample, ListOpsTask
from .mlm import MlmTask, TextExample, read_texts
from .recall import RecallExample, RecallTask
from .squad import SquadExample, SquadTask, postprocess, read_squad, split_articles

__all__ = [
    "BUILTIN",
    "GLUE_TASKS",
    "MODEL_INPUT_KEYS",
    "TASKS",
    "ByteTextExample",
    "ByteTextTask",
    "ConllTask",
    "DataFormatError",
    "Feature",
    "GlueExample",
    "GlueTask",
    "HeadType",
    "ListOpsExample",
    "ListOpsTask",
    "MlmTask",
    "NerExample",
    "ProblemType",
    "RecallExample",
    "RecallTask",
    "SquadExample",
    "SquadTask",
    "Task",
    "TextExample",
    "get_task",
    "iob1_to_iob2",
    "label_maps",
    "list_tasks",
    "postprocess",
    "read_conll",
    "read_squad",
    "read_texts",
    "register_task",
    "split_articles",
]
