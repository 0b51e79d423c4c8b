"""Tier policies in Python: which hot blocks go to the quantized cold tier.

:class:`SinkWindow` is kvforge's own plan (``kvforge_quant::TierPlan``, the
``cold`` table's ``sink`` and ``window``) in numpy: the first ``sink`` and
the newest ``window`` positions stay hot, every other full block goes cold.
:class:`Every` keeps the newest ``window`` hot but quantizes only every
``stride``-th older block — a researcher's variation (most of the old
context stays in full precision, at more bytes).
"""

import numpy as np

from kvforge.policy import HOT, TierPolicy


def _demotable(table, sink: int, window: int) -> np.ndarray:
    """Hot, full entries without holes outside the sink and the window
    (never the open last one)."""
    ok = (table.tier == HOT) & (table.tokens == table.block_size) & (table.holes == 0)
    ok &= (table.first >= sink) & (table.end + window <= table.positions)
    if table.open and len(table):
        ok[-1] = False
    return ok


class SinkWindow(TierPolicy):
    def __init__(self, window: int, sink: int = 0):
        if window < 0 or sink < 0:
            raise ValueError("window and sink are token counts (≥ 0)")
        self.window, self.sink = window, sink

    def demote(self, table):
        return np.flatnonzero(_demotable(table, self.sink, self.window))


class Every(TierPolicy):
    def __init__(self, window: int, stride: int = 2):
        if window < 0 or stride < 1:
            raise ValueError("window ≥ 0 tokens, stride ≥ 1 blocks")
        self.window, self.stride = window, stride

    def demote(self, table):
        ok = _demotable(table, 0, self.window)
        ok &= (table.first // table.block_size) % self.stride == 0
        return np.flatnonzero(ok)
