//! Prints the CUDA kernels' PTX for an architecture (`compute_90` unless
//! given): `cargo run -p kvforge-kernels --example ptx -- compute_80`
//! (needs NVRTC on the library path, not a GPU). Feed it to `ptxas -v`
//! to see registers and spills.

#![allow(clippy::print_stdout)]

fn main() -> std::process::ExitCode {
    let arch = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "compute_90".into());
    match kvforge_kernels::cuda::compile(&arch) {
        Ok(ptx) => {
            print!("{ptx}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
