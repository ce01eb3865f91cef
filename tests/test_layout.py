"""The architecture, kept: imports go down the layers and never in a circle; the public API stays."""

import ast
from pathlib import Path

import gtx

ROOT = Path(gtx.__file__).parent
#: bottom to top; a module may import its own layer's modules and those below, never above
LAYERS = [
    ("errors", "values", "files", "memory", "native"),
    ("plugins",),
    ("graph",),
    ("data",),
    ("backends",),
    ("attention",),
    ("model",),
    ("records",),
    ("run",),
    ("sweeps",),
    ("measure",),
    ("pictures",),
    ("testing",),
    ("cli",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The gtx modules ``path`` imports, at the top or inside functions, ``from gtx.x import y`` counting y where it is a module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gtx" and node.level == 0:
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "gtx"}
    return out - {"gtx"}  # the package root: __version__ and hookimpl, the facade


GRAPH = {name: {m for m in imports(path) if m != name} for name, path in MODULES.items() if name != "gtx"}


def layer(module: str) -> int:
    return LAYER[module.split(".")[1]]


def test_every_module_has_a_layer():
    assert not [m for m in GRAPH if m.split(".")[1] not in LAYER], (
        "a new top-level folder or module needs a place in LAYERS"
    )


def test_imports_only_go_down():
    up = sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps if d in GRAPH and layer(d) > layer(m))
    assert not up, "imports that go up a layer:\n" + "\n".join(up)


def test_no_import_cycles():
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            # a package and its own modules
            if d in GRAPH and d != m and not (m.startswith(d + ".") or d.startswith(m + ".")):
                if state.get(d) == "open":
                    cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
                elif d not in state:
                    visit(d, [*stack, d])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_public_api_is_what_docs_api_md_lists():
    """gtx.__all__ is exactly the names of docs/api.md's table, and each imports."""
    import re
    from pathlib import Path

    table = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text().split("## Where things live")[0]
    listed = {
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", row.split(" | ")[0])
    }
    assert sorted(gtx.__all__) == sorted(listed)
    for name in listed:
        assert getattr(gtx, name) is not None
    assert (
        gtx.parse_pattern("local:w=2").spec == "local:w=2" and callable(gtx.plot.pattern) and callable(gtx.load_results)
    )


def test_the_rooms_hold_what_their_names_say():
    """Built-in plugins sit in their rooms: ``patterns/`` registers patterns or biases, ``plugins/models/``
    models, ``plugins/tasks/`` tasks, and nothing sits loose in ``plugins/``; ``gtx/model/`` holds the
    model parts (a layer above ``gtx/attention/``)."""
    checkout = ROOT.parent
    rooms = {
        "patterns": {"register_patterns", "register_biases"},
        "plugins/models": {"register_models"},
        "plugins/tasks": {"register_tasks"},
    }
    misplaced = []
    for room, hooks in rooms.items():
        for path in sorted((checkout / room).glob("*.py")):
            defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
            registers = {name for name in defined if name.startswith("register_")}
            if not registers or not registers <= hooks:
                misplaced.append(f"{room}/{path.name} registers {sorted(registers)}")
    assert not misplaced, "plugins in the wrong room:\n" + "\n".join(misplaced)
    assert not list((checkout / "plugins").glob("*.py")), "a built-in plugin goes in plugins/models/ or plugins/tasks/"
    assert {"engine", "layers", "act", "stack", "decode"} <= {p.stem for p in (ROOT / "model").glob("*.py")}


def test_the_built_in_plugins_import_only_the_public_api():
    """``patterns/`` and ``plugins/`` are ordinary plugins: every gtx name they use comes from
    ``from gtx import ...`` (docs/api.md), at the top or inside a function, so what a built-in can
    do a user's plugin can too."""
    checkout = ROOT.parent
    private = []
    for path in sorted([*(checkout / "patterns").glob("*.py"), *(checkout / "plugins").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "gtx":
                if node.module != "gtx" or not {a.name for a in node.names} <= set(gtx.__all__):
                    private.append(f"{path.relative_to(checkout)}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.Import):
                private += [
                    f"{path.relative_to(checkout)}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.startswith("gtx")
                ]
    assert not private, (
        "built-in plugins reaching past the public API (add what they need to gtx/__init__.py and docs/api.md):\n"
        + "\n".join(private)
    )
