"""Tier policies written in Python (kvforge.TierPolicy): the numpy sink and
window plan demotes exactly what the Rust plan does, the Rust conformance
suite runs on them, and one that misbehaves fails its step with the cache
left as it was. On the tiny random-weight model."""

import json
import os

import numpy as np
import pytest

import kvforge
import kvforge.testing
from kvforge.examples.tiers import Every, SinkWindow

REQUIRE = bool(os.environ.get("KVFORGE_REQUIRE_ALL"))
if not kvforge.DEFAULT_MODEL.exists():
    if REQUIRE:
        raise RuntimeError(f"{kvforge.DEFAULT_MODEL} missing: run `cargo xtask setup`")
    pytest.skip("the model is not fetched (cargo xtask setup)", allow_module_level=True)

TINY = dict(d_model=128, layers=2, heads=4, kv_heads=2, ffn=256, max_ctx=1024)
IDS = list(range(300, 700))
TEXT = "The cold tier holds the older blocks of a long conversation in four bits. "
COLD = {"cold": {"format": "int4", "window": 32, "sink": 16}}


def tiny(**kw):
    return kvforge.Engine(random=TINY, **kw)


def test_the_numpy_plan_demotes_what_the_rust_plan_demotes():
    rust = tiny(mechanisms=COLD)
    numpy = tiny(mechanisms=COLD, tier_policy=SinkWindow(window=32, sink=16))
    a, b = (e.ppl(IDS, prefix=64, chunk=16) for e in (rust, numpy))
    assert a["cold_bytes"] > 0
    assert b["chunks"] == a["chunks"]
    assert (b["kv_bytes"], b["cold_bytes"]) == (a["kv_bytes"], a["cold_bytes"])
    demoted = [e.stats()["policies"]["demoted_blocks"] for e in (rust, numpy)]
    assert demoted[0] == demoted[1] > 0
    assert rust.blocks_in_use() == numpy.blocks_in_use() == [0, 0]


def test_another_plan_runs_and_keeps_more_in_full_precision():
    plan = tiny(mechanisms=COLD).ppl(IDS, prefix=64, chunk=16)
    every = tiny(mechanisms=COLD, tier_policy=Every(window=32, stride=2)).ppl(IDS, prefix=64, chunk=16)
    assert 0 < every["cold_bytes"] < plan["cold_bytes"]
    assert every["kv_bytes"] > plan["kv_bytes"]


def test_the_conformance_suite_passes_the_examples_and_catches_broken_ones():
    for p in (SinkWindow(window=32, sink=16), SinkWindow(window=0), Every(window=16, stride=3)):
        kvforge.testing.check_tier_policy(p)
        kvforge.testing.check_tier_policy(p, block_size=4)

    class IgnoresHoles(kvforge.TierPolicy):
        def demote(self, table):
            ok = (table.tier == kvforge.policy.HOT) & (table.tokens == table.block_size)
            if table.open and len(table):
                ok[-1] = False
            return np.flatnonzero(ok)

    with pytest.raises(AssertionError, match=r"IgnoresHoles: .*entry \d+ has holes left: 1 right: 0$"):
        kvforge.testing.check_tier_policy(IgnoresHoles())

    class Raises(kvforge.TierPolicy):
        def demote(self, table):
            raise KeyError("boom")

    with pytest.raises(RuntimeError, match="Raises.demote: KeyError: 'boom'"):
        kvforge.testing.check_tier_policy(Raises())
    with pytest.raises(TypeError, match="no demote"):
        kvforge.testing.check_tier_policy(object())
    with pytest.raises(ValueError, match="block_size"):
        kvforge.testing.check_tier_policy(SinkWindow(window=0), block_size=0)


class Misbehaves(kvforge.TierPolicy):
    """The sink-and-window plan until ``after`` calls, then answers
    ``answer`` (or raises it)."""

    def __init__(self, answer, after=3):
        self.plan, self.answer, self.after, self.calls = SinkWindow(32, 16), answer, after, 0

    def demote(self, table):
        self.calls += 1
        if self.calls <= self.after or self.answer is SinkWindow:
            return self.plan.demote(table)
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "open":
            return [len(table) - 1]
        return self.answer


@pytest.mark.parametrize(
    "answer, words",
    [
        (ValueError("not now"), "the tier policy failed: Misbehaves.demote: ValueError: not now"),
        ([99], "the tier policy named entry 99"),
        ([2, 1], "the tier policy named entries out of order or twice"),
        ("open", "not a full, closed hot block"),
        (None, "demote() returned a NoneType"),
        ([1.5], "demote() returned a float among its indexes"),
    ],
)
def test_a_misbehaving_tier_policy_fails_the_step_and_leaves_the_cache_unchanged(answer, words):
    policy = Misbehaves(answer)
    e = tiny(mechanisms=COLD, tier_policy=policy)
    with e.chat() as chat:
        chat.send(TEXT * 4, max_tokens=2)
        held, before = e.blocks_in_use(), e.stats()["policies"]["demoted_blocks"]
        with pytest.raises(RuntimeError) as err:
            chat.send(TEXT * 3, max_tokens=4)
        assert words in str(err.value) and "\n" not in str(err.value)
        assert e.blocks_in_use() == held
        assert e.stats()["policies"]["demoted_blocks"] == before
        policy.answer = SinkWindow
        _, r = chat.send(TEXT, max_tokens=2, report=True)
        assert r["reused_tokens"] > 0
    assert e.blocks_in_use() == [0, 0]


def test_a_tier_policy_needs_a_cold_tier_and_a_demote_method():
    with pytest.raises((ValueError, RuntimeError), match="cold tier"):
        tiny(tier_policy=SinkWindow(window=32))
    with pytest.raises(TypeError, match="not a tier policy"):
        tiny(mechanisms=COLD, tier_policy=kvforge.EvictionPolicy())


def test_an_interrupt_in_a_checked_policy_comes_out_of_the_check_not_a_later_call():
    class Interrupts(kvforge.TierPolicy):
        def demote(self, table):
            raise KeyboardInterrupt("from check")

    with pytest.raises(KeyboardInterrupt, match="from check"):
        kvforge.testing.check_tier_policy(Interrupts())

    class Evicts(kvforge.EvictionPolicy):
        def victims(self, seq, table, pressure):
            raise KeyboardInterrupt("from the eviction check")

    with pytest.raises(KeyboardInterrupt, match="from the eviction check"):
        kvforge.testing.check_eviction_policy(Evicts())
    e = tiny(mechanisms=COLD)
    assert e.generate("hello", max_tokens=2) == e.generate("hello", max_tokens=2)


def test_a_policy_that_runs_a_check_is_still_refused_the_engine():
    class Nested(kvforge.TierPolicy):
        def demote(self, table):
            kvforge.testing.check_tier_policy(SinkWindow(32, 16))
            self.engine.stats()
            return []

    policy = Nested()
    e = policy.engine = tiny(mechanisms=COLD, tier_policy=policy)
    with pytest.raises(RuntimeError, match="cannot call the engine from inside its methods"):
        e.ppl(IDS, prefix=64, chunk=16)
    assert e.blocks_in_use() == [0, 0]


def test_by_name_in_a_mechanisms_table_and_in_an_experiment_file(tmp_path):
    named = {**COLD, "tier": {"policy": "kvforge.examples.tiers:Every", "window": 32, "stride": 2}}
    by_name = tiny(mechanisms=named).ppl(IDS, prefix=64, chunk=16)
    by_object = tiny(mechanisms=COLD, tier_policy=Every(window=32, stride=2)).ppl(IDS, prefix=64, chunk=16)
    assert by_name["chunks"] == by_object["chunks"] and by_name["cold_bytes"] == by_object["cold_bytes"] > 0
    with pytest.raises(ValueError, match="tier needs a cold tier"):
        tiny(mechanisms={"tier": named["tier"]})
    with pytest.raises(ValueError, match="kvforge.examples.tiers:Nope: AttributeError"):
        tiny(mechanisms={**COLD, "tier": {"policy": "kvforge.examples.tiers:Nope"}})
    with pytest.raises(ValueError, match="unexpected keyword argument 'strides'"):
        tiny(mechanisms={**COLD, "tier": {"policy": "kvforge.examples.tiers:Every", "window": 32, "strides": 2}})

    src = (kvforge.engine.ROOT / "configs" / "python-policy.toml").read_text()
    head = src[: src.index("[[config]]")]
    exp = tmp_path / "tiers.toml"
    exp.write_text(
        head.replace('name = "python-policy"', 'name = "python-tiers"')
        + '[[config]]\nname = "plan"\ncold = { format = "int4", window = 32, sink = 16 }\n\n'
        + '[[config]]\nname = "plan-numpy"\ncold = { format = "int4", window = 32, sink = 16 }\n'
        + 'tier = { policy = "kvforge.examples.tiers:SinkWindow", window = 32, sink = 16 }\n\n'
        + '[[config]]\nname = "every-numpy"\ncold = { format = "int4", window = 32, sink = 16 }\n'
        + 'tier = { policy = "kvforge.examples.tiers:Every", window = 32, stride = 2 }\n'
    )
    kvforge.ablate(exp, tmp_path / "out")
    items = [json.loads(line) for line in open(tmp_path / "out" / "items.jsonl")]
    by = {}
    for r in items:
        assert r["error"] is None, r
        by.setdefault(r["config"], {})[r["item"]] = r
    assert set(by["plan"]) == set(by["plan-numpy"]) and len(by["plan"]) == 4
    for item, r in by["plan"].items():
        n = by["plan-numpy"][item]
        assert n["answer"] == r["answer"] and n.get("chunks") == r.get("chunks")
        assert n["values"]["kv_bytes"] == r["values"]["kv_bytes"]
        # The other plan ran: it keeps every other old block in f16.
        assert by["every-numpy"][item]["values"]["kv_bytes"] > r["values"]["kv_bytes"]


def test_an_interrupt_in_a_named_classs_init_comes_out_as_itself(monkeypatch):
    import types

    class Interrupts(kvforge.TierPolicy):
        def __init__(self):
            raise KeyboardInterrupt("in __init__")

    mod = types.ModuleType("kvforge_test_interrupts")
    mod.Interrupts = Interrupts
    monkeypatch.setitem(__import__("sys").modules, "kvforge_test_interrupts", mod)
    with pytest.raises(KeyboardInterrupt, match="in __init__"):
        tiny(mechanisms={**COLD, "tier": {"policy": "kvforge_test_interrupts:Interrupts"}})
    # Nothing left pending for a later call; a plain error names the policy once.
    with pytest.raises(ValueError) as err:
        tiny(mechanisms={**COLD, "tier": {"policy": "kvforge.examples.tiers:Every", "strides": 2}})
    assert str(err.value).count("kvforge.examples.tiers:Every") == 1, err.value
