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
import os
from pathlib import Path
from typing import Any

from . import _native

ROOT = Path(__file__).resolve().parents[2]
"""The kvforge checkout this package was built from (``maturin develop``)."""
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The model ``cargo xtask setup`` fetches: SmolLM2-135M-Instruct, Q4_1 GGUF."""


class _Sampling:
    """How to sample (read by the native module by attribute)."""

    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")

    def __init__(self, max_tokens, temperature, top_k, top_p, seed, ignore_eos):
        for name, v, low in (("max_tokens", max_tokens, 1), ("top_k", top_k, 0), ("seed", seed, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low or v >= 2**64:
                raise ValueError(f"kvforge: {name} must be an int ≥ {low}, not {v!r}")
        self.max_tokens, self.temperature, self.top_k = max_tokens, float(temperature), top_k
        self.top_p, self.seed, self.ignore_eos = float(top_p), seed, ignore_eos


class Engine:
    """A model, its tokenizer and a paged KV cache with kvforge's mechanisms.

    ``model``: a GGUF file or a Hugging Face directory (default: the
    SmolLM2 model setup fetched). ``mechanisms``: a mechanisms table as a
    dict (the TOML file's keys: ``prefix``, ``cold``, ``tier``,
    ``eviction``, ``share``, ``lifecycle``, ``budget_mib``,
    ``block_size``) or the path of a TOML file; absent, every mechanism is
    off. An eviction policy is
    named there (``"keydiff"``, or ``"module:Class"`` for one written in
    Python) or handed as an object with ``policy`` (a
    :class:`kvforge.EvictionPolicy`; it replaces the table's). A
    :class:`kvforge.TierPolicy` object given as ``tier_policy`` decides
    which hot blocks go to the cold tier in place of the table's ``cold``
    sink and window (the table must have a cold tier; the object replaces
    the table's ``tier``). ``random``:
    the dimensions of a random-weight model (``d_model``, ``layers``,
    ``heads``, ``kv_heads``, ``ffn``, ``max_ctx``) with ``model``'s
    tokenizer, for tests.

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
    ):
        path = Path(model) if model is not None else DEFAULT_MODEL
        if not path.exists():
            hint = "; run `cargo xtask setup`" if model is None else ""
            raise ValueError(f"kvforge: model {path} not found{hint}")
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
        report has the tokens, timings, reused prefix and KV bytes."""
        if isinstance(prompt, str):
            ids = self._native.chat_ids([("user", prompt)]) if chat else self.encode(prompt)
        else:
            ids = list(prompt)
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
        ids = self.encode(text) if isinstance(text, str) else list(text)
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
        seed: int = 0,
        report: bool = False,
    ):
        """The assistant's reply to ``message`` (``(text, report)`` with
        ``report``; the report's ``reused_tokens`` counts the session's
        cached tokens)."""
        n = self._engine._native
        if self._id is None:
            raise ValueError("kvforge: this session is closed")
        if self._turns == 0:
            msgs = [("system", self._system)] if self._system else []
            ids = n.chat_ids(msgs + [("user", message)])
        else:
            ids = n.user_turn_ids(self._closed_reply, message)
        s = _Sampling(max_tokens, temperature, 0, 1.0, seed, False)
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
