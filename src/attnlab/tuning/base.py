"""The tuner protocol, the tuner registry, and the helpers every tuner shares.

A *tuner* decides which weights of a Hugging Face model train and which new weights exist
(PASTA vectors, adapters, LoRA matrices, diff vectors). It is a stateless object with a
frozen config dataclass, used by the runner in this order::

    tuner, cfg = resolve_tuning("lora(r=8, alpha=16)")      # or "pasta", "full", ...
    model = tuner.apply(model, cfg, task=TaskInfo.from_tokenizer(tok, "pair"))
    opt = AdamW(p for _, p in tuner.trainable_parameters(model))
    tuner.before_step(model, step)                          # before each step's forward
    loss = out.loss + (tuner.aux_loss(model) or 0)          # diff pruning's L0 penalty
    tuner.finalize(model)                                   # diff pruning: prune + fix mask
    save_tuned(model, tuner, "runs/x/tuned.safetensors")    # only the tuned weights

``apply`` may return a different object (peft wraps the model): always keep its result.
Apply a tuner after any attention plan, on a model that was not tuned before.

The *backbone* is the encoder model without its task head (``model.base_model``: e.g.
``BertModel``, with its pooler where the task model has one: BERT sequence classification
does, token classification and RoBERTa's classifiers build theirs without, so BERT-large's
backbone is 335,141,888 for GLUE and 334,092,288 for NER); the *head* is every other
parameter of the model (``classifier``, ``qa_outputs``, ModernBERT's ``head`` and
``classifier``). Head and backbone are told apart by parameter identity, not by name: a
masked-LM head whose decoder shares the word-embedding matrix (XLM-R and CamemBERT
register ``lm_head`` first, so that matrix is named ``lm_head.decoder.weight``) still
leaves the matrix to the backbone. Both are recorded when a tuner is applied, so
``count_parameters`` divides by the backbone as it was before tuning.

Modules a tuner adds (PASTA's tables, adapters, LoRA layers, Diff-Prune's gates) take the
mode of the model they are added to: a model in eval stays in eval (``finish_tuning``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, cast, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from attnlab.core import Registry, config_dict, config_spec
from attnlab.io import atomic_path
from attnlab.tasks.base import DataFormatError

TaskKind = Literal["single", "pair", "ner", "qa", "other"]
RECORD_ATTR = "_attnlab_tuning"
# Families whose tokenizers write a pair as <s> A </s></s> B </s> (two separators between).
DOUBLE_SEP_FAMILIES = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet")
# [CLS], [SEP] in the BERT WordPiece vocabularies (cased and uncased, also ELECTRA, MiniLM).
BERT_SPECIAL_IDS = (101, 102)


class TuningError(ValueError):
    """A tuner cannot be applied as asked (to this model, plan or task); the message says
    why and what to use instead. The command line shows it as one line."""


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class OptimRecipe:
    """Optimiser facts published with a method. The runner fills every optim field a config
    leaves unset (lr, weight_decay, warmup_ratio, schedule) from them
    (``config.with_optim_defaults``); batch size and max length are listed for reference.

    optimizer: "adamw".  lr: peak learning rate.  weight_decay: AdamW decay.
    schedule: learning-rate schedule ("linear" decays to 0).  warmup_ratio: share of steps
    warmed up.  max_length: tokenizer truncation length.  batch_size: examples per step.
    source: where these numbers come from.
    """

    optimizer: str = "adamw"
    lr: float = 5e-5
    weight_decay: float = 0.0
    schedule: str = "linear"
    warmup_ratio: float = 0.0
    max_length: int = 128
    batch_size: int = 32
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class TunerConfig:
    """Base of every tuner config: frozen, keyword-only, every field typed and defaulted.

    Subclasses set the class-level ``name`` (registry key) and may set
    ``recommended_optim`` (an ``OptimRecipe`` from the method's paper or official scripts).
    """

    name: ClassVar[str] = ""
    recommended_optim: ClassVar[OptimRecipe | None] = None

    def spec(self) -> str:
        """The spec string that rebuilds this config, e.g. ``lora(r=8, alpha=16, ...)``."""
        return config_spec(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form ``{"name": ..., **fields}`` (tuples become lists)."""
        return config_dict(self)


@dataclass(frozen=True, kw_only=True)
class TaskInfo:
    """What a tuner may need to know about the task's inputs (PASTA does; most do not).

    kind: input layout: "single" sentence, sentence "pair", "ner" (single sentence, token
      labels), "qa" (question + context: a pair), or "other".
    special_ids: ids of the boundary tokens the tokenizer inserts ([CLS]/[SEP], <s>/</s>);
      None: the model family's default.
    pad_id: padding id (never treated as special); None: ``model.config.pad_token_id``.
    """

    kind: TaskKind = "other"
    special_ids: tuple[int, ...] | None = None
    pad_id: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, kind: TaskKind) -> TaskInfo:
        """Boundary ids from a Hugging Face tokenizer (cls/sep, else bos/eos) and its pad id."""
        ids = {
            getattr(tokenizer, attr, None)
            for attr in ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id")
        }
        pad = getattr(tokenizer, "pad_token_id", None)
        special = tuple(sorted(i for i in ids if i is not None and i != pad))
        return cls(kind=kind, special_ids=special or None, pad_id=pad)


# ----------------------------------------------------------------------------- protocol


@runtime_checkable
class Tuner(Protocol):
    """What the runner calls. Implementations are stateless; state lives on the model."""

    name: ClassVar[str]
    config_cls: ClassVar[type[TunerConfig]]

    def apply(self, model: nn.Module, cfg: TunerConfig, task: TaskInfo | None = None
              ) -> nn.Module:
        """Freeze / add parameters; returns the model to use from now on."""
        ...

    def trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs the optimizer should update."""
        ...

    def state_dict_to_save(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Only the tuned weights (head included), detached, ready for safetensors."""
        ...

    def load_tuned(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Load what ``state_dict_to_save`` wrote into a model this tuner was applied to."""
        ...

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        """A regulariser the runner adds to the task loss, or None."""
        ...

    def param_options(self, model: nn.Module) -> dict[int, dict]:
        """id(parameter) -> its own optimizer options (Diff-Prune's log_alpha at lr 0.1);
        empty for most."""
        ...

    def finalize_stage(self, cfg: TunerConfig) -> FinalizeStage | None:
        """None for most. Else the runner finalizes the best model after training
        (:meth:`finalize`), re-evaluates it (its metric is the run's result) and trains
        ``FinalizeStage.epochs`` more epochs with what finalize fixed (Diff-Prune)."""
        ...

    def finalize(self, model: nn.Module) -> None:
        """End-of-training step (diff pruning's magnitude pruning); a no-op for most."""
        ...

    def before_step(self, model: nn.Module, step: int) -> None:
        """Called by the training loop before each micro-batch of optimizer step ``step``
        (0-based): which parameters train in that step (MAE's block coordinate descent
        switches between gate-only and expert steps); a no-op for most."""
        ...


@dataclass(frozen=True)
class FinalizeStage:
    """What follows a tuner's finalize: ``epochs`` more epochs (0: none) at ``lr`` (None:
    the run's), with a fresh optimizer and schedule."""

    epochs: float
    lr: float | None = None


class RequiresGradTuner:
    """Defaults shared by the built-in tuners (composition would need a field per method).

    The tuned weights are exactly the parameters left with ``requires_grad`` (head
    included); they are what is saved and loaded; no auxiliary loss; nothing to finalize.
    Tuners override what differs (peft's own state dict, Diff-Prune's gates and L0 loss).
    """

    def trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return requires_grad_parameters(model)

    def state_dict_to_save(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return trainable_state(model)

    def load_tuned(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        load_exact(model, state, (n for n, _ in requires_grad_parameters(model)))

    def aux_loss(self, model: nn.Module) -> torch.Tensor | None:
        return None

    def param_options(self, model: nn.Module) -> dict[int, dict]:
        return {}

    def finalize_stage(self, cfg: TunerConfig) -> FinalizeStage | None:
        return None

    def finalize(self, model: nn.Module) -> None:
        return None

    def before_step(self, model: nn.Module, step: int) -> None:
        return None


TUNERS: Registry[Tuner] = Registry("tuner", example="lora(r=8)")


def register_tuner(config_cls: type[TunerConfig]):
    """Class decorator: registers one instance of the class under ``config_cls.name``."""
    if not (dataclasses.is_dataclass(config_cls) and issubclass(config_cls, TunerConfig)):
        raise TypeError("register_tuner takes a TunerConfig dataclass")
    if not config_cls.name:
        raise TypeError(f"{config_cls.__name__} needs a class-level name")

    def deco(cls: type) -> type:
        tuner_cls = cast("type[Tuner]", cls)  # a Tuner once name and config_cls are set
        tuner_cls.name = config_cls.name
        tuner_cls.config_cls = config_cls
        TUNERS.register(config_cls.name, tuner_cls())
        return cls

    return deco


def list_tuners() -> list[str]:
    """Registered tuner names, sorted."""
    return TUNERS.names()


def get_tuner(name: str) -> Tuner:
    return TUNERS.get(name)


def resolve_tuning(spec: str | Mapping[str, Any] | TunerConfig | None = None
                   ) -> tuple[Tuner, TunerConfig]:
    """``"lora(r=8)"``, ``{"name": "lora", "r": 8}``, a config, or None (= ``full``)."""
    cfg = TUNERS.config("full" if spec is None else spec)
    return get_tuner(cfg.name), cfg


# ----------------------------------------------------------------------------- model anatomy


def backbone_of(model: nn.Module) -> nn.Module:
    """The encoder model without its task head (``BertModel`` inside a classifier)."""
    inner = unwrap_peft(model)
    base = getattr(inner, "base_model", None)
    if not isinstance(base, nn.Module):
        raise TypeError(
            f"tuners work on Hugging Face PreTrainedModels (with .base_model); got "
            f"{type(model).__name__}"
        )
    return base


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (the model itself otherwise)."""
    get_base = getattr(type(model), "get_base_model", None)
    if callable(get_base):
        return model.get_base_model()  # type: ignore[operator]  # peft method
    return model


def backbone_parameter_ids(model: nn.Module) -> set[int]:
    """``id`` of every backbone parameter; any other parameter of the model is head. A
    parameter of the backbone stays backbone where a head module shares it (a masked-LM
    decoder tied to the word embeddings)."""
    return {id(p) for p in backbone_of(model).parameters()}


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Names of the top-level children that form the task head: those holding a parameter
    that is not the backbone's (ModernBERT: ``head`` and ``classifier``)."""
    inner = unwrap_peft(model)
    backbone = backbone_of(inner)
    if backbone is inner:
        return ()
    own = backbone_parameter_ids(inner)
    return tuple(
        name for name, child in inner.named_children()
        if child is not backbone and any(id(p) not in own for p in child.parameters())
    )


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer layers (``encoder.layer`` for BERT/RoBERTa/ELECTRA)."""
    backbone = backbone_of(model)
    for path in ("encoder.layer", "transformer.layer", "encoder.layers", "layers"):
        mod: Any = backbone
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return mod
    raise TypeError(
        f"cannot find the encoder layers of {type(backbone).__name__} (looked for "
        "encoder.layer, transformer.layer, encoder.layers, layers)"
    )


def model_family(model: nn.Module) -> str:
    return str(getattr(getattr(unwrap_peft(model), "config", None), "model_type", "") or "")


# ----------------------------------------------------------------------------- record


@dataclass(frozen=True)
class TuningRecord:
    """Facts fixed when a tuner is applied; kept on the model for ``count_parameters``.

    backbone_total: backbone parameters before tuning (the denominator of every percentage).
    backbone_name: the backbone's class (e.g. ``BertModel``), printed with the denominator.
    head: names of the head's top-level modules.
    training: the model's mode when the tuner was applied; the modules it adds take it.
    host_modules: the model's modules before tuning (held from ``start_tuning`` to
      ``finish_tuning`` only, to tell the added ones).
    """

    tuner: str
    spec: str
    backbone_total: int
    backbone_name: str
    head: tuple[str, ...]
    training: bool = True
    host_modules: tuple[nn.Module, ...] = field(default=(), repr=False, compare=False)


def start_tuning(model: nn.Module, cfg: TunerConfig) -> TuningRecord:
    """Check the model is untuned and measure backbone and head; call before changing it."""
    if getattr(model, RECORD_ATTR, None) is not None:
        prev = getattr(model, RECORD_ATTR)
        raise ValueError(
            f"this model was already tuned with {prev.spec}; apply one tuner to a fresh model"
        )
    backbone = backbone_of(model)
    return TuningRecord(
        tuner=cfg.name,
        spec=cfg.spec(),
        backbone_total=sum(p.numel() for p in backbone.parameters()),
        backbone_name=type(backbone).__name__,
        head=head_prefixes(model),
        training=model.training,
        host_modules=tuple(model.modules()),
    )


def finish_tuning(model: nn.Module, record: TuningRecord) -> nn.Module:
    """Give every module the tuner added (``model`` may be a new wrapper) the mode the model
    had in ``start_tuning``, then keep the record on the model. Only the added modules'
    own flags are set: the host's modules keep theirs, also inside an added wrapper."""
    host = {id(m) for m in record.host_modules}
    for module in model.modules():
        if id(module) not in host:
            module.training = record.training
    # a plain attribute, not a submodule
    object.__setattr__(model, RECORD_ATTR, dataclasses.replace(record, host_modules=()))
    return model


def tuning_record(model: nn.Module) -> TuningRecord | None:
    return getattr(model, RECORD_ATTR, None)


# ----------------------------------------------------------------------------- shared pieces


def set_trainable(model: nn.Module, keep: Iterable[str] | None = None, *,
                  head: bool = True) -> None:
    """Freeze everything except parameters named in ``keep`` and (if ``head``) the head's
    (every parameter outside the backbone)."""
    names = set(keep or ())
    backbone = backbone_parameter_ids(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name in names or (head and id(p) not in backbone))


def requires_grad_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters as detached, contiguous, unshared tensors."""
    return {n: p.detach().clone().contiguous() for n, p in requires_grad_parameters(model)}


def load_exact(model: nn.Module, state: Mapping[str, torch.Tensor],
               expected: Iterable[str]) -> None:
    """Copy ``state`` into the model; its keys must be exactly ``expected`` (else: which)."""
    want, got = set(expected), set(state)
    if want != got:
        missing, extra = sorted(want - got), sorted(got - want)
        raise KeyError(
            f"tuned state does not match the model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}. Apply the same tuner with the same config "
            "to the same architecture before loading."
        )
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, val in state.items():
            dst = params.get(name, buffers.get(name))
            if dst is None:
                raise KeyError(f"{name!r} is neither a parameter nor a buffer of the model")
            if dst.shape != val.shape:
                raise ValueError(f"{name}: saved shape {tuple(val.shape)} != model "
                                 f"{tuple(dst.shape)}")
            dst.copy_(val)


# ----------------------------------------------------------------------------- files


def save_tuned(model: nn.Module, tuner: Tuner, path: str | os.PathLike) -> Path:
    """Write only the tuned weights to a safetensors file, atomically (temp file + rename)."""
    path = Path(path)
    state = tuner.state_dict_to_save(model)
    record = tuning_record(model)
    meta = {"attnlab_tuner": tuner.name, "attnlab_spec": record.spec if record else ""}
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp),
                  metadata=meta)
    return path


def load_tuned_file(model: nn.Module, tuner: Tuner, path: str | os.PathLike) -> None:
    """Load a file from ``save_tuned`` into a model the same tuner was applied to; a file
    safetensors cannot read is a DataFormatError naming it (one line at the CLI)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            saved = (f.metadata() or {}).get("attnlab_tuner")
    except SafetensorError as e:
        raise DataFormatError(str(path), None, f"not a readable safetensors file ({e}); run the "
                              "training again, or copy the file anew") from None
    if saved is not None and saved != tuner.name:
        raise ValueError(f"{path} holds weights of tuner {saved!r}, not {tuner.name!r}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tuner.load_tuned(model, load_file(str(path), device=str(device)))
