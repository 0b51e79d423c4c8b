"""What a user runs into at the edges (review P4–P11): Ctrl-C during a
generation, policies handed as classes, negative and numpy integers, bytes
as a prompt, the sink and block named in their errors, a failing
conformance check that prints nothing but its AssertionError, and a
ColdStore shared by threads."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvforge
import kvforge.testing
from kvforge.examples.keydiff import KeyDiff

TINY = dict(d_model=128, layers=2, heads=4, kv_heads=2, ffn=256, max_ctx=1024)
IDS = list(range(300, 350))


def tiny(**kw):
    return kvforge.Engine(random=TINY, **kw)


def interrupt_after(seconds):
    """SIGINT to this process after ``seconds``, as Ctrl-C sends it."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture(autouse=True)
def python_handles_ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt) for each test: a
    process started in the background (`cmd &`, `nohup`) inherits SIGINT
    ignored, and Python then installs none."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_ctrl_c_stops_a_generation_within_a_step_and_the_engine_goes_on():
    e = tiny()
    expected = e.generate(IDS, max_tokens=6)
    start = time.perf_counter()
    _, r = e.generate(IDS, max_tokens=900, ignore_eos=True, report=True)
    full = time.perf_counter() - start
    step = full / 900
    timer = interrupt_after(full / 4)
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        e.generate(IDS, max_tokens=900, ignore_eos=True)
    stopped = time.perf_counter() - start
    timer.join()
    # It stops long before the generation would end (a quarter of it in,
    # plus at most a step and the unwinding), and every block is back.
    assert stopped < full * 3 / 4, (stopped, full, step)
    assert e.blocks_in_use() == [0]
    assert e.generate(IDS, max_tokens=6) == expected
    assert e.stats()["requests"] == 3


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_ctrl_c_in_a_chat_turn_leaves_the_session_as_it_was():
    e = tiny()
    with e.chat() as fresh:
        first = fresh.send("Hi", max_tokens=4)
        second = fresh.send("And then?", max_tokens=4)
    start = time.perf_counter()
    e.generate("Hi", max_tokens=600, ignore_eos=True)
    full = time.perf_counter() - start
    with e.chat() as chat:
        assert chat.send("Hi", max_tokens=4) == first
        timer = interrupt_after(full / 4)
        with pytest.raises(KeyboardInterrupt):
            chat.send("Something long", max_tokens=600, ignore_eos=True)
        timer.join()
        assert chat.send("And then?", max_tokens=4) == second
    assert e.blocks_in_use() == [0]


def test_a_policy_class_instead_of_an_instance_says_so():
    with pytest.raises(TypeError, match="policy must be an instance, not the class KeyDiff: pass KeyDiff"):
        tiny(policy=KeyDiff)
    with pytest.raises(TypeError, match="not the class KeyDiff"):
        kvforge.testing.check_eviction_policy(KeyDiff)


def test_negative_ints_name_their_argument_numpy_ints_work_bytes_are_refused():
    e = tiny()
    with pytest.raises(ValueError, match="block_size must be an int ≥ 1"):
        tiny(block_size=-1)
    with pytest.raises(ValueError, match="seed must be an int ≥ 0 and < 9223372036854775808"):
        tiny(seed=2**63)
    with pytest.raises(ValueError, match="a token id must be an int ≥ 0"):
        e.generate([-1], max_tokens=2)
    with pytest.raises(ValueError, match="not bytes"):
        e.generate(b"hello", max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens must be an int ≥ 1"):
        e.generate(IDS, max_tokens=True)
    assert e.generate(np.array(IDS), max_tokens=np.int64(3)) == e.generate(IDS, max_tokens=3)
    with pytest.raises(ValueError, match="group must be ≥ 0, not -1"):
        kvforge.Quantizer("int4", group=-1)
    store = kvforge.ColdStore("int4", window=32, sink=32, block=32, group=32)
    with pytest.raises(ValueError, match="blocks must be ≥ 0, not -1"):
        store.truncate(-1)
    with pytest.raises(ValueError, match="sink must be ≥ 0"):
        kvforge.ColdStore("int4", sink=-32)
    assert kvforge.Quantizer("int4", group=np.int64(32)).name == kvforge.Quantizer("int4", group=32).name


def test_the_sink_and_the_block_are_named_in_their_errors():
    with pytest.raises(ValueError, match="quant: sink of 7 tokens is not a multiple of the block size 32"):
        kvforge.ColdStore("int4", sink=7)
    with pytest.raises(ValueError, match="quant: hot window of 40 tokens"):
        kvforge.ColdStore("int4", window=40)
    with pytest.raises(ValueError, match="block size must be at least 1 token"):
        kvforge.ColdStore("int4", block=0)


def test_a_failing_conformance_check_prints_only_its_assertion():
    # A child process with RUST_BACKTRACE=1: nothing of Rust's panic on stderr.
    code = textwrap.dedent(
        """
        import kvforge, kvforge.testing
        class Newest(kvforge.EvictionPolicy):
            def victims(self, seq, table, pressure):
                return [len(table.first) - 1] if len(table.first) else []
        try:
            kvforge.testing.check_eviction_policy(Newest())
        except AssertionError as e:
            print("caught:", str(e).splitlines()[0][:60])
        """
    )
    env = dict(os.environ, RUST_BACKTRACE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("caught: Newest"), out.stdout
    assert "panicked" not in out.stderr and "backtrace" not in out.stderr, out.stderr


def test_a_cold_store_shared_by_threads_refuses_the_second_caller_and_stays_whole():
    # Documented: one thread at a time. A call that overlaps another fails
    # with "Already borrowed" and changes nothing.
    store = kvforge.ColdStore("int4", window=32, sink=32, block=32, group=32)
    x = np.random.default_rng(0).standard_normal((32, 2, 64), dtype=np.float32)
    ok, refused = [], []

    def append():
        for _ in range(20):
            try:
                store.append(x, x, 2, 64)
                ok.append(1)
            except RuntimeError as e:
                assert "Already borrowed" in str(e)
                refused.append(1)

    threads = [threading.Thread(target=append) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) + len(refused) == 80
    assert store.blocks == len(ok)


def test_the_capacity_is_settable_and_a_full_cache_says_how_to_raise_it():
    small = tiny(kv_tokens=64)
    with pytest.raises(ValueError, match="needs up to 7 KV blocks but the whole pool has 4"):
        small.generate(list(range(300, 400)), max_tokens=2)
    small = tiny(kv_tokens=128)
    with small.chat() as chat:
        chat.send("word " * 80, max_tokens=2)
        with pytest.raises(RuntimeError, match=r"KV cache full.*Engine\(kv_tokens=.*raise it"):
            small.generate(list(range(300, 400)), max_tokens=2)
    assert small.blocks_in_use() == [0]
    # Six threads, three requests each, on a cache that holds them all.
    e = tiny(kv_tokens=6 * 1024)
    prompts = [list(range(300 + 7 * t, 1000)) for t in range(6)]
    serial = [e.generate(p, max_tokens=4) for p in prompts]
    got, errors = {}, []

    def run(t):
        try:
            got[t] = [e.generate(prompts[t], max_tokens=4) for _ in range(3)]
        except Exception as x:  # noqa: BLE001 (the test reports it)
            errors.append(repr(x))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(got[t] == [serial[t]] * 3 for t in range(6))
    assert e.blocks_in_use() == [0]


def test_python_m_kvforge_help_is_help_and_a_bad_argument_is_status_2():
    for args in (["--help"], ["ablate", "-h"]):
        out = subprocess.run([sys.executable, "-m", "kvforge", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "python -m kvforge ablate" in out.stdout, out
    out = subprocess.run([sys.executable, "-m", "kvforge", "ablate", "--bogus"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown argument '--bogus'" in out.stderr


@pytest.mark.parametrize(
    "answer, words",
    [
        ([2, 1], "answers must ascend: entry 2 before entry 1"),
        ([1, 1], "named entry 1 twice"),
    ],
)
def test_the_conformance_suite_and_the_engine_refuse_an_answer_in_the_same_words(answer, words):
    # The engine's words for the same answers: test_engine's Misbehaves.
    class Answers(kvforge.EvictionPolicy):
        def victims(self, seq, table, pressure):
            return answer if len(table.first) > 3 else []

    with pytest.raises(AssertionError, match=f"Answers: .*{words}"):
        kvforge.testing.check_eviction_policy(Answers())

    class Unordered(kvforge.EvictionPolicy):
        def victims(self, seq, table, pressure):
            return {1, 2} if len(table.first) > 3 else []

    # A set is the wrong type of answer (as None or a str is): a TypeError.
    with pytest.raises(RuntimeError, match="victims\\(\\) returned a set"):
        kvforge.testing.check_eviction_policy(Unordered())


def test_a_report_has_the_peak_kv_bytes_of_the_call():
    e = tiny()
    _, short = e.generate(IDS[:20], max_tokens=2, report=True)
    _, long = e.generate(IDS * 4, max_tokens=2, report=True)
    assert short["kv_bytes_in_use"] == long["kv_bytes_in_use"] == 0
    assert 0 < short["kv_bytes_peak"] < long["kv_bytes_peak"]
    with e.chat() as chat:
        _, turn = chat.send("Hi", max_tokens=2, report=True)
        assert 0 < turn["kv_bytes_in_use"] <= turn["kv_bytes_peak"]


def test_the_documented_mechanisms_example_builds_an_engine_and_a_misspelt_key_is_named():
    e = tiny(mechanisms=kvforge.engine.MECHANISMS_EXAMPLE)
    assert e.generate(IDS, max_tokens=2)
    assert "MECHANISMS_EXAMPLE" in kvforge.Engine.__doc__
    bad = dict(kvforge.engine.MECHANISMS_EXAMPLE, cold={"format": "int4", "windw": 128})
    with pytest.raises(ValueError, match="windw"):
        tiny(mechanisms=bad)


def test_a_session_turn_samples_as_generate_does():
    e = tiny()
    with e.chat() as a, e.chat() as b:
        greedy = a.send("Hi", max_tokens=5)
        # top_k = 1 at any temperature is greedy; top_p and ignore_eos pass.
        assert b.send("Hi", max_tokens=5, temperature=1.5, top_k=1, top_p=0.9, seed=7, ignore_eos=True) == greedy
    with pytest.raises(ValueError, match="top_k must be an int ≥ 0"):
        e.chat().send("Hi", top_k=-1)
