"""Eviction policies written in Python.

Subclass :class:`EvictionPolicy` and the engine (``kvforge.Engine(...,
policy=obj)``), a mechanisms table (``eviction = { policy =
"module:Class", ... }``) and ``cargo xtask ablate`` run it in place of a
Rust policy. It sees what the Rust trait ``kvforge_evict::EvictionPolicy``
sees: the sequence's block table (:class:`Table`, numpy arrays), the
pressure on the byte budget (:class:`Pressure`), and, when it asks for
them, the attention mass or the key novelty of each entry after every step.

It answers which entries to drop. The coordinator checks the answer (an
entry that does not exist or is already dropped fails the step); a
``victims`` that raises, or answers anything but a sequence of ints, fails
the step with the exception's words; an ``observe`` / ``observe_keys`` that
raises fails the sequence's next step (or, when the sequence ends first,
goes to ``sys.unraisablehook``, as a raising ``forget`` does). Either way
the cache is left as it was. A policy must not call the engine from its
methods.

A page-level policy only: per-head and token-level eviction stay Rust's.
:class:`TierPolicy` is the other policy a Python object can be: which hot
blocks go to the quantized cold tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOT, COLD, ALIAS, DROPPED = 0, 1, 2, 3
"""Values of :attr:`Table.tier`."""


@dataclass(frozen=True)
class Pressure:
    """What the coordinator tells a policy before a step."""

    used: float
    """Fraction of the byte budget in use, all tiers, in ``[0, 1]``."""
    new_tokens: int
    """Tokens the coming step adds."""
    budget_bytes: int
    """The byte budget of all tiers (0 when unknown)."""
    hot_block_bytes: int
    """Bytes one hot block holds."""
    cold_block_bytes: int
    """Bytes one cold block holds (0 without a cold tier)."""


@dataclass(frozen=True)
class Table:
    """One sequence's block table: entry ``i`` holds the positions
    ``first[i] .. first[i] + tokens[i]`` in one block of its ``tier``.

    The arrays are read-only views of what the coordinator holds; they are
    valid for the call that receives them.
    """

    first: np.ndarray
    """``uint64``: the first position of each entry."""
    tokens: np.ndarray
    """``uint32``: the positions each entry spans."""
    tier: np.ndarray
    """``uint8``: :data:`HOT`, :data:`COLD`, :data:`ALIAS` (a copy shared
    with another block) or :data:`DROPPED`."""
    positions: int
    """Positions the sequence holds (dropped ones included)."""
    block_size: int
    """Tokens per block."""
    open: bool
    """Whether the last entry is still being written (never a victim)."""
    live_tokens: int
    """Tokens in entries that are not dropped."""
    holes: np.ndarray | None = None
    """``uint64``: the rows of each entry that token-level eviction marked
    invalid, bit ``r`` for row ``r`` (zeros when not given)."""

    def __post_init__(self):
        if self.holes is None:
            object.__setattr__(self, "holes", np.zeros(len(self.first), dtype=np.uint64))

    @property
    def end(self) -> np.ndarray:
        """``uint64``: one past the last position of each entry."""
        return self.first + self.tokens

    @property
    def live(self) -> np.ndarray:
        """``bool``: entries that are not dropped."""
        return self.tier != DROPPED

    def __len__(self) -> int:
        return len(self.first)

    @classmethod
    def _from_native(cls, first, tokens, tier, positions, block_size, open_, live_tokens, holes):
        return cls(
            np.frombuffer(first, dtype="<u8"),
            np.frombuffer(tokens, dtype="<u4"),
            np.frombuffer(tier, dtype=np.uint8),
            positions,
            block_size,
            open_,
            live_tokens,
            np.frombuffer(holes, dtype="<u8"),
        )


def _floats(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4")


class EvictionPolicy:
    """Names entries of a block table to drop.

    Override :meth:`victims`; set :attr:`wants_attention` or
    :attr:`wants_keys` to receive :meth:`observe` or :meth:`observe_keys`
    after every step. The contract is the Rust trait's (checked by
    :func:`kvforge.testing.check_eviction_policy`): the indexes ascend,
    exist, name live entries, never the open last entry nor the entry
    holding the newest position; once dropped, asking again with the same
    table does not name them again.

    Built from a mechanisms table by ``"module:Class"``, the class is
    called with the table's other keys as keyword arguments each time the
    engine builds the policy: to check the table, then once per cache it
    configures (a few times per engine; a policy keeps per-sequence
    state, keyed by ``seq``, and nothing across objects).
    """

    wants_attention: bool = False
    """Whether :meth:`observe` wants each entry's attention mass."""
    observation_window: int = 0
    """With :attr:`wants_attention`: how many of a step's last queries the
    mass comes from (0: all)."""
    wants_keys: bool = False
    """Whether :meth:`observe_keys` wants each entry's key novelty."""

    @property
    def name(self) -> str:
        """A short name for reports (the class name unless overridden)."""
        return type(self).__name__

    def observe(self, seq: int, table: Table, mass: np.ndarray) -> None:
        """Entry ``i`` received ``mass[i]`` of the last step's attention
        (summed over heads and queries; 0 for dropped entries)."""

    def observe_keys(self, seq: int, table: Table, novelty: np.ndarray) -> None:
        """Entry ``i``'s keys stood ``novelty[i]`` from the mean key in the
        last step (``1 − cos(key, mean key)``, averaged over its keys,
        heads and layers; 0 for dropped entries)."""

    def victims(self, seq: int, table: Table, pressure: Pressure):
        """The entries of ``table`` to drop before the next step: a list (or
        1-D integer array) of indexes, ascending; empty for none."""
        raise NotImplementedError(f"{type(self).__name__}.victims")

    def forget(self, seq: int) -> None:
        """The sequence ended: forget its state."""


class TierPolicy:
    """Names the hot entries of a block table that go to the quantized cold
    tier before the next step (the engine needs a cold tier: ``cold`` in its
    mechanisms; this object replaces that table's sink-and-window plan).

    Override :meth:`demote`. The contract is the Rust trait's
    ``kvforge_quant::TierPolicy`` (checked by
    :func:`kvforge.testing.check_tier_policy`): the indexes ascend, exist
    and name hot, full entries without holes, never the open last entry;
    once they are cold, asking again with the same table does not name
    them. The coordinator checks each answer: one it cannot take, or a
    ``demote`` that raises, fails the step with the cache left as it was.
    A tier policy sees only the table (no attention signals) and keeps no
    state per sequence.
    """

    @property
    def name(self) -> str:
        """A short name for reports (the class name unless overridden)."""
        return type(self).__name__

    def demote(self, table: Table):
        """The entries of ``table`` to quantize now: a list (or 1-D integer
        array) of indexes, ascending; empty for none."""
        raise NotImplementedError(f"{type(self).__name__}.demote")
