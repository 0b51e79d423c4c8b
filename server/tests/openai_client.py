"""The official `openai` Python client against `kvforge-serve`.

Run by `tests/openai.rs` (so `cargo xtask ci` runs it): starts the server
binary given in KVFORGE_SERVE on a free loopback port with the model in
KVFORGE_MODEL, runs the cases, stops the server with SIGTERM and checks
that it exits 0. Every case goes through the client's public API only.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

import openai

KEY = "sk-kvforge-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
SERVER = None
BASE = None


def start_server():
    global SERVER, BASE
    SERVER = subprocess.Popen(
        [
            os.environ["KVFORGE_SERVE"],
            "--model", os.environ["KVFORGE_MODEL"],
            "--port", "0",
            "--api-key", KEY,
            "--max-batch", "1",
            "--max-waiting", "1",
            "--max-body-bytes", "1000000",
            "--default-max-tokens", "32",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    line = SERVER.stderr.readline()
    m = re.search(r"http://(\S+)", line)
    if not m:
        SERVER.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    BASE = f"http://{m.group(1)}"
    # Keep draining stderr so the server never blocks on it.
    threading.Thread(target=lambda: SERVER.stderr.read(), daemon=True).start()


def client(key=KEY):
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=0, timeout=120)


def metric(name):
    text = urllib.request.urlopen(f"{BASE}/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def chat(c, content, salt, extra=None, **kw):
    return c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        extra_body={"cache_salt": salt, **(extra or {})},
        **kw,
    )


class OpenAIClient(unittest.TestCase):
    def test_models_lists_the_served_model(self):
        ids = [m.id for m in client().models.list()]
        self.assertEqual(ids, [MODEL])

    def test_models_retrieve_and_a_model_that_is_not_served(self):
        m = client().models.retrieve(MODEL)
        self.assertEqual((m.id, m.object), (MODEL, "model"))
        with self.assertRaises(openai.NotFoundError):
            client().models.retrieve("gpt-4o")

    def test_nulls_harnesses_send_and_a_signed_seed_are_accepted(self):
        # lm-evaluation-harness, LangChain and LlamaIndex pass None for the
        # fields they do not use; the client sends them as JSON null.
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            tools=None,
            tool_choice=None,
            response_format=None,
            logit_bias=None,
            top_logprobs=None,
            stop=None,
            n=None,
            seed=-1,
        )
        # Different salts: both computed afresh, so the same seed repeats.
        reply = lambda salt: client().chat.completions.create(**kw, extra_body={"cache_salt": salt})
        self.assertEqual(reply("a").choices[0].message.content, reply("b").choices[0].message.content)
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(**{**kw, "response_format": {"type": "json_object"}})
        self.assertIn("not supported", str(e.exception))

    def test_chat_reply_usage_and_cached_tokens_on_a_repeated_prefix(self):
        c = client()
        q = "What is the capital of France? Answer in one short sentence."
        a = chat(c, q, "chat", max_tokens=12)
        self.assertEqual(a.object, "chat.completion")
        self.assertEqual(a.choices[0].message.role, "assistant")
        self.assertIsInstance(a.choices[0].message.content, str)
        self.assertIn(a.choices[0].finish_reason, ("stop", "length"))
        u = a.usage
        self.assertEqual(u.total_tokens, u.prompt_tokens + u.completion_tokens)
        self.assertEqual(u.prompt_tokens_details.cached_tokens, 0)
        # The next turn resends the history, as clients do: its prefix is
        # found in the cache.
        b = c.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": q},
                {"role": "assistant", "content": a.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"},
            ],
            temperature=0,
            max_completion_tokens=8,
            extra_body={"cache_salt": "chat"},
        )
        cached = b.usage.prompt_tokens_details.cached_tokens
        self.assertGreaterEqual(cached, u.prompt_tokens - 16, b.usage)
        self.assertGreater(b.usage.prompt_tokens, u.prompt_tokens)

    def test_streaming_chat_gives_the_same_text_and_usage(self):
        c = client()
        q = "Name three colours."
        whole = chat(c, q, "s1", max_tokens=16)
        stream = chat(c, q, "s2", max_tokens=16, stream=True,
                      stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.content:
                    pieces.append(ch.delta.content)
                if ch.finish_reason:
                    finish = ch.finish_reason
        self.assertEqual("".join(pieces), whole.choices[0].message.content)
        self.assertEqual(finish, whole.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, whole.usage.completion_tokens)

    def test_completions_text_and_stream(self):
        c = client()
        a = c.completions.create(model=MODEL, prompt="The KV cache of a transformer",
                                 max_tokens=10, temperature=0, extra_body={"cache_salt": "c1"})
        self.assertEqual(a.object, "text_completion")
        self.assertEqual(a.usage.completion_tokens, 10)
        self.assertEqual(a.choices[0].finish_reason, "length")
        s = c.completions.create(model=MODEL, prompt="The KV cache of a transformer",
                                 max_tokens=10, temperature=0, stream=True,
                                 extra_body={"cache_salt": "c2"})
        text = "".join(ch.choices[0].text for ch in s if ch.choices)
        self.assertEqual(text, a.choices[0].text)
        ids = c.completions.create(model=MODEL, prompt=[504, 1125, 314], max_tokens=3)
        self.assertEqual(ids.usage.prompt_tokens, 3)

    def test_logprobs_for_chat_and_completions_and_echo_as_lm_eval_sends_it(self):
        c = client()
        a = chat(c, "Name a fruit.", "lp", max_tokens=5, logprobs=True, top_logprobs=3,
                 extra={"ignore_eos": True})
        content = a.choices[0].logprobs.content
        self.assertEqual(len(content), a.usage.completion_tokens)
        for e in content:
            self.assertLessEqual(e.logprob, 0.0)
            self.assertEqual(len(e.top_logprobs), 3)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(e.logprob, e.top_logprobs[0].logprob, places=5)
        # The reply's text leaves special tokens out; their entries stay.
        text = re.sub(r"<\|[a-z_]+\|>", "", bytes(b for e in content for b in e.bytes).decode())
        self.assertEqual(text, a.choices[0].message.content)
        # lm-evaluation-harness's loglikelihood request: token ids,
        # echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1].
        ids = [504, 3575, 282, 4649, 314]
        r = c.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0,
                                 logprobs=1, echo=True, seed=1234)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.token_logprobs), len(ids) + 1)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertTrue(all(x <= 0.0 for x in lp.token_logprobs[1:]))
        self.assertTrue(r.choices[0].text.startswith("".join(lp.tokens[:len(ids)])))
        self.assertEqual(r.usage.prompt_tokens_details.cached_tokens, 0)
        with self.assertRaises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="x", logprobs=21)
        self.assertEqual(e.exception.param, "logprobs")

    def test_n_choices_sample_on_their_own_and_wait_for_a_batch_slot(self):
        c = client()
        before = metric("kvforge:forked_prompt_tokens_total")
        ask = lambda salt, **kw: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a word."}],
            max_tokens=6, n=3, temperature=1.0, seed=5,
            extra_body={"cache_salt": salt, "ignore_eos": True}, **kw)
        a = ask("n")
        self.assertEqual([ch.index for ch in a.choices], [0, 1, 2])
        self.assertEqual(a.usage.completion_tokens, 18)
        # This server runs one sequence at a time (--max-batch 1): the other
        # choices wait their turn instead of forking the prompt's blocks
        # (tests/http.rs checks the sharing on a wider batch).
        forked = metric("kvforge:forked_prompt_tokens_total") - before
        self.assertEqual(forked, 0)
        # Streamed, the same seed: the same three choices.
        s = ask("n2", stream=True)
        texts = ["", "", ""]
        for chunk in s:
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
        self.assertEqual(texts, [ch.message.content for ch in a.choices])

    def test_errors_are_the_clients_exception_types(self):
        c = client()
        with self.assertRaises(openai.AuthenticationError):
            client("sk-wrong").models.list()
        with self.assertRaises(openai.NotFoundError) as e:
            c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
        self.assertEqual(e.exception.code, "model_not_found")
        with self.assertRaises(openai.BadRequestError) as e:
            chat(c, "x", "e", n=17)
        self.assertEqual(e.exception.param, "n")
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[])
        with self.assertRaises(openai.BadRequestError) as e:
            chat(c, "word " * 9000, "e", max_tokens=2)
        self.assertEqual(e.exception.code, "context_length_exceeded")
        with self.assertRaises(openai.APIStatusError) as e:
            chat(c, "x" * 1_200_000, "e", max_tokens=2)
        self.assertEqual(e.exception.status_code, 413)

    def test_a_full_queue_is_a_rate_limit_error_with_retry_after(self):
        c = client()
        long = chat(c, "Count to a thousand.", "q", max_tokens=400, stream=True,
                    extra={"ignore_eos": True})
        next(iter(long))  # running
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", chat(c, "Then me.", "q2", max_tokens=2)))
        t.start()
        deadline = time.time() + 60
        while metric("kvforge:num_requests_waiting") < 1:
            self.assertLess(time.time(), deadline)
            time.sleep(0.02)
        with self.assertRaises(openai.RateLimitError) as e:
            chat(c, "And me.", "q3", max_tokens=2)
        self.assertEqual(e.exception.response.headers.get("retry-after"), "1")
        long.close()  # the client goes away: the waiting request runs
        t.join(120)
        self.assertEqual(done["r"].usage.completion_tokens, 2)


def main():
    start_server()
    try:
        result = unittest.main(exit=False, verbosity=2).result
    finally:
        SERVER.send_signal(signal.SIGTERM)
        code = SERVER.wait(timeout=60)
    if code != 0:
        print(f"the server exited {code} after SIGTERM", file=sys.stderr)
        sys.exit(1)
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
