"""kvforge.kvpress.PolicyPress inside kvpress's pipeline, on a tiny random
LLaMA. kvpress is a reference package (`cargo xtask setup --reference`), not
one of CI's: without it these tests skip, even under KVFORGE_REQUIRE_ALL."""

import numpy as np
import pytest
import torch

pytest.importorskip("kvpress")
from transformers import DynamicCache  # noqa: E402

from kvforge.examples.keydiff import KeyDiff  # noqa: E402
from kvforge.kvpress import PolicyPress, block_novelty, layout  # noqa: E402
from conftest import within  # noqa: E402


def prefill(model, press, n=200):
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (1, n)))
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def test_the_press_keeps_what_keydiff_keeps_in_whole_blocks(tiny):
    press = PolicyPress(lambda b: KeyDiff(budget_tokens=b, sink=16, window=32), compression_ratio=0.5)
    cache = prefill(tiny, press)
    # 200 tokens, budget 100: whole blocks of 16 go until at most 100 stay.
    assert cache.get_seq_length() == 200 - 7 * 16
    full = prefill(tiny, PolicyPress(lambda b: KeyDiff(budget_tokens=b, sink=16, window=32)))
    assert full.get_seq_length() == 200
    # Layer 0 sees the same input either way: its kept keys are the full
    # cache's minus the seven least novel blocks between sink and window.
    k_full = full.layers[0].keys
    nov = block_novelty(k_full, 16)
    table = layout(200, 16)
    cand = [i for i in range(len(table)) if table.first[i] >= 16 and table.end[i] <= 200 - 32]
    drop = sorted(sorted(cand, key=lambda i: (nov[i], i))[:7])
    keep = [t for t in range(200) if t // 16 not in drop]
    assert torch.equal(cache.layers[0].keys, k_full[:, :, keep])


def test_across_layers_drops_the_same_blocks_from_every_layer_by_their_summed_novelty(tiny):
    def keydiff(b):
        return KeyDiff(budget_tokens=b, sink=16, window=32)

    full = prefill(tiny, PolicyPress(keydiff))
    cache = prefill(tiny, PolicyPress(keydiff, compression_ratio=0.5, across_layers=True))
    nov = sum(block_novelty(layer.keys, 16) for layer in full.layers)
    table = layout(200, 16)
    cand = [i for i in range(len(table)) if table.first[i] >= 16 and table.end[i] <= 200 - 32]
    drop = sorted(sorted(cand, key=lambda i: (nov[i], i))[:7])
    keep = [t for t in range(200) if t // 16 not in drop]
    for got, want in zip(cache.layers, full.layers):
        assert torch.equal(got.keys, want.keys[:, :, keep])
        assert torch.equal(got.values, want.values[:, :, keep])
    # Per layer, the two layers choose differently here: the modes differ.
    each = prefill(tiny, PolicyPress(keydiff, compression_ratio=0.5))
    assert any(not torch.equal(a.keys, b.keys) for a, b in zip(each.layers, cache.layers))


def test_across_layers_refuses_sliding_window_layers_and_a_bare_call(tiny):
    press = PolicyPress(lambda b: KeyDiff(budget_tokens=b, sink=16, window=32), compression_ratio=0.5,
                        across_layers=True)
    tiny.model.layers[1].self_attn.is_sliding = True  # as Gemma3's, which kvpress does not hook
    try:
        with pytest.raises(ValueError, match="sliding-window layers"):
            prefill(tiny, press)
    finally:
        del tiny.model.layers[1].self_attn.is_sliding
    with pytest.raises(ValueError, match="runs as `with press"):
        press.compress(tiny.model.layers[0].self_attn, None, torch.zeros(1, 2, 40, 8), torch.zeros(1, 2, 40, 8),
                       None, {"past_key_values": DynamicCache()})
    assert prefill(tiny, press).get_seq_length() == 200 - 7 * 16


@pytest.mark.numerics
def test_layout_and_novelty_follow_kvforges_blocks():
    t = layout(40, 16)
    assert t.first.tolist() == [0, 16, 32] and t.tokens.tolist() == [16, 16, 8] and t.open
    assert not layout(32, 16).open
    k = torch.randn(1, 2, 40, 8)
    nov = block_novelty(k, 16)
    cos = torch.nn.functional.cosine_similarity(k[0], k[0].mean(1, keepdim=True), dim=-1)
    want = (1 - cos).mean(0)
    err = np.abs(np.asarray(nov) - np.array([want[:16].mean(), want[16:32].mean(), want[32:].mean()])).max()
    assert within("block novelty", err, 1e-6), err


def test_bad_settings_and_answers_are_value_errors(tiny):
    with pytest.raises(ValueError, match="compression_ratio"):
        PolicyPress(lambda b: KeyDiff(budget_tokens=b), compression_ratio=1.0)

    class Newest(KeyDiff):
        def victims(self, seq, table, pressure):
            return [len(table)]

    with pytest.raises(ValueError, match="named entries"):
        prefill(tiny, PolicyPress(lambda b: Newest(budget_tokens=b, sink=16, window=32), compression_ratio=0.5))
