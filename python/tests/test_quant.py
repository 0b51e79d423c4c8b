"""kvforge's quantizer and cold store from Python: the crate's numerics,
sizes, and a one-line ValueError for every bad input."""

import numpy as np
import pytest

import kvforge


def slab(tokens=32, heads=3, dim=64, seed=0):
    return np.random.default_rng(seed).standard_normal((tokens, heads, dim), dtype=np.float32)


def test_imports_and_version():
    assert kvforge.__version__.count(".") == 2
    assert kvforge.Quantizer("int4").name.startswith("int4")


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_roundtrip_error_shrinks_with_bits(axis):
    x = slab()
    errs = []
    for fmt, bound in [("int8", 0.02), ("int4", 0.35), ("int2", 1.6)]:
        y = kvforge.roundtrip(kvforge.Quantizer(fmt, group=32, axis=axis), x)
        assert y.shape == x.shape and y.dtype == np.float32
        err = np.abs(y - x).max()
        # The crate bounds every element by half its group's scale: for a
        # standard normal slab, about range / (2 · levels).
        assert 0 < err < bound, (fmt, err)
        errs.append(np.abs(y - x).mean())
    assert errs[0] < errs[1] / 8 < errs[2] / 8, errs


def test_rotation_is_undone_on_dequantize():
    x = slab(seed=1)
    x[:, :, 5] *= 40  # an outlier channel, what the rotation spreads
    plain = np.abs(kvforge.roundtrip(kvforge.Quantizer("int4"), x) - x).mean()
    rotated = np.abs(kvforge.roundtrip(kvforge.Quantizer("int4", rotate=True), x) - x).mean()
    assert rotated < plain


def test_block_bytes_are_codes_plus_f16_group_parameters():
    x = slab()
    b = kvforge.Quantizer("int4", group=32).quantize(x, *x.shape)
    groups = 32 * 3 * 64 // 32
    assert b.nbytes == 32 * 3 * 64 // 2 + groups * 2 * 2  # codes, scale + minimum
    b8 = kvforge.Quantizer("int8", group=32).quantize(x, *x.shape)
    assert b8.nbytes == 32 * 3 * 64 + groups * 2  # symmetric: a scale only
    assert b.shape == (32, 3, 64)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: kvforge.Quantizer("int3"), "unknown format"),
        (lambda: kvforge.Quantizer("int4", axis="row"), "unknown group axis"),
        (lambda: kvforge.Quantizer("int4", group=0), "group size"),
        (lambda: kvforge.ColdStore("int4", window=100), "quant:"),
        (lambda: kvforge.ColdStore("int4", keys="nope"), "unknown group axis"),
    ],
)
def test_bad_settings_are_one_line_value_errors(make, needle):
    with pytest.raises(ValueError) as e:
        make()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_arrays_are_one_line_value_errors():
    q = kvforge.Quantizer("int4", group=32)
    x = slab()
    cases = [
        (lambda: q.quantize(x.astype(np.float64), *x.shape), "float32"),
        (lambda: q.quantize(x, 16, 3, 64), "elements"),
        (lambda: q.quantize(np.asfortranarray(x), *x.shape), "C-contiguous"),
        (lambda: q.quantize(x, 0, 3, 64), "empty"),
        (lambda: kvforge.roundtrip(q, x[0]), "tokens × heads × head_dim"),
        (lambda: kvforge.Quantizer("int4", group=48).quantize(x, *x.shape), "group size"),
    ]
    bad = x.copy()
    bad[3, 1, 7] = np.nan
    cases.append((lambda: q.quantize(bad, *x.shape), "non-finite"))
    out = np.empty_like(x)
    out.setflags(write=False)
    cases.append((lambda: q.dequantize_into(q.quantize(x, *x.shape), out), "read-only"))
    cases.append((lambda: q.dequantize_into(q.quantize(x, *x.shape), np.empty(5, np.float32)), "elements"))
    # A transposed slab of the right size, a block read by another
    # quantizer, an output of the wrong dtype or layout.
    cases.append((lambda: q.quantize(x, 64, 3, 32), "has shape"))
    b = q.quantize(x, *x.shape)
    cases.append((lambda: kvforge.Quantizer("int4", rotate=True).dequantize_into(b, np.empty_like(x)), "quantized by"))
    cases.append((lambda: q.dequantize_into(b, np.empty(x.shape, np.float64)), "float32"))
    cases.append((lambda: q.dequantize_into(b, np.empty((64, 3, 32), np.float32).transpose(1, 0, 2)), "C-contiguous"))
    for call, needle in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cold_store_keeps_blocks_in_order_and_a_failed_append_adds_nothing():
    s = kvforge.ColdStore("int8", window=32, sink=32, block=32, group=32, keys="channel")
    assert s.cold_blocks(96) == 1 and s.cold_blocks(95) == 0 and s.block == 32
    blocks = [slab(seed=i) for i in range(3)]
    for b in blocks:
        s.append(b, -b, 3, 64)
    assert (s.blocks, s.tokens) == (3, 96)
    k, v = np.empty((96, 3, 64), np.float32), np.empty((96, 3, 64), np.float32)
    s.dequantize_into(k, v)
    want = np.concatenate(blocks)
    assert np.abs(k - want).max() < 0.02 and np.abs(v + want).max() < 0.02
    with pytest.raises(ValueError, match="overlap"):
        s.dequantize_into(k, k)
    with pytest.raises(ValueError, match="elements"):
        s.dequantize_into(k[:64], v)
    nbytes = s.nbytes
    bad = blocks[0].copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        s.append(blocks[0], bad, 3, 64)
    with pytest.raises(ValueError, match="heads"):
        s.append(slab(heads=2), slab(heads=2), 2, 64)
    with pytest.raises(ValueError, match="elements"):
        s.append(blocks[0][:16], blocks[0][:16], 3, 64)
    assert (s.blocks, s.nbytes) == (3, nbytes)
    s.truncate(1)
    assert s.tokens == 32
    s.clear()
    assert (s.blocks, s.nbytes) == (0, 0)
    empty = np.empty((0, 3, 64), np.float32)
    s.dequantize_into(empty, empty.copy())
    with pytest.raises(ValueError, match="holds none"):
        s.dequantize_into(k, v)
    with pytest.raises(ValueError, match="quant:"):
        kvforge.ColdStore("int4", window=32, sink=16, block=32)
