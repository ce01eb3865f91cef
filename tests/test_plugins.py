"""Plugin loading: folders, duplicates, misspelled hooks, plugins that raise, unknown names."""

import pytest

from gtx.errors import PluginError, UnknownNameError
from gtx.graph.spec import parse_pattern
from gtx.plugins import hookspecs
from gtx.plugins import registry as plugins
from gtx.plugins.registry import MODELS, PATTERNS, TASKS

NEW_PATTERN = """
    from gtx import hookimpl
    from gtx.graph.pattern import Pattern

    def diagonal() -> Pattern:
        '''Only the self-edge.'''
        return Pattern.from_rule(lambda q, k, n_q, n_k: q == k)

    @hookimpl
    def register_patterns(register):
        register("diagonal", diagonal)
"""


def test_hook_register_patterns(plugin_dir):
    plugins.load_plugins(dirs=[plugin_dir(diag=NEW_PATTERN)])
    assert "diagonal" in PATTERNS.names()
    assert PATTERNS.get("diagonal").description == "Only the self-edge."
    src, dst = parse_pattern("diagonal").edges("ee", 3, 3)
    assert src.tolist() == dst.tolist() == [0, 1, 2]


def test_unloading_a_folder_forgets_its_patterns(plugin_dir):
    folder = plugin_dir(diag=NEW_PATTERN)
    plugins.load_plugins(dirs=[folder])
    plugins.unload_dir(folder)
    assert "diagonal" not in PATTERNS.names()


def test_duplicate_names_name_both_plugins(plugin_dir):
    folder = plugin_dir(
        dup="""
        from gtx import hookimpl
        from gtx.graph.pattern import Pattern

        @hookimpl
        def register_patterns(register):
            register("local", lambda: None)
        """
    )
    plugins.load_plugins(dirs=[folder])
    with pytest.raises(PluginError) as info:
        PATTERNS.names()
    msg = str(info.value)
    assert "pattern 'local' is registered twice" in msg
    assert "patterns/local.py" in msg and str(folder / "dup.py") in msg


def test_misspelled_hook_is_an_error(plugin_dir):
    folder = plugin_dir(
        typo="""
        from gtx import hookimpl

        @hookimpl
        def register_pattern(register):
            pass
        """
    )
    with pytest.raises(
        PluginError, match=r"typo.py.*unknown hook 'register_pattern'.*gtx's hooks are: register_backends"
    ):
        plugins.load_plugins(dirs=[folder])


def test_plugin_raising_in_a_hook_is_named(plugin_dir):
    folder = plugin_dir(
        boom="""
        from gtx import hookimpl

        @hookimpl
        def register_patterns(register):
            raise RuntimeError("kaput")
        """
    )
    plugins.load_plugins(dirs=[folder])
    with pytest.raises(PluginError, match=r"plugin .*boom.py raised in register_patterns: RuntimeError: kaput"):
        PATTERNS.names()


def test_plugin_failing_at_import_is_named(plugin_dir):
    folder = plugin_dir(broken="import no_such_module_xyz\n")
    with pytest.raises(PluginError, match=r"plugin file .*broken.py failed to import: ModuleNotFoundError"):
        plugins.load_plugins(dirs=[folder])


def test_pattern_raising_while_building_edges_is_named(plugin_dir):
    folder = plugin_dir(
        bad_rule="""
        from gtx import hookimpl
        from gtx.graph.pattern import Pattern

        def bad():
            def rule(q, k, n_q, n_k):
                raise ZeroDivisionError("oops")
            return Pattern.from_rule(rule)

        @hookimpl
        def register_patterns(register):
            register("bad", bad)
        """
    )
    plugins.load_plugins(dirs=[folder])
    with pytest.raises(
        PluginError, match=r"pattern 'bad' raised while building ee edges for n_q=2, n_k=2: ZeroDivisionError"
    ):
        parse_pattern("bad").edges("ee", 2, 2)


def test_a_backend_whose_available_raises_or_takes_no_device_is_named(plugin_dir, cli):
    from gtx.backends import get_backend

    folder = plugin_dir(
        old_style="""
        from gtx import hookimpl
        from gtx.backends import Backend

        class Mine(Backend):
            name = "mine"

            def available(self):  # written before available took the device
                return None

        @hookimpl
        def register_backends(register):
            register("mine", Mine())
        """
    )
    plugins.load_plugins(dirs=[folder])
    with pytest.raises(PluginError, match=r"backend 'mine' of .*old_style.py raised in available\(device\): TypeError"):
        get_backend("mine")
    listed = cli("backends", "--plugins-dir", folder)
    assert listed.exit_code == 2 and "old_style.py raised in available(device)" in listed.output
    assert "Traceback" not in listed.output


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise RuntimeError('kaput')", r"raised computing ee attention: RuntimeError: kaput"),
        ("return v[:1]", r"returned \(1, 2, 8\) for ee attention, not \(n_dst, H, Dv\) = \(\d+, 2, 8\)"),
    ],
)
def test_a_plugin_backend_failing_in_a_run_is_one_line_naming_it(plugin_dir, tmp_path, tiny_run, body, message):
    import re

    folder = plugin_dir(
        failing=f"""
        from gtx import hookimpl
        from gtx.backends import Backend

        class Failing(Backend):
            name = "failing"

            def __call__(self, q, k, v, edges):
                {body}

        @hookimpl
        def register_backends(register):
            register("failing", Failing())
        """
    )
    args = ["--backend", "failing", "--plugins-dir", folder]
    result = tiny_run(tmp_path, *args, n_train=16, n_valid=4, n_test=4, exit_code=2).result
    assert "Traceback" not in result.output, result.output
    assert re.search(r"backend 'failing' of .*failing.py " + message, result.output), result.output


def test_missing_folder_is_an_error(tmp_path):
    with pytest.raises(PluginError, match="does not exist; pass an existing folder"):
        plugins.load_plugins(dirs=[tmp_path / "nope"])


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownNameError, match="unknown pattern 'nope'; known patterns: act, bigbird, bipartite"):
        PATTERNS.get("nope")


def test_check_pending_passes_with_all_builtins():
    plugins.load_plugins()
    plugins.pm.check_pending()


def test_every_hook_has_a_test():
    """Each hook in hookspecs has a test named test_hook_<name> somewhere in tests/."""
    import pathlib

    source = "\n".join(p.read_text() for p in pathlib.Path(__file__).parent.glob("test_*.py"))
    hooks = [n for n in dir(hookspecs) if n.startswith("register_")]
    assert hooks and all(hasattr(plugins.pm.hook, n) for n in hooks)
    for name in hooks:
        assert f"def test_hook_{name}(" in source, name


def test_registries_are_separate_kinds():
    assert PATTERNS.kind == "pattern" and MODELS.kind == "model" and TASKS.kind == "task"


def _register_one(plugin_dir, hook, name):
    folder = plugin_dir(
        **{
            f"my_{name}": f"""
            from dataclasses import dataclass
            from gtx import hookimpl

            @dataclass
            class Config:
                size: int = 3

            class Thing:
                '''A test {name}.'''

            @hookimpl
            def {hook}(register):
                register("{name}", Thing, config=Config)
            """
        }
    )
    plugins.load_plugins(dirs=[folder])


def test_hook_register_models(plugin_dir):
    _register_one(plugin_dir, "register_models", "tiny-model")
    entry = MODELS.get("tiny-model")
    assert entry.description == "A test tiny-model." and entry.config().size == 3


def test_hook_register_tasks(plugin_dir):
    _register_one(plugin_dir, "register_tasks", "tiny-task")
    entry = TASKS.get("tiny-task")
    assert entry.description == "A test tiny-task." and entry.config().size == 3
