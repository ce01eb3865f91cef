"""gtx: sparse attention as message passing over token graphs.

Plugin authors write ``from gtx import hookimpl``; see ``gtx/hookspecs.py`` for the hooks.
"""

from gtx.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"
__all__ = ["hookimpl", "hookspec", "__version__"]
