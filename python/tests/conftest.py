"""Fixtures shared by the transformers tests, and `within`: a float
comparison between two paths, recorded for `cargo xtask numerics`."""

import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "numerics: compares floats of two paths (cargo xtask numerics reruns it under other kernel settings)")


def within(what, err, bound, kind="order"):
    """Whether `err` is within `bound`; with KVFORGE_NUMERICS_LOG set, the
    comparison is appended to it (the current test, `what`, the error, the
    bound, `order` for two computation orders of the same arithmetic or
    `loss` for a lossy path against an exact one), as the engine's
    `numerics::within` does."""
    err = float(err)
    log = os.environ.get("KVFORGE_NUMERICS_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "unnamed").rsplit(" ", 1)[0]
        clean = lambda s: s.replace("\t", " ").replace("\n", " ")
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{clean(test)}\t{clean(what)}\t{err:e}\t{float(bound):e}\t{kind}\n")
    return err <= bound


@pytest.fixture(scope="module")
def tiny():
    """A tiny random-weight LLaMA in transformers (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()
