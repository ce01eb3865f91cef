"""Scoring by generation: a model that generates (``generate``, as ``--model hf``) continues each
example's prompt greedily, the prompt read under the run's pattern and each new token under the
decode pattern, and the task scores the text (``Task.new_tokens``, ``prompt_len``, ``score_text``).

Each sample's outcome is kept, in the split's order, beside the seed that drew the samples, so
that two runs over the same samples (two patterns, the same task settings and seed) can be compared
sample by sample with a paired test (``gtx.records.paired``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gtx.attention.budget import generated_keys
from gtx.data.task import Task
from gtx.errors import PluginError
from gtx.graph.pattern import Pattern


def generates(model, task: Task) -> bool:
    """Whether ``task`` is scored by generation and ``model`` can generate."""
    return task.form == "lm" and task.new_tokens() > 0 and callable(getattr(model, "generate", None))


def generation_metrics(
    model,
    task: Task,
    split: str,
    pattern: Pattern,
    decode: Pattern,
    limit: int = -1,
    on_sample: Callable[[int], Callable[[], None]] = lambda count: lambda: None,
) -> dict:
    """Generate after the first ``limit`` prompts of ``split`` (-1: all) and score the texts;
    ``on_sample(count)`` returns a callback called after each sample (progress).

    Returns metrics for the results row: ``answer_acc`` (the mean outcome), ``outcomes`` (each
    sample's, in order), ``samples`` (how many), ``sample_seed`` (the task's seed, which drew them),
    ``generate_s`` (wall time), ``generate_cache`` (whether the key/value cache ran: it does
    where the decode pattern is fixed; a pattern that chooses keys at run time recomputes the whole
    sequence per token) and ``decode_edges_per_query``: the keys each generated token's query reads
    under the decode pattern, over all samples (``budget.generated_keys``: a selection counts its
    budget). Generation stops after the tokenizer's end-of-text token, which the scored text leaves out."""
    examples = task.splits()[split]
    count = len(examples) if limit < 0 else min(limit, len(examples))
    cache = decode.plain
    tokenizer = task.tokenizer
    stop = set(task.tgt_vocab.encode(tokenizer.stop_tokens())) if tokenizer is not None else set()
    outcomes, keys, queries = [], 0.0, 0
    tick = on_sample(count)
    start = time.perf_counter()
    for i in range(count):
        prompt = examples[i][0][: task.prompt_len(split, i)]
        out = model.generate(task.src_vocab.encode(prompt), task.new_tokens(), pattern, cache, decode, stop)
        read, asked = generated_keys(decode, len(prompt), len(out.tokens))
        keys, queries = keys + read, queries + asked
        tokens = out.tokens[:-1] if out.tokens and out.tokens[-1] in stop else out.tokens
        outcome = task.score_text(split, i, task.read(task.tgt_vocab.decode(tokens)))
        if not isinstance(outcome, (int, float)) or isinstance(outcome, bool) or not 0 <= outcome <= 1:
            raise PluginError(
                f"task {task.name!r} score_text gave {outcome!r:.40} for {split} example {i}; expected a number in [0, 1]"
            )
        outcomes.append(round(float(outcome), 4))
        tick()
    return {
        "answer_acc": sum(outcomes) / count if count else math.nan,
        "outcomes": outcomes,
        "samples": count,
        "sample_seed": getattr(task.config, "seed", None),
        "generate_s": time.perf_counter() - start,
        "generate_cache": cache,
        "decode_edges_per_query": keys / queries if queries else math.nan,
    }
