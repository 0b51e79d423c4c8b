"""kvforge's quantized cold tier as a Hugging Face transformers cache.

::

    from transformers import AutoModelForCausalLM
    import kvforge.hf

    cache = kvforge.hf.QuantizedCache(model.config, format="int4", window=128, sink=32)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    cache.nbytes()   # {'hot': …, 'cold': …, 'f16': …}

Each layer keeps its first ``sink`` tokens and its newest ``window`` tokens
in the model's dtype; every whole block of ``block`` tokens in between is
quantized by the Rust crate ``kvforge-quant`` (the same formats, group
layout and numerics as kvforge's engine: keys per channel, KIVI's layout,
or per token; values per token; optional Hadamard rotation) and its
full-precision copy dropped. The rule is the engine's ``TierPlan``: a
block goes cold once it ends ``window`` tokens before the newest token.
A step attends to every token it writes in full precision; blocks that
leave the window are quantized after the step, and read back
(dequantized) by the next one.

One sequence per cache (batch 1), on the CPU: the cold tier is Rust code
on host memory; keys and values of one head dim (not MLA's). Legacy tuple
access (``cache[i]``) gives a layer's newest (hot) tokens only. Written
against transformers 4.57's cache-layer API.
"""

from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ._native import ColdStore

__all__ = ["QuantizedCache", "QuantizedLayer"]


class QuantizedLayer(CacheLayerMixin):
    """One layer: sink and hot window in the model's dtype, the blocks in
    between in a :class:`kvforge.ColdStore`."""

    is_sliding = False

    def __init__(self, format: str = "int4", window: int = 128, sink: int = 32, block: int = 32,
                 group: int = 32, keys: str = "channel", rotate: bool = False):
        super().__init__()
        # Checks every parameter now (ValueError with the crate's message).
        self.settings = (format, window, sink, block, group, keys, rotate)
        self.store = ColdStore(*self.settings)
        self.sink, self.block = sink, block
        self.length = 0
        self.sink_keys: Optional[torch.Tensor] = None
        self.sink_values: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor):
        if key_states.dim() != 4:
            raise ValueError(
                f"kvforge.hf: a QuantizedCache holds batch × heads × tokens × head_dim; got shape {tuple(key_states.shape)}"
            )
        if key_states.shape[0] != 1:
            # What generate(num_beams=2) or num_return_sequences=2 looks
            # like on arrival: the batch is expanded before any reorder.
            raise NotImplementedError(
                f"kvforge.hf: a QuantizedCache holds one sequence (batch 1), so batches, beam search and "
                f"num_return_sequences > 1 are not supported; got shape {tuple(key_states.shape)}"
            )
        if key_states.device.type != "cpu":
            raise ValueError(f"kvforge.hf: the cold tier runs on the CPU; got a tensor on {key_states.device}")
        # What only the model's shape can tell (a group that does not divide
        # the head dim, a rotation of one that is not a power of two) fails
        # here, on a block of zeros, not a window later.
        heads, dim = key_states.shape[1], key_states.shape[3]
        zeros = torch.zeros((self.block, heads, dim)).numpy()
        ColdStore(*self.settings).append(zeros, zeros, heads, dim)
        self.dtype, self.device = key_states.dtype, key_states.device
        empty = key_states[..., :0, :].clone()
        self.sink_keys, self.sink_values = empty, empty.clone()
        self.keys, self.values = empty.clone(), empty.clone()
        self.is_initialized = True

    def _check(self, k: torch.Tensor, v: torch.Tensor):
        want = (1, self.keys.shape[1], self.keys.shape[3])
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want:
                raise ValueError(
                    f"kvforge.hf: {name} of shape {tuple(t.shape)} do not extend a cache of "
                    f"(1, {want[1]}, tokens, {want[2]})"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"kvforge.hf: {name} are {t.dtype}, the cache holds {self.dtype}")
            # Refused on arrival: a NaN kept in the hot window would fail
            # every later step when its block is quantized.
            if not torch.isfinite(t).all():
                raise ValueError(f"kvforge.hf: the new {name} hold a non-finite value; refusing them")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"kvforge.hf: {k.shape[2]} new keys but {v.shape[2]} new values")

    def _cold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cold tier dequantized, ``(1, heads, tokens, head_dim)``."""
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        n = self.store.tokens
        k = torch.empty((n, heads, dim), dtype=torch.float32)
        v = torch.empty((n, heads, dim), dtype=torch.float32)
        if n:
            self.store.dequantize_into(k.numpy(), v.numpy())
        as_layer = lambda t: t.permute(1, 0, 2).unsqueeze(0).to(self.dtype)  # noqa: E731
        return as_layer(k), as_layer(v)

    def _demote(self):
        """Quantizes the blocks that left the hot window (all or none of a
        block's keys and values; a failure leaves the layer as it was)."""
        n = self.store.cold_blocks(self.length) - self.store.blocks
        b, heads, dim = self.block, self.keys.shape[1], self.keys.shape[3]
        for _ in range(n):
            piece = lambda t: t[0, :, :b, :].detach().transpose(0, 1).to(torch.float32).contiguous()  # noqa: E731
            self.store.append(piece(self.keys).numpy(), piece(self.values).numpy(), heads, dim)
            # Each block leaves the hot part as it is stored, so that an
            # error on the next one still holds every token exactly once.
            self.keys, self.values = self.keys[..., b:, :], self.values[..., b:, :]
        if n > 0:
            self.keys, self.values = self.keys.contiguous(), self.values.contiguous()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self._check(key_states, value_states)
        before = (self.sink_keys, self.sink_values, self.keys, self.values, self.length, self.store.blocks)
        try:
            return self._update(key_states, value_states)
        except BaseException:
            # A failed step (a non-finite value the quantizer refuses, an
            # interrupt) leaves the layer as it was before it.
            self.sink_keys, self.sink_values, self.keys, self.values, self.length, blocks = before
            self.store.truncate(blocks)
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        room = max(self.sink - self.sink_keys.shape[2], 0)
        self.sink_keys = torch.cat([self.sink_keys, key_states[..., :room, :]], dim=-2)
        self.sink_values = torch.cat([self.sink_values, value_states[..., :room, :]], dim=-2)
        self.keys = torch.cat([self.keys, key_states[..., room:, :]], dim=-2)
        self.values = torch.cat([self.values, value_states[..., room:, :]], dim=-2)
        self.length += key_states.shape[2]
        cold_k, cold_v = self._cold()
        keys = torch.cat([self.sink_keys, cold_k, self.keys], dim=-2)
        values = torch.cat([self.sink_values, cold_v, self.values], dim=-2)
        self._demote()
        return keys, values

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.clear()
        self.length = 0
        if self.is_initialized:
            empty = self.keys[..., :0, :]
            self.sink_keys, self.sink_values = empty.clone(), empty.clone()
            self.keys, self.values = empty.clone(), empty.clone()

    def nbytes(self) -> dict:
        """Bytes held: ``hot`` (sink and window, in the model's dtype),
        ``cold`` (codes and group parameters), and ``f16``, what the same
        tokens take in a full f16 cache."""
        if not self.is_initialized:
            return {"hot": 0, "cold": 0, "f16": 0}
        hot = sum(t.numel() * t.element_size() for t in (self.sink_keys, self.sink_values, self.keys, self.values))
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        return {"hot": hot, "cold": self.store.nbytes, "f16": 2 * 2 * self.length * heads * dim}

    def _refuse(self, what: str):
        raise NotImplementedError(f"kvforge.hf: a QuantizedCache does not support {what}")

    def crop(self, max_length: int) -> None:
        self._refuse("crop (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse("more than one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("batch selection")


class QuantizedCache(Cache):
    """A transformers cache whose older tokens live in kvforge's quantized
    tier: ``QuantizedCache(model.config, format="int4", window=128, sink=32,
    block=32, group=32, keys="channel", rotate=False)``.

    ``format``: ``int8``, ``int4`` or ``int2``; ``window`` and ``sink`` are
    whole blocks of ``block`` tokens; ``keys``: ``channel`` (KIVI) or
    ``token``; ``group``: elements per group (along the tokens of a block
    for per-channel keys, along the head dim otherwise). Bad values raise
    ``ValueError`` here; a group or rotation the model's head dim does not
    fit raises at the first step, before anything is cached.
    """

    def __init__(self, config=None, *, num_layers: Optional[int] = None, format: str = "int4",
                 window: int = 128, sink: int = 32, block: int = 32, group: int = 32,
                 keys: str = "channel", rotate: bool = False):
        if num_layers is None:
            if config is None:
                raise ValueError("kvforge.hf: give the model's config or num_layers")
            num_layers = config.get_text_config(decoder=True).num_hidden_layers
        layers = [QuantizedLayer(format, window, sink, block, group, keys, rotate) for _ in range(num_layers)]
        super().__init__(layers=layers)

    def nbytes(self) -> dict:
        """Bytes held by every layer together (see :meth:`QuantizedLayer.nbytes`)."""
        total = {"hot": 0, "cold": 0, "f16": 0}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                total[k] += v
        return total
