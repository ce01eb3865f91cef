"""User-facing errors: each message is one line that names the thing and the fix."""


class GtxError(Exception):
    """An error caused by input or plugins; the CLI prints it as one line and exits with code 2."""


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
