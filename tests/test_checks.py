"""What plugins hand back is checked before use: fuzzed at each boundary (hypothesis), and end to
end through the CLI, where a bad return is one line naming the plugin."""

import math
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gtx.errors import PluginError
from gtx.graph.pattern import Pattern, check_edges
from gtx.model.layers import Output
from gtx.plugins import checks

DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.float64]


@st.composite
def tensors(draw, max_dim=2):
    shape = draw(st.lists(st.integers(0, 4), max_size=max_dim))
    dtype = draw(st.sampled_from(DTYPES))
    return torch.randint(0, 3, shape).to(dtype)


anything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=3), tensors()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(value=anything, n_q=st.integers(1, 4), n_k=st.integers(1, 4))
def test_edge_functions_returning_anything_are_accepted_or_named(value, n_q, n_k):
    """An edge function's return either passes the checks (and then only valid edges are used) or is one PluginError."""
    pattern = Pattern(ee=None, dd=None, ed=None, spec="fuzz", edge_fns={"ee": lambda a, b: value})
    try:
        src, dst = pattern.edges("ee", n_q, n_k)
    except PluginError as e:
        assert "pattern 'fuzz'" in str(e) and "\n" not in str(e)
    except Exception as e:  # the edge invariants: PatternError
        assert type(e).__name__ == "PatternError" and "pattern 'fuzz'" in str(e)
    else:
        assert src.dtype == torch.int64 and src.shape == dst.shape
        check_edges("fuzz", "ee", n_q, n_k, src, dst)


@settings(max_examples=200, deadline=None)
@given(value=anything)
def test_rules_returning_anything_are_accepted_or_named(value):
    pattern = Pattern(ee=lambda q, k, n_q, n_k: value, dd=None, ed=None, spec="fuzz")
    try:
        src, dst = pattern.edges("ee", 3, 3)
    except PluginError as e:
        assert "pattern 'fuzz'" in str(e) and "bool tensor" in str(e)
    except Exception as e:
        assert type(e).__name__ == "PatternError"
    else:
        assert isinstance(value, torch.Tensor) and value.dtype == torch.bool


@settings(max_examples=300, deadline=None)
@given(value=anything)
def test_metrics_returning_anything_are_accepted_or_named(value):
    try:
        out = checks.metrics("task 'fuzz'", value)
    except PluginError as e:
        assert str(e).startswith("task 'fuzz'")
    else:
        for v in out.values():
            for x in v.values() if isinstance(v, dict) else [v]:
                assert isinstance(x, (int, float)) and not math.isinf(x)


@settings(max_examples=300, deadline=None)
@given(value=anything)
def test_task_data_of_any_shape_is_accepted_or_named(value):
    try:
        checks.examples("task 'fuzz'", value)
    except PluginError as e:
        assert str(e).startswith("task 'fuzz'")
    else:
        assert all(len(split[i]) == 2 for split in value.values() for i in {0, len(split) - 1} if len(split))


@settings(max_examples=200, deadline=None)
@given(logits=st.one_of(tensors(), anything), aux=st.one_of(st.none(), tensors(1)))
def test_model_outputs_are_accepted_or_named(logits, aux):
    model = torch.nn.Linear(1, 1)
    model.plugin_label = "model 'fuzz'"
    try:
        checks.model_output(model, Output(logits, aux), 2, 3)
    except PluginError as e:
        assert str(e).startswith("model 'fuzz'")
    else:
        assert logits.shape == (2, 3) and logits.is_floating_point()


def changed(kind: str, base: str, name: str, body: str) -> str:
    """A plugin's source registering ``name``: the built-in ``kind`` (task or model) ``base`` with the
    class body ``body`` (its methods) over it, and the same config."""
    registry = {"task": "TASKS", "model": "MODELS"}[kind]
    return f"""
import torch
from gtx import hookimpl
from gtx.model.layers import Output
from gtx.plugins.registry import {registry}

BASE = {registry}.get("{base}")

class Changed(BASE.obj):
{textwrap.indent(textwrap.dedent(body).strip(), "    ")}

@hookimpl
def register_{kind}s(register):
    register("{name}", Changed, config=BASE.config)
"""


BAD_PLUGINS = {
    "float edges": (
        '''
        import torch
        from gtx import hookimpl
        from gtx.graph.pattern import Pattern

        def floaty():
            """Edges as floats."""
            edges = lambda n_q, n_k: (torch.zeros(n_q), torch.arange(n_q).float())
            return Pattern(ee=None, dd=None, ed=None, edge_fns={"ee": edges, "dd": edges, "ed": edges})

        @hookimpl
        def register_patterns(register):
            register("floaty", floaty)
    ''',
        {"pattern": "floaty"},
        "pattern 'floaty' (ee edges for n_q=",
    ),
    "string metric": (
        changed(
            "task",
            "copy",
            "chatty",
            '''
            """Copy, with a metric that is a sentence."""
            def phase_metrics(self, loss, groups, split):
                return {"mood": "good"}
            ''',
        ),
        {"task": "chatty"},
        "task 'chatty' phase_metrics: metric 'mood' is 'good'",
    ),
    "wrong logits": (
        changed(
            "model",
            "transformer",
            "short",
            '''
            """Drops a logit row."""
            def forward(self, batch):
                return Output(super().forward(batch).logits[1:])
            ''',
        ),
        {"model": "short"},
        "model 'short' (",
    ),
    "model raises": (
        changed(
            "model",
            "transformer",
            "broken",
            '''
            """Fails to build."""
            def __init__(self, *a):
                raise KeyError("weights")
            ''',
        ),
        {"model": "broken"},
        "raised while being built: KeyError",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PLUGINS))
def test_a_bad_plugin_return_is_one_line_naming_the_plugin(case, plugin_dir, tmp_path, tiny_run):
    source, choice, message = BAD_PLUGINS[case]
    folder = plugin_dir(bad=source)
    bad = tiny_run(tmp_path, "--plugins-dir", folder, n_train=16, n_valid=4, n_test=4, exit_code=2, **choice)
    assert message in bad.result.output and len(bad.result.output.strip().splitlines()) == 1
    assert not (bad.folder / "runs").exists()
