"""Fixtures shared by the transformers tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def tiny():
    """A tiny random-weight LLaMA in transformers (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()
