"""Mechanism families, one file each. Importing this package registers every built-in.

Every module in this folder whose name does not start with "_" is imported, so adding a
mechanism (or a whole family file) touches that file only.
"""

import pkgutil
from importlib import import_module

from . import _blocklayout, _flex

FAMILIES = sorted(
    m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")
)

for _family in FAMILIES:
    import_module(f"{__name__}.{_family}")


def chunk_elems() -> int:
    """Scores per chunk of the blocked engine (``ATTNLAB_CHUNK_ELEMS``, read at import):
    sparse patterns draw their attention-dropout masks per chunk."""
    return _blocklayout.CHUNK_ELEMS


def chunk_elems_error() -> str | None:
    """Why ``ATTNLAB_CHUNK_ELEMS`` could not be used (one line naming the fix), or None."""
    return _blocklayout.CHUNK_ENV_ERROR


def compiled_flex_attention():
    """torch's ``flex_attention`` compiled once per process (``dynamic=False``), as the sparse
    patterns run it on CUDA; call it inside ``flex_recompile_limit()``."""
    return _flex.compiled_flex()


def flex_recompile_limit():
    """A context raising dynamo's recompile limit for FlexAttention calls (one compiled
    graph per shape; past dynamo's default of 8 it falls back to eager FlexAttention)."""
    return _flex.recompile_limit()

