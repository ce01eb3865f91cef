"""The docs cannot rot: the plugin shown in writing-patterns.md is loaded and used; every hook is documented."""

import inspect
import re
from pathlib import Path

from gtx import testing
from gtx.plugins import hookspecs
from gtx.testing.float32 import float64_reference

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: the settings of a tiny recall run of an lm with a plugin's pattern (the kit's tiny_run)
TINY_RECALL = {"task": "recall", "model": "lm", "seq_len": 64, "n_train": 32, "n_valid": 8, "n_test": 8}


def doc_example(tag: str) -> str:
    """The Python block writing-patterns.md marks ``<!-- tag -->``, as written there."""
    text = (DOCS / "writing-patterns.md").read_text()
    return re.search(rf"<!-- {tag} -->\s*```python\n(.*?)```", text, re.S).group(1)


def test_documented_plugin_works_from_an_empty_folder(cli, plugin_dir):
    folder = plugin_dir(chunks=doc_example("plugin-example"))
    listed = cli("patterns", "--plugins-dir", folder)
    assert listed.exit_code == 0, listed.output
    assert any(line.startswith("chunks") and "b: int = 4" in line for line in listed.output.splitlines())
    shown = cli("show-pattern", "chunks:b=3|local:w=1", "--src-len", 6, "--plugins-dir", folder)
    assert shown.exit_code == 0, shown.output
    assert "pattern chunks:b=3|local:w=1" in shown.output
    assert "     0 ###...\n     1 ###...\n     2 ####..\n     3 ..####\n     4 ...###\n     5 ...###" in shown.output
    bad = cli("show-pattern", "chunks:b=0", "--plugins-dir", folder)
    assert bad.exit_code == 2 and "b must be >= 1, got 0" in bad.output
    testing.check_pattern("chunks:b=3", lengths=(1, 4, 9))  # the page's "Test it" section


def test_every_hook_is_documented_with_its_signature():
    text = (DOCS / "plugin-hooks.md").read_text()
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if name.startswith("register_"):
            args = ", ".join(inspect.signature(fn).parameters)
            assert f"## {name}({args})" in text, name


def test_documented_content_pattern_trains_and_keeps_fewer_edges(tmp_path, plugin_dir, tiny_run):
    folder = plugin_dir(near_max=doc_example("content-example"))
    for pattern in ("full", "near_max:margin=1"):
        rows = tiny_run(tmp_path, "--plugins-dir", folder, pattern=pattern, **TINY_RECALL).rows
    valid = rows.query("split == 'valid'").set_index("pattern")
    assert valid.edges_per_query_dd["near_max:margin=1.0"] < valid.edges_per_query_dd["full"]


def test_documented_trainable_pattern_trains_per_layer_and_reports_its_branches(tmp_path, plugin_dir, tiny_run):
    import json

    import torch

    folder = plugin_dir(mixed=doc_example("trainable-example"))
    run = tiny_run(tmp_path, "--plugins-dir", folder, pattern="mixed:w=4,l=8", **TINY_RECALL, layers=2)
    train = run.rows.query("split == 'train'").iloc[0]
    kept = json.loads(train.metrics)
    # the query's own key, in both, read once
    assert train.edges_per_query_dd < kept["kept_window"] + kept["kept_strided"]
    state = torch.load(next(run.folder.glob("checkpoints/*/last.pt")), weights_only=False)["model"]
    gates = [state[f"layer_attention.{i}.trainable.gate.weight"] for i in (0, 1)]
    assert not torch.equal(gates[0], gates[1])  # each layer's own gate, trained
    bad = tiny_run(tmp_path, "--plugins-dir", folder, pattern="mixed:l=0", exit_code=2, **TINY_RECALL).result
    assert "need w >= 0 and l >= 1" in bad.output


def sparq_by_definition(q, k, lens, count, r, local):
    """SparQ's choice written out: per query t and head, the r components of q_t of largest magnitude; each
    key j <= t scored sum over them of q_t[d] k_j[d]; the keys t - local < j <= t first; the ``count`` best
    (all where fewer). Per query row, per head, a set of positions within the sample."""
    chosen, start = [], 0
    for n in lens:
        for t in range(n):
            row = []
            for h in range(q.shape[1]):
                dims = q[start + t, h].abs().topk(min(r, q.shape[-1])).indices
                estimate = k[start : start + t + 1, h][:, dims] @ q[start + t, h, dims]
                estimate[max(0, t - local + 1) :] = float("inf")
                row.append(set(estimate.topk(min(count, t + 1)).indices.tolist()))
            chosen.append(row)
        start += n
    return chosen


def over_allowed(q, k, v, allowed):
    """Softmax attention of each query (n, H, D) over its allowed (n, H, n) keys."""
    import torch

    score = torch.einsum("thd,shd->ths", q, k).masked_fill(~allowed, float("-inf"))
    return torch.einsum("ths,shd->thd", score.softmax(-1), v)


def test_documented_published_method_chooses_as_sparq_runs_on_the_c_kernel_and_trains(
    tmp_path, monkeypatch, plugin_dir, tiny_run
):
    """The walkthrough's plugin, loaded from a folder exactly as written: its choice equals SparQ's
    written out; it hands the kernels a KeySelection, which the C kernel attends over on the CPU (no mask
    over edges, no backend), equal to float64 dense attention over the chosen keys; and a run trains with it."""
    import json

    import torch

    from gtx import KeySelection, build_graph, load_plugins, parse_pattern, selection
    from gtx.attention.module import Attention
    from gtx.backends import get_backend
    from gtx.selection import keys as key_kernels

    folder = plugin_dir(sparq=doc_example("selection-example"))
    load_plugins(dirs=[folder])
    native = key_kernels._forward_native
    ran = []  # the C kernel's forward calls
    monkeypatch.setattr(key_kernels, "_forward_native", lambda *a: ran.append(1) or native(*a))
    g = torch.Generator().manual_seed(0)
    for lens, (count, r, local) in [([30, 17], (6, 3, 2)), ([41], (5, 8, 1)), ([9, 1, 25], (4, 1, 4))]:
        q, k, v = (torch.randn(sum(lens), 2, 8, generator=g) for _ in range(3))
        pattern = parse_pattern(f"sparq:k={count},r={r},local={local}")
        edges = build_graph(pattern, None, lens).edges["dd"]
        sel = pattern.select(q, k, edges)
        assert isinstance(sel, KeySelection)
        want = sparq_by_definition(q, k, lens, count, r, local)
        first = [start for start, n in zip([sum(lens[:i]) for i in range(len(lens))], lens) for _ in range(n)]
        allowed = torch.zeros(len(q), 2, len(q), dtype=torch.bool)
        for row in range(len(q)):
            for h in range(2):
                assert set((sel.keys[row, h][sel.valid[row, h]] - first[row]).tolist()) == want[row][h], (row, h)
                allowed[row, h, [first[row] + j for j in want[row][h]]] = True
        selection.kernels.take_ran()
        calls = len(ran)
        out = Attention(get_backend("dense"), pattern, 2)(q, k, v, edges)
        recorded = selection.kernels.take_ran().get("dd", {})
        assert len(ran) == calls + 1 and all(kernel == "c:keys" for kernel in recorded), recorded  # no backend
        float64_reference(over_allowed, q, k, v, allowed).check(out, "sparq on the C kernel")
    pattern, small = "sparq:k=8,r=4,local=2", {"n_train": 16, "n_valid": 4, "n_test": 4}
    rows = tiny_run(tmp_path, "--plugins-dir", folder, pattern=pattern, **{**TINY_RECALL, **small}).rows
    assert (rows.edges_per_query_dd <= 8).all() and rows.loss.notna().all()
    for plan in rows.backend_plan:  # a mask over edges would send dd to the backend
        assert all(kernel.endswith(":keys") for kernel in json.loads(plan).get("dd", {})), plan


def test_the_cli_reference_is_current():
    """docs/cli.md is every command's --help as the code prints it: regenerate it (and docs/methods.md)
    with ``make docs``."""
    from gtx.cli.reference import markdown

    assert (DOCS / "cli.md").read_text() == markdown(), "docs/cli.md is stale: make docs"


def test_the_methods_reference_is_current_and_gtx_patterns_name_prints_an_entry(cli):
    """docs/methods.md holds every registered pattern and bias as their docstrings say (regenerate:
    ``make docs``); ``gtx patterns NAME`` prints the same entry."""
    from gtx.cli.reference import methods
    from gtx.plugins.registry import BIASES, PATTERNS

    text = (DOCS / "methods.md").read_text()
    assert text == methods(), "docs/methods.md is stale: make docs"
    for name in PATTERNS.names():
        assert re.search(rf"^## {re.escape(name)}(\(PATTERN\))?$", text, re.M), f"docs/methods.md misses pattern {name}"
    for name in BIASES.names():
        assert f"## +{name}\n" in text
    out = cli("patterns", "moba")
    assert (
        out.exit_code == 0
        and out.output.startswith("moba\n\nParameters: `b: int = 64")
        and "Budget: k*b keys per query" in out.output
    )
    unknown = cli("patterns", "nosuch")
    assert unknown.exit_code == 2 and "nosuch" in unknown.output and "local" in unknown.output


def test_the_results_readme_is_the_layout_the_code_writes():
    """results/README.md is generated from ``gtx.records.layout.ResultsFolder`` (``make docs``): each
    place it lists, with the path the layout's method builds."""
    from gtx.cli.reference import PAGES, results_readme
    from gtx.records.layout import ResultsFolder

    text = (ROOT / "results" / "README.md").read_text()
    assert text == results_readme() and "results/README.md" in PAGES, "results/README.md is stale: make docs"
    folder = ResultsFolder("")
    for path in (folder.run_table("<run_id>"), folder.checkpoint_dir("<run_id>"), folder.claims(), folder.report()):
        assert f"- `{path.as_posix()}" in text


# Words that narrate how gtx was developed rather than say what it does, each specific enough to leave
# ordinary uses alone ("target length", "random seeds"; "session" has no user's sense in gtx).
NARRATION = {
    "a work session": r"\bsessions?\b",
    "a worktree": r"\bworktrees?\b",
    "a scratch script": r"\bscratch (?:scripts?|folders?)\b",
    "an issue": r"\bthe issue\b|\bissue #?\d+",
    "the seed code ('the seeds')": r"\bthe seeds\b",
    "the project's own machines": r"\bthis project\b",
    "a past plan's targets": r"\btargets?,? where (?:it|they) stands?\b|\btarget \(issue|\(target\s*[≤≥<>]"
    r"|\b(?:meets?|met|missed|misses|short of|against)\s+(?:the\s+|its\s+|both of its\s+)?(?:[\d.]+x\s+)?targets?\b",
    "a development log": r"\b(?:later|earlier) session\b|\bperf\b showed",
}
ROOT = DOCS.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def narration(text: str) -> list[tuple[int, str]]:
    """(line, what) for each narrating phrase in text."""
    lines = enumerate(text.splitlines(), 1)
    return [(n, what) for n, line in lines for what, rx in NARRATION.items() if re.search(rx, line, re.I)]


def links_outside(page: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Markdown link targets and ``../`` code spans naming a path that is absolute, climbs out of the
    repository, or is not in it (``../shared/x.md`` from docs/ meant a folder beside the repository)."""
    found = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)", line) + re.findall(r"`(\.\./[^`\s]*)`", line):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = target.split("#")[0]
            resolved = (page.parent / path).resolve()
            if path.startswith(("/", "file:")) or not resolved.is_relative_to(root) or not resolved.exists():
                found.append((n, target))
    return found


def test_narration_is_found_where_it_is_and_nowhere_else():
    found = set(narration("A later session met the 2x target.\nThe issue's targets, where they stand."))
    session, log, targets, issue = "a work session", "a development log", "a past plan's targets", "an issue"
    assert found == {(1, session), (1, log), (1, targets), (2, issue), (2, targets)}
    assert narration("Decoder edges must not depend on the target length; pooled over random seeds.") == []
    assert len(narration("on this project's 2-core CPU,\nthe seeds' formulation,\nin a worktree")) == 3


def test_docs_narrate_no_development_history_and_link_nothing_outside_the_repository():
    problems = []
    for page in PAGES:
        name = page.relative_to(ROOT)
        problems += [f"{name}:{n}: narrates {what}" for n, what in narration(page.read_text())]
        problems += [f"{name}:{n}: link outside the repository: {target}" for n, target in links_outside(page)]
    assert not problems, "\n".join(problems)


def test_code_and_tests_narrate_no_development_history():
    """What the code says (docstrings, --help text, messages, comments) and what the tests say is read
    by users and contributors too: the DGL tutorial is named as such, not as "the seeds"."""
    here = Path(__file__).resolve()
    files = [
        path
        for folder in ("gtx", "patterns", "plugins", "tests", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != here  # this file holds the phrases it looks for
    ]
    problems = [
        f"{path.relative_to(ROOT)}:{n}: narrates {what}" for path in files for n, what in narration(path.read_text())
    ]
    assert not problems, "\n".join(problems)


def test_a_link_outside_the_repository_is_named(tmp_path):
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    (tmp_path / "README.md").write_text("")
    (page.parent / "other.md").write_text("")
    page.write_text(
        "[ok](other.md#a) [up](../README.md) [web](https://x.org)\n"
        "see `../../shared/notes.md`, `../shared/notes.md` and [abs](/etc/passwd)\n"
    )
    expected = [(2, "/etc/passwd"), (2, "../../shared/notes.md"), (2, "../shared/notes.md")]
    assert links_outside(page, root=tmp_path) == expected


def test_code_cites_references_by_name_not_by_a_path_outside_the_repository():
    outside = re.compile(r"\.\./(?:shared|seeds)/")
    sources = [
        f
        for folder in ("gtx", "patterns", "plugins", "tests", "bench")
        for f in (ROOT / folder).rglob("*")
        if f.suffix in {".py", ".c", ".h", ".sh"} and f != Path(__file__)
    ]
    hits = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in sources
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not hits, hits


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_to_a_heading_find_it():
    broken = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for path, anchor in re.findall(r"\]\(([^)\s#:]*\.md|)#([^)\s]+)\)", line):
                target = (page.parent / path).resolve() if path else page
                if target.exists() and anchor not in heading_anchors(target):
                    broken.append(f"{page.relative_to(ROOT)}:{n}: {path}#{anchor}")
    assert not broken, "\n".join(broken)


def test_every_test_a_method_entry_names_exists():
    """methods.md says which test checks each method against its reference: each named test is one."""
    tests = Path(__file__).resolve().parent
    sources = {p.name: p.read_text() for p in tests.glob("test_*.py")}
    for entry in (DOCS / "methods.md").read_text().split("\n## ")[1:]:
        checked = entry.partition("**Checked**")[2]
        assert checked.strip(), f"{entry.splitlines()[0]}: no **Checked** section naming its test"
        for file, name in re.findall(r"tests/(test_\w+\.py)::(test_\w+)", checked):
            assert f"def {name}(" in sources[file], (file, name)
        for name in re.findall(r"``(test_\w+)``", checked):
            assert any(f"def {name}(" in text for text in sources.values()), name


def test_ci_runs_the_readmes_test_command_and_says_its_machine_before_the_tests():
    """.ci/run: the README's test command, with ``python -m gtx.native`` (the CPU, its vector
    instructions, torch's threads, the C kernels' flags) after the installs, before lint and tests."""
    root = DOCS.parent
    command = re.search(r"## Install and run the tests\n\n```bash\n(.*?)\n```", (root / "README.md").read_text()).group(
        1
    )
    installs, tests = command.split(" && ruff check ")
    assert (root / ".ci" / "run").read_text().strip().splitlines()[-1] == (
        f"{installs} && python -m gtx.native && ruff check {tests}"
    )
