"""gtx on a CUDA GPU: every backend and pattern against dense attention, a training step of every
model under the sparse methods, and the CUDA memory meter. Skipped without a GPU; ``python -m
pytest -m cuda`` selects them (``bench/gpu.sh`` runs them on a lent card).

Tolerances are relative norms ``|got - want| / |want|`` (``rel_error``) against the CPU's float32 dense reference:
1e-4 in float32 (no TF32: torch's default), 2e-2 in bfloat16 (8 bits of mantissa). With
``GTX_CUDA_REPORT=FILE`` each comparison's error is also written to FILE (CSV).
"""

import copy
import csv
import os
import traceback

import pytest
import torch
from click.testing import CliRunner

from gtx.attention.module import Attention
from gtx.backends import get_backend
from gtx.graph.spec import parse_pattern
from gtx.graph.tokens import build_graph
from gtx.plugins.registry import BACKENDS

# GTX_CUDA_TEST_DEVICE=cpu runs the same checks on the CPU: how the suite itself is checked without a GPU.
CUDA = torch.device(os.environ.get("GTX_CUDA_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
ZERO_FLOOR = 1e-2  # a gradient this much smaller than the comparison's largest is judged against that share of it
LENS = (37, 130, 200)  # a mixed batch: several blocks of 16 to 128, a sample shorter than one
# Fixed patterns: their edges do not depend on the inputs, so every backend runs them.
FIXED = [
    "full",
    "causal",
    "local:w=16",
    "dilated:w=4,d=3",
    "strided:l=8",
    "fixed:l=16,c=2",
    "bigbird:b=16,r=1",
    "longformer:w=4,g=2",
    "sinks:s=4,w=16",
    "local:w=8|strided:l=16",
    "heads(local:w=4,full)",
    "local:w=8+alibi",
    "causal+relbias",
]
# Content-chosen and trainable patterns: their choice reads q and k; they run on gtx's own paths.
CHOSEN = [
    "topk:k=8",
    "lsh(full)",
    "moba:b=16,k=2",
    "moba:b=16,k=2,gate=block",
    "nsa:l=8,d=4,s=16,n=4,w=16",
    "dsa:k=8,dense=0",
    "dsa:k=32,dense=0,b=16",
    "topk(local:w=32):k=4",
    "vslash:v=8,sl=16,last=32,sink=2,local=4",
    "blocktopk:b=16,k=3",
    "quest:p=16,k=2",
]
_rows: list[dict] = []


def backends_on_cuda() -> list[str]:
    """The backends that train on the suite's device (all but dgl's on a card; flex not on the CPU)."""
    return [
        n
        for n in BACKENDS.names()
        if BACKENDS.get(n).obj.available(CUDA) is None and BACKENDS.get(n).obj.trains_on(CUDA)
    ]


def rel_error(got: torch.Tensor, want: torch.Tensor, scale: float = 0.0) -> float:
    """|got - want| / max(|want|, ZERO_FLOOR * scale): a gradient that is zero in exact arithmetic
    (NSA's last bias of phi_k shifts every compressed key alike, which no softmax sees) is judged
    against the comparison's largest gradient (``scale``), whose float32 rounding is its whole value."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - want).norm() / max(float(want.norm()), ZERO_FLOOR * scale, 1e-30))


def report(**row) -> None:
    _rows.append(row)
    path = os.environ.get("GTX_CUDA_REPORT")
    if path:
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if f.tell() == 0:
                writer.writeheader()
            writer.writerow(row)


def outputs_and_grads(attention: Attention, q, k, v, edges, weights, inputs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, edges, inputs=inputs)
    grads = torch.autograd.grad(
        (out.float() * weights).sum(), [q, k, v, *attention.parameters()], materialize_grads=True
    )
    return [out, *grads]


def compare(spec: str, stage: str, backend: str, dtype: torch.dtype, heads: int = 4, dim: int = 32) -> None:
    """``backend`` on CUDA in ``dtype`` against dense on the CPU in float32: output and gradients of
    q, k, v and the pattern's own parameters, for ``stage`` over a batch of LENS."""
    p = parse_pattern(spec)
    graph = build_graph(p, LENS if stage == "ee" else None, LENS if stage == "dd" else None)
    edges = graph.edges[stage]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, generator=g) for n in (edges.n_dst, edges.n_src, edges.n_src))
    inputs = torch.randn(edges.n_dst, heads * dim, generator=g)  # the layer's input, which dsa's indexer reads
    torch.manual_seed(0)
    reference = Attention(get_backend("dense"), p, heads, dim)
    for table in reference.parameters():  # away from their start, so that their gradients are compared too
        # scaled by fan-in as at initialization: unscaled, NSA's compression MLP made scores of ~10^3,
        # where the CPU's own float32 reference is 1e-3 off float64
        table.data = torch.randn(table.shape, generator=g) / (table.shape[-1] ** 0.5 if table.dim() > 1 else 1.0)
    weights = torch.randn(edges.n_dst, heads, dim, generator=g)
    want = outputs_and_grads(reference, q, k, v, edges, weights, inputs)
    attention = Attention(get_backend(backend, CUDA), p, heads, dim).to(CUDA)
    attention.load_state_dict(reference.state_dict())
    got = outputs_and_grads(
        attention, *(x.to(CUDA, dtype) for x in (q, k, v)), edges.to(CUDA), weights.to(CUDA), inputs.to(CUDA, dtype)
    )
    names = ["out", "dq", "dk", "dv", *(n for n, _ in reference.named_parameters())]
    scale = max(float(w.norm()) for w in want[1:])
    errors = {name: rel_error(a, b, scale) for name, a, b in zip(names, got, want)}
    for name, err in errors.items():
        report(
            pattern=spec,
            stage=stage,
            backend=backend,
            dtype=str(dtype).removeprefix("torch."),
            what=name,
            rel_error=f"{err:.3e}",
        )
    worst = max(errors, key=errors.get)
    off = (
        ((got[0].float().cpu() - want[0]).norm(dim=-1) > TOLERANCE[dtype] * want[0].norm(dim=-1))
        .any(-1)
        .nonzero()
        .flatten()
    )
    assert errors[worst] <= TOLERANCE[dtype], (
        f"{spec} {stage} {backend} {dtype}: {worst} off by {errors[worst]:.2e} (relative norm); "
        f"{len(off)} of {len(want[0])} queries' outputs differ, first {off[:8].tolist()}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spec", FIXED)
def test_every_backend_equals_dense_on_fixed_patterns(spec, dtype):
    for stage in ("ee", "dd"):
        for backend in backends_on_cuda():
            # the others refuse biases in one line
            if parse_pattern(spec).bias is None or BACKENDS.get(backend).obj.supports_bias:
                compare(spec, stage, backend, dtype)


@pytest.mark.parametrize("spec", CHOSEN)
def test_content_chosen_and_trainable_patterns_equal_dense_under_the_same_choice(spec):
    stages = ("dd",) if spec.startswith(("moba", "nsa", "dsa", "vslash", "blocktopk", "quest")) else ("ee", "dd")
    for stage in stages:
        for backend in ("auto", "dense"):
            compare(spec, stage, backend, torch.float32)


def test_flex_is_offered_on_cuda_and_auto_uses_sdpa_for_plain_attention():
    assert ("flex" in backends_on_cuda()) == (CUDA.type == "cuda")  # on the CPU flex has no backward
    auto = get_backend("auto", CUDA)
    auto.reset_choices()
    compare("causal", "dd", "auto", torch.bfloat16)
    assert set(auto.reset_choices()["dd"]) == {"flash-causal"}


MODELS = {
    "lm": ("recall", ["--set", "seq_len=160", "--set", "n_pairs=4"]),
    "transformer": ("copy", ["--set", "mean_len=40"]),
    "ut": ("copy", ["--set", "mean_len=40", "--set", "max_depth=3"]),
    "hf": ("recall", ["--set", "seq_len=160", "--set", "n_pairs=4", "--set", "layers=2"]),
}
METHODS = [
    "local:w=16",
    "moba:b=16,k=2",
    "moba:b=16,k=2,gate=block",
    "nsa:l=8,d=4,s=16,n=4,w=16",
    "dsa:k=8,dense=1",
    "topk:k=8",
]
# (model, precision, methods): every method on the decoder-only models; the seq2seq ones, whose
# decoding dominates a short run, under three.
RUNS = [
    ("lm", "float32", METHODS),
    ("lm", "bfloat16", METHODS),
    ("hf", "bfloat16", METHODS),
    ("transformer", "float32", METHODS[:2] + METHODS[4:5]),
    ("ut", "bfloat16", METHODS[:2] + METHODS[4:5]),
]


@pytest.mark.parametrize("model,precision,methods", RUNS, ids=[f"{m}-{p}" for m, p, _ in RUNS])
def test_a_training_run_of_every_model_under_the_methods(tmp_path, model, precision, methods):
    """``gtx run --device cuda``: two optimizer steps and an evaluation per method, finite losses,
    rows written with the GPU's peak memory."""
    import pandas as pd

    from gtx.cli import cli

    task, extra = MODELS[model]
    for spec in methods:
        args = [
            "run",
            "--task",
            task,
            "--model",
            model,
            "--pattern",
            spec,
            "--device",
            CUDA.type,
            "--epochs",
            "1",
            "--dim",
            "64",
            "--heads",
            "4",
            "--dim-ff",
            "128",
            "--set",
            "n_train=64",
            "--set",
            "n_valid=16",
            "--set",
            "n_test=16",
            "--set",
            "max_steps=2",
            "--set",
            "batch_size=32",
            "--set",
            "decode_valid=4",
            "--set",
            f"precision={precision}",
            "--results",
            str(tmp_path / "results"),
            *extra,
        ]
        result = CliRunner().invoke(cli, args)
        why = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info and result.exit_code == 1 else ""
        assert result.exit_code == 0, f"{model} {spec} {precision}: {result.output[-2000:]}{why[-3000:]}"
    rows = pd.concat([pd.read_csv(p) for p in (tmp_path / "results" / "runs").glob("*.csv")])
    assert len(rows.pattern.unique()) == len(methods)
    assert rows.loss.notna().all() and (rows.loss < 20).all()
    assert (rows[rows.split == "train"].peak_mem_mb > 0).all()


@pytest.mark.parametrize(
    "spec", ["local:w=16", "moba:b=16,k=2", "nsa:l=8,d=4,s=16,n=4,w=16", "dsa:k=8,dense=0", "topk:k=8"]
)
def test_a_model_on_cuda_computes_what_it_computes_on_the_cpu(spec):
    """The lm's loss and every parameter's gradient on one batch: CUDA against the CPU, float32."""
    from gtx.data.batch import IGNORE, batches
    from gtx.run.build import build_attention, build_model
    from gtx.run.runner import RunConfig, resolve

    settings = {
        "seq_len": "160",
        "n_pairs": "4",
        "n_train": "8",
        "n_valid": "4",
        "n_test": "4",
        "dim": "64",
        "heads": "4",
        "dim_ff": "128",
    }
    r = resolve(RunConfig(task="recall", model="lm", pattern=spec, device="cpu", settings=settings))
    torch.manual_seed(0)
    cpu = build_model(r, build_attention(r)).eval()
    gpu = copy.deepcopy(cpu).to(CUDA)
    batch = next(batches(r.task, "train", r.pattern, 8))
    found = {}
    for name, model, device in (("cpu", cpu, "cpu"), ("cuda", gpu, CUDA)):
        out = model(batch.to(device))
        loss = torch.nn.functional.cross_entropy(out.logits, batch.targets.to(device), ignore_index=IGNORE)
        loss.backward()
        found[name] = (loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert rel_error(found["cuda"][0], found["cpu"][0]) <= 1e-4
    err = rel_error(found["cuda"][1], found["cpu"][1])
    report(pattern=spec, stage="lm", backend="auto", dtype="float32", what="parameter grads", rel_error=f"{err:.3e}")
    assert err <= 1e-3, f"{spec}: gradients differ by {err:.2e}"
