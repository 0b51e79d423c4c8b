"""The kvforge wheel in a fresh venv, as a user installs it: run by `cargo
xtask wheel` (and `cargo xtask ci`) with the venv's python, from outside
the checkout, with KVFORGE_HOME an empty folder.

Checks that the package imports from site-packages (not the checkout),
fetches the default model on first use into KVFORGE_HOME, generates, runs
an eviction policy written in Python through the engine and the
conformance suite, and runs the transformers cache. Prints one line per
check; exits non-zero with the failure.
"""

import os
import sys

import kvforge
import kvforge.hf
import kvforge.testing
import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

home = os.environ["KVFORGE_HOME"]
where = os.path.dirname(kvforge.__file__)
assert "site-packages" in where, f"kvforge imported from {where}, not an installed wheel"
assert kvforge.assets.checkout() is None, kvforge.assets.checkout()
print(f"import: kvforge {kvforge.__version__} from {where}, torch {torch.__version__}")

engine = kvforge.Engine()
assert str(kvforge.assets.model()).startswith(home), kvforge.assets.model()
reply = engine.generate("What is the capital of France?", max_tokens=8)
assert reply.strip(), "an empty reply"
print(f"generate: the default model fetched into {home}; reply {reply!r}")


class Oldest(kvforge.EvictionPolicy):
    """Drops the oldest live entries past the first (the sink) until the
    sequence fits in `budget` tokens."""

    def __init__(self, budget):
        self.budget = budget

    def victims(self, seq, table, pressure):
        total, out = table.live_tokens, []
        for i in range(1, len(table.first) - 1):
            if total <= self.budget:
                break
            if table.live[i]:
                out.append(i)
                total -= int(table.tokens[i])
        return out


kvforge.testing.check_eviction_policy(Oldest(64))
tiny = dict(d_model=64, layers=2, heads=4, kv_heads=2, ffn=128, max_ctx=512)
small = kvforge.Engine(random=tiny, policy=Oldest(64))
small.generate(list(range(300, 500)), max_tokens=4)
evicted = small.stats()["policies"]["evicted_entries"]
assert evicted > 0, small.stats()["policies"]
print(f"policy: a Python policy passed the conformance suite and evicted {evicted} entries")

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 256, (1, 120))
cache = kvforge.hf.QuantizedCache(config, format="int4", window=32, sink=32)
args = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=8, do_sample=False)
out = model.generate(ids, past_key_values=cache, **args)
ref = model.generate(ids, past_key_values=DynamicCache(), **args)
assert out.shape == ref.shape == (1, 128), (out.shape, ref.shape)
assert cache.nbytes()["cold"] > 0, cache.nbytes()
print(f"hf: QuantizedCache in model.generate, {cache.nbytes()}")
print("wheel smoke: ok")
sys.exit(0)
