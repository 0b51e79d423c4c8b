//! `cargo xtask ablate`: every mechanism on and off on a real model; one
//! report with tables and plots in `target/ablate/<name>/`.
//!
//! ```text
//! ablate                      # configs/ablate.toml (about 17 min on 2 cores)
//! ablate --quick              # configs/quick.toml: tiny random model, seconds
//! ablate --full               # configs/full.toml: the complete matrix
//! ablate --config FILE [--out DIR] [--resume]
//! ```

#![allow(clippy::print_stdout)] // a report printer

use std::path::PathBuf;

use anyhow::{Result, bail};
use kvforge_bench::ablate::run::{Options, run};

fn main() -> std::process::ExitCode {
    kvforge_bench::main_with("ablate", || {
        let opts = parse(std::env::args().skip(1).collect())?;
        let done = run(&opts)?;
        let report = done.out.join("report.md");
        println!("report: {}", report.display());
        if done.failed > 0 {
            bail!(
                "{} of the {} items measured failed (see Failures in {})",
                done.failed,
                done.measured,
                report.display()
            );
        }
        Ok(())
    })
}

fn parse(args: Vec<String>) -> Result<Options> {
    let mut opts = Options {
        config: PathBuf::from("configs/ablate.toml"),
        out: None,
        resume: false,
        progress: true,
        root: PathBuf::from("."),
        registry: kvforge_ablate::registry(),
    };
    let mut preset = None;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" | "--full" => {
                if preset.replace(a.clone()).is_some() {
                    bail!("give one of --quick, --full and --config");
                }
                opts.config = PathBuf::from(format!("configs/{}.toml", &a[2..]));
            }
            "--config" => {
                if preset.replace(a.clone()).is_some() {
                    bail!("give one of --quick, --full and --config");
                }
                match it.next() {
                    Some(v) => opts.config = v.into(),
                    None => bail!("--config needs a file"),
                }
            }
            "--out" => match it.next() {
                Some(v) => opts.out = Some(v.into()),
                None => bail!("--out needs a folder"),
            },
            "--resume" => opts.resume = true,
            "--no-progress" => opts.progress = false,
            _ => bail!(
                "unknown argument {a:?}; usage: ablate [--quick | --full | --config FILE] [--out DIR] [--resume] [--no-progress]"
            ),
        }
    }
    Ok(opts)
}
