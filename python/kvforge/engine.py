"""The kvforge engine from Python: a LLaMA model in libtorch with kvforge's
paged KV cache and its mechanisms (prefix reuse, the quantized cold tier,
eviction, sharing, the lifecycle), as the ``kvforge`` CLI runs them.

    eng = kvforge.Engine(mechanisms={"cold": {"format": "int4", "window": 128, "sink": 32}})
    eng.generate("What is a KV cache?", max_tokens=32)
    chat = eng.chat(); chat.send("Hi!"); chat.send("And then?")
    eng.ppl(text, prefix=256, chunk=64)["ppl"]
    eng.stats()["counters"]
"""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path
from typing import Any

import numpy as np

from . import _native, assets

ROOT = assets.home()
"""Where the model and data are (:func:`kvforge.assets.home`): the kvforge
checkout this package was built from, ``$KVFORGE_HOME``, or a cache folder."""
DEFAULT_MODEL = ROOT / "models" / assets.MODEL_FILE
"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is looked for
and fetched to on first use (``$KVFORGE_MODEL`` overrides it)."""


def _int(name: str, v: Any, low: int, high: int = 2**64) -> int:
    """``v`` as an int in ``low .. high`` (a Python int or a numpy integer,
    not a bool), else a ``ValueError`` naming ``name``."""
    if isinstance(v, (bool, np.bool_)):
        raise ValueError(f"kvforge: {name} must be an int ≥ {low}, not {v!r}")
    try:
        i = operator.index(v)
    except TypeError:
        raise ValueError(f"kvforge: {name} must be an int ≥ {low}, not {v!r}") from None
    if not low <= i < high:
        raise ValueError(f"kvforge: {name} must be an int ≥ {low} and < {high}, not {i}")
    return i


def _ids(prompt: Any) -> list[int]:
    """Token ids from a list (or array) of ints; bytes are refused, not read
    as ids."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError("kvforge: a prompt is a str or a list of token ids, not bytes: decode it first")
    try:
        return [_int("a token id", i, 0, 2**32) for i in prompt]
    except TypeError:
        raise ValueError(f"kvforge: a prompt is a str or a list of token ids, not {type(prompt).__name__}") from None


def _instance(name: str, policy: Any) -> Any:
    if isinstance(policy, type):
        raise TypeError(f"kvforge: {name} must be an instance, not the class {policy.__name__}: pass {policy.__name__}(...)")
    return policy


class _Sampling:
    """How to sample (read by the native module by attribute)."""

    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")

    def __init__(self, max_tokens, temperature, top_k, top_p, seed, ignore_eos):
        self.max_tokens = _int("max_tokens", max_tokens, 1)
        self.top_k, self.seed = _int("top_k", top_k, 0), _int("seed", seed, 0)
        self.temperature, self.top_p, self.ignore_eos = float(temperature), float(top_p), bool(ignore_eos)


MECHANISMS_EXAMPLE = {
    "prefix": {"index": "hash-chain", "tail": "copy"},  # index: hash-chain | radix; tail: copy | seal | skip
    "cold": {"format": "int4", "window": 128, "sink": 32, "group": 32, "keys": "channel", "rotate": False},
    "eviction": {"policy": "keydiff", "sink": 32, "window": 256, "budget_tokens": 544},
    "share": {"policy": "exact"},
    "lifecycle": {"policy": "recent-turns", "keep": 4},
    "budget_mib": 0,
    "block_size": 16,
}
"""Every mechanism on, each with its keys (a dict ``Engine(mechanisms=…)``
takes; the TOML file's keys are the same). ``cold.format``: int8 | int4 |
int2, ``keys``: channel | token. ``eviction.policy``: sink-window (sink,
window), h2o / lfu / keydiff / snapkv / hybrid (sink, window,
budget_tokens — or high and low, watermarks over ``budget_mib``; keydiff
and snapkv also per_head or per_token; h2o decay, snapkv observe, hybrid
alpha / beta / gamma), or ``"module:Class"`` for a Python class (the
other keys its keyword arguments). ``tier``: a tier policy beside
``cold`` (``{"policy": "module:Class", …}``). ``budget_mib``: bytes all
tiers may hold (0: the hot tier's capacity). Each key is explained in
``ablate/README.md`` (the experiment file's ``[[config]]``)."""


class Engine:
    """A model, its tokenizer and a paged KV cache with kvforge's mechanisms.

    ``model``: a GGUF file or a Hugging Face directory (default:
    :func:`kvforge.assets.model`, SmolLM2-135M-Instruct: ``$KVFORGE_MODEL``,
    else the copy under the home folder, fetched on first use). ``mechanisms``: a mechanisms table as a
    dict (the TOML file's keys: ``prefix``, ``cold``, ``tier``,
    ``eviction``, ``share``, ``lifecycle``, ``budget_mib``,
    ``block_size``; every key of each: ``kvforge.engine.MECHANISMS_EXAMPLE``)
    or the path of a TOML file; absent, every mechanism is off. An eviction policy is
    named there (``"keydiff"``, or ``"module:Class"`` for one written in
    Python) or handed as an object with ``policy`` (a
    :class:`kvforge.EvictionPolicy`; it replaces the table's). A
    :class:`kvforge.TierPolicy` object given as ``tier_policy`` decides
    which hot blocks go to the cold tier in place of the table's ``cold``
    sink and window (the table must have a cold tier; the object replaces
    the table's ``tier``). ``random``:
    the dimensions of a random-weight model (``d_model``, ``layers``,
    ``heads``, ``kv_heads``, ``ffn``, ``max_ctx``) with ``model``'s
    tokenizer, for tests. ``kv_tokens``: the hot tier's capacity in tokens
    (default 0: one sequence of the model's context); requests and
    sessions of several threads share it, and one that does not fit fails
    with ``RuntimeError`` ("KV cache full") — raise it for concurrent use.

    Bad input raises ``ValueError``; a step that fails (a policy that
    raised, a full cache) raises ``RuntimeError`` — each with the engine's
    one-line message, the cache left as it was.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        mechanisms: dict[str, Any] | str | os.PathLike | None = None,
        *,
        policy: Any = None,
        tier_policy: Any = None,
        random: dict[str, int] | None = None,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "f32",
        kv_dtype: str = "f16",
        block_size: int = 16,
        kv_tokens: int = 0,
    ):
        path = Path(model) if model is not None else assets.model()
        if not path.exists():
            raise ValueError(f"kvforge: model {path} not found")
        table = path_ = None
        if isinstance(mechanisms, dict):
            try:
                table = json.dumps(mechanisms, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"kvforge: mechanisms: {e}") from None
        elif mechanisms is not None:
            path_ = os.fspath(mechanisms)
        dims = None
        if random is not None:
            keys = ("d_model", "layers", "heads", "kv_heads", "ffn", "max_ctx")
            unknown = set(random) - set(keys)
            if unknown or len(random) != len(keys):
                raise ValueError(f"kvforge: random needs exactly {', '.join(keys)}")
            dims = tuple(random[k] for k in keys)
        policy, tier_policy = _instance("policy", policy), _instance("tier_policy", tier_policy)
        block_size, seed = _int("block_size", block_size, 1), _int("seed", seed, 0, 2**63)
        kv_tokens = _int("kv_tokens", kv_tokens, 0)
        self._native = _native.Engine(
            os.fspath(path),
            mechanisms_json=table,
            mechanisms_path=path_,
            policy=policy,
            tier_policy=tier_policy,
            random=dims,
            seed=seed,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            block_size=block_size,
            kv_tokens=kv_tokens,
        )

    def encode(self, text: str, special: bool = False) -> list[int]:
        """The ids of ``text`` (control tokens parsed only with ``special``)."""
        return self._native.encode(text, special)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""
        return self._native.decode(list(ids))

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int = 64,
        *,
        chat: bool = True,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        ignore_eos: bool = False,
        report: bool = False,
    ):
        """The reply to ``prompt``: a user message in the chat template
        (``chat=False``: raw text), or token ids as they are. Greedy unless
        ``temperature > 0``. With ``report``, ``(text, report)`` where the
        report has the tokens, timings, reused prefix, ``kv_bytes_in_use``
        after the call (0 once a stateless request gave its blocks back)
        and ``kv_bytes_peak``, the most KV bytes the cache held inside any
        step of the call (every request's: this one's alone when no other
        thread generates).
        Ctrl-C stops the generation within one decode step
        (``KeyboardInterrupt``), the engine left as before the call."""
        if isinstance(prompt, str):
            ids = self._native.chat_ids([("user", prompt)]) if chat else self.encode(prompt)
        else:
            ids = _ids(prompt)
        s = _Sampling(max_tokens, temperature, top_k, top_p, seed, ignore_eos)
        text, r = self._native.complete(ids, s)
        return (text, r) if report else text

    def chat(self, system: str | None = None) -> Session:
        """A chat session: each :meth:`Session.send` is one turn, the
        session's KV kept between turns (and cut by the lifecycle policy)."""
        return Session(self, system)

    def ppl(
        self,
        text: str | list[int],
        prefix: int = 256,
        chunk: int = 64,
        decode: int = 0,
        window: int | None = None,
    ) -> dict[str, Any]:
        """Perplexity of ``text`` through the cache: streaming (prefill
        ``prefix`` tokens, then score chunks of ``chunk``, so eviction and
        the cold tier act as the context grows), or with ``window``,
        windows from an empty cache. A dict: ``ppl``, ``scored``, KV bytes
        at the peak, tokens/s, per-chunk ``(tokens, nll)``."""
        ids = self.encode(text) if isinstance(text, str) else _ids(text)
        return self._native.ppl(ids, prefix, chunk, decode, window)

    def stats(self) -> dict[str, Any]:
        """The cache manager's metrics: requests, reused tokens, the
        coordinator's counters, each tier's blocks and bytes, the policies'
        stats."""
        return json.loads(self._native.metrics_json())

    def blocks_in_use(self) -> list[int]:
        """Blocks in use per tier, hot first (0 everywhere once every
        request and session ended)."""
        return self._native.blocks_in_use()


class Session:
    """A chat session of an :class:`Engine`; close it (or use ``with``) to
    release its blocks. A turn that fails leaves the session as it was."""

    def __init__(self, engine: Engine, system: str | None = None):
        self._engine = engine
        self._id = engine._native.open_session()
        self._system = system
        self._turns = 0
        self._closed_reply = True

    def send(
        self,
        message: str,
        max_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        ignore_eos: bool = False,
        report: bool = False,
    ):
        """The assistant's reply to ``message`` (``(text, report)`` with
        ``report``; the report's ``reused_tokens`` counts the session's
        cached tokens). Sampling as in :meth:`Engine.generate`. A turn
        that fails or is interrupted (Ctrl-C) leaves the session as it
        was before it."""
        n = self._engine._native
        if self._id is None:
            raise ValueError("kvforge: this session is closed")
        if self._turns == 0:
            msgs = [("system", self._system)] if self._system else []
            ids = n.chat_ids(msgs + [("user", message)])
        else:
            ids = n.user_turn_ids(self._closed_reply, message)
        s = _Sampling(max_tokens, temperature, top_k, top_p, seed, ignore_eos)
        text, r = n.turn(self._id, ids, s)
        self._turns += 1
        self._closed_reply = r["stopped_at_eos"]
        return (text, r) if report else text

    def close(self) -> None:
        """Releases the session's blocks."""
        if self._id is not None:
            self._engine._native.close_session(self._id)
            self._id = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
