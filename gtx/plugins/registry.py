"""Plugin loading, and the registries built from the hooks.

Load order (``load_plugins``, lazy and idempotent): gtx's own backends; the built-in plugin folders
``patterns/``, ``plugins/models/`` and ``plugins/tasks/`` beside the ``gtx`` package, loaded by path like a user's
folder; installed packages of the entry-point group ``gtx`` (``GTX_LOAD_PLUGINS=a,b`` allow-lists
distributions, an empty value loads none); then user folders (``--plugins-dir`` or
``GTX_PLUGINS_DIR``, several separated by ``os.pathsep``). Last, ``pm.check_pending()`` rejects
misspelled hooks. A packaged plugin declares::

    [project.entry-points.gtx]
    myplugin = "gtx_myplugin"
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy

from gtx.errors import PluginError, UnknownNameError, plugin_code
from gtx.plugins import hookspecs

ROOT = Path(__file__).resolve().parents[2]  # gtx/plugins/registry.py -> the checkout


#: the built-in plugin folders, relative to where they are installed
BUILTIN_FOLDERS = ("patterns", "plugins/models", "plugins/tasks")


def _builtin_dirs() -> tuple[Path, ...]:
    """``patterns/``, ``plugins/models/`` and ``plugins/tasks/`` beside the package (a checkout, an
    editable install), else where a regular install puts them (``<prefix>/share/gtx``)."""
    bases = (ROOT, Path(sys.prefix) / "share" / "gtx")
    base = next((b for b in bases if (b / "patterns").is_dir()), ROOT)
    return tuple(base / folder for folder in BUILTIN_FOLDERS)


BUILTIN_DIRS = _builtin_dirs()
DEFAULT_PLUGINS = ("gtx.backends", "gtx.run.loggers")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")

pm = pluggy.PluginManager("gtx")
pm.add_hookspecs(hookspecs)

_labels: dict[str, str] = {}  # pluggy plugin name -> what a user recognises (file path, distribution)
_loaded_dirs: set[Path] = set()
_state = {"builtins": False, "entrypoints": False, "generation": 0}


def _register(plugin: object, name: str, label: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin {label}: {e}") from None
    _labels[name] = label
    _state["generation"] += 1


def load_file(path: Path) -> None:
    """Import one plugin file and register it (a plain ``.py`` file with ``@hookimpl`` functions)."""
    path = path.resolve()
    name = str(path)
    if pm.has_plugin(name):
        return
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    modname = f"gtx_plugin_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module  # so dataclasses, pickling and tracebacks can find it
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[modname]
        raise PluginError(f"plugin file {path} failed to import: {type(e).__name__}: {e}") from e
    _register(module, name, str(path))


def load_dir(directory: str | Path) -> None:
    """Load every ``*.py`` file of a folder (not recursive, ``_``-prefixed files skipped)."""
    directory = Path(directory).resolve()
    if directory in _loaded_dirs:
        return
    if not directory.is_dir():
        raise PluginError(f"plugins folder {directory} does not exist; pass an existing folder to --plugins-dir")
    for path in sorted(directory.glob("*.py")):
        if not path.name.startswith("_"):
            load_file(path)
    _loaded_dirs.add(directory)


def _load_entrypoints() -> None:
    allow = os.environ.get("GTX_LOAD_PLUGINS")
    allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
    for ep in importlib.metadata.entry_points(group="gtx"):
        dist = ep.dist.name if ep.dist else ep.name
        if allowed is not None and dist not in allowed:
            continue
        label = f"{dist} ({ep.value})"
        try:
            module = ep.load()
        except Exception as e:
            raise PluginError(f"plugin {label} failed to import: {type(e).__name__}: {e}") from e
        if not pm.is_registered(module):
            _register(module, f"entrypoint:{ep.name}", label)


def load_plugins(dirs: Iterable[str | Path] = (), entrypoints: bool = True) -> None:
    """Load built-ins, installed plugins and the given folders; idempotent. Raises PluginError."""
    if not _state["builtins"]:
        for modname in DEFAULT_PLUGINS:
            _register(importlib.import_module(modname), modname, modname)
        for d in BUILTIN_DIRS:
            load_dir(d)
        _state["builtins"] = True
    if entrypoints and not _state["entrypoints"]:
        _load_entrypoints()
        _state["entrypoints"] = True
    env_dirs = [d for d in os.environ.get("GTX_PLUGINS_DIR", "").split(os.pathsep) if d]
    for d in [*env_dirs, *dirs]:
        load_dir(d)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        label = _labels.get(pm.get_name(e.plugin) or "", repr(e.plugin))
        hooks = ", ".join(n for n in dir(hookspecs) if n.startswith("register_"))
        raise PluginError(f"plugin {label}: {e}; gtx's hooks are: {hooks}") from None


def unload_dir(directory: str | Path) -> None:
    """Unregister the plugins loaded from a folder (tests use this to undo a temporary folder)."""
    directory = Path(directory).resolve()
    for name, _ in list(pm.list_name_plugin()):
        if Path(name).parent == directory:
            pm.unregister(name=name)
            _labels.pop(name, None)
    _loaded_dirs.discard(directory)
    _state["generation"] += 1


def label_of(plugin_name: str) -> str:
    return _labels.get(plugin_name, plugin_name)


#: the kinds whose entries may declare a definition version (``register(name, factory, definition=N)``)
DEFINED_KINDS = ("pattern", "bias")


@dataclass(frozen=True)
class Entry:
    """One registered thing: its name, the object, the plugin that registered it, its config class,
    and (patterns and score biases) its definition version: the number a plugin raises when the
    method computes something else under the same name; results rows and figure tables record it."""

    name: str
    obj: Any
    plugin: str
    config: type | None = None
    definition: int | None = None

    @property
    def description(self) -> str:
        """The docstring's first paragraph, on one line."""
        doc = (inspect.getdoc(self.obj) or "").strip()
        return " ".join(doc.split("\n\n")[0].split()) if doc else "Undocumented"


class Registry:
    """Name -> Entry for one kind, rebuilt from its ``register_*`` hook whenever plugins change."""

    def __init__(self, kind: str, hook: str):
        self.kind, self.hook = kind, hook
        self._entries: dict[str, Entry] = {}
        self._generation = -1

    def entries(self) -> dict[str, Entry]:
        if not _state["builtins"]:
            load_plugins()
        if self._generation != _state["generation"]:
            self._entries = self._collect()
            self._generation = _state["generation"]
        return self._entries

    def _collect(self) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        for impl in reversed(getattr(pm.hook, self.hook).get_hookimpls()):  # registration order
            label = label_of(impl.plugin_name)

            def register(
                name: str, obj: Any, *, config: type | None = None, definition: int | None = None, _label: str = label
            ) -> None:
                if not isinstance(name, str) or not NAME_RE.match(name):
                    raise PluginError(
                        f"plugin {_label} registered the {self.kind} name {name!r}; use letters, digits, '_' or '-'"
                    )
                if name in entries:
                    raise PluginError(
                        f"{self.kind} {name!r} is registered twice: by {entries[name].plugin} and by {_label}; rename one"
                    )
                if config is not None and not (isinstance(config, type) and dataclasses.is_dataclass(config)):
                    raise PluginError(
                        f"plugin {_label} registered {self.kind} {name!r} with config={config!r}; pass a dataclass (or no config)"
                    )
                if definition is not None and (
                    self.kind not in DEFINED_KINDS or type(definition) is not int or definition < 1
                ):
                    raise PluginError(
                        f"plugin {_label} registered {self.kind} {name!r} with definition={definition!r}; "
                        + (
                            "give a whole number from 1, raised when the method computes something else under its name"
                            if self.kind in DEFINED_KINDS
                            else f"only patterns and score biases declare a definition version; drop it from {name!r}"
                        )
                    )
                entries[name] = Entry(name, obj, _label, config, definition)

            call_hook(impl, label, register=register)
        return entries

    def get(self, name: str) -> Entry:
        entries = self.entries()
        if name not in entries:
            raise UnknownNameError(self.kind, name, entries)
        return entries[name]

    def names(self) -> list[str]:
        return sorted(self.entries())


def call_hook(impl: pluggy.HookImpl, label: str, **kwargs: Any) -> Any:
    """Call one hook implementation with the arguments it asks for; name the plugin if it raises."""
    with plugin_code(f"plugin {label}", f"in {impl.function.__name__}"):
        return impl.function(**{a: kwargs[a] for a in impl.argnames})


def call_each(hook: str, after: Callable[[str], None] | None = None, **kwargs: Any) -> None:
    """Call every implementation of a hook, naming the plugin that raises; ``after(label)``, if given,
    checks what each plugin did."""
    for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
        call_hook(impl, label_of(impl.plugin_name), **kwargs)
        if after is not None:
            after(label_of(impl.plugin_name))


PATTERNS = Registry("pattern", "register_patterns")
BACKENDS = Registry("backend", "register_backends")
MODELS = Registry("model", "register_models")
TASKS = Registry("task", "register_tasks")
LOGGERS = Registry("logger", "register_loggers")
BIASES = Registry("bias", "register_biases")


def task_metrics() -> dict[str, str]:
    """Each registered task's own metric (``Task.metric``: bpc for text, query_acc for recall)."""
    return {name: getattr(entry.obj, "metric", "token_acc") for name, entry in TASKS.entries().items()}
