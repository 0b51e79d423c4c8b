"""Type stubs of kvforge's native module (``python/src/``)."""

from typing import Any

__version__: str

class Block:
    """One quantized slab: packed codes and f16 group parameters."""

    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int, int]: ...

class Quantizer:
    """``Quantizer("int4", group=32, axis="token", rotate=False)``; formats
    ``int8`` / ``int4`` / ``int2``, axis ``token`` or ``channel`` (KIVI keys)."""

    def __init__(self, format: str, group: int = 32, axis: str = "token", rotate: bool = False) -> None: ...
    @property
    def name(self) -> str: ...
    def quantize(self, x: Any, tokens: int, heads: int, head_dim: int) -> Block:
        """``x``: a C-contiguous float32 buffer of ``tokens × heads × head_dim``."""
    def dequantize_into(self, block: Block, out: Any) -> None:
        """``out``: a writable C-contiguous float32 buffer of the block's size."""

class ColdStore:
    """One layer's cold tier: whole blocks past the sink, older than the
    hot window, keys (``keys`` axis) and values (per token), in order.

    One thread at a time: a call that overlaps another thread's on the
    same store raises ``RuntimeError: Already borrowed`` and changes
    nothing (give each thread its own store, or hold a lock)."""

    def __init__(
        self,
        format: str,
        window: int = 128,
        sink: int = 32,
        block: int = 32,
        group: int = 32,
        keys: str = "channel",
        rotate: bool = False,
    ) -> None: ...
    @property
    def block(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def names(self) -> tuple[str, str]: ...
    def cold_blocks(self, positions: int) -> int: ...
    def append(self, k: Any, v: Any, heads: int, head_dim: int) -> None: ...
    def dequantize_into(self, k_out: Any, v_out: Any) -> None: ...
    def truncate(self, blocks: int) -> None: ...
    def clear(self) -> None: ...

class Engine:
    """The engine (``kvforge.Engine`` wraps it): a model, its tokenizer and
    the paged KV cache with kvforge's mechanisms."""

    def __init__(
        self,
        model: str,
        *,
        mechanisms_json: str | None = None,
        mechanisms_path: str | None = None,
        policy: Any = None,
        tier_policy: Any = None,
        random: tuple[int, int, int, int, int, int] | None = None,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "f32",
        kv_dtype: str = "f16",
        block_size: int = 16,
        kv_tokens: int = 0,
    ) -> None: ...
    def encode(self, text: str, special: bool = False) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat_ids(self, messages: list[tuple[str, str]]) -> list[int]: ...
    def user_turn_ids(self, closed: bool, msg: str) -> list[int]: ...
    def complete(self, ids: list[int], sampling: Any) -> tuple[str, dict[str, Any]]: ...
    def open_session(self) -> int: ...
    def turn(self, id: int, ids: list[int], sampling: Any) -> tuple[str, dict[str, Any]]: ...
    def close_session(self, id: int) -> None: ...
    def ppl(
        self, ids: list[int], prefix: int, chunk: int, decode: int = 0, window: int | None = None
    ) -> dict[str, Any]: ...
    def metrics_json(self) -> str: ...
    def blocks_in_use(self) -> list[int]: ...

def ablate(
    config: str, out: str | None = None, resume: bool = False, progress: bool = False, root: str | None = None
) -> tuple[str, int, int]:
    """Runs an experiment file; ``(output folder, items measured, items failed)``."""

def check_eviction_policy(policy: Any, block_size: int = 16) -> None:
    """The Rust eviction conformance suite on a Python policy."""

def check_tier_policy(policy: Any, block_size: int = 16) -> None:
    """The Rust tier-policy conformance suite on a Python policy."""
