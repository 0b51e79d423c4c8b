"""Writes the HF fuzzer's seeds into fuzz/corpus/hf: `config` (byte 0, then a
config.json) and `safetensors` (byte 1, then a model.safetensors of
LlamaConfig::tiny's shape, f16 weights). Needs `cargo xtask setup --reference`.

    .venv/bin/python scripts/fuzz_seed_hf.py fuzz/corpus/hf
"""
import json
import pathlib
import sys

import numpy as np
from safetensors.numpy import save

out = pathlib.Path(sys.argv[1])
config = {"model_type": "llama", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
(out / "config").write_bytes(b"\x00" + json.dumps(config).encode())
rng = np.random.default_rng(2)
t = {"model.embed_tokens.weight": (97, 32), "model.norm.weight": (32,)}
for i in range(2):
    p = f"model.layers.{i}."
    t.update({p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
              p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
              p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
              p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
              p + "mlp.down_proj.weight": (32, 64)})
tensors = {k: rng.standard_normal(s).astype(np.float16) for k, s in t.items()}
(out / "safetensors").write_bytes(b"\x01" + save(tensors))
print("wrote", out)
