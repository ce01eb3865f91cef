"""User-facing errors: each message is one line that names the thing and the fix."""

from collections.abc import Iterator
from contextlib import contextmanager


class GtxError(Exception):
    """An error caused by input or plugins; the CLI prints it as one line and exits with code 2."""


class Interrupted(GtxError):
    """Ctrl-C: what was done is kept; the message says how to continue. Exit code 130, the shell's
    code for a process stopped by SIGINT."""

    exit_code = 130


class UnknownNameError(GtxError, KeyError):
    """A name that no plugin registered."""

    def __init__(self, kind: str, name: str, known):
        self.kind, self.name, self.known = kind, name, sorted(known)
        plural = kind + ("es" if kind.endswith("s") else "s")
        super().__init__(f"unknown {kind} {name!r}; known {plural}: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class PatternError(GtxError):
    """A pattern spec that does not parse, or a pattern whose edges break an invariant."""


class PluginError(GtxError):
    """A plugin that could not be loaded, registered a duplicate name, or raised inside a hook."""


@contextmanager
def plugin_code(who: str, doing: str = "", settings: str = "") -> Iterator[None]:
    """Run code a plugin supplied: a GtxError passes as it is; with ``settings`` (what they belong
    to, e.g. "model 'ut'"), a ValueError is a setting the plugin rejects; any other exception becomes
    one PluginError line, ``<who> raised <doing>: <type>: <message>``."""
    try:
        yield
    except GtxError:
        raise
    except ValueError as e:
        if not settings:
            raise PluginError(f"{who} raised{' ' + doing if doing else ''}: ValueError: {e}") from e
        raise GtxError(f"bad settings for {settings}: {e}") from None
    except Exception as e:
        raise PluginError(f"{who} raised{' ' + doing if doing else ''}: {type(e).__name__}: {e}") from e
