//! Programs the tests start, from Debian's packages: the one on `PATH`,
//! else `apt-get install` when setup runs as root (an `apt-get update`
//! first if the install fails), else none, and setup says so.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Result;

use crate::say;
use crate::setup::run;

/// `name` on `PATH`, if it is there.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The program `name` of Debian's `package`, installed when missing and
/// possible (`why`: what needs it, for the messages). `Ok(None)` when it
/// cannot be installed here (not root, or no `apt-get`).
pub(crate) fn program(name: &str, package: &str, why: &str) -> Result<Option<PathBuf>> {
    if let Some(p) = on_path(name) {
        return Ok(Some(p));
    }
    let root_user = run("id -u", Command::new("id").arg("-u")).is_ok_and(|u| u == "0");
    if !root_user || on_path("apt-get").is_none() {
        say(&format!(
            "setup: no {name} here, and Debian's {package} cannot be installed (not root, or no apt-get)"
        ));
        return Ok(None);
    }
    say(&format!(
        "setup: apt-get install {package} (Debian's, {why})"
    ));
    let install = || {
        run(
            &format!("apt-get install {package}"),
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "-q", "--no-install-recommends", package]),
        )
    };
    if install().is_err() {
        run(
            "apt-get update",
            Command::new("apt-get").args(["update", "-q"]),
        )?;
        install()?;
    }
    Ok(on_path(name))
}
