"""Every registered pattern against an independent oracle, the edge invariants, and composition."""

import oracles
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gtx import testing
from gtx.errors import PatternError, UnknownNameError
from gtx.graph.pattern import STAGES, Pattern, check_edges, within_window
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import batch_edges
from gtx.plugins.registry import PATTERNS

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
lengths = st.integers(1, 40)

# name -> strategy of (spec, oracle)
CASES = {
    "full": st.just(("full", oracles.full())),
    "causal": st.just(("causal", oracles.causal())),
    "bipartite": st.just(("bipartite", oracles.bipartite())),
    "local": st.integers(0, 6).map(lambda w: (f"local:w={w}", oracles.local(w))),
    "strided": st.integers(1, 6).map(lambda l: (f"strided:l={l}", oracles.strided(l))),
    "fixed": st.integers(1, 8).flatmap(
        lambda l: st.integers(1, l).map(lambda c: (f"fixed:l={l},c={c}", oracles.fixed(l, c)))
    ),
    "longformer": st.tuples(st.integers(0, 5), st.integers(0, 3)).map(
        lambda a: (f"longformer:w={a[0]},g={a[1]}", oracles.longformer(*a))
    ),
    "dilated": st.tuples(st.integers(0, 4), st.integers(1, 4)).map(
        lambda a: (f"dilated:w={a[0]},d={a[1]}", oracles.dilated(*a))
    ),
    "sinks": st.tuples(st.integers(0, 4), st.integers(1, 6)).map(
        lambda a: (f"sinks:s={a[0]},w={a[1]}", oracles.sinks(*a))
    ),
    "act": st.integers(0, 4).map(lambda w: (f"act(local:w={w})", oracles.local(w))),
    # head groups: the set's own edges are the union of its groups' (each group is attended to alone: test_attention.py)
    "heads": st.tuples(st.integers(0, 4), st.integers(1, 5)).map(
        lambda a: (f"heads(local:w={a[0]},strided:l={a[1]})", oracles.union(oracles.local(a[0]), oracles.strided(a[1])))
    ),
    # content-selected patterns: their fixed edges are the candidates they select from (selection: test_attention.py)
    "topk": st.integers(1, 8).map(lambda k: (f"topk:k={k}", oracles.full())),
    "moba": st.tuples(st.integers(1, 8), st.integers(1, 4), st.sampled_from(["token", "block"])).map(
        lambda a: (f"moba:b={a[0]},k={a[1]},gate={a[2]}", oracles.full())
    ),
    "lsh": st.sampled_from([2, 4, 8]).map(lambda b: (f"lsh:buckets={b}", oracles.full())),
    "vslash": st.integers(1, 4).map(lambda v: (f"vslash:v={v},sl=2,last=4,sink=1,local=1", oracles.full())),
    "blocktopk": st.integers(1, 8).map(lambda b: (f"blocktopk:b={b},k=3", oracles.full())),
    "quest": st.tuples(st.integers(1, 8), st.integers(1, 4)).map(
        lambda a: (f"quest:p={a[0]},k={a[1]}", oracles.full())
    ),
    # trainable attention: its candidates are full (causal in dd); what it attends to: test_nsa.py, test_dsa.py
    "nsa": st.tuples(st.integers(1, 8), st.integers(1, 8)).map(
        lambda a: (f"nsa:l={a[0]},d={min(a)},s={a[1]}", oracles.full())
    ),
    "dsa": st.integers(1, 8).map(lambda k: (f"dsa:k={k}", oracles.full())),
}


def edge_set(pattern, stage, n_q, n_k):
    src, dst = pattern.edges(stage, n_q, n_k)
    return set(zip(dst.tolist(), src.tolist()))


def oracle_set(allowed, stage, n_q, n_k):
    return {(i, j) for i in range(n_q) for j in range(n_k) if allowed(stage, i, j, n_q, n_k)}


def sizes(stage, n_src, n_tgt):
    return {"ee": (n_src, n_src), "dd": (n_tgt, n_tgt), "ed": (n_tgt, n_src)}[stage]


def test_every_registered_pattern_has_an_oracle():
    assert set(PATTERNS.names()) == set(CASES) | {"bigbird"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pattern_matches_oracle(name):
    @SETTINGS
    @given(case=CASES[name], n_src=lengths, n_tgt=lengths)
    def check(case, n_src, n_tgt):
        spec, allowed = case
        p = parse_pattern(spec)
        for stage in STAGES:
            n_q, n_k = sizes(stage, n_src, n_tgt)
            assert edge_set(p, stage, n_q, n_k) == oracle_set(allowed, stage, n_q, n_k), (spec, stage, n_q, n_k)

    check()


@SETTINGS
@given(b=st.integers(1, 6), r=st.integers(0, 3), seed=st.integers(0, 3), n_src=lengths, n_tgt=lengths)
def test_bigbird_window_global_and_random_blocks(b, r, seed, n_src, n_tgt):
    p = parse_pattern(f"bigbird:b={b},r={r},seed={seed}")
    allowed = oracles.bigbird_deterministic(b)
    for stage in STAGES:
        n_q, n_k = sizes(stage, n_src, n_tgt)
        got, base = edge_set(p, stage, n_q, n_k), oracle_set(allowed, stage, n_q, n_k)
        assert base <= got
        extra = got - base
        if stage in ("ee", "dd"):  # each query block gains at most r random key blocks
            nb = -(-n_k // b)
            for qb in range(nb):
                blocks = {j // b for (i, j) in extra if i // b == qb}
                assert len(blocks) <= r
        if stage == "dd":
            assert all(j <= i for i, j in got)
    again = parse_pattern(f"bigbird:b={b},r={r},seed={seed}")
    assert again is p or edge_set(again, "ee", n_src, n_src) == edge_set(p, "ee", n_src, n_src)


def test_bigbird_random_blocks_are_seeded():
    a = parse_pattern("bigbird:b=2,r=2,seed=1").dense("ee", 40, 40)
    b = parse_pattern("bigbird:b=2,r=2,seed=1").dense("ee", 40, 40)
    c = parse_pattern("bigbird:b=2,r=2,seed=2").dense("ee", 40, 40)
    assert torch.equal(a, b) and not torch.equal(a, c)


ALL_SPECS = [
    "full",
    "causal",
    "bipartite",
    "local:w=3",
    "act(local:w=2)",
    "strided:l=3",
    "fixed:l=4,c=2",
    "longformer:w=2,g=2",
    "bigbird:b=3,r=1",
    "dilated:w=2,d=3",
    "sinks:s=2,w=3",
    "local:w=1|strided:l=5",
    "(local:w=2|full)&causal",
]


def test_decoder_edges_of_a_shorter_sample_are_the_first_rows_of_the_longest_kept():
    """One dd sample is kept, the longest asked for; shorter ones are views of its first rows, equal
    to the rule's edges at their own length (mixed lengths once kept a copy per length: gigabytes)."""
    from dataclasses import replace

    p = replace(parse_pattern("local:w=3|strided:l=4"), _cache={})
    for n in (50, 20, 70, 5, 70, 1):
        src, dst = p.edges("dd", n, n)
        assert torch.equal(torch.stack([src, dst]), p.dense("dd", n, n).nonzero().T.flip(0)), n
    assert [key for key in p._cache if key == "dd" or key[0] == "dd"] == ["dd"] and p._cache["dd"][0] == 70
    assert p.edges("dd", 20, 20)[0].untyped_storage().data_ptr() == p._cache["dd"][1].untyped_storage().data_ptr()


def test_encoder_edges_of_many_lengths_are_kept_within_a_byte_budget(monkeypatch):
    """ee and ed edges are kept per length pair, the most recently used within EDGE_CACHE_BYTES:
    an encoder task of many lengths (listops' LRA preset) once grew by gigabytes."""
    from dataclasses import replace

    from gtx.graph import pattern as module

    monkeypatch.setattr(module, "EDGE_CACHE_BYTES", 16 * 3000)  # 3,000 edges
    p = replace(parse_pattern("local:w=3|strided:l=4"), _cache={})
    for n in [*range(40, 80), 41]:
        for stage, n_k in (("ee", n), ("ed", n + 5)):
            src, dst = p.edges(stage, n, n_k)
            assert torch.equal(torch.stack([src, dst]), p.dense(stage, n, n_k).nonzero().T.flip(0)), (stage, n)
    kept = p._cache[("memo", "edges")]
    assert 16 * sum(edges[0].numel() for edges, _ in kept.values()) <= 16 * 3000
    assert list(kept)[-2:] == [("ee", 41, 41), ("ed", 41, 46)] and len(kept) < 80


@pytest.mark.parametrize("spec", ALL_SPECS)
@SETTINGS
@given(n_src=st.integers(1, 70), n_tgt=st.integers(1, 70))
def test_invariants(spec, n_src, n_tgt):
    p = parse_pattern(spec)
    for stage in STAGES:
        n_q, n_k = sizes(stage, n_src, n_tgt)
        src, dst = p.edges(stage, n_q, n_k)
        assert src.dtype == dst.dtype == torch.int64
        assert ((src >= 0) & (src < n_k) & (dst >= 0) & (dst < n_q)).all()
        key = dst * n_k + src
        assert (key[1:] > key[:-1]).all()  # sorted by (dst, src), no duplicates
        assert (torch.bincount(dst, minlength=n_q) > 0).all()
        if stage == "dd":
            assert (src <= dst).all()
        assert torch.equal(p.dense(stage, n_q, n_k).nonzero().T.flip(0), torch.stack([src, dst]))


@SETTINGS
@given(a=st.sampled_from(ALL_SPECS[:10]), b=st.sampled_from(ALL_SPECS[:10]), n_src=lengths, n_tgt=lengths)
def test_union_and_intersection_are_set_operations(a, b, n_src, n_tgt):
    pa, pb = parse_pattern(a), parse_pattern(b)
    union = parse_pattern(f"{a}|{b}")
    assert union.spec == f"{pa.spec}|{pb.spec}"
    for stage in STAGES:
        n_q, n_k = sizes(stage, n_src, n_tgt)
        ea, eb = edge_set(pa, stage, n_q, n_k), edge_set(pb, stage, n_q, n_k)
        assert edge_set(union, stage, n_q, n_k) == ea | eb
        meet = ea & eb
        if {i for i, _ in meet} == set(range(n_q)):  # else validation rejects it, tested below
            assert edge_set(parse_pattern(f"({a})&({b})"), stage, n_q, n_k) == meet


def test_intersection_leaving_a_query_without_edges_is_rejected():
    first_key = Pattern.from_rule(lambda q, k, n_q, n_k: k == 0, spec="first")
    meet = first_key & parse_pattern("local:w=0")
    assert meet.spec == "first&local:w=0"
    assert edge_set(meet, "ee", 1, 1) == {(0, 0)}
    with pytest.raises(PatternError, match=r"stage ee .*lengths n_q=3, n_k=3: query 1 has no incoming edge"):
        meet.edges("ee", 3, 3)


def test_canonical_specs_round_trip():
    for spec in ALL_SPECS + ["local", "act(full)", "bigbird"]:
        canonical = parse_pattern(spec).spec
        assert parse_pattern(canonical).spec == canonical
    assert parse_pattern("local").spec == "local:w=4"
    assert parse_pattern(" local : w = 2 ").spec == "local:w=2"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lokal", "unknown pattern 'lokal'; known patterns: act, bigbird"),
        ("local:w=-1", "bad parameters for pattern 'local': w must be >= 0"),
        ("local:x=3", "pattern 'local' has no parameter 'x'; its parameters: w: int = 4"),
        ("local:w=abc", "parameter w of pattern 'local' must be int, got 'abc'"),
        ("local:w", "bad parameter 'w' for pattern 'local'; write key=value"),
        ("local|", "expected 'name'"),
        ("act", "pattern 'act' wraps another pattern"),
        ("full(local)", "pattern 'full' does not wrap another pattern"),
        ("", "empty pattern spec"),
        # ambiguous parameters
        ("local:w=2,w=3", "parameter 'w' is given twice (2 and 3)"),
        ("local:", "':' with no parameters after it"),
        ("local:w=2,", "cannot parse pattern 'local:w=2,' at ','"),
    ],
)
def test_bad_specs_name_the_fix(spec, message):
    with pytest.raises((PatternError, UnknownNameError)) as info:
        parse_pattern(spec)
    assert isinstance(info.value, UnknownNameError) == message.startswith("unknown pattern"), repr(info.value)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def leaky(stage_rule):
    p = parse_pattern("full")
    return Pattern(ee=p.ee, dd=stage_rule, ed=p.ed, spec="leaky")


def test_decoder_future_edge_is_named():
    p = leaky(lambda q, k, n_q, n_k: k <= q + 1)
    with pytest.raises(PatternError) as info:
        p.edges("dd", 5, 5)
    msg = str(info.value)
    assert "pattern 'leaky', stage dd" in msg and "n_q=5, n_k=5" in msg
    assert "edge 1->0 lets position 0 see later position 1" in msg


def test_decoder_edges_depending_on_target_length_are_rejected():
    p = leaky(lambda q, k, n_q, n_k: (k <= q) & ((k == 0) | (q == n_q - 1)))  # the last query sees all
    with pytest.raises(
        PatternError, match=r"stage dd .*edge 1->2 exists for target length 4 but not 3.*independent of n_q"
    ):
        p.edges("dd", 4, 4)


def test_other_invariants_are_checked():
    def check(src, dst, n_q=3, n_k=3, stage="ee"):
        check_edges("p", stage, n_q, n_k, torch.tensor(src), torch.tensor(dst))

    with pytest.raises(PatternError, match="edge 3->0 is out of range"):
        check([3, 0, 1], [0, 1, 2])
    with pytest.raises(PatternError, match="edge 0->1 appears more than once"):
        check([0, 0, 0, 2], [0, 1, 1, 2])
    with pytest.raises(PatternError, match="query 1 has no incoming edge"):
        check([0, 2], [0, 2])
    check([0, 1, 2], [0, 1, 2])


def test_act_filters_edges_into_halted_queries():
    from gtx.graph.tokens import build_graph

    p = parse_pattern("act(local:w=1)")
    g = build_graph(p, [4, 3], [3, 2])
    active = torch.tensor([True, False, True, True, False, True, True])
    kept = p.filter(g.edges["ee"], active)
    assert set(kept.dst.tolist()) == {0, 2, 3, 5, 6}
    assert kept.num_edges == sum(int(d in {0, 2, 3, 5, 6}) for d in g.edges["ee"].dst.tolist())
    assert p.filter(g.edges["ee"], torch.ones(7, dtype=torch.bool)).num_edges == g.edges["ee"].num_edges


@pytest.mark.parametrize("name", ["full", "causal"])
def test_declared_structures_are_what_the_edges_say(name):
    from dataclasses import replace

    declared = parse_pattern(name)
    assert declared.structures
    counted = replace(declared, structures={}, _cache={})  # judged from its edges instead
    for stage in STAGES:
        for n_q in range(1, 9):
            n_k = n_q if stage != "ed" else n_q + 3
            assert declared.structure(stage, n_q, n_k) == counted.structure(stage, n_q, n_k), (stage, n_q, n_k)


@pytest.mark.parametrize("spec", ["full", "causal", "local:w=3", "strided:l=3"])
def test_most_keys_is_the_largest_in_degree_and_builds_no_edges_where_declared(spec):
    from dataclasses import replace

    pattern = parse_pattern(spec)
    for stage in STAGES:
        for n_q in range(1, 9):
            n_k = n_q if stage != "ed" else n_q + 3
            dst = replace(pattern, structures={}, _cache={}).edges(stage, n_q, n_k)[1]
            assert pattern.most_keys(stage, n_q, n_k) == int(torch.bincount(dst).max()), (stage, n_q, n_k)
    if pattern.structures:  # a causal sample of 2^20 tokens: 5.5e11 edges, if they were built
        fresh = replace(pattern, _cache={})
        assert fresh.most_keys("dd", 2**20, 2**20) == 2**20
        assert not fresh._cache


@pytest.mark.parametrize(
    "spec",
    [
        *ALL_SPECS,
        "topk:k=2",
        "moba:b=4,k=2",
        "moba:b=4,k=2,gate=block",
        "vslash:v=2,sl=2,last=4,sink=1,local=1",
        "blocktopk:b=2,k=3",
        "quest:p=2,k=2",
        "nsa:l=4,d=2,s=4,w=2",
        "dsa:k=2,dense=0",
        "heads(local:w=1,strided:l=3)+alibi",
    ],
)
def test_the_checks_pattern_authors_run_pass_on_the_built_in_patterns(spec):
    testing.check_pattern(spec, lengths=(1, 2, 5, 9))


def test_the_checks_pattern_authors_run_name_a_broken_pattern():
    with pytest.raises(PatternError, match="lets position 0 see later position 1"):
        testing.check_edges(leaky(lambda q, k, n_q, n_k: k <= q + 1))
    with pytest.raises(PatternError, match="must not depend on the target length"):
        testing.check_edges(leaky(lambda q, k, n_q, n_k: (k <= q) & ((k == 0) | (q == n_q - 1))))


def test_an_intersection_is_judged_by_its_result_not_its_operands():
    leaks = leaky(lambda q, k, n_q, n_k: k <= q + 1)  # sees one token ahead: refused alone
    with pytest.raises(PatternError, match="lets position"):
        leaks.edges("dd", 5, 5)
    fixed = leaks & parse_pattern("causal")  # what the leak error advises: k <= q + 1 and k <= q is causal
    for got, want in zip(fixed.edges("dd", 5, 5), parse_pattern("causal").edges("dd", 5, 5)):
        assert torch.equal(got, want)


def test_an_unannotated_parameter_takes_its_defaults_type():
    """A plugin's ``def window(w=4)`` got w as the string "2" from ``window:w=2``; it is the int 2,
    and the listing of its parameters says int."""
    import inspect

    from gtx.graph.spec import _kwargs, describe_params, param_type

    def window(w=4, scale=1.0, on=False, name="x", other=None):
        return parse_pattern(f"local:w={w}")

    got = _kwargs("pattern", "window", window, {"w": "2", "scale": "0.5", "on": "true", "name": "y", "other": "z"})
    assert got == {"w": 2, "scale": 0.5, "on": True, "name": "y", "other": "z"} and type(got["w"]) is int
    assert (
        describe_params(window)
        == "w: int = 4, scale: float = 1.0, on: bool = False, name: str = 'x', other: str = None"
    )
    with pytest.raises(PatternError, match="parameter w of pattern 'window' must be int, got 'x'"):
        _kwargs("pattern", "window", window, {"w": "x"})
    assert param_type(inspect.signature(lambda k: k).parameters["k"]) is str  # neither annotated nor defaulted


def test_a_pattern_within_a_sliding_window_keeps_its_run_time_parts():
    """A pretrained model's sliding window of 3 keys: the query's own and the two before it, intersected
    with the pattern; head groups, bias and selection kept, the selection among the windowed candidates."""
    assert torch.equal(
        within_window(parse_pattern("full"), 3).dense("dd", 9, 9), parse_pattern("local:w=2").dense("dd", 9, 9)
    )
    strided = parse_pattern("strided:l=2")
    assert torch.equal(
        within_window(strided, 3).dense("dd", 9, 9),
        strided.dense("dd", 9, 9) & parse_pattern("local:w=2").dense("dd", 9, 9),
    )
    grouped = within_window(parse_pattern("heads(local:w=1,strided:l=4)+alibi"), 3)
    assert (
        grouped.bias[0] == "alibi"
        and len(grouped.heads) == 2
        and grouped.spec == "(heads(local:w=1,strided:l=4)+alibi)&window:3"
    )
    assert torch.equal(
        grouped.heads[1].dense("dd", 9, 9),
        parse_pattern("strided:l=4").dense("dd", 9, 9) & parse_pattern("local:w=2").dense("dd", 9, 9),
    )
    topk = within_window(parse_pattern("topk:k=2"), 3)
    edges = batch_edges(topk, "dd", [9], [9])
    q = torch.randn(9, 2, 4)
    keep = topk.select(q, q, edges)  # a keep mask over the windowed candidates only
    assert keep.shape == (edges.num_edges, 2) and bool((edges.dst - edges.src < 3).all())
    with pytest.raises(PatternError, match="not among its candidates"):
        moba = within_window(parse_pattern("moba:b=2,k=2"), 3)
        moba.select(q, q, batch_edges(moba, "dd", [9], [9]))
    with pytest.raises(PatternError, match="own parameters"):
        within_window(parse_pattern("nsa"), 3)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lócal", "'ó' at position 1 is not part of a spec"),
        ("local:w=" + "9" * 23, "beyond 2,147,483,647"),
        ("dsa:dense=" + "1" + "0" * 21, "beyond 2,147,483,647"),
        ("(" * 100 + "full" + ")" * 100, "nests 100 levels of parentheses; gtx takes at most 64"),
        ("heads(" * 5000 + "full" + ")" * 5000, "gtx takes at most 4,096"),
        ("|".join(["local:w=1"] * 2000), "pattern spec of 19,999 characters"),
    ],
)
def test_hostile_specs_are_one_short_line(spec, message, cli):
    result = cli("show-pattern", spec)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and len(result.output) < 400
