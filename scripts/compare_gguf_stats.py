"""Compares kvforge's dequantization of a GGUF file (the JSON lines of
`cargo run -p kvforge-engine --example gguf_stats`, on stdin) with the `gguf` package's
reference dequantizer, tensor by tensor. Exits non-zero on a mismatch.
Needs `cargo xtask setup --reference`.

    ./target/release/examples/gguf_stats FILE | .venv/bin/python scripts/compare_gguf_stats.py FILE
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

reader = GGUFReader(sys.argv[1])
ref = {t.name: t for t in reader.tensors}
bad, seen = 0, 0
for line in sys.stdin:
    k = json.loads(line)
    t = ref[k["name"]]
    x = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    seen += 1
    picks = [x[i * (x.size - 1) // 7] for i in range(8)] if x.size else []
    ok = (
        x.size == k["n"]
        and np.isclose(x.sum(), k["sum"], rtol=1e-5, atol=1e-3)
        and np.isclose((x * x).sum(), k["sumsq"], rtol=1e-5)
        and np.allclose(picks, k["picks"], rtol=1e-6, atol=1e-7)
    )
    if not ok:
        bad += 1
        print(f"mismatch: {k['name']} ({k['type']})")
print(f"{seen} tensors compared with the gguf reference, {bad} mismatches")
sys.exit(1 if bad or seen != len(ref) else 0)
