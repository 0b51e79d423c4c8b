"""Reference dequantization of GGML block formats by the `gguf` package.

Writes engine/tests/fixtures/kquants_reference.json: for each type, a few
random blocks (hex) and the f32 values `gguf.quants.dequantize` gives them.
The engine's dequantizers must reproduce them (test
`gguf_block_formats_match_the_gguf_reference`). Needs
`cargo xtask setup --reference` (gguf==0.17.1, numpy).

    .venv/bin/python scripts/kquants_reference.py
"""

import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

# type -> (blocks, byte offsets of f16 scale fields, offset of an f32 scale)
TYPES = {
    "Q4_0": (4, [0], None),
    "Q4_1": (4, [0, 2], None),
    "Q5_0": (4, [0], None),
    "Q5_1": (4, [0, 2], None),
    "Q8_0": (4, [0], None),
    "Q4_K": (2, [0, 2], None),
    "Q5_K": (2, [0, 2], None),
    "Q6_K": (2, [208], None),
}
# Q8_K is not here: gguf 0.17.1 has no dequantizer for it (it is llama.cpp's
# intermediate format for dot products); a unit test covers it.


def main() -> None:
    rng = np.random.default_rng(20261130)
    out = {}
    for name, (n, f16_at, f32_at) in TYPES.items():
        qtype = getattr(T, name)
        block, size = quants.GGML_QUANT_SIZES[qtype]
        raw = bytearray(rng.integers(0, 256, size * n, dtype=np.uint8).tobytes())
        for b in range(n):
            # Random bytes are fine for codes; scales must be finite.
            for at in f16_at:
                v = np.float16(rng.uniform(-0.05, 0.05))
                raw[b * size + at : b * size + at + 2] = v.tobytes()
            if f32_at is not None:
                v = np.float32(rng.uniform(-0.05, 0.05))
                raw[b * size + f32_at : b * size + f32_at + 4] = v.tobytes()
        data = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(n, size)
        values = quants.dequantize(data, qtype).astype(np.float32).reshape(-1)
        assert values.size == n * block and np.isfinite(values).all()
        out[name] = {
            "id": int(qtype),
            "hex": bytes(raw).hex(),
            "values": [float(v) for v in values],
        }
    path = pathlib.Path(__file__).resolve().parent.parent / "engine/tests/fixtures/kquants_reference.json"
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
