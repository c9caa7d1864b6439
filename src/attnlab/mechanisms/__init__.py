"""Mechanism families, one file each. Importing this package registers every built-in.

Every module in this folder whose name does not start with "_" is imported, so adding a
mechanism (or a whole family file) touches that file only.
"""

import pkgutil
from importlib import import_module

FAMILIES = sorted(
    m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")
)

for _family in FAMILIES:
    import_module(f"{__name__}.{_family}")
