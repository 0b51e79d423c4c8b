//! Fuzz target: the Hugging Face loader. The first byte picks the part:
//! even — the rest is a `config.json` (parsed and range-checked); odd — the
//! rest is a `model.safetensors` loaded beside a valid tiny `config.json`
//! (header, tensor table, names and shapes checked against the config). Any
//! input must give `Ok` or an error, never a panic, an abort or a hang.
//!
//! `cargo xtask fuzz` (see the engine README, "Fuzzing").
#![no_main]

use std::sync::OnceLock;

use kvforge_engine::{Device, Kind, Llama};
use libfuzzer_sys::fuzz_target;

/// The config.json beside fuzzed safetensors: LlamaConfig::tiny's shape.
const CONFIG: &str = r#"{"model_type": "llama", "vocab_size": 97, "hidden_size": 32,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "intermediate_size": 64, "max_position_embeddings": 512}"#;

fn dir() -> &'static std::path::Path {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("kvforge-fuzz-hf-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        std::fs::write(d.join("config.json"), CONFIG).expect("config.json");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    if pick % 2 == 0 {
        let _ = Llama::config_from_hf_json(&String::from_utf8_lossy(rest));
    } else {
        let d = dir();
        if std::fs::write(d.join("model.safetensors"), rest).is_ok() {
            let _ = Llama::from_hf_dir(d, Device::Cpu, Kind::Float);
        }
    }
});
