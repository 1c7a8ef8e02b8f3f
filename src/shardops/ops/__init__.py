"""Op families, one module each. Importing this package registers every strategy.

Every module in this package is imported, so a new op family needs no edit here.
"""

import importlib
import pkgutil

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
