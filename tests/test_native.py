"""The C kernels (gtx/native/keys_kernel.c) compute what their torch paths compute: attention over
selected keys, the top-k choice (the indexer's and topk's) and the indexer's KL losses (sparse and
dense), values and gradients; they build with older compilers, and a machine that cannot build or cache them falls back
with one logged line."""

import ctypes
import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import both_hold, both_paths

from gtx import files, native
from gtx.backends.flash import flash_attention
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import EdgeSet, build_graph
from gtx.selection.choice import top_keys
from gtx.selection.indexer import dense_index_kl, index_kl, top_indexed
from gtx.selection.keys import RANGE_SHIFT, KeySelection, attend_keys

pytestmark = pytest.mark.skipif(
    native.load("keys_kernel") is None, reason="no C compiler: the torch paths are all there is"
)


KERNELS = ("keys_kernel", "index_kernel", "dense_kernel", "packed_kernel")  # what ``loads_and_agrees`` builds


@settings(max_examples=30, deadline=None)
# 32: the kernels' unrolled copy
@given(
    n=st.integers(1, 40),
    heads=st.sampled_from([1, 2, 4]),
    count=st.integers(1, 20),
    shared=st.booleans(),
    dims=st.sampled_from([(8, 8), (16, 5), (32, 32)]),
    seed=st.integers(0, 100),
)
def test_attention_over_selected_keys_agrees_with_the_torch_path(n, heads, count, shared, dims, seed):
    check_selected_keys(n, n + 3, heads, count, shared, dims, seed)


@pytest.mark.parametrize("shared", [True, False])
def test_attention_over_keys_in_several_ranges_agrees_with_the_torch_path(shared, monkeypatch):
    """The backward's threads own ranges of 2^RANGE_SHIFT keys: 700 keys make three, on two threads."""
    assert 700 > 2 << RANGE_SHIFT
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    check_selected_keys(120, 700, 2, 40, shared, (16, 8), 1)


def check_selected_keys(n, n_keys, heads, count, shared, dims, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dims[0], generator=g) * dims[0] ** -0.5  # scaled, as attention's: scores of order 1
    k = torch.randn(n_keys, heads, dims[0], generator=g)
    v = torch.randn(n_keys, heads, dims[1], generator=g)
    # count > 8: runs of 8 slots and a rest
    keys = torch.randint(0, n_keys, (n, 1 if shared else heads, count), generator=g)
    valid = torch.rand(n, 1 if shared else heads, count, generator=g) > 0.3
    valid[0] = False  # a query with nothing to read: zero output, no gradient
    sel = KeySelection(keys.expand(-1, heads, -1), valid.expand(-1, heads, -1))  # shared: a view with head stride 0
    weights = torch.randn(n, heads, dims[1], generator=g)
    edges = build_graph(parse_pattern("full"), [n], None).edges["ee"]

    def run(q, k, v, weights):
        xs = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
        out, mean_p = attend_keys(*xs, edges, sel, probs=True)
        return out, mean_p, *torch.autograd.grad((out * weights).sum(), xs)

    got, _ = both_hold(run, q, k, v, weights)
    assert (got[0][0] == 0).all()


def indexer_inputs(n, heads, dim, seed):
    """Small integers: every score is exact in float32, so the two paths see the same ties (many)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-1, 2, (n, heads, dim), generator=g).float(),
        torch.randint(-2, 3, (n, heads), generator=g).float(),
        torch.randint(-1, 2, (n, dim), generator=g).float(),
    )


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=3), count=st.integers(1, 40), seed=st.integers(0, 100))
def test_the_indexer_chooses_the_same_keys_ties_to_the_later_one(lens, count, seed):
    iq, w, ik = indexer_inputs(sum(lens), 2, 4, seed)
    edges = build_graph(parse_pattern("causal"), None, lens).edges["dd"]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_indexed(iq, w, ik, edges, count))
    assert same_sets(keys, valid, want_keys, want_valid)
    start = 0
    for n in lens:  # each query kept min(count, t + 1) of its own sample's earlier keys
        t = torch.arange(n)
        assert torch.equal(valid[start : start + n].sum(1), (t + 1).clamp(max=count))
        chosen = keys[start : start + n]
        assert ((chosen >= start) & (chosen <= start + t[:, None]) | ~valid[start : start + n]).all()
        start += n


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_rows_that_fill_the_candidate_buffer_keep_the_torch_paths_keys(precision):
    """Rows seeing more keys than the kernel's candidate buffer holds (1024) select in it on the way (the
    partition on AVX-512 builds, through its spare room); equal scores (many here) still prefer later keys."""
    iq, w, ik = indexer_inputs(2600, 2, 6, 4)
    if precision == "int8":  # a 127 in every row: each scale 1, each int8 score exact in float32 on both paths
        iq, w, ik = iq * 127, w, ik * 127
        iq[..., 0], ik[:, 0] = 127.0, 127.0
    edges = build_graph(parse_pattern("causal"), None, [2500, 100]).edges["dd"]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_indexed(iq, w, ik, edges, 7, precision))
    assert same_sets(keys, valid, want_keys, want_valid)


def same_sets(keys, valid, want_keys, want_valid) -> bool:
    """The same valid key ids per query (and head), in any order."""
    return torch.equal(
        keys.long().masked_fill(~valid, -1).sort(-1).values, want_keys.masked_fill(~want_valid, -1).sort(-1).values
    )


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    count=st.integers(1, 40),
    heads=st.sampled_from([1, 3]),
    stage=st.sampled_from(["ee", "dd"]),
    seed=st.integers(0, 100),
)
def test_topk_chooses_the_same_keys_per_head_on_the_kernel(lens, count, heads, stage, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(sum(lens), heads, 8, generator=g) for _ in range(2))  # random scores: no ties
    pattern = parse_pattern("full" if stage == "ee" else "causal")
    edges = build_graph(pattern, lens if stage == "ee" else None, lens if stage == "dd" else None).edges[stage]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_keys(q, k, edges, count))
    assert keys.dtype == torch.int32 and keys.shape == want_keys.shape == (sum(lens), heads, count)
    assert same_sets(keys, valid, want_keys, want_valid)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), count=st.integers(1, 12), dim=st.sampled_from([5, 8, 32]), seed=st.integers(0, 100))
def test_the_indexer_kl_over_kept_keys_agrees_with_the_torch_path(n, count, dim, seed):
    g = torch.Generator().manual_seed(seed)
    iq, w, ik = (
        torch.randn(n, 2, dim, generator=g),
        torch.randn(n, 2, generator=g),
        torch.randn(n + 5, dim, generator=g),
    )
    keys = torch.randint(0, n + 5, (n, count), generator=g)
    valid = torch.rand(n, count, generator=g) > 0.25
    p = torch.softmax(torch.randn(n, count, generator=g).masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)
    p[:, 0] = p[:, 0] * valid[:, 0]  # a zero target weight: p log p is 0

    def run(p, iq, w, ik):
        xs = [x.clone().requires_grad_() for x in (iq, w, ik)]
        loss = index_kl(p, *xs, keys, valid)
        return loss, *torch.autograd.grad(loss * 1.5, xs)

    both_hold(run, p, iq, w, ik)


REAL_CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def fresh(tmp_path, monkeypatch, caplog):
    """An empty cache (GTX_CACHE), nothing logged or looked up yet in this process, the log captured;
    returns a function giving the warning lines."""
    monkeypatch.setenv("GTX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GTX_NATIVE", raising=False)
    monkeypatch.setattr(native, "_said", set())
    native.toolchain.cache_clear()
    files._usable_cache.cache_clear()
    caplog.set_level(logging.INFO, logger="gtx")
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    native.toolchain.cache_clear()
    files._usable_cache.cache_clear()


def script(path: Path, body: str) -> str:
    """An executable shell script at ``path`` (a stand-in compiler); returns its path."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def loads_and_agrees(monkeypatch):
    """The kernels load (from ``$GTX_CACHE``, as built now) and compute what the torch paths compute."""
    libs = {name: native.load.__wrapped__(name) for name in KERNELS}
    assert all(libs.values())
    monkeypatch.setattr(native, "load", libs.get)
    check_selected_keys(30, 40, 2, 12, False, (32, 32), 0)  # the lane sums' shuffles at the unrolled size
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(50, 2, 8, generator=g) for _ in range(2))
    edges = build_graph(parse_pattern("causal"), None, [50]).edges["dd"]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_keys(q, k, edges, 5))
    assert same_sets(keys, valid, want_keys, want_valid)
    # the int8 choice (VNNI or the portable loop) on scores exact in float32: ties to the later key alike
    iq, w, ik = (x * 127 for x in indexer_inputs(300, 2, 6, 0))
    iq[..., 0], ik[:, 0], w = 127.0, 127.0, w / 127
    edges = build_graph(parse_pattern("causal"), None, [300]).edges["dd"]
    (keys, valid), (want_keys, want_valid) = both_paths(lambda: top_indexed(iq, w, ik, edges, 40, "int8"))
    assert same_sets(keys, valid, want_keys, want_valid)
    # the dense KL's element-wise steps: rows past a chunk of 512 columns, on random values (small
    # integers' equal terms make a scalar build's sums round alike each time: coherent, beyond the bound)
    q, k = (torch.randn(600, 2, 8, generator=g) for _ in range(2))

    def dense(q, k, *inputs):
        xs = [x.clone().requires_grad_() for x in inputs]
        loss = dense_index_kl(q, k, None, *xs, [600], 64)
        return loss, *torch.autograd.grad(loss, xs)

    both_hold(
        dense,
        q,
        k,
        torch.randn(600, 2, 8, generator=g),
        torch.randn(600, 2, generator=g),
        torch.randn(600, 8, generator=g),
    )
    # plain attention over packed short samples (the kernel hidden: SDPA's padded calls), at the unrolled size
    edges = build_graph(parse_pattern("full"), [3, 9, 20], [5, 1, 12]).edges["ed"]
    qkv = [torch.randn(n, 2, 32, generator=g) for n in (edges.n_dst, edges.n_src, edges.n_src)]

    def plain(*qkv):
        qkv = [x.clone().requires_grad_() for x in qkv]
        out = flash_attention(
            *qkv, EdgeSet(edges.src, edges.dst, edges.n_src, edges.n_dst, "ed", edges.q_lens, edges.k_lens), "complete"
        )
        return out, *torch.autograd.grad(out.sin().sum(), qkv)

    both_hold(plain, *qkv)


def int8_kind(lib) -> str:
    lib.gtx_int8_kind.restype = ctypes.c_char_p
    return lib.gtx_int8_kind().decode()


def test_the_int8_choice_builds_portable_without_the_cpus_int8_instructions(fresh, monkeypatch):
    """GTX_PORTABLE leaves out the AVX-512 and VNNI code, as a CPU or compiler without them does."""
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-DGTX_PORTABLE"])
    assert int8_kind(native.load.__wrapped__("index_kernel")) == "portable"
    loads_and_agrees(monkeypatch)
    assert fresh() == []


def test_the_float32_choice_keeps_the_same_keys_built_for_avx512_and_portable(fresh, monkeypatch):
    """The float32 scores' 16-lane loop (AVX-512 builds) sums each key's dot product in the order of the
    portable 8-lane one: on random scores (few ties, many near ones) both keep the same keys."""
    if "avx512f" not in native._cpu_features().split():
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(3)
    iq, w, ik = (
        torch.randn(700, 2, 32, generator=g),
        torch.randn(700, 2, generator=g),
        torch.randn(700, 32, generator=g),
    )
    edges = build_graph(parse_pattern("causal"), None, [300, 400]).edges["dd"]
    chosen, build = [], native.load.__wrapped__
    for flags in ([], ["-DGTX_PORTABLE"]):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(native, "FLAGS", [*native.FLAGS, *flags])
            lib = {"index_kernel": build("index_kernel")}
        monkeypatch.setattr(native, "load", lib.get)
        chosen.append(top_indexed(iq, w, ik, edges, 60))
    (keys, valid), (want_keys, want_valid) = chosen
    assert same_sets(keys, valid, want_keys.long(), want_valid) and valid.sum() > 30_000
    assert fresh() == []


def test_a_cpu_with_avx512_vnni_scores_int8_on_it():
    if "avx512_vnni" not in native._cpu_features().split():
        pytest.skip("this CPU has no AVX-512 VNNI")
    if native.arch() != ["-march=native"]:
        pytest.skip(f"GTX_NATIVE_ARCH: the kernels are built for {native.arch()[0]}, not this CPU")
    assert int8_kind(native.load("index_kernel")) == "avx512-vnni"


def test_the_kernels_use_no_builtin_that_only_gcc_12_has_outside_its_guard():
    """GCC 11 (Ubuntu 22.04, RHEL 9, Debian 11) has no __builtin_shufflevector: kernel.h picks it only
    for clang and GCC >= 12, __builtin_shuffle elsewhere."""
    folder = Path(native.__file__).parent
    text = re.sub(
        r"/\*.*?\*/", "", "\n".join(p.read_text() for p in [*folder.glob("*.h"), *folder.glob("*.c")]), flags=re.S
    )
    guarded = re.compile(r"#if defined\(__clang__\) \|\| __GNUC__ >= 12\n(.*?)#else\n(.*?)#endif", re.S)
    assert len(guarded.findall(text)) == 1 and "__builtin_shuffle(" in guarded.search(text).group(2)
    assert "__builtin_shufflevector" not in guarded.sub("", text)


@pytest.mark.parametrize("compiler", ["gcc-11", "clang"])
def test_older_compilers_build_kernels_that_agree_with_the_torch_path(compiler, fresh, monkeypatch):
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} here (CI installs gcc-11 where it can)")
    monkeypatch.setenv("CC", compiler)
    loads_and_agrees(monkeypatch)
    assert not [line for line in fresh() if "does not build" in line]


def test_cc_is_split_as_a_shell_would_a_wrapper_and_flags_too(fresh, tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    wrap = script(tmp_path / "my wrap", f'echo x >> "{calls}"; exec "$@"')  # as ccache runs the compiler it is given
    monkeypatch.setenv("CC", f"'{wrap}' {REAL_CC} -O2")
    loads_and_agrees(monkeypatch)
    assert fresh() == [] and len(calls.read_text().split()) == 1 + len(KERNELS)  # --version, then one build per kernel


def test_gtx_native_arch_builds_for_that_target_under_its_own_key(fresh, tmp_path, monkeypatch):
    """GTX_NATIVE_ARCH=x86-64: the compiler gets -march=x86-64 (SSE2: the int8 choice's portable loop),
    build_flags says so, and the library is another than -march=native's."""
    calls = tmp_path / "calls"
    wrap = script(tmp_path / "wrap", f'echo "$*" >> "{calls}"; exec {REAL_CC} "$@"')
    monkeypatch.setenv("CC", wrap)
    monkeypatch.setenv("GTX_NATIVE_ARCH", "x86-64")
    portable = native.library("index_kernel")
    assert int8_kind(ctypes.CDLL(str(portable))) == "portable"
    assert "-march=x86-64 " in calls.read_text() and "-march=native" not in calls.read_text()
    assert "-march=x86-64" in native.build_flags("index_kernel").split()
    monkeypatch.delenv("GTX_NATIVE_ARCH")
    assert native.library("index_kernel") != portable and "-march=native" in calls.read_text()
    assert fresh() == []


def test_python_m_gtx_native_says_the_machine_and_the_flags_in_two_lines(capsys):
    """What CI prints first: the CPU and torch's threads, then the compiler and flags the kernels build with."""
    import runpy

    runpy.run_module("gtx.native", run_name="__main__")
    machine, flags = capsys.readouterr().out.splitlines()
    assert machine.startswith("machine: ") and f"threads {torch.get_num_threads()}" in machine
    assert flags.startswith("C kernels: ") and "-O3" in flags.split()  # the test run builds them


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "gcc '-O2"])
def test_a_compiler_that_is_not_there_gives_the_torch_path_and_one_line_naming_cc(cc, fresh, monkeypatch):
    monkeypatch.setenv("CC", cc)
    assert native.load.__wrapped__("keys_kernel") is None and native.load.__wrapped__("index_kernel") is None
    (line,) = fresh()
    assert line.startswith(f"CC={cc!r}") and "torch path" in line


def test_no_compiler_on_the_path_says_so_once(fresh, tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert native.library("keys_kernel") is None and native.library("index_kernel") is None
    assert fresh() == [
        "no C compiler (no cc or gcc on the PATH): topk, dsa and dropout run on their torch path, several times slower "
        "on the CPU; set CC to a C compiler's command"
    ]


def test_gtx_native_0_says_so_in_one_line(fresh, monkeypatch):
    monkeypatch.setenv("GTX_NATIVE", "0")
    assert native.load.__wrapped__("keys_kernel") is None and native.load.__wrapped__("index_kernel") is None
    (line,) = fresh()
    assert line.startswith("GTX_NATIVE=0:")


@pytest.mark.parametrize("kind", ["a file", "below a file", "/dev/null", "empty", "read-only"])
def test_a_cache_that_cannot_be_used_gives_a_temporary_folder_and_one_line_naming_gtx_cache(
    kind, fresh, tmp_path, monkeypatch
):
    (tmp_path / "f").write_text("")
    value = {
        "a file": tmp_path / "f",
        "below a file": tmp_path / "f" / "sub",
        "/dev/null": "/dev/null",
        "empty": "",
        "read-only": tmp_path / "ro",
    }[kind]
    if kind == "read-only":  # root writes anywhere: the check is made to see a read-only folder
        (tmp_path / "ro").mkdir()
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != tmp_path / "ro" and access(p, mode))
    monkeypatch.setenv("GTX_CACHE", str(value))
    lib = native.library("keys_kernel")
    (line,) = fresh()
    assert line.startswith(f"GTX_CACHE={value} cannot be used") and "set GTX_CACHE to a writable folder" in line
    assert lib is not None and lib.parent.parent == files.cache_dir() != Path(str(value)).absolute()
    assert lib.parent.parent.name.startswith("gtx-cache-") and native.load.__wrapped__("keys_kernel") is not None


def test_gtx_cache_dir_is_read_as_gtx_cache_where_that_is_unset(fresh, tmp_path, monkeypatch):
    monkeypatch.delenv("GTX_CACHE")
    monkeypatch.setenv("GTX_CACHE_DIR", str(tmp_path / "old"))
    assert files.cache_dir() == tmp_path / "old"
    monkeypatch.setenv("GTX_CACHE", str(tmp_path / "new"))
    assert files.cache_dir() == tmp_path / "new" and fresh() == []


def test_a_kernels_folder_that_cannot_be_made_gives_the_torch_path_and_one_line_naming_gtx_cache(fresh, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "native").write_text("")
    assert native.library("keys_kernel") is None and native.library("index_kernel") is None
    (line,) = fresh()
    assert "cannot be used" in line and "set GTX_CACHE to a writable folder" in line


def test_a_damaged_cached_library_is_rebuilt_never_loaded(fresh):
    """A library cut short (a crash, a full disk) killed the process with SIGBUS when loaded."""
    path = native.library("keys_kernel")  # built, not loaded: this process never maps it
    whole = path.read_bytes()
    for damage in ("cut short", "empty", "a byte changed", "no hash beside it"):
        if damage == "no hash beside it":
            (path.parent / (path.name + ".sha256")).unlink()
        else:
            path.write_bytes(
                {"cut short": whole[: len(whole) // 2], "empty": b"", "a byte changed": whole[:-1] + b"\1"}[damage]
            )
        assert not native._verified(path)
        assert (
            native.library("keys_kernel") == path and len(path.read_bytes()) == len(whole) and native._verified(path)
        ), damage
    assert native.load.__wrapped__("keys_kernel") is not None and fresh() == []


def test_a_library_that_does_not_load_gives_the_torch_path_and_one_line_naming_gtx_cache_and_cc(
    fresh, tmp_path, monkeypatch
):
    foreign = tmp_path / "foreign.so"
    foreign.write_bytes(b"no shared object")
    monkeypatch.setattr(native, "library", lambda name: foreign)
    assert native.load.__wrapped__("keys_kernel") is None
    (line,) = fresh()
    assert line.startswith("C kernel keys_kernel does not load (") and "set GTX_CACHE to another folder, or CC" in line


def test_the_library_is_synced_before_it_is_moved_into_place(fresh, monkeypatch):
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(Path(b).name), replace(a, b))[1])
    path = native.library("keys_kernel")
    at = events.index(path.name)
    assert at > 0 and events[at - 1] == "fsync"


def test_the_openmp_choice_and_the_toolchain_are_in_the_cache_key(fresh, tmp_path, monkeypatch):
    """A one-off OpenMP failure builds without OpenMP, under its own key; the failure is retried a day
    later, and then the OpenMP build is used. Another compiler (a wrapper too) builds its own library."""
    once = tmp_path / "fail-once"
    once.write_text("")
    flaky = script(
        tmp_path / "flaky",
        f'case "$*" in *-fopenmp*) if [ -e "{once}" ]; then rm "{once}"; exit 1; fi;; esac; exec {REAL_CC} "$@"',
    )
    monkeypatch.setenv("CC", flaky)
    single = native.library("keys_kernel")
    assert single is not None and "built without OpenMP" in fresh()[0]
    monkeypatch.setattr(native, "_said", set())
    assert native.library("keys_kernel") == single  # the failure remembered: no retry by this process
    (marker,) = single.parent.glob("keys_kernel-*.failed")
    os.utime(marker, (time.time() - native.RETRY_AFTER - 1,) * 2)
    threaded = native.library("keys_kernel")
    assert threaded not in (None, single)
    monkeypatch.setenv("CC", REAL_CC)
    assert native.library("keys_kernel") not in (single, threaded)


def test_a_compiler_that_refuses_march_native_builds_for_the_baseline(fresh, tmp_path, monkeypatch):
    picky = script(
        tmp_path / "picky",
        f'case "$*" in *-march=native*) echo "error: unknown target CPU native" >&2; exit 1;; esac; exec {REAL_CC} "$@"',
    )
    monkeypatch.setenv("CC", picky)
    monkeypatch.delenv("GTX_NATIVE_ARCH", raising=False)  # -march=native, what the compiler refuses
    loads_and_agrees(monkeypatch)
    (line,) = fresh()  # one line for both kernels
    assert line.startswith("the C kernels are built for the baseline CPU (the compiler refused -march=native)")


def test_a_failing_compiler_is_remembered_not_retried_by_every_process(fresh, tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    broken = script(tmp_path / "broken", f'echo x >> "{calls}"; echo "broken.c:1: error: no" >&2; exit 1')
    monkeypatch.setenv("CC", broken)
    assert native.library("keys_kernel") is None and native.library("index_kernel") is None
    (line,) = fresh()  # one line for both kernels
    assert f"does not build with CC={broken}" in line and "broken.c:1: error: no" in line and ".failed to retry" in line
    tries = len(calls.read_text().split())  # --version, then each build tried
    monkeypatch.setattr(native, "_said", set())  # as a new process
    assert native.library("keys_kernel") is None and native.library("index_kernel") is None
    # --version, then 4 builds of each kernel, once
    assert len(calls.read_text().split()) == tries == 9 and len(fresh()) == 2


def test_a_library_whose_loading_ends_the_process_is_remembered_as_a_failed_build(fresh, tmp_path, monkeypatch):
    """CC='gcc -fsanitize=address' built a library whose loading aborts the process (the sanitizer's
    runtime must come first): every later run died. Here a library that ends its loader: tried in a
    child process, remembered as a failed build, never loaded by this one."""
    (tmp_path / "die.c").write_text(
        '#include <unistd.h>\n__attribute__((constructor)) static void die(void) { write(2, "dying\\n", 6); _exit(1); }\n'
    )
    calls = tmp_path / "calls"
    deadly = script(tmp_path / "deadly", f'echo x >> "{calls}"; exec {REAL_CC} "$@" "{tmp_path / "die.c"}"')
    monkeypatch.setenv("CC", deadly)
    assert native.library("keys_kernel") is None
    (line,) = fresh()
    assert f"does not build with CC={deadly} (built, but loading it ends the process: dying)" in line, line
    tries = len(calls.read_text().split())
    monkeypatch.setattr(native, "_said", set())  # as a new process
    assert native.library("keys_kernel") is None and len(calls.read_text().split()) == tries == 5


def test_the_cache_key_holds_the_cpus_model_where_there_is_no_proc_cpuinfo(tmp_path, monkeypatch):
    """macOS: the architecture's name alone let a cache copied from a newer Mac run unknown instructions."""
    script(tmp_path / "sysctl", 'echo "machdep.cpu.brand_string: Apple M9"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    read_text = Path.read_text
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: (
            (_ for _ in ()).throw(OSError()) if str(self) == "/proc/cpuinfo" else read_text(self, *a, **k)
        ),
    )
    assert "Apple M9" in native._cpu_features.__wrapped__()


@pytest.mark.parametrize("on_kernel", [True, False])
def test_attention_over_no_keys_reads_nothing_and_ids_out_of_range_are_an_error(on_kernel, monkeypatch):
    """Over an empty key set the kernel read out of bounds (a segfault); the torch path raised."""
    if not on_kernel:
        monkeypatch.setattr(native, "kernel", lambda *_: None)
    e = build_graph(parse_pattern("full"), [0], [5]).edges["ed"]
    q = torch.randn(5, 2, 8, requires_grad=True)
    k, v = torch.randn(0, 2, 8, requires_grad=True), torch.randn(0, 2, 8, requires_grad=True)
    out = attend_keys(q, k, v, e, KeySelection(*top_keys(q.detach(), k.detach(), e, 4)))
    assert out.shape == (5, 2, 8) and not out.any()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert not dq.any() and dk.shape == k.shape and dv.shape == v.shape
    k3, v3 = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    for keys in (torch.full((5, 2, 4), 3), torch.full((5, 2, 4), -1)):
        with pytest.raises(IndexError, match="out of range"):
            attend_keys(q, k3, v3, e, KeySelection(keys, torch.zeros(5, 2, 4, dtype=torch.bool)))
    with pytest.raises(IndexError, match="out of range"):
        attend_keys(
            q, k, v, e, KeySelection(torch.zeros(5, 2, 4, dtype=torch.long), torch.ones(5, 2, 4, dtype=torch.bool))
        )


def test_the_indexer_kl_refuses_ids_out_of_range():
    iq, w, ik = torch.randn(4, 2, 8), torch.randn(4, 2), torch.randn(3, 8)
    keys, valid = torch.full((4, 2), 3), torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(IndexError, match="out of range"):
        index_kl(torch.full((4, 2), 0.5), iq, w, ik, keys, valid)
