"""kvforge.hf.QuantizedCache inside transformers: on a tiny random LLaMA
(every behaviour) and on SmolLM2-135M (the real model, a perplexity bound)."""

import os

import numpy as np
import pytest
import torch

# CI sets KVFORGE_REQUIRE_ALL: a missing package or model fails there
# instead of skipping.
REQUIRE = bool(os.environ.get("KVFORGE_REQUIRE_ALL"))
transformers = __import__("transformers") if REQUIRE else pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvforge.hf  # noqa: E402
from conftest import within  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def chunked_logits(model, ids, cache, chunk=48):
    """Teacher-forced logits of ``ids`` fed in chunks through ``cache``."""
    out = []
    with torch.no_grad():
        for i in range(0, ids.shape[1], chunk):
            r = model(ids[:, i:i + chunk], past_key_values=cache, use_cache=True)
            out.append(r.logits)
    return torch.cat(out, dim=1)


def ids(n, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (1, n)))


@pytest.mark.numerics
def test_a_window_covering_the_sequence_is_the_full_cache(tiny):
    x = ids(200)
    full = chunked_logits(tiny, x, DynamicCache())
    cache = kvforge.hf.QuantizedCache(tiny.config, format="int4", window=224, sink=32)
    ours = chunked_logits(tiny, x, cache)
    assert cache.nbytes()["cold"] == 0
    diff = (ours - full).abs().max().item()
    assert within("no block cold", diff, 1e-5), diff


@pytest.mark.numerics
@pytest.mark.parametrize("fmt,tol", [("int8", 0.005), ("int4", 0.05), ("int2", 0.25)])
def test_quantized_logits_stay_close_and_the_cold_tier_holds_the_old_blocks(tiny, fmt, tol):
    x = ids(300, seed=1)
    full = chunked_logits(tiny, x, DynamicCache())
    cache = kvforge.hf.QuantizedCache(tiny.config, format=fmt, window=64, sink=32)
    ours = chunked_logits(tiny, x, cache)
    diff = (ours - full).abs().max().item()
    assert 0 < diff and within(fmt, diff, tol, "loss"), diff
    # 300 tokens: sink 32, then (300 - 32 - 64) // 32 = 6 cold blocks, and
    # the 76 newest tokens hot; per layer and K/V.
    layer = cache.layers[0]
    assert (layer.store.blocks, layer.keys.shape[2], layer.sink_keys.shape[2]) == (6, 76, 32)
    assert cache.get_seq_length() == 300
    b = cache.nbytes()
    assert b["hot"] == 2 * 2 * (32 + 76) * 2 * 32 * 4  # layers, K/V, tokens, heads, dim, f32
    assert 0 < b["cold"] < b["f16"] / 2


def test_generate_with_the_cache(tiny):
    x = ids(100, seed=2)
    plain = tiny.generate(x, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache())
    wide = kvforge.hf.QuantizedCache(tiny.config, format="int4", window=128, sink=32)
    same = tiny.generate(x, max_new_tokens=12, do_sample=False, past_key_values=wide)
    # A window over every token computes exactly what the full cache does.
    assert torch.equal(plain, same)
    cache = kvforge.hf.QuantizedCache(tiny.config, format="int4", window=32, sink=32)
    out = tiny.generate(x, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 112) and cache.layers[0].store.blocks == 1


def test_bad_input_is_refused_and_a_failed_step_changes_nothing(tiny):
    with pytest.raises(ValueError, match="unknown format"):
        kvforge.hf.QuantizedCache(tiny.config, format="fp3")
    with pytest.raises(ValueError, match="config or num_layers"):
        kvforge.hf.QuantizedCache()
    cache = kvforge.hf.QuantizedCache(num_layers=1, format="int4", window=32, sink=32)
    with pytest.raises(NotImplementedError, match="batch 1"):
        cache.update(torch.zeros(2, 2, 8, 32), torch.zeros(2, 2, 8, 32), 0)
    with pytest.raises(ValueError, match="batch × heads × tokens × head_dim"):
        cache.update(torch.zeros(2, 8, 32), torch.zeros(2, 8, 32), 0)
    cache = kvforge.hf.QuantizedCache(num_layers=1, format="int4", window=32, sink=32)
    k = torch.randn(1, 2, 96, 32)
    cache.update(k, k.clone(), 0)
    assert cache.layers[0].store.blocks == 1
    with pytest.raises(ValueError, match="do not extend"):
        cache.update(torch.zeros(1, 3, 1, 32), torch.zeros(1, 3, 1, 32), 0)
    with pytest.raises(ValueError, match="float64"):
        cache.update(k.double(), k.double(), 0)
    before = cache.nbytes(), cache.get_seq_length()
    bad = torch.randn(1, 2, 64, 32)
    bad[0, 1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        cache.update(bad, torch.randn(1, 2, 64, 32), 0)
    assert (cache.nbytes(), cache.get_seq_length()) == before
    with pytest.raises(NotImplementedError, match="crop"):
        cache.crop(10)


def test_keys_come_back_in_position_order():
    # Position by position against the full cache's keys: sink, then the
    # cold blocks, then the hot tail (attention over a full past would not
    # notice a shuffle; a sliding-window mask would).
    torch.manual_seed(3)
    layer = kvforge.hf.QuantizedCache(num_layers=1, format="int8", window=32, sink=32).layers[0]
    seen = []
    for n in (40, 64, 1, 64, 7):
        k = torch.randn(1, 2, n, 32) * 3
        seen.append(k)
        keys, values = layer.update(k, -k)
        want = torch.cat(seen, dim=2)
        assert keys.shape == want.shape
        assert (keys - want).abs().max() < 0.1 and (values + want).abs().max() < 0.1
    assert layer.store.blocks == 3


def test_a_non_finite_value_is_refused_on_arrival_and_later_steps_work():
    cache = kvforge.hf.QuantizedCache(num_layers=1, format="int4", window=32, sink=32)
    cache.update(torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32), 0)
    before = cache.nbytes(), cache.get_seq_length()
    bad = torch.randn(1, 2, 1, 32)
    bad[0, 0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        cache.update(torch.randn(1, 2, 1, 32), bad, 0)
    assert (cache.nbytes(), cache.get_seq_length()) == before
    cache.update(torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32), 0)
    assert cache.get_seq_length() == 104 and cache.layers[0].store.blocks == 1


def test_a_group_the_head_dim_does_not_fit_fails_at_the_first_step_and_grad_is_fine():
    cache = kvforge.hf.QuantizedCache(num_layers=1, format="int4", group=48, keys="token")
    with pytest.raises(ValueError, match="group size 48"):
        cache.update(torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64), 0)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized
    with pytest.raises(ValueError, match="power-of-two"):
        kvforge.hf.QuantizedCache(num_layers=1, rotate=True).update(torch.randn(1, 2, 8, 96), torch.randn(1, 2, 8, 96), 0)
    # Outside torch.no_grad: tensors that require grad are stored too.
    cache = kvforge.hf.QuantizedCache(num_layers=1, format="int4", window=32, sink=32)
    k = torch.randn(1, 2, 96, 32, requires_grad=True)
    cache.update(k, k * 2, 0)
    assert cache.layers[0].store.blocks == 1


MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TEXT = os.path.join(ROOT, "data", "exllamav2", "wiki.utf8")


@pytest.mark.skipif(not REQUIRE and not os.path.exists(MODEL), reason="`cargo xtask setup` installs the model")
@pytest.mark.numerics
def test_smollm2_int4_keeps_perplexity_within_one_percent():
    if not REQUIRE:
        pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(MODEL)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    text = open(TEXT, encoding="utf-8").read()[:20000]
    x = tok(text, return_tensors="pt").input_ids[:, :768]

    def nll(cache):
        logits = chunked_logits(model, x, cache, chunk=64)
        lp = torch.log_softmax(logits[0, 255:-1].double(), dim=-1)
        return -lp.gather(1, x[0, 256:, None]).mean().item()

    full = nll(DynamicCache())
    cache = kvforge.hf.QuantizedCache(model.config, format="int4", window=128, sink=32)
    ours = nll(cache)
    change = np.exp(ours - full) - 1
    assert within("perplexity change", abs(change), 0.01, "loss"), change
    assert cache.layers[0].store.blocks == (768 - 32 - 128) // 32


def test_beam_search_and_several_sequences_are_not_implemented(tiny):
    x = ids(40)
    for kw in (dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)):
        cache = kvforge.hf.QuantizedCache(tiny.config, format="int4", window=32, sink=32)
        with pytest.raises(NotImplementedError, match="beam search"):
            tiny.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0, max_new_tokens=2,
                          past_key_values=cache, **kw)
