"""kvforge.Engine from Python: generate, chat sessions, perplexity, stats,
mechanisms as a dict or a file, policies written in Python (and their
failures), the conformance suite, and the ablation with a Python policy.

The tiny random-weight model (SmolLM2's tokenizer) for the mechanisms;
SmolLM2-135M itself for one greedy reply."""

import json
import os

import numpy as np
import pytest

import kvforge
import kvforge.testing
from kvforge.examples.keydiff import KeyDiff

REQUIRE = bool(os.environ.get("KVFORGE_REQUIRE_ALL"))
if not kvforge.DEFAULT_MODEL.exists():
    if REQUIRE:
        raise RuntimeError(f"{kvforge.DEFAULT_MODEL} missing: run `cargo xtask setup`")
    pytest.skip("the model is not fetched (cargo xtask setup)", allow_module_level=True)

TINY = dict(d_model=128, layers=2, heads=4, kv_heads=2, ffn=256, max_ctx=1024)
IDS = list(range(300, 700))
KEYDIFF = {"sink": 16, "window": 32, "budget_tokens": 96}


def tiny(**kw):
    return kvforge.Engine(random=TINY, **kw)


def test_generate_is_greedy_and_repeatable_and_frees_every_block():
    e = tiny()
    a, r = e.generate("Hello there", max_tokens=6, report=True)
    assert a == e.generate("Hello there", max_tokens=6)
    assert r["new_tokens"] == 6 and len(r["tokens"]) == 6
    assert r["prompt_tokens"] == len(e._native.chat_ids([("user", "Hello there")]))
    assert e.decode(r["tokens"]) == a
    assert e.blocks_in_use() == [0]
    assert e.stats()["requests"] == 2


def test_prefix_reuse_from_a_dict_reuses_the_earlier_request():
    e = tiny(mechanisms={"prefix": {"index": "hash-chain", "tail": "copy"}})
    _, first = e.generate(IDS[:200], max_tokens=2, report=True)
    _, again = e.generate(IDS[:200] + [5, 6], max_tokens=2, report=True)
    assert first["reused_tokens"] == 0
    assert again["reused_tokens"] >= 192  # every full block of the first prompt
    assert e.stats()["reused_tokens"] == again["reused_tokens"]


def test_a_chat_session_keeps_its_kv_between_turns():
    e = tiny()
    with e.chat(system="Be brief.") as chat:
        chat.send("Hi", max_tokens=4)
        _, r = chat.send("And then?", max_tokens=4, report=True)
        assert r["reused_tokens"] > 0 and r["prefilled_tokens"] < r["prompt_tokens"]
        assert e.blocks_in_use()[0] > 0
    assert e.blocks_in_use() == [0]
    with pytest.raises(ValueError, match="closed"):
        chat.send("again")


def test_mechanisms_from_a_toml_file_match_the_same_dict(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('cold = { format = "int4", window = 32, sink = 16 }\n')
    a = tiny(mechanisms=f).ppl(IDS, prefix=64, chunk=32)
    b = tiny(mechanisms={"cold": {"format": "int4", "window": 32, "sink": 16}}).ppl(IDS, prefix=64, chunk=32)
    full = tiny().ppl(IDS, prefix=64, chunk=32)
    assert a["nll_sum"] == b["nll_sum"] and a["kv_bytes"] == b["kv_bytes"]
    assert a["cold_bytes"] > 0 and a["kv_bytes"] < full["kv_bytes"]
    assert a["scored"] == len(IDS) - 64 and len(a["chunks"]) == 11


def test_bad_input_is_a_one_line_value_error(tmp_path):
    with pytest.raises(ValueError, match="unknown eviction policy \"nope\""):
        tiny(mechanisms={"eviction": {"policy": "nope"}})
    with pytest.raises(ValueError, match="mechanisms: unknown field `colder`"):
        tiny(mechanisms={"colder": {}})
    bad = tmp_path / "bad.toml"
    bad.write_text("cold = { format = \"int5\" }\n")
    with pytest.raises(ValueError, match="bad.toml"):
        tiny(mechanisms=bad)
    with pytest.raises(ValueError, match="cannot read .*missing.toml"):
        tiny(mechanisms=tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="not found"):
        kvforge.Engine(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="random needs"):
        kvforge.Engine(random={"d_model": 64})
    e = tiny()
    with pytest.raises(ValueError, match="max_tokens"):
        e.generate("x", max_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        e.generate([10**9], max_tokens=2)
    with pytest.raises(ValueError, match="streaming perplexity"):
        e.ppl(IDS[:10], prefix=64, chunk=32)
    with pytest.raises(ValueError, match="unknown device"):
        tiny(device="tpu")
    assert e.blocks_in_use() == [0]


def test_numpy_keydiff_drops_what_the_rust_keydiff_drops():
    rust = tiny(mechanisms={"eviction": {"policy": "keydiff", **KEYDIFF}})
    by_name = tiny(mechanisms={"eviction": {"policy": "kvforge.examples.keydiff:KeyDiff", **KEYDIFF}})
    by_object = tiny(policy=KeyDiff(**KEYDIFF))
    full = tiny().ppl(IDS, prefix=64, chunk=16)
    runs = [e.ppl(IDS, prefix=64, chunk=16) for e in (rust, by_name, by_object)]
    assert runs[0]["kv_bytes"] < full["kv_bytes"] / 3
    for r in runs[1:]:
        assert r["chunks"] == runs[0]["chunks"] and r["kv_bytes"] == runs[0]["kv_bytes"]
    for e in (rust, by_name, by_object):
        assert e.stats()["policies"]["evicted_entries"] == rust.stats()["policies"]["evicted_entries"] > 0
        assert e.blocks_in_use() == [0]


def test_the_conformance_suite_passes_keydiff_and_catches_a_broken_policy():
    kvforge.testing.check_eviction_policy(KeyDiff(**KEYDIFF))
    kvforge.testing.check_eviction_policy(KeyDiff(**KEYDIFF), block_size=4)

    class Newest(kvforge.EvictionPolicy):
        def victims(self, seq, table, pressure):
            return [len(table) - 1] if len(table) else []

    with pytest.raises(AssertionError, match="Newest"):
        kvforge.testing.check_eviction_policy(Newest())

    class Raises(kvforge.EvictionPolicy):
        def victims(self, seq, table, pressure):
            raise KeyError("boom")

    with pytest.raises(RuntimeError, match="KeyError: 'boom'"):
        kvforge.testing.check_eviction_policy(Raises())
    with pytest.raises(TypeError, match="no victims"):
        kvforge.testing.check_eviction_policy(object())


class Misbehaves(kvforge.EvictionPolicy):
    """Evicts sensibly until ``after`` calls, then answers ``answer`` (or
    raises it, if it is an exception)."""

    def __init__(self, answer, after=3):
        self.answer, self.after, self.calls = answer, after, 0

    def victims(self, seq, table, pressure):
        self.calls += 1
        if self.calls <= self.after:
            return []
        if isinstance(self.answer, BaseException):
            raise self.answer
        if isinstance(self.answer, str) and self.answer == "newest":
            return [len(table.first) - 1]
        return self.answer


@pytest.mark.parametrize(
    "answer, words",
    [
        (ValueError("no victims today"), "ValueError: no victims today"),
        ([99], "named entry 99"),
        ([-1], "named entry -1"),
        (None, "returned a NoneType"),
        ("0", "returned a str"),
        ([0.5], "returned a float among its indexes"),
        (np.array([True, False]), "returned a bool among its indexes"),
        ([1, 0], "victims() answers must ascend: entry 1 before entry 0"),
        ([0, 0], "victims() named entry 0 twice"),
        ({0, 1}, "victims() returned a set"),
        ("newest", "the newest: it cannot be evicted"),
    ],
)
def test_a_misbehaving_policy_fails_the_request_and_leaves_the_cache_unchanged(answer, words):
    policy = Misbehaves(answer)
    e = tiny(policy=policy)
    with e.chat() as chat:
        chat.send("Hi", max_tokens=2)
        held = e.blocks_in_use()
        before = e.stats()
        with pytest.raises(RuntimeError, match="the eviction policy Misbehaves failed|named entry") as err:
            chat.send("A longer message that needs several more steps", max_tokens=4)
        assert words in str(err.value)
        assert "\n" not in str(err.value)
        assert e.blocks_in_use() == held
        for k in ("evicted_entries", "evicted_tokens", "packed_blocks", "demoted_blocks"):
            assert e.stats()["policies"][k] == before["policies"][k]
        # The session goes on from where it was once the policy behaves.
        policy.answer = []
        _, r = chat.send("Again", max_tokens=2, report=True)
        assert r["reused_tokens"] > 0
    assert e.blocks_in_use() == [0]


def test_the_ablation_runs_a_python_policy_by_name_and_matches_rust(tmp_path):
    rows = kvforge.ablate(kvforge.engine.ROOT / "configs" / "python-policy.toml", tmp_path / "out")
    if not isinstance(rows, list):
        rows = rows.to_dict("records")
    names = {r["config"] for r in rows}
    assert names == {"baseline", "keydiff", "keydiff-numpy"}
    items = [json.loads(line) for line in open(tmp_path / "out" / "items.jsonl")]
    by = {}
    for r in items:
        assert r["error"] is None, r
        by.setdefault(r["config"], {})[r["item"]] = r
    assert set(by["keydiff-numpy"]) == set(by["keydiff"]) and len(by["keydiff"]) == 4
    for item, r in by["keydiff"].items():
        n = by["keydiff-numpy"][item]
        assert n["answer"] == r["answer"]
        assert n.get("chunks") == r.get("chunks")
        assert n["values"]["kv_bytes"] == r["values"]["kv_bytes"] < by["baseline"][item]["values"]["kv_bytes"]


def test_the_ablation_reports_a_bad_file_and_an_unbuildable_policy(tmp_path):
    with pytest.raises(ValueError):
        kvforge.ablate(tmp_path / "missing.toml", tmp_path / "out")
    src = (kvforge.engine.ROOT / "configs" / "python-policy.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(src.replace("kvforge.examples.keydiff:KeyDiff", "kvforge.examples.keydiff:Nope"))
    with pytest.raises(ValueError, match="kvforge.examples.keydiff:Nope: AttributeError"):
        kvforge.ablate(bad, tmp_path / "out", root=kvforge.engine.ROOT)


def test_smollm2_answers_from_python_as_the_cli_does():
    e = kvforge.Engine()
    text = e.generate("What is the capital of France?", max_tokens=12)
    assert "Paris" in text
    assert e.blocks_in_use() == [0]


class Calls(kvforge.EvictionPolicy):
    """Answers [] (or runs ``hook``) from its ``after``-th victims call on."""

    wants_keys = True

    def __init__(self, hook=None, after=0, observe=None, forget=None):
        self.hook, self.after, self.calls = hook, after, 0
        self._observe, self._forget = observe, forget

    def victims(self, seq, table, pressure):
        self.calls += 1
        if self.hook is not None and self.calls > self.after:
            return self.hook()
        return []

    def observe_keys(self, seq, table, novelty):
        if self._observe is not None:
            self._observe()

    def forget(self, seq):
        if self._forget is not None:
            self._forget()


def test_a_raising_forget_or_late_observe_fails_nothing_later(monkeypatch):
    import sys

    def boom():
        raise ValueError("boom")

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    e = tiny(policy=Calls(forget=boom))
    for _ in range(3):
        e.generate(IDS[:40], max_tokens=2)
    assert seen == ["Calls.forget: ValueError: boom"] * 3
    assert e.blocks_in_use() == [0]
    state = {"raise": True}

    def once():
        if state.pop("raise", False):
            raise ValueError("observe boom")

    e = tiny(policy=Calls(observe=once))
    with pytest.raises(RuntimeError, match="observe_keys: ValueError: observe boom"):
        e.generate(IDS[:40], max_tokens=4)  # its next step fails
    assert e.blocks_in_use() == [0]
    e.generate(IDS[:40], max_tokens=4)  # and the next request is fine


def test_a_policy_that_calls_the_engine_is_refused_not_hung():
    box = {}
    e = tiny(policy=Calls(hook=lambda: box["e"].blocks_in_use()))
    box["e"] = e
    with pytest.raises(RuntimeError, match="cannot call the engine from inside"):
        e.generate(IDS[:40], max_tokens=2)
    assert e.blocks_in_use() == [0]


def test_a_second_thread_reading_stats_does_not_deadlock_a_python_policy():
    import threading
    import time

    e = tiny(policy=Calls(hook=lambda: time.sleep(0.002) or []))
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            e.blocks_in_use()
            e.stats()

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (e.generate(IDS[:100], max_tokens=8), done.set()), daemon=True)
    worker.start()
    worker.join(timeout=60)
    stop.set()
    t.join(timeout=10)
    assert done.is_set(), "generate did not finish: a deadlock"


def test_an_interrupt_in_a_policy_comes_out_as_itself():
    def interrupt():
        raise KeyboardInterrupt

    e = tiny(policy=Calls(hook=interrupt))
    with pytest.raises(KeyboardInterrupt):
        e.generate(IDS[:40], max_tokens=2)
    assert e.blocks_in_use() == [0]
    e2 = tiny(policy=Calls(hook=lambda: [2**70]))
    with pytest.raises(RuntimeError, match="named entry 1180591620717411303424, out of range"):
        e2.generate(IDS[:40], max_tokens=2)


def test_a_policy_attribute_that_raises_is_an_error_not_a_default():
    class BadName(kvforge.EvictionPolicy):
        @property
        def name(self):
            raise KeyError("no name")

        def victims(self, seq, table, pressure):
            return []

    with pytest.raises(KeyError, match="no name"):
        tiny(policy=BadName())

    class HugeWindow(BadName):
        name = "huge"
        wants_attention = True
        observation_window = 2**63

    with pytest.raises(TypeError, match="observation_window"):
        tiny(policy=HugeWindow())


def test_more_bad_arguments_are_value_errors():
    e = tiny()
    with pytest.raises(ValueError, match="top_k"):
        e.generate("x", top_k=-1)
    with pytest.raises(ValueError, match="seed"):
        e.generate("x", seed=-1)
    with pytest.raises(ValueError, match="mechanisms: Out of range float"):
        tiny(mechanisms={"budget_mib": float("nan")})
    with pytest.raises(ValueError, match="^mechanisms: invalid type: floating point"):
        tiny(mechanisms={"budget_mib": 0.5})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.decode([10**9])
    with pytest.raises(ValueError, match="window"):
        KeyDiff(budget_tokens=96, sink=16, window=0)
