"""Parameter-efficient tuners: which weights of a Hugging Face model train.

``full`` (default), ``pasta``, ``bitfit``, ``adapter``, ``lora`` (via peft), ``prefix``,
``diff_prune``, ``wo_sparse`` (W_O L1 / group lasso), ``mae`` (mixture of attentive
experts). Importing this package registers them all; see ``base`` for the protocol
and ``accounting`` for parameter counts.
"""

from . import (  # noqa: F401  (register tuners)
    adapters,
    bitfit,
    diff_prune,
    full,
    mae,
    pasta,
    prefix,
    wo_sparse,
)
from . import peft as _peft  # noqa: F401  (peft itself is imported only when used)
from .accounting import build_published, count_parameters, format_params, params_report
from .base import (
    TUNERS,
    OptimRecipe,
    TaskInfo,
    Tuner,
    TunerConfig,
    TuningError,
    TuningRecord,
    get_tuner,
    list_tuners,
    load_tuned_file,
    resolve_tuning,
    save_tuned,
    tuning_record,
)

__all__ = [
    "TUNERS",
    "OptimRecipe",
    "TaskInfo",
    "Tuner",
    "TunerConfig",
    "TuningError",
    "TuningRecord",
    "build_published",
    "count_parameters",
    "format_params",
    "get_tuner",
    "list_tuners",
    "load_tuned_file",
    "params_report",
    "resolve_tuning",
    "save_tuned",
    "tuning_record",
]
