//! Where an installed memfold's parts are, relative to the `memfold` binary.
//!
//! | install | binaries | agent library |
//! |---|---|---|
//! | a build (`target/release`) | `target/release/` | beside them |
//! | the Debian package | `/usr/bin/` | `/usr/lib/memfold/` |
//! | `cargo install --path crates/memfold-cli` | `~/.cargo/bin/` | `~/.cargo/lib/memfold/` (copied there by hand, README) |

use std::path::{Path, PathBuf};

/// The agent library's file name.
pub const AGENT_LIBRARY: &str = "libmemfold_agent.so";

/// The places the agent library may be for the binary at `exe`, in the order they are
/// tried: beside it (a build), then `../lib/memfold/` from its folder (the Debian
/// package's `/usr/lib/memfold`, `/usr/local/lib/memfold`, `~/.cargo/lib/memfold`).
pub fn agent_library_candidates(exe: &Path) -> Vec<PathBuf> {
    let mut v = vec![exe.with_file_name(AGENT_LIBRARY)];
    if let Some(prefix) = exe.parent().and_then(Path::parent) {
        v.push(prefix.join("lib/memfold").join(AGENT_LIBRARY));
    }
    v
}

/// The agent library for the binary at `exe`: the first of
/// [`agent_library_candidates`] that exists.
pub fn agent_library(exe: &Path) -> Option<PathBuf> {
    agent_library_candidates(exe)
        .into_iter()
        .find(|p| p.exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_found_beside_the_binary_or_under_lib_memfold() {
        assert_eq!(
            agent_library_candidates(Path::new("/usr/bin/memfold")),
            [
                PathBuf::from("/usr/bin/libmemfold_agent.so"),
                PathBuf::from("/usr/lib/memfold/libmemfold_agent.so")
            ]
        );
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("bin/memfold");
        assert_eq!(agent_library(&exe), None);
        let lib = dir.path().join("lib/memfold/libmemfold_agent.so");
        std::fs::create_dir_all(lib.parent().unwrap()).unwrap();
        std::fs::write(&lib, b"").unwrap();
        assert_eq!(agent_library(&exe), Some(lib));
        let beside = dir.path().join("bin/libmemfold_agent.so");
        std::fs::create_dir_all(beside.parent().unwrap()).unwrap();
        std::fs::write(&beside, b"").unwrap();
        assert_eq!(
            agent_library(&exe),
            Some(beside),
            "a build's own library first"
        );
    }
}
