//! A directory only this user can read, for one bench run's config and streamer log, removed
//! when dropped — so nothing the run writes is left in the current directory or readable by
//! other users of the machine.

use std::fs::{DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A fresh `0700` directory under the system's temporary directory.
#[derive(Debug)]
pub(super) struct PrivateDir {
    path: PathBuf,
    /// Keep the directory (with what [`PrivateDir::forget`] did not remove) when dropped.
    keep: bool,
}

impl PrivateDir {
    /// Creates `<tmp>/<prefix>-<pid>-<nanos>`; fails if it exists.
    pub(super) fn create(prefix: &str) -> std::io::Result<Self> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let path = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
        DirBuilder::new().mode(0o700).create(&path)?;
        Ok(Self { path, keep: false })
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `name` with `text`, readable and writable by this user only (`0600`).
    pub(super) fn write(&self, name: &str, text: &str) -> std::io::Result<PathBuf> {
        let path = self.path.join(name);
        let mut file = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        file.write_all(text.as_bytes())?;
        Ok(path)
    }

    /// Creates `name` for writing (`0600`), for a child process's output.
    pub(super) fn file(&self, name: &str) -> std::io::Result<std::fs::File> {
        OpenOptions::new().write(true).create_new(true).mode(0o600).open(self.path.join(name))
    }

    /// Keeps the directory when dropped, without `remove` (a failed run's log, for the
    /// operator); returns its path.
    pub(super) fn keep_without(&mut self, remove: &[&str]) -> &Path {
        for name in remove {
            let _ = std::fs::remove_file(self.path.join(name));
        }
        self.keep = true;
        &self.path
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn only_this_user_reads_it_and_it_is_gone_when_dropped() {
        let dir = PrivateDir::create("outbox-private-dir-test").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(dir.path()), 0o700);
        let file = dir.write("config.toml", "secret").unwrap();
        assert_eq!(mode(&file), 0o600);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "secret");
        assert!(dir.write("config.toml", "again").is_err(), "never writes through an existing file");
        let path = dir.path().to_path_buf();
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn a_kept_directory_loses_what_is_named() {
        let mut dir = PrivateDir::create("outbox-private-dir-test").unwrap();
        dir.write("config.toml", "secret").unwrap();
        dir.write("streamer.log", "log").unwrap();
        let path = dir.keep_without(&["config.toml"]).to_path_buf();
        drop(dir);
        assert!(!path.join("config.toml").exists() && path.join("streamer.log").exists());
        std::fs::remove_dir_all(path).unwrap();
    }
}
