"""Serial tests of mpicoll.tuning (table load, lookup, fallback) and its use by ``auto``."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_one_node_timings_never_choose_for_several_nodes():
    def e(size, rpn, name):
        return {"world_size": size, "ranks_per_node": rpn,
                "rules": [{"max_bytes": None, "algorithm": name}]}

    one_node = tuning.TuningTable(table_dict(allreduce=[e(4, 4, "one-node")]))
    assert one_node.lookup("allreduce", 4, 4, 1) == "one-node"
    assert one_node.lookup("allreduce", 4, 2, 1) is None        # 2 nodes x 2: built-in rules
    assert one_node.lookup("allreduce", 4, 0, 1) == "one-node"  # unknown layout
    multi = tuning.TuningTable(table_dict(allreduce=[e(8, 2, "multi")]))
    assert multi.lookup("allreduce", 8, 4, 1) == "multi"
    assert multi.lookup("allreduce", 8, 8, 1) is None
    # an entry of another size with the same ranks per node, measured on one node: not
    # for 2 nodes x 3 (it was taken as it was: same ranks per node)
    three = tuning.TuningTable(table_dict(allreduce=[e(3, 3, "one-node")]))
    assert three.lookup("allreduce", 3, 3, 1) == "one-node"
    assert three.lookup("allreduce", 6, 3, 1) is None


def test_builtin_rules_take_hierarchical_across_nodes():
    big, small = 16 << 20, 4096
    assert selection.builtin_choice("allreduce", 4, 2, big) == "hierarchical"
    assert selection.builtin_choice("allreduce", 8, 4, small) == "recursive_doubling"
    assert selection.builtin_choice("allreduce", 4, 4, big) != "hierarchical"  # one node
    assert selection.builtin_choice("allreduce", 4, 1, big) == "ring"  # 1 rank per node
    assert selection.builtin_choice("allreduce", 4, 1, small) == "recursive_doubling"
    assert selection.builtin_choice("allreduce", 4, 2, 64 << 10) == "recursive_doubling"
    assert selection.builtin_choice("allreduce", 4, 2, 128 << 10) == "hierarchical"
    assert tuning.active_table().source.endswith("tuning_default.json")
    assert selection.choose("allreduce", 4, 2, big) == "hierarchical"  # shipped: one node


@pytest.mark.parametrize("bad, message", [
    ({"format": "other/9", "collectives": {}}, "format"),
    ({"format": tuning.FORMAT}, "'collectives'"),
    ({"collectives": {"allreduce": {}}}, "must be a list"),
    ({"collectives": {"allreduce": [5]}}, r"allreduce\[0\]: expected an object"),
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


def test_repr_names_the_source_and_the_collectives():
    """A table's repr says where it came from and which collectives it covers."""
    table = tuning.TuningTable(table_dict(), source="mine.json")
    assert repr(table) == "TuningTable('mine.json', collectives=['allreduce'])"


def test_an_invalid_default_table_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    """A broken shipped table gives the built-in rules, warned once (the error is cached);
    a missing one is logged at debug level only."""
    bad = write(tmp_path, "{not json", "default.json")
    monkeypatch.setattr(tuning, "_DEFAULT_PATH", bad)
    with caplog.at_level("DEBUG", logger="mpicoll.tuning"):
        assert tuning.default_table() is None
        assert tuning.default_table() is None        # the cached error: no second log
    warned = [r for r in caplog.records if "ignoring the default tuning table" in r.message]
    assert [r.levelname for r in warned] == ["WARNING"] and "not valid JSON" in warned[0].message
    caplog.clear()
    monkeypatch.setattr(tuning, "_DEFAULT_PATH", str(tmp_path / "absent.json"))
    with caplog.at_level("DEBUG", logger="mpicoll.tuning"):
        assert tuning.default_table() is None
    assert [r.levelname for r in caplog.records] == ["DEBUG"]


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


def returns(rules: list[dict]) -> list[str]:
    """Algorithms that take sizes again after another one took over (A, B, A)."""
    names = [r["algorithm"] for r in rules]
    return sorted({names[i] for i in range(2, len(names)) if names[i] in names[:i - 1]})


def test_rules_from_timings():
    timings = {8: {"a": 1.0, "b": 2.0}, 16: {"a": 1.0, "b": 1.5},
               32: {"a": 2.0, "b": 1.0}, 64: {"a": 3.0, "b": 1.0}}
    assert tuning.rules_from_timings(timings) == [
        {"max_bytes": 16, "algorithm": "a"}, {"max_bytes": None, "algorithm": "b"}]
    with pytest.raises(ValueError):
        tuning.rules_from_timings({})
    with pytest.raises(ValueError):
        tuning.rules_from_timings(timings, noise=-0.1)


def test_rules_from_timings_merges_within_noise():
    noisy = {8: {"a": 1.00, "b": 1.10}, 16: {"a": 1.02, "b": 1.00}, 32: {"a": 1.0, "b": 1.2}}
    assert tuning.rules_from_timings(noisy) == [{"max_bytes": None, "algorithm": "a"}]
    assert tuning.rules_from_timings(noisy, noise=0.0, single_range=False) == [
        {"max_bytes": 8, "algorithm": "a"}, {"max_bytes": 16, "algorithm": "b"},
        {"max_bytes": None, "algorithm": "a"}]


def test_rules_from_timings_prefers_native_then_simpler_within_noise():
    tied = {8: {"ring": 1.00, "native": 1.03, "tree": 0.99},
            16: {"ring": 1.00, "native": 1.04, "tree": 1.0}}
    assert tuning.rules_from_timings(tied) == [{"max_bytes": None, "algorithm": "native"}]
    # fewer switches first: native cannot cover 16, so ring (simpler than tree) takes both
    close = {8: {"ring": 1.00, "native": 1.03, "tree": 0.99},
             16: {"ring": 1.00, "tree": 0.97, "native": 1.2}}
    assert tuning.rules_from_timings(close) == [{"max_bytes": None, "algorithm": "ring"}]
    assert tuning.rules_from_timings(close, preference=["tree"]) == [
        {"max_bytes": None, "algorithm": "tree"}]
    assert tuning.rules_from_timings({8: {"zeta": 1.0, "alpha": 1.0}}) == [
        {"max_bytes": None, "algorithm": "alpha"}]   # unlisted names: alphabetical


def test_rules_from_timings_single_range():
    # b really is faster in the middle (beyond noise): kept only when returns are allowed
    timings = {8: {"a": 1.0, "b": 1.5}, 16: {"a": 1.3, "b": 1.0}, 32: {"a": 1.0, "b": 1.5},
               64: {"a": 2.0, "b": 1.0}}
    free = tuning.rules_from_timings(timings, single_range=False)
    assert [r["algorithm"] for r in free] == ["a", "b", "a", "b"]
    one = tuning.rules_from_timings(timings)
    assert returns(one) == []
    assert one == [{"max_bytes": 32, "algorithm": "a"}, {"max_bytes": None, "algorithm": "b"}]
    assert tuning.slowdowns(timings, one) == [
        {"nbytes": 16, "algorithm": "a", "slowdown": 1.3, "fastest": "b"}]
    assert tuning.slowdowns(timings, free) == []


def test_single_range_returns_only_where_an_algorithm_is_missing():
    gap = {8: {"a": 1.0}, 16: {"b": 1.0}, 32: {"a": 1.0}}  # b failed at 8 and 32, a at 16
    assert [r["algorithm"] for r in tuning.rules_from_timings(gap)] == ["a", "b", "a"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["native", "ring", "tree"]),
                          st.floats(0.0, 0.049)), min_size=1, max_size=12),
       st.booleans())
def test_no_flip_flop_from_differences_within_noise(winners, single_range):
    """Every algorithm within 5% of the best at every size, the per-size best varying:
    the rules name one algorithm (the most preferred) and nothing flips."""
    timings = {}
    for k, (best, margin) in enumerate(winners):
        times = {a: 1.0 + margin for a in ("native", "ring", "tree")}
        times[best] = 1.0
        timings[8 << k] = times
    rules = tuning.rules_from_timings(timings, noise=0.05, single_range=single_range)
    assert rules == [{"max_bytes": None, "algorithm": "native"}]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.fixed_dictionaries({a: st.floats(1.0, 3.0)
                                       for a in ("native", "binomial", "ring")}),
                min_size=1, max_size=10))
def test_derived_rules_flip_only_beyond_noise(per_size):
    """A, B, A survives only with returns allowed, and only where A is slower than noise
    allows at some size of B's range; every size is within noise of its fastest."""
    timings = {8 << k: t for k, t in enumerate(per_size)}
    assert returns(tuning.rules_from_timings(timings)) == []
    rules = tuning.rules_from_timings(timings, single_range=False)
    assert tuning.slowdowns(timings, rules) == []
    names = [r["algorithm"] for r in rules]
    bounds = [0] + [r["max_bytes"] or float("inf") for r in rules]
    for i in range(1, len(rules) - 1):
        if names[i - 1] == names[i + 1]:
            middle = [b for b in timings if bounds[i] < b <= bounds[i + 1]]
            a = names[i - 1]
            assert any(a not in timings[b] or timings[b][a] > 1.05 * min(timings[b].values())
                       for b in middle)


def test_slowdowns_skip_sizes_without_usable_times():
    """slowdowns ignores a size whose times are all missing or zero, and reports the sizes
    where the rules pick an algorithm slower than noise allows."""
    timings = {1024: {"ring": None, "tree": 0.0},
               4096: {"ring": 2.0, "tree": 1.0}}
    rules = [{"max_bytes": None, "algorithm": "ring"}]
    assert tuning.slowdowns(timings, rules) == [
        {"nbytes": 4096, "algorithm": "ring", "slowdown": 2.0, "fastest": "tree"}]


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


def test_default_table_has_no_flip_flop_and_follows_its_timings():
    """The shipped table: no algorithm comes back after another, and its rules are exactly
    what its recorded derivation gives from its recorded timings (no hand edits)."""
    path = tuning.default_table_path()
    if not path.exists():
        pytest.skip("no default table in this checkout")
    data = json.loads(path.read_text(encoding="utf-8"))
    derivation = data["meta"]["derivation"]
    for command in [derivation["command"], *(r["command"] for r in data["meta"]["runs"])]:
        assert "python -m bench.tune" in command
        assert not any(word.startswith("/") for word in command.split()), command
    for coll, entries in data["collectives"].items():
        for e in entries:
            assert returns(e["rules"]) == [], (coll, e["world_size"], e["rules"])
    for run in data["meta"]["runs"]:
        for coll, per in run["timings_us"].items():
            timings = {int(b): v for b, v in per.items()}
            rules = tuning.rules_from_timings(timings, derivation["noise"],
                                              derivation["preference"],
                                              derivation["single_range"])
            entry = [e for e in data["collectives"][coll]
                     if e["world_size"] == run["world_size"]]
            assert entry and entry[0]["rules"] == rules, (coll, run["world_size"])


def test_tune_rebuild_derives_from_stored_timings(tmp_path):
    """``python -m bench.tune --rebuild`` (no MPI): rules from the stored timings, the
    derivation and a repository-relative command in the meta."""
    tune = pytest.importorskip("bench.tune")
    table = table_dict(allreduce=[{"world_size": 2, "ranks_per_node": 2, "rules": RULES}],
                       reduce=[{"world_size": 9, "rules": RULES}])
    table["meta"] = {"runs": [{"world_size": 2, "ranks_per_node": 2, "tolerance": 0.1,
                               "command": "mpirun -n 2 python -m bench.tune",
                               "timings_us": {"allreduce": {
                                   "8": {"native": 1.0, "ring": 1.2},
                                   "16": {"native": 1.12, "ring": 1.0},
                                   "32": {"native": 1.0, "ring": 1.2}}}}]}
    src, out = write(tmp_path, table), str(tmp_path / "out.json")
    assert tune.main(["--rebuild", src, "--output", out]) == 0
    new = json.loads(open(out, encoding="utf-8").read())
    assert new["collectives"]["allreduce"][0]["rules"] == [
        {"max_bytes": None, "algorithm": "native"}]
    assert new["collectives"]["reduce"][0]["rules"] == RULES       # no timings: kept
    d = new["meta"]["derivation"]
    assert d["noise"] == 0.05 and d["single_range"] is True
    assert d["preference"][0] == "native"
    assert d["beyond_noise"] == [{"collective": "allreduce", "world_size": 2, "nbytes": 16,
                                  "algorithm": "native", "slowdown": 1.12,
                                  "fastest": "ring"}]
    assert d["command"].startswith("python -m bench.tune --rebuild ")
    assert "tolerance" not in new["meta"]["runs"][0]
    assert tune.main(["--rebuild", src, "--output", out, "--allow-returns"]) == 0
    new = json.loads(open(out, encoding="utf-8").read())
    assert [r["algorithm"] for r in new["collectives"]["allreduce"][0]["rules"]] == [
        "native", "ring", "native"]
