//! Dequantizes every tensor of a GGUF file with kvforge's reader and prints
//! one JSON line per tensor: type, element count, sum, sum of squares, and
//! eight values at fixed strides. `scripts/llama_cpp_kquants.sh` compares the
//! lines with the `gguf` package's reference dequantizer.
//!
//! ```text
//! cargo run --release -p kvforge-engine --example gguf_stats -- FILE.gguf
//! ```
#![allow(clippy::print_stdout)]

use kvforge_engine::gguf::GgufFile;

fn main() -> std::process::ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: gguf_stats FILE.gguf");
        return std::process::ExitCode::from(2);
    };
    let g = match GgufFile::open(path.as_ref()) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    for (name, info) in &g.tensors {
        let (x, _) = match g.dequantize(name) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("error: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        let sum: f64 = x.iter().map(|&v| f64::from(v)).sum();
        let sq: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let last = x.len().saturating_sub(1);
        let picks: Vec<f32> = (0..8)
            .filter_map(|k| x.get(k * last / 7).copied())
            .collect();
        println!(
            "{}",
            serde_json::json!({"name": name, "type": format!("{:?}", info.dtype),
                "n": x.len(), "sum": sum, "sumsq": sq, "picks": picks})
        );
    }
    std::process::ExitCode::SUCCESS
}
