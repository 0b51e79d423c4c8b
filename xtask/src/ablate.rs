//! `cargo xtask ablate`: which experiment file, and whether it needs the
//! Python process (a policy written in Python).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::{say, setup};

/// The experiment file `ablate ARGS` reads (`--config FILE`, `--quick`,
/// `--full`, else the default).
pub(crate) fn ablate_config(root: &Path, args: &[String]) -> PathBuf {
    let mut file = PathBuf::from("configs/ablate.toml");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" | "--full" => file = PathBuf::from(format!("configs/{}.toml", &a[2..])),
            "--config" => file = it.next().map_or(file, PathBuf::from),
            _ => {}
        }
    }
    root.join(file)
}

/// Whether the experiment file names a policy written in Python (a
/// `[[config]]` whose `eviction.policy` or `tier.policy` is
/// `"module:Class"`). A file
/// that cannot be read or parsed is left to the ablation's own error.
pub(crate) fn names_python_policy(root: &Path, args: &[String]) -> bool {
    std::fs::read_to_string(ablate_config(root, args)).is_ok_and(|t| python_policy_named(&t))
}

/// Whether a TOML experiment text has a `[[config]]` whose eviction or
/// tier policy is a `"module:Class"` name.
fn python_policy_named(text: &str) -> bool {
    let Ok(doc) = text.parse::<toml::Table>() else {
        return false;
    };
    let configs = doc.get("config").and_then(|c| c.as_array());
    configs.into_iter().flatten().any(|c| {
        ["eviction", "tier"].iter().any(|k| {
            c.get(k)
                .and_then(|e| e.get("policy"))
                .and_then(|p| p.as_str())
                .is_some_and(|p| p.contains(':'))
        })
    })
}

/// The ablation of a file that names a policy written in Python: setup
/// (which builds the Python package), then `python -m kvforge ablate ARGS`
/// — the same runner, in a Python process; exits with its status.
pub(crate) fn python_ablate(root: &Path, args: &[String]) -> Result<()> {
    let env = setup::setup(root, false)?;
    say("ablate: the experiment file names a policy written in Python: python -m kvforge ablate");
    let status = Command::new(&env.python)
        .current_dir(root)
        .env("KVFORGE_REDIS_SERVER", &env.redis_server)
        .args(["-m", "kvforge", "ablate"])
        .args(args)
        .status()
        .context("could not start python -m kvforge")?;
    std::process::exit(status.code().unwrap_or(1));
}

#[cfg(test)]
mod tests {
    use super::python_policy_named;

    #[test]
    fn a_python_policy_is_a_module_colon_class_name_of_a_configs_eviction_or_tier() {
        let named = |c: &str| python_policy_named(&format!("[[config]]\nname = \"x\"\n{c}\n"));
        assert!(named(
            "eviction = { policy = \"kvforge.examples.keydiff:KeyDiff\", sink = 16 }"
        ));
        assert!(named("eviction = { policy = 'm:C' }"));
        assert!(named("eviction = { \"policy\" = \"m:C\", note = \"v#2\" }"));
        assert!(named("[config.eviction]\npolicy = \"m:C\""));
        assert!(!named("eviction = { policy = \"keydiff\", sink = 16 }"));
        assert!(!named("# eviction = { policy = \"m:C\" }"));
        assert!(named(
            "tier = { policy = \"kvforge.examples.tiers:Every\" }"
        ));
        assert!(!named("tier = { policy = \"plan\" }"));
        assert!(!named("lifecycle = { policy = \"a:b\" }"));
        assert!(!python_policy_named("not toml = = ="));
    }
}
