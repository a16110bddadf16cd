"""The one version lookup: an installed distribution's version, for messages and checks."""

from __future__ import annotations

import sys


def installed(*dists: str, module: str | None = None, default: str = "unknown") -> str:
    """The version of the first of ``dists`` that is installed.

    Else the ``__version__`` of ``module`` when it is imported (a source checkout on the path),
    else ``default``. Best effort: a broken metadata lookup counts as not installed.
    """
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in dists:
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
    except Exception:  # pragma: no cover - metadata is best effort
        pass
    found = sys.modules.get(module) if module is not None else None
    return str(getattr(found, "__version__", default))
