//! Reading the files a user names (texts, experiment and mechanisms files,
//! data packages): regular files only, checked before they are opened (a
//! FIFO would block `open` forever), bounded in size (`/dev/zero` or a
//! runaway file would fill the memory), UTF-8.

use std::io::Read as _;
use std::path::Path;

/// The most a text input may hold: 256 MiB (the largest data package the
/// setup installs is under 10 MiB).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// The most a configuration file may hold: 1 MiB.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of `path`, at most `limit` bytes, or one line saying why not:
/// `cannot read PATH: not a regular file` (a folder, a device, a FIFO),
/// `… larger than the N MiB limit`, `… not UTF-8 text`, or the OS error.
pub fn read_text(path: &Path, limit: u64) -> Result<String, String> {
    let buf = read_bytes(path, limit)?;
    String::from_utf8(buf).map_err(|e| {
        format!(
            "cannot read {}: not UTF-8 text (at byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// The bytes of `path`, at most `limit`, under the same checks as
/// [`read_text`] but for UTF-8 (a log whose last line may be cut inside a
/// character).
pub fn read_bytes(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let bad = |why: String| format!("cannot read {}: {why}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let too_big = || bad(format!("larger than the {} limit", size(limit)));
    if meta.len() > limit {
        return Err(too_big());
    }
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut buf = Vec::new();
    // Bounded again: the file may grow between the check and the read.
    file.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| bad(e.to_string()))?;
    if buf.len() as u64 > limit {
        return Err(too_big());
    }
    Ok(buf)
}

/// A regular file that exists, or one line saying why not (for files that
/// are mapped or read elsewhere, such as a GGUF model).
pub fn regular_file(path: &Path) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(format!("{}: not a regular file", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn size(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bounded_regular_utf8_files_are_read() {
        let dir = std::env::temp_dir().join(format!("kvforge-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok.txt");
        std::fs::write(&ok, "héllo").unwrap();
        assert_eq!(read_text(&ok, 100).unwrap(), "héllo");
        let e = read_text(&ok, 3).unwrap_err();
        assert!(e.ends_with("larger than the 3 bytes limit"), "{e}");
        let bin = dir.join("bin");
        std::fs::write(&bin, [b'a', 0xff, b'b']).unwrap();
        let e = read_text(&bin, 100).unwrap_err();
        assert!(e.ends_with("not UTF-8 text (at byte 1)"), "{e}");
        let e = read_text(&dir, 100).unwrap_err();
        assert!(e.ends_with("not a regular file"), "{e}");
        assert!(regular_file(&dir).is_err() && regular_file(&ok).is_ok());
        let e = read_text(Path::new("/dev/zero"), MAX_TEXT_BYTES).unwrap_err();
        assert!(e.ends_with("not a regular file"), "{e}");
        let e = read_text(&dir.join("absent"), 100).unwrap_err();
        assert!(e.starts_with("cannot read ") && !e.contains('\n'), "{e}");
        #[cfg(unix)]
        {
            // A FIFO is refused without opening it (opening would block).
            let fifo = dir.join("fifo");
            let made = std::process::Command::new("mkfifo").arg(&fifo).status();
            if made.is_ok_and(|s| s.success()) {
                let e = read_text(&fifo, 100).unwrap_err();
                assert!(e.ends_with("not a regular file"), "{e}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
