//! Fuzz target: everything kvforge does with a GGUF file before it builds
//! tensors — header, metadata, tensor table and layout checks, the model
//! configuration and tensor set, the tokenizer from metadata, and every
//! tensor's dequantization. Any input must give `Ok` or an error, never a
//! panic, an abort or a hang.
//!
//! `cargo xtask fuzz` (see the engine README, "Fuzzing").
#![no_main]

use kvforge_engine::gguf::GgufFile;
use kvforge_engine::{Llama, Tokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let _ = Llama::config_from_gguf(&g);
    let _ = Tokenizer::from_gguf(&g);
    for name in g.tensors.keys() {
        let _ = g.dequantize(name);
    }
});
