"""Writes the GGUF fuzzer's seed, fuzz/corpus/gguf/tiny-llama.gguf: a tiny
LLaMA-shaped GGUF (1 layer, 32 wide, 8-token vocabulary, F32 and Q8_0
tensors) written by the gguf package. Needs `cargo xtask setup --reference`.

    .venv/bin/python scripts/fuzz_seed_gguf.py fuzz/corpus/gguf/tiny-llama.gguf
"""
import numpy as np, gguf, sys
from gguf import GGMLQuantizationType as T
out = sys.argv[1]
w = gguf.GGUFWriter(out, "llama")
w.add_context_length(64); w.add_embedding_length(32); w.add_block_count(1)
w.add_feed_forward_length(64); w.add_head_count(4); w.add_head_count_kv(2)
w.add_rope_dimension_count(8); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
w.add_tokenizer_model("gpt2")
toks = ["a", "b", "c", "ab", "<|im_start|>", "<|im_end|>", "Ġ", "Ċ"]
w.add_token_list(toks); w.add_token_types([1,1,1,1,3,3,1,1]); w.add_token_merges(["a b"])
w.add_eos_token_id(5); w.add_bos_token_id(4)
rng = np.random.default_rng(1)
def t(name, shape, q=None):
    x = rng.standard_normal(shape).astype(np.float32)
    if q is None:
        w.add_tensor(name, x)
    else:
        w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)
t("token_embd.weight", (8, 32), T.Q8_0)
t("output_norm.weight", (32,))
for n in ["attn_norm", "ffn_norm"]:
    t(f"blk.0.{n}.weight", (32,))
for n, s in [("attn_q", (32, 32)), ("attn_k", (16, 32)), ("attn_v", (16, 32)), ("attn_output", (32, 32)),
             ("ffn_gate", (64, 32)), ("ffn_up", (64, 32)), ("ffn_down", (32, 64))]:
    t(f"blk.0.{n}.weight", s, T.Q8_0)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
