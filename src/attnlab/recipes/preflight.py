"""What ``attnlab validate`` and ``attnlab run`` both check before anything runs.

One list, so the two agree: whatever ``run`` would refuse, ``validate`` refuses first, with
the same one-line message. Each failure is a :class:`~attnlab.config.ConfigError` (or the
registry's / surgery's own error) naming the problem and the fix.

``run`` checks everything but the data (it loads the data itself a moment later, with the
same errors); ``validate`` loads the data too (``load_data=True``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError, ExperimentConfig
from ..core import mechanism_class
from ..hf.check import check_model_config, load_model_config
from ..hf.plan import Plan
from ..models import SIZES
from ..tasks import get_task
from ..tasks.base import canonical_split, require_package
from ..tuning import resolve_tuning
from .evaluation import eval_splits_of
from .head_select import check_run_selectors
from .rundir import check_writable


def check_model_name(name: str) -> None:
    """``default``, ``scratch:SIZE``, or a local model folder (hub ids only when online)."""
    if name == "default":
        return
    if name.startswith("scratch:"):
        size = name.split(":", 1)[1]
        if size not in SIZES:
            raise ConfigError(f"model.name {name!r}: unknown size {size!r}; use one of "
                              + ", ".join(f"scratch:{s}" for s in SIZES))
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name {name!r}: the folder has no config.json; point it "
                              "at a folder written by save_pretrained")
        return
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ConfigError(
            f"model.name {name!r}: no such local folder, and the Hugging Face hub is offline "
            "(HF_HUB_OFFLINE); give a folder written by save_pretrained, 'default' (the "
            "embedded MiniLM) or 'scratch:SIZE'")


def check_attn_implementation(name: str) -> None:
    """``model.attn_implementation``: ``eager`` or one registered with transformers
    (``sdpa``, ``flex_attention``, ``flash_attention_2``, ...), optionally ``paged|``, or a
    hub kernel ``org/repo`` (which transformers fetches itself)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name.removeprefix("paged|") in known or "/" in name:
        return
    from ..hf.backend import BACKEND  # attnlab's own, which plans set: not for the config

    shown = sorted(set(known) - {BACKEND})
    raise ConfigError(f"model.attn_implementation {name!r} is not an attention of "
                      f"transformers; use one of {', '.join(shown)}")


def check_task_ids(plan: Plan | None, task_id: int | None) -> None:
    """``task.task_id`` conditions task-conditioned mechanisms (``Capabilities.
    task_conditioned``): it needs one in the plan, each of those needs an id (the run's or
    its own ``task``), and the id must be one of its ``tasks``."""
    conditioned = [r.mechanism for r in (plan.rules if plan else ())
                   if mechanism_class(r.mechanism.name).caps.task_conditioned]
    if task_id is not None and not conditioned:
        raise ConfigError(f"task.task_id={task_id} but no mechanism of the plan is "
                          "task-conditioned (e.g. camtl_prior); drop task.task_id or add one")
    for mech in conditioned:
        fields = mech.to_dict()  # a task-conditioned config has tasks and task (Capabilities)
        tasks, fixed = fields["tasks"], fields["task"]
        if task_id is None and fixed is None:
            raise ConfigError(f"plan mechanism {mech.spec()!r} needs a task id: set "
                              f"task.task_id (0..{tasks - 1}) or fix one with task=...")
        if task_id is not None and not 0 <= task_id < tasks:
            raise ConfigError(f"task.task_id={task_id} is not a task of {mech.spec()!r} "
                              f"(ids 0..{tasks - 1}); pick an id below its tasks")


def preflight(cfg: ExperimentConfig, load_data: bool = False) -> list[str]:
    """Raise the first problem that would stop ``cfg`` from running (nothing is written).
    Returns warnings that do not stop it (``validate`` prints them; ``run`` gives its own
    when it builds the model)."""
    task = get_task(cfg.task.name)
    for key, split in (("task.train_split", cfg.task.train_split),
                       ("task.eval_split", cfg.task.eval_split)):
        if split is not None:
            try:
                canonical_split(split, task.splits, task.name)
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
    check_task_ids(Plan.parse(cfg.plan) if cfg.plan else None, cfg.task.task_id)
    resolve_tuning(cfg.tuning.method)
    check_model_name(cfg.model.name)
    check_attn_implementation(cfg.model.attn_implementation)
    plan = check_run_selectors(cfg)  # class:/score selectors: an analysis, known names
    unread = check_model_config(cfg.model.name, plan or None)  # architecture + plan
    check_tuner_fits(cfg, plan or None)
    if cfg.task.data_dir is None:
        require_package("datasets", "hub", f"task.data_dir: null (task {task.name!r} from "
                        "the Hugging Face hub)")
    elif cfg.task.data_dir != "builtin" and not Path(cfg.task.data_dir).expanduser().is_dir():
        raise ConfigError(
            f"task.data_dir {cfg.task.data_dir!r} is not a folder; give the data root (e.g. "
            "../shared/data), 'builtin' for the shipped sample, or null for the hub")
    check_writable(cfg.run_dir)
    if load_data:
        train_split = cfg.task.train_split or task.train_split
        nonempty(task.load(train_split, cfg.task.data_dir), cfg, train_split)
        for split in eval_splits_of(cfg, task):
            nonempty(task.load(split, cfg.task.data_dir), cfg, split)
    dead = unread_lora_targets(cfg, unread)
    return [dead] if dead is not None else []


def unread_lora_targets(cfg: ExperimentConfig, unread: list[tuple[int, str, str]]
                        ) -> str | None:
    """The warning ``run`` gives (``hf.unread``) from the config alone: LoRA's target
    modules (the config's or the model type's default) include projections the plan
    leaves unread (``check_model_config``'s (layer, role, module name)); else None."""
    from ..hf.unread import fix
    from ..tuning.peft import LoraTunerConfig, default_lora_targets

    _, tuner_cfg = resolve_tuning(cfg.tuning.method)
    if not unread or not isinstance(tuner_cfg, LoraTunerConfig):
        return None
    model_type = str(getattr(load_model_config(cfg.model.name), "model_type", "") or "")
    targets = tuner_cfg.target_modules or default_lora_targets(model_type) or ()
    leaves = {t.rsplit(".", 1)[-1] for t in targets}  # peft matches the end of a name
    hit = [(layer, name) for layer, _, name in unread if name in leaves]
    if not hit:
        return None
    names = "/".join(dict.fromkeys(name for _, name in hit))
    layers = ", ".join(str(x) for x in sorted({layer for layer, _ in hit}))
    return (f"lora: target_modules include the {names} projections of layer(s) {layers}, "
            f"which no head of those layers reads: their LoRA matrices get no gradient from "
            f"the task loss; {fix(names)}")


def check_tuner_fits(cfg: ExperimentConfig, plan: Plan | None) -> None:
    """Refuse, from the model's config, a prefix tuner the run cannot take: a plan mechanism
    that reads key j as token j (``tuning.prefix.refuse_token_keyed``, the check the tuner
    itself makes on the planned model), or, with ``shift_positions``, more positions
    (prefix + ``model.max_length``) than the model has."""
    from ..tuning.prefix import PrefixTunerConfig, refuse_token_keyed

    _, tuner_cfg = resolve_tuning(cfg.tuning.method)
    if not isinstance(tuner_cfg, PrefixTunerConfig):
        return
    config = load_model_config(cfg.model.name)
    p = tuner_cfg.num_virtual_tokens
    positions = getattr(config, "max_position_embeddings", None)
    if tuner_cfg.shift_positions and positions is not None and p + cfg.model.max_length > positions:
        raise ConfigError(
            f"tuning.method: prefix's {p} virtual tokens shift the tokens' positions to "
            f"{p}..{p + cfg.model.max_length - 1}, beyond the model's {positions} "
            f"(max_position_embeddings); lower num_virtual_tokens or model.max_length to a "
            f"sum of at most {positions}, or set prefix(shift_positions=False)")
    if plan is None:
        return
    num_layers, num_heads = config.num_hidden_layers, config.num_attention_heads
    resolved = plan.resolve(num_layers, num_heads)  # layer -> head -> config
    refuse_token_keyed([list(resolved.get(li, {}).values()) for li in range(num_layers)], p)


def nonempty(examples: list, cfg: ExperimentConfig, split: str) -> list:
    """``examples`` of ``split``, refused when there are none (a data file with a header
    and no rows): training would stop later with no word of the file."""
    if not examples:
        where = cfg.task.data_dir or "the Hugging Face hub"
        raise ConfigError(f"task {cfg.task.name!r}: the {split} split in {where} has no "
                          "examples; fill its file (or generate it again) or point "
                          "task.data_dir at another folder")
    return examples
