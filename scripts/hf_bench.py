"""Prefill and decode speed of Hugging Face transformers on the same GGUF
model, for `cargo xtask engine-bench` to print beside kvforge's.

    .venv/bin/python scripts/hf_bench.py MODEL_GGUF TEXT_FILE CONTEXT DECODE

Takes the first CONTEXT tokens of TEXT_FILE as the prompt, times one prefill
forward, then DECODE greedy steps with the model's own KV cache (DynamicCache),
all in f32 on CPU. Prints one JSON line.
"""

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    model_path, text_file, context, decode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    d, f = os.path.split(os.path.abspath(model_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    ids = tok(open(text_file, encoding="utf-8").read(), add_special_tokens=False)["input_ids"][:context]
    x = torch.tensor([ids])
    with torch.inference_mode():
        model(x[:, :16])  # warm-up
        t0 = time.perf_counter()
        out = model(x, use_cache=True)
        prefill = time.perf_counter() - t0
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        for _ in range(decode):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
        dec = time.perf_counter() - t1
    print(json.dumps({
        "engine": "transformers",
        "dtype": "f32",
        "context": len(ids),
        "prefill_tok_s": len(ids) / prefill,
        "decode_tok_s": decode / dec,
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
