"""Experiment configs: YAML -> typed dataclasses, with ``key.sub=value`` overrides.

Every field has a default, so the smallest config is ``task: {name: cola}``. Unknown keys
are errors naming the close matches; values are type-checked. ``resolved_yaml`` writes the
fully resolved config next to each run (``runs/<name>/config.yaml``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from .core.spec import RegistryError, coerce, unknown_parameter
from .io import not_utf8
from .presets import plan_value


class ConfigError(ValueError):
    """A bad config file or override; the message names the key and the fix."""


@dataclass
class ModelConfig:
    name: str = "default"  # "default" = embedded MiniLM; a from_pretrained path; "scratch:SIZE"
    max_length: int = 128  # tokens per example (longer inputs are truncated)
    attn_implementation: str = "sdpa"  # host attention for heads no plan touches
    dropout: float | None = None  # override hidden/attention dropout (None = model's own)


@dataclass
class TaskConfig:
    name: str = "cola"  # a registered task (attnlab.tasks)
    data_dir: str | None = None  # local data folder, "builtin" for the shipped sample, None = hub
    train_limit: int | None = None  # use only the first N training examples
    eval_limit: int | None = None  # use only the first N evaluation examples
    train_fraction: float = 1.0  # fraction of the training set (seeded subset)
    train_split: str | None = None  # None = the task's own (SQuAD here: "dev_train")
    eval_split: str | None = None  # None = the task's own eval splits (MNLI: both)
    task_id: int | None = None  # this task's id for task-conditioned mechanisms (camtl_prior)


@dataclass
class TuningConfig:
    method: str = "full"  # tuner spec: full, bitfit, pasta, lora(r=8), prefix, adapter, ...


# What an unset (None) optim field becomes when the tuner publishes no recipe.
OPTIM_DEFAULTS: dict[str, Any] = {
    "lr": 5e-5, "weight_decay": 0.01, "warmup_ratio": 0.1, "schedule": "linear"}


@dataclass
class OptimConfig:
    # None = the tuner's published recipe (pasta: 2.5e-4, wd 0, no warmup, linear;
    # diff_prune: 1e-5, wd 0), else OPTIM_DEFAULTS; see ``with_optim_defaults``
    lr: float | None = None  # peak learning rate (default 5e-5)
    weight_decay: float | None = None  # AdamW decoupled decay, not on biases/LayerNorm (0.01)
    warmup_ratio: float | None = None  # warmup over floor(share x steps) steps (0.1)
    schedule: str | None = None  # "linear" (warmup, then linear decay) or "constant"
    max_grad_norm: float | None = 1.0  # gradient clipping (None = off)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fused: bool | None = None  # AdamW's fused kernel (None: on for floating params on CPU/CUDA)


@dataclass
class TrainConfig:
    batch_size: int = 32  # per process
    grad_accum: int = 1  # gradient accumulation steps
    epochs: float = 3.0  # may be fractional
    max_steps: int | None = None  # overrides epochs when set
    eval_every: int | None = None  # optimizer steps between evaluations (None = per epoch)
    save_every: int | None = None  # optimizer steps between checkpoints (None = at evals)
    early_stopping_patience: int | None = None  # evaluations without improvement
    keep_best: bool = True  # restore the best checkpoint (task metric) at the end
    keep_checkpoints: bool = False  # keep checkpoints + best copy of a finished run (resume)
    # batches of similar lengths (Hugging Face's group_by_length: megabatches of up to 50
    # optimizer steps' examples sorted by length): 1.5-2.9x fewer padded tokens on GLUE, a
    # different batch order
    group_by_length: bool = False
    mixed_precision: str = "no"  # "no", "bf16", "fp16" (Accelerate)
    log_every: int = 10  # optimizer steps between metrics.jsonl lines


@dataclass
class EvalConfig:
    batch_size: int = 64


@dataclass
class ExperimentConfig:
    name: str = "run"  # run name: results go to <output_dir>/<name>
    seed: int = 0
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    plan: list[Any] = field(default_factory=list)  # attention plan rules (see attnlab.Plan)
    # head analysis for plan rules that choose heads by class or score (heads: class:vertical):
    # a head_scores.json (or its folder), or task / task:NAME to compute it on a dev split
    analysis: str | None = None
    tuning: TuningConfig = field(default_factory=TuningConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, recursively, with clear key/type errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, val in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            owner = f"config section {where!r}" if where else "the config"
            raise ConfigError(unknown_parameter(key, owner, names))
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, val or {}, path)
        else:
            try:
                kwargs[key] = coerce(path, tp, val, from_yaml=True)
            except TypeError as e:
                raise ConfigError(str(e)) from None
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Dataclass -> plain dict (tuples become lists), for YAML/JSON."""
    def plain(x):
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        if isinstance(x, list):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(dataclasses.asdict(cfg))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (value parsed as YAML) to a raw config mapping.
    ``plan=`` also takes a named plan or rules (``presets.plan_value``)."""
    out = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            if key.strip() == "plan" and raw.strip()[:1] not in ("[", ""):
                val = plan_value(raw)  # a named plan or LAYERS:HEADS:SPEC rules
            else:
                val = yaml.load(raw, Loader=_UniqueKeyLoader)
        except RegistryError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        except yaml.YAMLError as e:
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            fix = ("" if isinstance(e, yaml.constructor.ConstructorError) else
                   "; quote a value that holds YAML's special characters")
            raise ConfigError(f"override {item!r}: value is not valid YAML ({what}){fix}"
                              ) from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = val
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the
    last, silently dropping the first setting)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):  # complex keys: YAML's own rules
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice; keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: Path, sections: str) -> dict[str, Any]:
    """The mapping at the top of the YAML file ``path``; a missing or empty file, one that
    is not UTF-8, invalid YAML (with its line), a key given twice or anything but a mapping
    is a one-line ConfigError, which names the expected ``sections`` (e.g. "task:, model:,
    ...")."""
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, what = not_utf8(raw, e)
        raise ConfigError(f"{path}:{line}: {what}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    if data is None:  # no document: an empty file, or comments only
        raise ConfigError(f"{path} is empty; a config needs at least its task ({sections}), "
                          "e.g. task: {name: cola}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({sections})")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML file (or start from ``base``), apply overrides, validate."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        data = _paths_from(p.parent, read_yaml_mapping(p, "task:, model:, ..."))
    data = apply_overrides(data, overrides or [])
    cfg = from_dict(ExperimentConfig, data)
    validate(cfg)
    d = cfg.task.data_dir  # any path still relative (overrides, ``base``) is the cwd's
    if d is not None and d != "builtin" and not Path(d).expanduser().is_absolute():
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(
            cfg.task, data_dir=str(Path(d).expanduser().resolve())))
    a = cfg.analysis
    if a is not None and not computed_analysis(a) and not Path(a).expanduser().is_absolute():
        cfg = dataclasses.replace(cfg, analysis=str(Path(a).expanduser().resolve()))
    return cfg


def computed_analysis(analysis: str) -> bool:
    """Whether ``analysis`` is ``task`` / ``task:NAME`` (computed on a dev split by
    ``recipes.head_select``), not the path of a saved head analysis."""
    text = analysis.strip()
    return text == "task" or text.startswith("task:")


def _path_text(x: Any) -> TypeGuard[str]:
    """A string that can be a path (one holding NUL is refused by ``validate``)."""
    return isinstance(x, str) and "\0" not in x


def _paths_from(folder: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Relative paths written in a config file are relative to that file: ``task.data_dir``
    and ``analysis`` (unless ``task``/``task:NAME``) always, ``model.name`` when it names an
    existing folder there (else it is a hub id or ``default``/``scratch:SIZE``). Paths given
    as overrides stay relative to the current folder, and ``output_dir`` too (where the user
    runs is where runs go)."""
    task, model = data.get("task"), data.get("model")
    if isinstance(task, dict) and _path_text(task.get("data_dir")):
        d = task["data_dir"]
        if d != "builtin" and not Path(d).expanduser().is_absolute():
            here = (folder / d).resolve()
            # run folders written before paths were resolved hold cwd-relative paths
            if here.exists() or not Path(d).exists():
                data = {**data, "task": {**task, "data_dir": str(here)}}
    a = data.get("analysis")
    if _path_text(a) and not computed_analysis(a) and not Path(a).expanduser().is_absolute():
        data = {**data, "analysis": str((folder / Path(a).expanduser()).resolve())}
    if isinstance(model, dict) and _path_text(model.get("name")):
        name = model["name"]
        if not Path(name).is_absolute() and (folder / name / "config.json").is_file():
            data = {**data, "model": {**model, "name": str((folder / name).resolve())}}
    return data


def validate(cfg: ExperimentConfig) -> None:
    """Cross-field checks that types alone can't express."""
    if cfg.train.batch_size < 1 or cfg.train.grad_accum < 1:
        raise ConfigError("train.batch_size and train.grad_accum must be >= 1")
    if not 0 < cfg.task.train_fraction <= 1:
        raise ConfigError(f"task.train_fraction must be in (0, 1], got {cfg.task.train_fraction}")
    if cfg.optim.schedule not in (None, "linear", "constant"):
        raise ConfigError(f"optim.schedule must be 'linear' or 'constant', "
                          f"got {cfg.optim.schedule!r}")
    if cfg.train.mixed_precision not in ("no", "bf16", "fp16"):
        raise ConfigError("train.mixed_precision must be 'no', 'bf16' or 'fp16'")
    if cfg.train.max_steps is None and cfg.train.epochs <= 0:
        raise ConfigError("train.epochs must be > 0 (or set train.max_steps)")
    t = cfg.train
    for key, value, low in (  # (key, value, least value); None = unset where allowed
            ("train.max_steps", t.max_steps, 1), ("train.eval_every", t.eval_every, 1),
            ("train.save_every", t.save_every, 1),
            ("train.early_stopping_patience", t.early_stopping_patience, 1),
            ("train.log_every", t.log_every, 1), ("eval.batch_size", cfg.eval.batch_size, 1),
            ("task.train_limit", cfg.task.train_limit, 1),
            ("task.eval_limit", cfg.task.eval_limit, 1),
            ("model.max_length", cfg.model.max_length, 2)):
        if value is not None and value < low:
            raise ConfigError(f"{key} must be >= {low}, got {value}")
    o = cfg.optim
    if o.lr is not None and not o.lr >= 0:  # 0 is allowed: a run that trains nothing
        raise ConfigError(f"optim.lr must be >= 0, got {o.lr}")
    if o.weight_decay is not None and not o.weight_decay >= 0:
        raise ConfigError(f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    if o.warmup_ratio is not None and not 0 <= o.warmup_ratio <= 1:
        raise ConfigError(f"optim.warmup_ratio must be in [0, 1] (a share of the steps), got "
                          f"{o.warmup_ratio}")
    if o.max_grad_norm is not None and not o.max_grad_norm > 0:
        raise ConfigError(f"optim.max_grad_norm must be > 0 (or null: no clipping), got "
                          f"{o.max_grad_norm}")
    if not (o.eps > 0 and len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas)):
        raise ConfigError(f"optim.eps must be > 0 and optim.betas two numbers in [0, 1), got "
                          f"{o.eps} and {list(o.betas)}")
    if cfg.model.dropout is not None and not 0 <= cfg.model.dropout < 1:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    if not 0 <= cfg.seed < 2**32:  # what numpy and Python's random take
        raise ConfigError(f"seed must be in 0 .. 2**32 - 1, got {cfg.seed}")
    for key, text in (("name", cfg.name), ("output_dir", cfg.output_dir),
                      ("model.name", cfg.model.name), ("task.data_dir", cfg.task.data_dir),
                      ("analysis", cfg.analysis)):
        if text is not None and "\0" in text:
            raise ConfigError(f"{key} {text!r} holds a NUL character, which no path can; "
                              "remove it")
    name = cfg.name
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ConfigError(f"name {name!r} must be one folder name (no '/', not '.' or '..'); "
                          "put the folder above it in output_dir")


def with_optim_defaults(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with every unset (None) optim field filled: from the tuner's published recipe
    (``recommended_optim``: PASTA's and Diff-Prune's official scripts) when it has one,
    else from ``OPTIM_DEFAULTS``. Values the config sets are kept. Batch size and max length
    stay the config's own (the recipes list them for reference)."""
    missing = [k for k in OPTIM_DEFAULTS if getattr(cfg.optim, k) is None]
    if not missing:
        return cfg
    from .tuning.base import resolve_tuning  # tuning imports this module

    try:
        _, tuner_cfg = resolve_tuning(cfg.tuning.method)
    except Exception as e:  # an unknown tuner: the same error the run would raise later
        raise ConfigError(f"tuning.method {cfg.tuning.method!r}: {e}") from None
    recipe = type(tuner_cfg).recommended_optim
    values = {k: getattr(recipe, k) if recipe is not None else OPTIM_DEFAULTS[k]
              for k in missing}
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **values))


def resolved_yaml(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_changes(old: ExperimentConfig, new: ExperimentConfig,
                   ignore: tuple[str, ...] = ("name", "output_dir", "train.keep_checkpoints")
                   ) -> list[str]:
    """The settings that differ between two configs, as ``key: old -> new`` lines (keys in
    ``ignore``, or under them, skipped: a run's location and what it keeps on disk are not
    part of what it computes)."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict) and d:
            return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): d}

    a, b = flat(to_dict(old)), flat(to_dict(new))
    keys = [k for k in dict.fromkeys([*a, *b])
            if not any(k == i or k.startswith(i + ".") for i in ignore)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def run_config_changes(run_dir: Path, cfg: ExperimentConfig) -> list[str] | None:
    """How ``cfg`` differs from the config saved in ``run_dir/config.yaml`` (None when there
    is none); a saved config this version cannot read counts as one change."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.exists():
        return None
    try:
        old = from_dict(ExperimentConfig, yaml.safe_load(saved.read_text()) or {})
    except (ConfigError, yaml.YAMLError) as e:
        return [f"{saved} cannot be read by this version ({e})"]
    return config_changes(old, cfg)
