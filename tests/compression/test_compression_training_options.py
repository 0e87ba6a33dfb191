"""examples/train.py's learning-rate schedules and bench.compression_training's variant
names, baselines and merged results (no training, no MPI)."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

from bench import compression_training as B

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402


def test_learning_rate_schedules():
    lr, total = 0.05, 345
    assert [train.learning_rate("constant", lr, t, total) for t in (0, 200, 344)] == [lr] * 3
    cos = [train.learning_rate("cosine", lr, t, total) for t in range(total)]
    assert cos[0] == lr and all(a > b > 0 for a, b in zip(cos, cos[1:]))
    assert cos[total // 2 + 1] < lr / 2 < cos[total // 2 - 1]
    assert math.isclose(cos[-1], lr * 0.5 * (1 + math.cos(math.pi * 344 / 345)))
    step = [train.learning_rate("step", lr, t, 100) for t in (0, 49, 50, 74, 75, 99)]
    assert step == [lr, lr, lr * 0.1, lr * 0.1, lr * 0.01, lr * 0.01]
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
        train.learning_rate("linear", lr, 0, total)


@pytest.mark.parametrize("entry, spec, extra, env", [
    ("onebit:two", "onebit:two", [], {}),
    ("none-cosine", "none", ["--lr-schedule", "cosine"], {}),
    ("onebit:32:two-warm1ep-step", "onebit:32:two",
     ["--lr-schedule", "step", "--compress-warmup", "1ep"], {}),
    ("onebit-nofusion-noef", "onebit", ["--no-error-feedback"], B.NO_FUSION_ENV),
])
def test_entries_parse_and_label_back(entry, spec, extra, env):
    got = B.parse_entry(entry)
    assert got == (spec, extra, env)
    rec = {"compression": spec, "error_feedback": "--no-error-feedback" not in extra,
           "compress_momentum": spec.startswith("onebit"), "compress_warmup": 0,
           "lr_schedule": extra[extra.index("--lr-schedule") + 1]
           if "--lr-schedule" in extra else "constant", "env": env or None}
    name = B.label(rec)
    assert name.startswith(spec) and name.endswith(B.protocol(rec))
    assert B.baseline(rec) == ("none-" + rec["lr_schedule"] if rec["lr_schedule"] !=
                               "constant" else "none")


def test_an_option_twice_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        B.parse_entry("onebit-cosine-step")


def _rec(comp, seed, acc, schedule="constant", ranks=2):
    return {"compression": comp, "error_feedback": True, "compress_momentum": False,
            "compress_warmup": 0, "lr_schedule": schedule, "seed": seed, "ranks": ranks,
            "epochs": 15, "final_accuracy": acc, "samples": 100, "train_seconds": 1.0,
            "bytes_per_step": 10, "dense_bytes_per_step": 40, "log": []}


def test_each_schedule_is_compared_with_its_own_none(tmp_path):
    recs = [_rec("none", 1, 0.90), _rec("onebit", 1, 0.89),
            _rec("none", 1, 0.95, "cosine"), _rec("onebit", 1, 0.93, "cosine")]
    rows = {r["compression"]: r for r in B.summarize(recs)}
    assert rows["onebit"]["pp_vs_none"] == {1: -1.0}
    assert rows["onebit-cosine"]["pp_vs_none"] == {1: -2.0}
    assert "| onebit-cosine | 93.00% (-2.00) | 93.00% | -2.00 |" in B.table(list(rows.values()))
    paths = []
    for i, part in enumerate((recs[:2], recs[1:] + [_rec("none", 2, 0.5)])):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"command": f"cmd {i}", "machine": "m", "records": part}, f)
    merged = B.merge(paths)
    assert merged["commands"] == ["cmd 0", "cmd 1"]
    assert len(merged["records"]) == 5                 # onebit seed 1 kept once
    with open(paths[0], "w") as f:
        json.dump({"command": "x", "records": [_rec("none", 3, 0.9, ranks=4)]}, f)
    with pytest.raises(SystemExit, match="mix world sizes"):
        B.merge(paths)
