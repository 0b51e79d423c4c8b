"""kvforge from Python.

The engine (:class:`Engine`: generate, chat sessions, perplexity, stats,
with the mechanisms as a dict or a TOML file), policies written in Python
(:class:`EvictionPolicy`, :class:`TierPolicy`, checked by
:mod:`kvforge.testing`), the ablation
(:func:`ablate`), and kvforge's quantized KV tier (the Rust crate ``kvforge-quant``: INT8 / INT4 /
INT2 groups per token or per channel, Hadamard rotation, a sink and a hot
window kept in full precision) for numpy arrays, and as a Hugging Face
transformers cache (:mod:`kvforge.hf`)::

    import numpy as np, kvforge
    q = kvforge.Quantizer("int4", group=32, axis="token")
    x = np.random.default_rng(0).standard_normal((32, 3, 64), dtype=np.float32)
    y = kvforge.roundtrip(q, x)          # what the cache would read back
    block = q.quantize(x, *x.shape)      # block.nbytes: codes + f16 scales
"""

import numpy as np
import torch  # noqa: F401  (loads the libtorch the native module links: one libtorch per process)

from ._native import Block, ColdStore, Quantizer, __version__
from . import assets, testing
from .ablation import ablate
from .engine import DEFAULT_MODEL, Engine, Session
from .policy import EvictionPolicy, Pressure, Table, TierPolicy

__all__ = [
    "Block",
    "ColdStore",
    "DEFAULT_MODEL",
    "Engine",
    "EvictionPolicy",
    "Pressure",
    "Quantizer",
    "Session",
    "Table",
    "TierPolicy",
    "__version__",
    "ablate",
    "assets",
    "roundtrip",
    "testing",
]


def roundtrip(q: Quantizer, x: np.ndarray) -> np.ndarray:
    """``x`` (``tokens × heads × head_dim``) quantized by ``q`` and read back.

    Raises ``ValueError`` (the crate's one-line message) on a bad shape,
    dtype, group size, or a non-finite value.
    """
    x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"kvforge: x must be tokens × heads × head_dim, got shape {x.shape}")
    if x.dtype != np.float32:
        raise ValueError(f"kvforge: x must be float32, got {x.dtype}")
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    q.dequantize_into(q.quantize(x, *x.shape), out)
    return out
