"""Serial tests of mpicoll.tuning (table load, lookup, fallback) and its use by ``auto``."""
from __future__ import annotations

import json

import pytest

import mpicoll
from mpicoll import config, selection, tuning

RULES = [{"max_bytes": 4096, "algorithm": "recursive_doubling"},
         {"max_bytes": 1 << 20, "algorithm": "rabenseifner"},
         {"max_bytes": None, "algorithm": "ring"}]


def table_dict(**entries_by_coll) -> dict:
    return {"format": tuning.FORMAT, "meta": {"note": "test"},
            "collectives": entries_by_coll or {
                "allreduce": [{"world_size": 4, "ranks_per_node": 4, "rules": RULES}]}}


def setenv(monkeypatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    config.refresh()  # mpicoll caches MPICOLL_* reads


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.delenv("MPICOLL_TUNING_FILE", raising=False)
    monkeypatch.delenv("MPICOLL_ALGORITHM", raising=False)
    config.refresh()
    tuning.use_table(None)
    tuning.clear_cache()
    yield
    monkeypatch.undo()
    config.refresh()
    tuning.use_table(None)
    tuning.clear_cache()


def write(tmp_path, data, name="t.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_lookup_boundaries_are_inclusive():
    t = tuning.TuningTable(table_dict())
    assert t.lookup("allreduce", 4, 4, 0) == "recursive_doubling"
    assert t.lookup("allreduce", 4, 4, 4096) == "recursive_doubling"
    assert t.lookup("allreduce", 4, 4, 4097) == "rabenseifner"
    assert t.lookup("allreduce", 4, 4, 1 << 20) == "rabenseifner"
    assert t.lookup("allreduce", 4, 4, (1 << 20) + 1) == "ring"
    assert t.lookup("allreduce", 4, 4, 1 << 40) == "ring"


def test_rules_sorted_and_last_extended():
    rules = [{"max_bytes": 100, "algorithm": "b"}, {"max_bytes": 10, "algorithm": "a"}]
    t = tuning.TuningTable(table_dict(allreduce=[{"world_size": 2, "rules": rules}]))
    assert [t.lookup("allreduce", 2, 0, b) for b in (5, 50, 500)] == ["a", "b", "b"]
    back = t.to_dict()["collectives"]["allreduce"][0]["rules"]
    assert back[-1] == {"max_bytes": None, "algorithm": "b"}


def test_no_entry_gives_none():
    t = tuning.TuningTable(table_dict())
    assert t.lookup("broadcast", 4, 4, 8) is None
    assert t.lookup("allreduce", 16, 4, 8) is None   # 4 is not within a factor 2 of 16
    assert t.lookup("allreduce", 3, 4, 8) is None    # 3 is not a power of two, 4 is


def test_nearest_world_size_of_the_same_kind():
    entries = [{"world_size": s, "rules": [{"max_bytes": None, "algorithm": f"a{s}"}]}
               for s in (2, 3, 4, 8)]
    t = tuning.TuningTable(table_dict(allreduce=entries))
    assert t.lookup("allreduce", 5, 0, 8) == "a3"     # nearest non-power-of-two
    assert t.lookup("allreduce", 6, 0, 8) == "a3"
    assert t.lookup("allreduce", 16, 0, 8) == "a8"
    assert t.lookup("allreduce", 7, 0, 8) is None     # 3 is more than a factor 2 away
    assert t.world_sizes("allreduce") == [2, 3, 4, 8]


def test_ranks_per_node_exact_then_wildcard_then_nearest():
    def e(rpn, name):
        return {"world_size": 8, "ranks_per_node": rpn,
                "rules": [{"max_bytes": None, "algorithm": name}]}

    t = tuning.TuningTable(table_dict(allreduce=[e(2, "two"), e(8, "eight")]))
    assert t.lookup("allreduce", 8, 2, 1) == "two"
    assert t.lookup("allreduce", 8, 8, 1) == "eight"
    assert t.lookup("allreduce", 8, 0, 1) == "two"     # unknown layout: nearest
    assert t.lookup("allreduce", 8, 4, 1) == "two"
    t2 = tuning.TuningTable(table_dict(allreduce=[e(2, "two"), e(0, "any")]))
    assert t2.lookup("allreduce", 8, 4, 1) == "any"


@pytest.mark.parametrize("bad, message", [
    ({"format": "other/9", "collectives": {}}, "format"),
    ({"format": tuning.FORMAT}, "'collectives'"),
    ({"collectives": {"allreduce": {}}}, "must be a list"),
    ({"collectives": {"allreduce": [{"rules": RULES}]}}, "world_size"),
    ({"collectives": {"allreduce": [{"world_size": 2, "rules": []}]}}, "non-empty"),
    ({"collectives": {"allreduce": [{"world_size": 2, "rules": [{"max_bytes": 1}]}]}},
     "algorithm"),
    ({"collectives": {"allreduce": [{"world_size": 2, "rules": [
        {"max_bytes": "big", "algorithm": "ring"}]}]}}, "max_bytes"),
    ({"collectives": {"allreduce": [{"world_size": 0, "rules": RULES}]}}, ">= 1"),
    ([1, 2], "JSON object"),
])
def test_invalid_tables_raise_valueerror(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        tuning.TuningTable(bad)
    path = write(tmp_path, bad)
    with pytest.raises(ValueError, match="t.json"):
        tuning.load_table(path)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        tuning.load_table(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not valid JSON"):
        tuning.load_table(write(tmp_path, "{not json"))


def test_load_is_cached_until_cleared(tmp_path):
    path = write(tmp_path, table_dict())
    first = tuning.load_table(path)
    assert tuning.load_table(path) is first
    write(tmp_path, table_dict(allreduce=[{"world_size": 4, "rules": [
        {"max_bytes": None, "algorithm": "tree"}]}]))
    assert tuning.load_table(path) is first          # every rank keeps what it read
    tuning.clear_cache()
    assert tuning.load_table(path).lookup("allreduce", 4, 0, 8) == "tree"


def test_round_trip(tmp_path):
    t = tuning.TuningTable(table_dict())
    again = tuning.TuningTable(json.loads(json.dumps(t.to_dict())))
    assert again.to_dict() == t.to_dict()
    assert again.meta == {"note": "test"}


def test_choose_follows_the_file_in_the_environment(tmp_path, monkeypatch):
    setenv(monkeypatch, "MPICOLL_TUNING_FILE", write(tmp_path, table_dict()))
    assert selection.choose("allreduce", 4, 0, 8) == "recursive_doubling"
    assert selection.choose("allreduce", 4, 0, 64 << 10) == "rabenseifner"
    assert selection.choose("allreduce", 4, 0, 64 << 20) == "ring"
    # no entry for broadcast or this world size: the built-in rules
    assert selection.choose("broadcast", 4, 0, 8) == selection.builtin_choice(
        "broadcast", 4, 0, 8)
    assert selection.choose("allreduce", 3, 0, 64 << 20) == selection.builtin_choice(
        "allreduce", 3, 0, 64 << 20)


def test_choose_ignores_unregistered_names(tmp_path, monkeypatch):
    data = table_dict(allreduce=[{"world_size": 2, "rules": [
        {"max_bytes": None, "algorithm": "from_a_future_version"}]}])
    setenv(monkeypatch, "MPICOLL_TUNING_FILE", write(tmp_path, data))
    assert selection.choose("allreduce", 2, 0, 8) == selection.builtin_choice(
        "allreduce", 2, 0, 8)


def test_forced_algorithm_beats_the_table(tmp_path, monkeypatch):
    setenv(monkeypatch, "MPICOLL_TUNING_FILE", write(tmp_path, table_dict()))
    setenv(monkeypatch, "MPICOLL_ALGORITHM", "tree")
    assert selection.choose("allreduce", 4, 0, 8) == "tree"


def test_none_disables_tables(monkeypatch):
    setenv(monkeypatch, "MPICOLL_TUNING_FILE", "none")
    assert tuning.active_table() is None
    for nbytes in (8, 1 << 16, 1 << 26):
        assert selection.choose("allreduce", 4, 0, nbytes) == selection.builtin_choice(
            "allreduce", 4, 0, nbytes)


def test_bad_environment_file_is_an_error(tmp_path, monkeypatch):
    setenv(monkeypatch, "MPICOLL_TUNING_FILE", str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="MPICOLL_TUNING_FILE"):
        selection.choose("allreduce", 2, 0, 8)


def test_use_table_overrides_environment(tmp_path, monkeypatch):
    setenv(monkeypatch, "MPICOLL_TUNING_FILE", "none")
    tuning.use_table(table_dict())
    assert selection.choose("allreduce", 4, 0, 8) == "recursive_doubling"
    tuning.use_table(write(tmp_path, table_dict(allreduce=[{"world_size": 4, "rules": [
        {"max_bytes": None, "algorithm": "tree"}]}])))
    assert selection.choose("allreduce", 4, 0, 8) == "tree"
    tuning.use_table(None)
    assert tuning.active_table() is None              # back to the environment


def test_rules_from_timings():
    timings = {8: {"a": 1.0, "b": 2.0}, 16: {"a": 1.0, "b": 1.5},
               32: {"a": 2.0, "b": 1.0}, 64: {"a": 3.0, "b": 1.0}}
    assert tuning.rules_from_timings(timings) == [
        {"max_bytes": 16, "algorithm": "a"}, {"max_bytes": None, "algorithm": "b"}]


def test_rules_from_timings_hysteresis_and_single_winner():
    noisy = {8: {"a": 1.00, "b": 1.10}, 16: {"a": 1.02, "b": 1.00}, 32: {"a": 1.0, "b": 1.2}}
    assert tuning.rules_from_timings(noisy, tolerance=0.05) == [
        {"max_bytes": None, "algorithm": "a"}]
    assert tuning.rules_from_timings(noisy, tolerance=0.0) == [
        {"max_bytes": 8, "algorithm": "a"}, {"max_bytes": 16, "algorithm": "b"},
        {"max_bytes": None, "algorithm": "a"}]
    with pytest.raises(ValueError):
        tuning.rules_from_timings({})


def test_merge_tables_later_wins():
    a = table_dict(allreduce=[{"world_size": 2, "rules": [
        {"max_bytes": None, "algorithm": "ring"}]}, {"world_size": 4, "rules": RULES}])
    b = table_dict(allreduce=[{"world_size": 2, "rules": [
        {"max_bytes": None, "algorithm": "tree"}]}])
    m = tuning.merge_tables([a, b])
    assert m.world_sizes("allreduce") == [2, 4]
    assert m.lookup("allreduce", 2, 0, 8) == "tree"
    assert m.lookup("allreduce", 4, 0, 8) == "recursive_doubling"


def test_default_table_ships_and_names_registered_algorithms():
    path = tuning.default_table_path()
    if not path.exists():
        pytest.skip("no default table in this checkout")
    t = tuning.load_table(path)
    for coll in t.collectives():
        assert coll in mpicoll.COLLECTIVES
        for size in t.world_sizes(coll):
            for nbytes in [1 << k for k in range(0, 31)]:
                assert t.lookup(coll, size, 0, nbytes) in mpicoll.algorithms(coll)
    assert {2, 4}.issubset(t.world_sizes("allreduce"))
    assert tuning.active_table() is t or tuning.active_table().to_dict() == t.to_dict()
