"""Head analysis: token info (tokens), scorers and classifier (heads), figures (plots),
tables and report (report), a run folder as the report reads it (runfiles).

Importing this package loads torch only; matplotlib loads when a figure is first drawn
(``from attnlab.analysis import plots``, or ``build_report``).
"""

from .heads import (
    DEFAULT_SCORERS,
    HEAD_CLASSES,
    NO_CLASS,
    SCORERS,
    ClassRule,
    HeadAnalysis,
    HeadScoreAccumulator,
    HeadScorer,
    HeadView,
    analyze_heads,
    build_scorer,
    class_counts,
    class_names,
    classify_heads,
    classify_shares,
    register_scorer,
    score_heads,
)
from .report import build_report, example_maps, read_json, to_csv, to_json
from .runfiles import metric_groups, plan_rules, read_history, replaced_heads
from .tokens import TokenInfo, token_infos

__all__ = [
    "DEFAULT_SCORERS",
    "HEAD_CLASSES",
    "NO_CLASS",
    "SCORERS",
    "ClassRule",
    "HeadAnalysis",
    "HeadScoreAccumulator",
    "HeadScorer",
    "HeadView",
    "TokenInfo",
    "analyze_heads",
    "build_report",
    "build_scorer",
    "class_counts",
    "class_names",
    "classify_heads",
    "classify_shares",
    "example_maps",
    "metric_groups",
    "plan_rules",
    "read_history",
    "read_json",
    "replaced_heads",
    "register_scorer",
    "score_heads",
    "to_csv",
    "to_json",
    "token_infos",
]
