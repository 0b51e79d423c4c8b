"""A kvforge eviction policy as an NVIDIA kvpress press.

:class:`PolicyPress` runs a policy written for kvforge (a
:class:`kvforge.EvictionPolicy`, e.g. :class:`kvforge.examples.keydiff.KeyDiff`)
inside kvpress's pipeline, so kvpress users can set it beside their presses
in their own harness::

    from kvforge.kvpress import PolicyPress
    from kvforge.examples.keydiff import KeyDiff

    press = PolicyPress(lambda budget: KeyDiff(budget_tokens=budget, sink=32, window=256),
                        compression_ratio=0.5)
    with press(model):
        model.model(input_ids=context, past_key_values=cache)

After each layer's prefill, the press lays the layer's tokens out as
kvforge does — blocks of ``block_size`` tokens, the last one open when it is
partial — builds the policy for a budget of ``(1 − compression_ratio)`` of
the tokens, gives it each block's key novelty (``1 − cos(key, mean key)``,
averaged over the block's tokens and the layer's KV heads) when it wants
keys, asks for victims, and removes those blocks' tokens from every head of
the layer. kvforge's engine averages novelty over the layers too and drops
the same entries in every layer. A press sees one layer at a time, so by
default each layer chooses its own (the policy keeps each layer's state
under its own ``seq``, the layer index), as kvpress's presses do. With
``across_layers=True`` the press does what kvforge's engine does: it sums
each block's novelty over the layers and, at the last layer's hook, asks the
policy once and drops the same blocks from every layer (the prefill's
hidden states never depend on the cache being compressed, so waiting for
the last layer changes nothing else; a model with sliding-window layers,
which kvpress does not hook, is refused). Page level: whole blocks go, as in
kvforge's page-level eviction; kvpress's presses drop single tokens per
head.

Needs kvpress (``cargo xtask setup --reference`` installs 0.5.5). A policy
that wants attention mass is refused (kvpress computes attention weights
only under eager attention); a policy's bad answer raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

try:
    from kvpress import BasePress
    from transformers import QuantizedCache
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"kvforge.kvpress needs kvpress ({e}); run `cargo xtask setup --reference`") from e

from .policy import HOT, EvictionPolicy, Pressure, Table


def layout(n: int, block_size: int) -> Table:
    """``n`` prefilled tokens as kvforge's block table: full hot blocks, the
    last one open when it is partial."""
    first = np.arange(0, n, block_size, dtype=np.uint64)
    tokens = np.minimum(block_size, n - first.astype(np.int64)).astype(np.uint32)
    tier = np.full(len(first), HOT, dtype=np.uint8)
    return Table(first, tokens, tier, n, block_size, n % block_size != 0, n)


def block_novelty(keys: torch.Tensor, block_size: int) -> np.ndarray:
    """Each block's ``1 − cos(key, mean key)`` of one layer's ``keys``
    (``1 × kv_heads × n × head_dim``), averaged over its tokens and heads."""
    k = keys[0].float()
    cos = torch.nn.functional.cosine_similarity(k, k.mean(dim=1, keepdim=True), dim=-1)
    per_token = (1.0 - cos).mean(dim=0)  # n
    n = per_token.shape[0]
    pad = (-n) % block_size
    padded = torch.nn.functional.pad(per_token, (0, pad))
    counts = torch.full((padded.shape[0] // block_size,), float(block_size))
    counts[-1] = block_size - pad
    sums = padded.view(-1, block_size).sum(dim=1)
    return (sums / counts).numpy().astype(np.float32)


@dataclass
class PolicyPress(BasePress):
    """A kvforge eviction policy as a kvpress press.

    ``policy(budget_tokens)`` builds the policy for a layer's budget: the
    tokens it may keep, ``(1 − compression_ratio)`` of the prefilled ones.
    ``across_layers``: one choice for all layers from their summed novelty,
    as kvforge's engine makes it, instead of one per layer.
    """

    policy: Callable[[int], EvictionPolicy]
    compression_ratio: float = 0.0
    block_size: int = 16
    across_layers: bool = False
    _novelty: list = field(default_factory=list, init=False, repr=False)
    _layers: int | None = field(default=None, init=False, repr=False)

    def post_init_from_model(self, model):
        # The layers kvpress hooks (it skips Gemma3's sliding-window ones):
        # across layers, the choice is made at the last and applies to all.
        lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
        sliding = [getattr(layer.self_attn, "is_sliding", False) for layer in lm.layers]
        if self.across_layers and any(sliding):
            raise ValueError("PolicyPress(across_layers=True) needs every layer full-attention (this model has sliding-window layers)")
        self._layers = len(lm.layers)
        self._novelty = []

    def __post_init__(self):
        if not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1), not {self.compression_ratio}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {self.block_size}")

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0.0:
            return keys, values
        if keys.shape[0] != 1:
            raise ValueError("PolicyPress compresses one sequence at a time (batch 1)")
        if self.across_layers and self._layers is None:
            raise ValueError("PolicyPress(across_layers=True) runs as `with press(model):`")
        n = keys.shape[2]
        layer = int(getattr(module, "layer_idx", 0))
        policy = self.policy(int(n * (1.0 - self.compression_ratio)))
        if policy.wants_attention:
            raise ValueError(f"{policy.name} wants attention mass, which PolicyPress does not compute")
        if not self.across_layers:
            keep = self._keep(policy, layer, n, block_novelty(keys, self.block_size))
            return keys[:, :, keep].contiguous(), values[:, :, keep].contiguous()
        cache = kwargs["past_key_values"]
        if isinstance(cache, QuantizedCache):
            raise ValueError("PolicyPress(across_layers=True) needs an unquantized cache")
        if layer == 0:
            self._novelty = []
        if len(self._novelty) != layer or any(c.keys.shape[2] != n for c in cache.layers[:layer]):
            self._novelty = []
            raise ValueError(f"PolicyPress(across_layers=True): layer {layer} came without every layer before it, at {n} tokens")
        self._novelty.append(block_novelty(keys, self.block_size))
        if layer + 1 < self._layers:
            return keys, values
        novelty, self._novelty = np.sum(self._novelty, axis=0), []
        keep = self._keep(policy, 0, n, novelty)
        for other in cache.layers[:layer]:
            other.keys = other.keys[:, :, keep].contiguous()
            other.values = other.values[:, :, keep].contiguous()
        return keys[:, :, keep].contiguous(), values[:, :, keep].contiguous()

    def _keep(self, policy: EvictionPolicy, seq: int, n: int, novelty: np.ndarray) -> torch.Tensor:
        """The token mask of what ``policy`` keeps of ``n`` tokens in blocks."""
        table = layout(n, self.block_size)
        if policy.wants_keys:
            policy.observe_keys(seq, table, novelty)
        victims = policy.victims(seq, table, Pressure(1.0, 0, 0, 0, 0))
        policy.forget(seq)
        victims = np.asarray(victims, dtype=np.int64).reshape(-1)
        if len(victims) and (victims.min() < 0 or victims.max() >= len(table) or np.any(np.diff(victims) <= 0)):
            raise ValueError(f"{policy.name} named entries {victims.tolist()} of {len(table)}")
        keep = torch.ones(n, dtype=torch.bool)
        for i in victims.tolist():
            start = i * self.block_size
            keep[start : start + int(table.tokens[i])] = False
        return keep
