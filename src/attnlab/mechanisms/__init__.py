"""Mechanism families, one file each. Importing this package registers every built-in.

Every module in this folder whose name does not start with "_" is imported, so adding a
mechanism (or a whole family file) touches that file only.
"""

import pkgutil
from importlib import import_module

from . import _blocksparse

FAMILIES = sorted(
    m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")
)

for _family in FAMILIES:
    import_module(f"{__name__}.{_family}")


def chunk_elems() -> int:
    """Scores per chunk of the blocked engine (``ATTNLAB_CHUNK_ELEMS``, read at import):
    sparse patterns draw their attention-dropout masks per chunk."""
    return _blocksparse.CHUNK_ELEMS


def chunk_elems_error() -> str | None:
    """Why ``ATTNLAB_CHUNK_ELEMS`` could not be used (one line naming the fix), or None."""
    return _blocksparse.CHUNK_ENV_ERROR
