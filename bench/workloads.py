"""Workloads of the to-accuracy training benchmarks besides ``examples/train.py``'s digits.

``markov``: a synthetic language, long enough for thousands of steps of steady progress
(``bench.diloco --workload markov``). The text comes from an order-3 Markov source over 16
symbols: each of the 4,096 contexts (the last three symbols) has 4 possible successors, with
probabilities drawn once (squared exponentials, normalized). The task is next-symbol
prediction from the previous 8 symbols; the source's own predictor (the most likely
successor of the true context) sets the ceiling, about 0.68 on the test windows
(:func:`markov_data` reports it). The model, :class:`MarkovLM`, embeds each symbol in 16
dimensions and runs an MLP 128-256-256-16 on the concatenation (103,184 float32
parameters). Everything is made from fixed seeds with torch and numpy: no file, no
download, the same data on every rank.
"""
from __future__ import annotations

import bisect
from typing import Any

SYMBOLS, ORDER, SUCCESSORS, CONTEXT = 16, 3, 4, 8
TRAIN, TEST = 128_000, 20_000


def markov_data() -> tuple[Any, Any, Any, Any, str]:
    """``(train x, train y, test x, test y, description)``: windows of ``CONTEXT`` symbols
    (int64, ``[n, 8]``) and the symbol after each (``[n]``), as ``examples/train.py``'s
    ``load_data`` returns its images."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(0)
    contexts = SYMBOLS ** ORDER
    successors = torch.stack([torch.randperm(SYMBOLS, generator=g)[:SUCCESSORS]
                              for _ in range(contexts)]).numpy()
    weights = (-torch.log(torch.rand(contexts, SUCCESSORS, generator=g))) ** 2
    prob = (weights / weights.sum(1, keepdim=True)).numpy()
    cumulative = prob.cumsum(1).tolist()
    successors_l, likeliest = successors.tolist(), successors[
        np.arange(contexts), prob.argmax(1)].tolist()
    n = TRAIN + TEST + CONTEXT
    text = torch.randint(0, SYMBOLS, (ORDER,), generator=g).tolist()
    draws = torch.rand(n, generator=g).tolist()
    state = text[0] * SYMBOLS ** 2 + text[1] * SYMBOLS + text[2]
    best = [0] * ORDER                           # the source's most likely next symbol
    for i in range(ORDER, n):
        j = min(bisect.bisect_left(cumulative[state], draws[i]), SUCCESSORS - 1)
        best.append(likeliest[state])
        text.append(successors_l[state][j])
        state = (state * SYMBOLS + text[-1]) % contexts
    text, best = np.array(text, dtype=np.int64), np.array(best, dtype=np.int64)
    t = torch.from_numpy(text)
    x = torch.stack([t[k:n - CONTEXT + k] for k in range(CONTEXT)], 1)
    y = t[CONTEXT:]
    ceiling = float((torch.from_numpy(best[CONTEXT + TRAIN:]) == y[TRAIN:]).double().mean())
    desc = (f"order-{ORDER} Markov source over {SYMBOLS} symbols, next symbol from "
            f"{CONTEXT}; {TRAIN} training and {TEST} test windows; the source's own "
            f"predictor scores {ceiling:.4f} on the test windows")
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:], desc


def MarkovLM() -> Any:  # noqa: N802  (a model factory, named like the class it builds)
    """Embedding(16, 16) per symbol, concatenated, then Linear(128, 256), ReLU,
    Linear(256, 256), ReLU, Linear(256, 16)."""
    import torch.nn as nn

    return nn.Sequential(nn.Embedding(SYMBOLS, 16), nn.Flatten(1),
                         nn.Linear(16 * CONTEXT, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, SYMBOLS))
