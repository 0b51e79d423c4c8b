"""Reference outputs from Hugging Face transformers for the engine's parity tests.

Loads the same GGUF file the engine uses (transformers dequantizes it to f32
and undoes llama.cpp's Q/K permutation itself), runs a few prompts, and writes
a small JSON fixture: input ids, top logits at every position, a greedy
continuation, and tokenizer ids of tricky text. Nothing here is kvforge code.

    .venv/bin/python scripts/reference.py [MODEL_GGUF] [OUT_JSON]

Needs `cargo xtask setup --reference`.
"""

import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = sys.argv[2] if len(sys.argv) > 2 else "engine/tests/fixtures/smollm2_reference.json"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain in two sentences why the sky is blue.",
]
TOKENIZER_TEXTS = [
    "Hello, world! 12345 tabs\there\tand\nnewlines.",
    "Ünïcödé: 東京は日本の首都です。Привет, мир! مرحبا",
    "emoji 🦀🚀👩‍💻 and numbers 3.14159, 2,048 x 1e-5",
    "<|im_start|>user\nspecial tokens<|im_end|>\n  leading  spaces   ",
    "def f(x):\n    return x ** 2  # code\n",
]


def chat(text):
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


def main():
    torch.manual_seed(0)
    d, f = os.path.split(os.path.abspath(MODEL))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    out = {
        "model": f,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompts": [],
        "tokenizer": [],
    }
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ids = tok(chat(p), add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0]
            top = torch.topk(logits, 5, dim=-1)
            entry = {
                "text": chat(p),
                "ids": ids,
                "top_ids": top.indices.tolist(),
                "top_logits": top.values.tolist(),
            }
            if i == 0:
                gen = model.generate(
                    torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None
                )
                entry["greedy"] = gen[0, len(ids):].tolist()
            out["prompts"].append(entry)
    for t in TOKENIZER_TEXTS:
        out["tokenizer"].append({"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]})
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(out, fh)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
