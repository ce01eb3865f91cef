"""Methods' definition versions, from their registration to results rows and checkpoints, and the docs'
figure tables: each a CSV with its provenance, shown in its page as it is, citing only definitions the
code has."""

import json
from pathlib import Path

import pytest
import torch

from gtx.errors import PluginError
from gtx.graph.pattern import within_window
from gtx.graph.spec import parse_pattern
from gtx.plugins import registry as plugins
from gtx.records import figures
from gtx.records.results import load

ROOT = Path(__file__).resolve().parents[1]

#: a plain pattern and a score bias that declare definition versions
VERSIONED = '''
import torch
from gtx import Pattern, hookimpl

def diag(w: int = 2):
    """Diag: each query reads the keys fewer than w positions away."""
    return Pattern.from_rule(lambda q, k, n_q, n_k: (q - k).abs() < w)

class Boost(torch.nn.Module):
    """Boost: one more unit of score for a query's own position."""

    def __init__(self, heads: int):
        super().__init__()

    def forward(self, q_pos, k_pos, stage, heads):
        return (q_pos == k_pos).float()[:, None].expand(-1, len(heads))

@hookimpl
def register_patterns(register):
    register("diag", diag, definition=3)

@hookimpl
def register_biases(register):
    register("boost", Boost, definition=1)
'''


def test_a_pattern_carries_the_definition_versions_of_its_parts(plugin_dir):
    plugins.load_plugins(dirs=[plugin_dir(versioned=VERSIONED)])
    assert parse_pattern("dsa").definitions == {"dsa": 2} and parse_pattern("moba").definitions == {"moba": 2}
    assert parse_pattern("local:w=2").definitions == {}
    assert parse_pattern("diag:w=3|local:w=2").definitions == {"diag": 3}
    assert parse_pattern("local:w=2&diag").definitions == {"diag": 3}
    assert parse_pattern("diag+boost").definitions == {"boost": 1, "diag": 3}
    assert parse_pattern("act(diag)").definitions == {"diag": 3}
    assert parse_pattern("heads(diag,moba:b=4,k=2)").definitions == {"diag": 3, "moba": 2}
    assert within_window(parse_pattern("diag+boost"), 4).definitions == {"boost": 1, "diag": 3}


@pytest.mark.parametrize(
    "hook, call, message",
    [
        ("register_patterns", 'register("v0", lambda: None, definition=0)', "definition=0; give a whole number from 1"),
        ("register_patterns", 'register("vs", lambda: None, definition="2")', "definition='2'; give a whole number"),
        ("register_backends", 'register("vb", object(), definition=1)', "only patterns and score biases declare"),
    ],
)
def test_a_definition_version_that_is_no_version_is_refused_naming_the_plugin(plugin_dir, hook, call, message):
    folder = plugin_dir(badversion=f"from gtx import hookimpl\n\n@hookimpl\ndef {hook}(register):\n    {call}\n")
    plugins.load_plugins(dirs=[folder])
    registry = plugins.PATTERNS if hook == "register_patterns" else plugins.BACKENDS
    with pytest.raises(PluginError, match=f"badversion.py.*{message}"):
        registry.entries()


def test_a_runs_rows_record_its_definitions_and_a_checkpoint_of_another_is_refused(plugin_dir, tiny_run, tmp_path, cli):
    folder = plugin_dir(versioned=VERSIONED)
    run = tiny_run(tmp_path, "--plugins-dir", folder, pattern="diag")
    assert set(run.rows.definitions) == {'{"diag": 3}'}

    run_id = run.rows.run_id.iloc[0]
    evaluated = cli("eval", run_id, "--results", run.folder, "--pattern", "full", "--plugins-dir", folder)
    assert evaluated.exit_code == 0, evaluated.output
    rows = load(run.folder)
    # evaluated under full, the figures still depend on the method the model trained under
    assert set(rows[rows.eval_of.notna()].definitions) == {'{"diag": 3}'}

    path = run.folder / "checkpoints" / run_id / "best.pt"
    state = torch.load(path, weights_only=True)
    common = {**json.loads(state["common"]), "definitions": json.dumps({"diag": 2})}
    torch.save({**state, "common": json.dumps(common)}, path)
    refused = cli("eval", run_id, "--results", run.folder, "--plugins-dir", folder)
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "trained under diag definition 2; this gtx's diag is definition 3" in refused.output


def test_the_docs_figure_tables_have_provenance_cite_current_definitions_and_are_their_csvs():
    """docs/results/ and docs/gpu/: each CSV with its TOML (command, commit, machine, date, definitions), and
    each table block of docs/*.md the CSV it names (regenerate: make docs)."""
    assert figures.problems(ROOT) == []
    assert (ROOT / "docs" / "results" / "recall-int8-choice.toml").is_file()


ABOUT = 'command = "gtx bench attention"\ncommit = "abc1234"\nmachine = "cpu2"\ndate = 2026-01-01\n'


def test_the_check_names_each_table_without_provenance_citing_a_gone_definition_or_not_its_csv(tmp_path):
    tables = tmp_path / "docs" / "results"
    tables.mkdir(parents=True)
    files = {
        "bare.csv": "pattern,ms\nfull,1\n",
        "stale.csv": "pattern,ms\ndsa:k=8,2\n",
        "stale.toml": ABOUT + "[definitions]\ndsa = 1\n",
        "gone.csv": "pattern,ms\nfull,1\n",
        "gone.toml": ABOUT + "[definitions]\nnosuch = 1\n",
        "unsaid.csv": 'pattern,ms\n"moba:b=4,k=2",3\n',
        "unsaid.toml": ABOUT,
        "undated.csv": "pattern,ms\nfull,1\n",
        "undated.toml": ABOUT.replace("date = 2026-01-01\n", ""),
        "good.csv": "pattern,ms,ratio\nmoba:b=4|local:w=2,331.875123,1.0\n",
        "good.toml": ABOUT + "[definitions]\nmoba = 2\n",
    }
    for name, text in files.items():
        (tables / name).write_text(text)
    page = tmp_path / "docs" / "page.md"
    page.write_text("Intro.\n\n<!-- table: results/good.csv -->\n| old |\n<!-- end table -->\n\nAfter.\n")
    found = figures.problems(tmp_path)
    expected = [
        "bare.csv has no provenance: write bare.toml beside it",
        "gone.csv cites nosuch definition 1, and no registered method declares nosuch's",
        "stale.csv cites dsa definition 1; the code's dsa is definition 2: measure it again (gtx bench attention)",
        "undated.toml lacks date",
        "unsaid.csv names moba in its rows but not the definition they ran under: add moba = 2",
        "docs/page.md: a table block is not its CSV: make docs",
    ]
    assert len(found) == len(expected) and all(any(e in f for f in found) for e in expected), found

    assert figures.write_pages(tmp_path) == [page]
    table = "| pattern | ms | ratio |\n|---|---|---|\n| moba:b=4\\|local:w=2 | 332 | 1.0 |\n"
    assert page.read_text() == f"Intro.\n\n<!-- table: results/good.csv -->\n\n{table}\n<!-- end table -->\n\nAfter.\n"
    assert not [f for f in figures.problems(tmp_path) if "page.md" in f or "good" in f]

    (tables / "good.toml").write_text(ABOUT + 'columns = ["ratio", "pattern"]\n[definitions]\nmoba = 2\n')
    assert (
        figures.read(tables / "good.csv").markdown()
        == "| ratio | pattern |\n|---|---|\n| 1.0 | moba:b=4\\|local:w=2 |\n"
    )
