"""Import dgl 2.1 beside a newer torch: the two shims it needs, in one place.

1. ``dgl/utils`` imports ``setuptools.extern.packaging``, which setuptools >= 71 removed: alias it
   to the ``packaging`` module.
2. ``dgl.graphbolt`` (a sampling library gtx never uses) ships compiled libraries only for old torch
   releases and raises at import: put a placeholder module in its place, whose attribute access
   raises a clear error. The error subclasses AttributeError so that ``hasattr`` probes (torch and
   inspect walk ``sys.modules``) see a missing attribute rather than crash.

Always import dgl through ``import_dgl()``.
"""

from __future__ import annotations

import os
import sys
import types

_dgl = None
_error: str | None = None


class GraphboltUnavailable(AttributeError):
    pass


class _GraphboltPlaceholder(types.ModuleType):
    def __getattr__(self, name: str):
        raise GraphboltUnavailable(f"dgl.graphbolt.{name}: graphbolt is not loaded by gtx (no build for this torch)")


def _install_shims() -> None:
    try:
        import setuptools.extern.packaging  # noqa: F401
    except ImportError:
        import packaging
        import packaging.version

        extern = sys.modules.get("setuptools.extern") or types.ModuleType("setuptools.extern")
        extern.packaging = packaging
        sys.modules["setuptools.extern"] = extern
        sys.modules["setuptools.extern.packaging"] = packaging
        sys.modules["setuptools.extern.packaging.version"] = packaging.version
    sys.modules.setdefault("dgl.graphbolt", _GraphboltPlaceholder("dgl.graphbolt"))
    os.environ.setdefault("DGLBACKEND", "pytorch")  # else dgl writes ~/.dgl/config.json and prints a notice


def import_dgl():
    """dgl, imported with the shims; raises ImportError with the reason where it cannot load."""
    global _dgl, _error
    if _dgl is None and _error is None:
        import torch  # noqa: F401 - torch first, so dgl binds to it

        _install_shims()
        try:
            import dgl
            import dgl.ops
            from dgl.nn.functional import edge_softmax  # noqa: F401
        except Exception as e:  # a missing package, or a build for another torch/CUDA
            _error = f"{type(e).__name__}: {e}"
        else:
            _dgl = dgl
    if _dgl is None:
        raise ImportError(f"dgl cannot be imported: {_error}")
    return _dgl


def dgl_error() -> str | None:
    """None when dgl imports, else why not."""
    try:
        import_dgl()
    except ImportError as e:
        return str(e)
    return None
