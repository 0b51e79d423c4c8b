"""KeyDiff (Park et al.; NVIDIA kvpress's ``KeyDiffPress``) in numpy: when
the live tokens would pass ``budget_tokens``, drop the entries whose keys
stand closest to the mean key, outside the first ``sink`` and the newest
``window`` positions. The same rule, ties and signal as kvforge's Rust
``keydiff`` (page level, token budget), so both drop the same entries.
"""

import numpy as np

from kvforge.policy import EvictionPolicy


class KeyDiff(EvictionPolicy):
    wants_keys = True

    def __init__(self, budget_tokens: int, sink: int = 0, window: int = 1):
        if sink < 0 or window < 1:
            raise ValueError("the sink must be ≥ 0 tokens and the recent window keep at least one")
        if budget_tokens <= sink + window:
            raise ValueError(f"a budget of {budget_tokens} tokens leaves nothing beyond sink + window")
        self.budget, self.sink, self.window = budget_tokens, sink, window
        self.novelty = {}  # seq -> {first position: novelty}

    def observe_keys(self, seq, table, novelty):
        seen = self.novelty.setdefault(seq, {})
        for first, live, n in zip(table.first.tolist(), table.live, novelty.tolist()):
            if live:
                seen[first] = n if np.isfinite(n) else 0.0
            else:
                seen.pop(first, None)

    def victims(self, seq, table, pressure):
        need = table.live_tokens + pressure.new_tokens - self.budget
        if need <= 0:
            return []
        recent = max(table.positions - self.window, 0)
        ok = table.live & (table.first >= self.sink) & (table.end <= recent)
        if table.open and len(table):
            ok[-1] = False
        idx = np.flatnonzero(ok)
        seen = self.novelty.get(seq, {})
        nov = np.array([seen.get(int(table.first[i]), 0.0) for i in idx], dtype=np.float32)
        order = idx[np.lexsort((idx, nov))]  # least novel first, the older on a tie
        enough = np.searchsorted(np.cumsum(table.tokens[order]), need) + 1
        return sorted(order[:enough].tolist())

    def forget(self, seq):
        self.novelty.pop(seq, None)
