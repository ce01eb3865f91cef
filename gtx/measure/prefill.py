"""``gtx bench prefill``: a transformers causal LM's forward pass over one long sequence (a prefill),
its attention run by gtx under each pattern, against the same weights on transformers' own SDPA.

    df = bench_prefill("llama", patterns=["full", "local:w=256"], lengths=[4096, 16384])

The model is ``--model hf``'s (``plugins/models/hf.py``), randomly initialised (speed does not depend
on the weights), or a pretrained one given by ``path`` (``settings={"path": "smollm2"}``: the same
code over a real model's sizes). Each row times ``repeats`` forward passes without gradients (the
median, after one warm-up) and measures the pass's peak memory growth over the loaded model (``gtx.memory``).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from gtx.errors import GtxError
from gtx.memory import peak_mb, reset_peak

SDPA = "transformers sdpa"
CEILING = "no attention"  # gtx's model with attention skipped (SkipAttention): what no gtx row can beat
VOCAB = 256  # tokens of the random model: the embedding and the output layer stay small beside the attention


class _Vocab:
    def __len__(self) -> int:
        return VOCAB


def _config(family: str, settings: dict[str, str], length: int):
    """The hf model's config from ``--set`` strings, checked as ``gtx run`` checks them."""
    from gtx.plugins.registry import MODELS
    from gtx.run.config import build_configs

    return build_configs(
        {"family": family, "max_len": str(length), **settings}, {"model": ("hf", MODELS.get("hf").config)}
    )["model"]


def check_lengths(family: str, settings: dict[str, str], lengths: Sequence[int]) -> None:
    """Before any model or data is made: each length within the model's positions (a folder's, or
    ``--set max_len``; a random model is otherwise built with as many as the length), and the least
    one forward holds (a layer's input and output, the logits) within this machine's memory."""
    memory = _physical_bytes()
    for n in lengths:
        config = _config(family, settings, n)
        if n > config.max_len:
            whose = f"path={config.path}" if config.path else "--set max_len"
            raise GtxError(
                f"bench prefill --lengths {n}: past the model's {config.max_len} positions ({whose}); give lengths up to "
                f"{config.max_len}{'' if config.path else ', or raise max_len'}"
            )
        least = n * (2 * config.dim + VOCAB) * 4  # float32
        if memory and least > memory:
            raise GtxError(
                f"bench prefill --lengths {n}: one forward pass holds at least {least / 2**30:,.1f} GiB (hidden states of "
                f"{n:,} tokens x {config.dim}, twice, and their logits over {VOCAB} tokens), more than this machine's "
                f"{memory / 2**30:,.1f} GiB; give shorter lengths"
            )


def _physical_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def _gtx_model(config, pattern, backend="auto"):
    """The hf plugin's model with gtx's attention under ``pattern`` (its trainable parts built for it);
    ``backend`` a name or a Backend."""
    from gtx.attention.module import Attention
    from gtx.backends import get_backend
    from gtx.plugins.registry import MODELS

    torch.manual_seed(0)
    backend = get_backend(backend) if isinstance(backend, str) else backend
    attention = Attention.for_width(backend, pattern, config.heads, config.dim)
    return MODELS.get("hf").obj(config, _Vocab(), _Vocab(), attention).eval()


def _same_weights(model, implementation: str):
    """``model``'s transformers model with its weights, under one of transformers' attention implementations."""
    import transformers

    other = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(model.hf.config), attn_implementation=implementation
    ).eval()
    other.load_state_dict(model.hf.state_dict())
    return other


def _batch(ids: torch.Tensor, pattern):
    """One sequence of ``ids`` as gtx's models read it, its graph under ``pattern``."""
    from gtx.data.batch import Batch
    from gtx.graph.tokens import build_graph, positions

    n = len(ids)
    return Batch(None, None, ids, positions(torch.tensor([n])), ids, build_graph(pattern, None, [n]), "test", [0])


def _time(repeats: int, forward: Callable, *args, **kwargs) -> tuple[float, float]:
    """(median ms, peak memory growth in MB) of ``forward(*args, **kwargs)``, after one warm-up pass."""
    with torch.no_grad():
        forward(*args, **kwargs)
        base = reset_peak()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(*args, **kwargs)
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times), peak_mb() - base


def bench_prefill(
    family: str = "llama",
    patterns: Sequence[str] = ("full",),
    lengths: Sequence[int] = (4096,),
    settings: dict[str, str] | None = None,
    repeats: int = 3,
    log: Callable[[str], None] = lambda s: None,
    backends: Sequence[str] = ("auto",),
) -> pd.DataFrame:
    """Rows per length: transformers' SDPA (``is_causal``: the best kernel plain torch has for a causal
    prefill), gtx's model with attention skipped (the ceiling of the gtx rows: the same code around the
    attention, ``SkipAttention`` over one edge per query), then gtx under each pattern and backend
    (``attention`` names a backend other than auto: "gtx flex"). Columns: family, length, attention, pattern, ms,
    tokens_per_s, vs_sdpa (SDPA's time over the row's), peak_mem_mb (growth during the passes).
    ``settings``: the hf model's (``--set``); with ``path`` (a pretrained folder, a GGUF file,
    ``smollm2``) that model is timed, its rows' family column naming the path. Each timing, and each
    load of a pretrained model's weights, is said through ``log`` as it starts (progress)."""
    from gtx.graph.spec import parse_pattern
    from gtx.measure.reference import NO_EDGES, SkipAttention

    given = dict(settings or {})
    check_lengths(family, given, lengths)
    label = given.get("path") or family  # a pretrained model by its path (smollm2), a random one by family
    rows = []

    def timed(n: int, name: str, spec: str, forward: Callable, *args, **kwargs) -> None:
        say = f"{label} {n:>6} {name:<18} {spec:<20}"
        log(f"{say} timing {repeats} pass{'es' * (repeats > 1)} after a warm-up")
        ms, mem = _time(repeats, forward, *args, **kwargs)
        rows.append({"family": label, "length": n, "attention": name, "pattern": spec, "ms": ms, "peak_mem_mb": mem})
        log(f"{say} {ms:10.1f} ms {mem:8.1f} MB")

    for n in lengths:
        config = _config(family, given, n)

        def build(pattern, backend="auto", config=config, n=n):
            if config.path:  # reading (and dequantizing) the weights takes seconds
                log(f"{label} {n:>6} loading the model for {pattern.spec}")
            return _gtx_model(config, pattern, backend)

        reference = build(parse_pattern("full"))
        tokens = min(VOCAB, reference.hf.get_input_embeddings().num_embeddings)  # a folder's may be smaller
        ids = torch.randint(tokens, (n,), generator=torch.Generator().manual_seed(n))
        skip = parse_pattern(NO_EDGES)
        timed(n, SDPA, "causal", _same_weights(reference, "sdpa"), input_ids=ids[None], use_cache=False)
        timed(n, CEILING, "-", build(skip, SkipAttention()), _batch(ids, skip))
        for spec in patterns:
            pattern = parse_pattern(spec)
            for backend in backends:
                name = "gtx" if backend == "auto" else f"gtx {backend}"
                model = reference if spec == "full" and backend == "auto" else build(pattern, backend)
                timed(n, name, pattern.spec, model, _batch(ids, pattern))
    df = pd.DataFrame(rows)
    df["tokens_per_s"] = df.length / (df.ms / 1000)
    df["vs_sdpa"] = df.groupby("length").ms.transform(lambda ms: ms.iloc[0]) / df.ms
    return df[["family", "length", "attention", "pattern", "ms", "tokens_per_s", "vs_sdpa", "peak_mem_mb"]]
