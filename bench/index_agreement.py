"""How often dsa's int8 choice keeps the keys its float32 choice keeps, on a trained indexer.

    python bench/index_agreement.py RUN [--results DIR] [--split valid] [--batches 8]

RUN is a run trained with a token-level ``dsa`` pattern (any ``index_precision``). The script runs its
checkpoint's model over the first batches of a split in its sparse stage and, at every layer's choice,
chooses the kept keys in float32 and in int8 from the same index queries, weights and keys. It prints,
per layer and in all, the share of float32's kept (query, key) slots that int8 keeps too: the agreement
``tests/test_index_precision.py`` asks of random inputs, here on what training made of the indexer.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import gtx.selection.indexer as indexer

REAL = indexer.top_indexed
SHARED: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # choice within a batch -> [shared slots, float32's slots]
CALL = [0]  # the choice within this batch: one per layer


def key_sets(keys: torch.Tensor, valid: torch.Tensor) -> list[set[int]]:
    return [set(row) - {-1} for row in keys.long().masked_fill(~valid, -1).tolist()]


def both(iq, w, ik, edges, count, precision="float32"):
    """The choice in both precisions, the shared slots counted; returns the run's own precision's."""
    chosen = {p: REAL(iq, w, ik, edges, count, p) for p in ("float32", "int8")}
    (k32, v32), (k8, v8) = chosen["float32"], chosen["int8"]
    call, CALL[0] = CALL[0], CALL[0] + 1
    SHARED[call][0] += sum(len(a & b) for a, b in zip(key_sets(k32, v32), key_sets(k8, v8)))
    SHARED[call][1] += int(v32.sum())
    return chosen[precision]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--results", default="results")
    parser.add_argument("--split", default="valid")
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    indexer.top_indexed = both  # before the pattern plugins load: dsa's module binds it on import
    from gtx.attention.trainable import stages_of
    from gtx.data.batch import batches
    from gtx.measure.probe import load_model

    model, resolved, _ = load_model(args.run, args.results)
    stage = stages_of(model) or ""
    if "dense stage" in stage:
        raise SystemExit(f"run {args.run} stopped in dsa's dense stage ({stage}): there is no choice to compare")
    seen = 0
    with torch.no_grad():
        for batch in batches(resolved.task, args.split, resolved.pattern_run, resolved.train.eval_batch_size):
            if seen == args.batches:
                break
            CALL[0], seen = 0, seen + 1
            model(batch.to(resolved.device))
    calls = sorted(SHARED)
    if not calls:
        raise SystemExit(f"run {args.run}: no token-level dsa choice ran (a dsa:b>1 run chooses blocks)")
    for call in calls:
        shared, slots = SHARED[call]
        print(
            f"choice {call} (layer {call + 1}): int8 keeps {shared:,} of float32's {slots:,} slots: {shared / slots:.4f}"
        )
    shared, slots = (sum(SHARED[c][i] for c in calls) for i in (0, 1))
    print(
        f"all: {shared:,} of {slots:,}: {shared / slots:.4f} ({resolved.pattern_given.spec}, {args.split}, {seen} batches)"
    )


if __name__ == "__main__":
    main()
