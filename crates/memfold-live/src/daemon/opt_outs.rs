//! The operator's opt-outs and opt-ins (issue 14, KSM's `MADV_UNMERGEABLE` for a whole
//! VM), written beside memfoldd's socket (`SOCKET.opt-outs`) before the operator is
//! answered, so that one answered holds across a memfoldd restart. Before, it lived in
//! memfoldd's books and the agent's memory only: a memfoldd that died between its answer
//! and the agent's hearing of it (or whose message to the agent was lost with the
//! connection) heard from the re-attaching agent that the guest was in, and merged it
//! again — or, after an opt-in, kept it out.
//!
//! A guest is named by its QEMU's pid, its RAM memfd's (device, inode) and its name, as a
//! re-attach proves it is the same VM (`attach.rs`); a QEMU that got a dead one's pid has
//! another RAM memfd. At a re-attach after a restart, the file's word for the guest wins;
//! a guest it does not name (an opt-out older than the file) keeps its agent's word.
//! Entries of guests memfoldd releases (their QEMU gone) are removed; at load, those
//! of QEMUs that no longer run.
//!
//! The file is memfoldd's own, in its socket's folder (which only memfoldd's user may
//! write: whoever could write there could replace the socket too). A line that does not
//! parse is skipped and counted in the log, never an error: memfoldd starts whatever it
//! holds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A guest as a re-attach names it: its QEMU's pid, its RAM memfd's (device, inode), its
/// name.
pub(crate) type GuestKey = (u32, (u64, u64), String);

/// The largest file read at start, bytes (a line a guest; memfoldd writes it).
const MAX_FILE_BYTES: u64 = 16 << 20;

/// The opt-outs and opt-ins recorded, and where.
#[derive(Debug)]
pub(crate) struct OptOuts {
    path: PathBuf,
    /// Each guest's last word: out (true) or in.
    out: BTreeMap<GuestKey, bool>,
}

impl OptOuts {
    /// The record beside `socket`, as a previous memfoldd left it, less the guests whose
    /// QEMU no longer runs (`alive`); none if there is no file (or it cannot be read: said
    /// in the log).
    pub(crate) fn load(socket: &Path, alive: impl Fn(u32) -> bool) -> OptOuts {
        let mut path = socket.as_os_str().to_owned();
        path.push(".opt-outs");
        let path = PathBuf::from(path);
        let mut o = OptOuts {
            path,
            out: BTreeMap::new(),
        };
        let text = match std::fs::metadata(&o.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return o,
            Ok(m) if m.len() > MAX_FILE_BYTES => {
                tracing::warn!(
                    "{}: {} bytes, over {MAX_FILE_BYTES}: not read; opt-outs are the agents' word",
                    o.path.display(),
                    m.len()
                );
                return o;
            }
            _ => match std::fs::read_to_string(&o.path) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!("{}: {e}; opt-outs are the agents' word", o.path.display());
                    return o;
                }
            },
        };
        let (mut bad, mut gone) = (0, 0);
        for line in text.lines().filter(|l| !l.is_empty()) {
            match parse(line) {
                Some((k, out)) if alive(k.0) => {
                    o.out.insert(k, out);
                }
                Some(_) => gone += 1,
                None => bad += 1,
            }
        }
        if bad > 0 {
            tracing::warn!(
                "{}: {bad} lines that do not parse, skipped",
                o.path.display()
            );
        }
        if gone > 0 {
            // Written back without them; a failure only keeps them a while longer.
            let _ = o.save();
        }
        o
    }

    /// The record's word on guest `k`: Some(out) if it names it.
    pub(crate) fn of(&self, k: &GuestKey) -> Option<bool> {
        self.out.get(k).copied()
    }

    /// Records `out` for each guest of `keys` and writes the file (a new file renamed over
    /// the old: a reader never sees half of it).
    ///
    /// Errors: the file could not be written (its path said). It is removed then, so that
    /// its older word on these guests cannot override, at a restart, an agent that did
    /// hear of the new one (every guest has its agent's word); the record in memory holds
    /// the new words all the same.
    pub(crate) fn set(&mut self, keys: Vec<GuestKey>, out: bool) -> Result<(), String> {
        for k in keys {
            self.out.insert(k, out);
        }
        self.save().inspect_err(|_| {
            let _ = std::fs::remove_file(&self.path);
        })
    }

    /// Forgets guests `keys` (released: their QEMU is gone), writing the file once if it
    /// named any.
    pub(crate) fn forget(&mut self, keys: &[GuestKey]) {
        let before = self.out.len();
        for k in keys {
            self.out.remove(k);
        }
        if self.out.len() != before {
            if let Err(e) = self.save() {
                tracing::warn!("{e}");
            }
        }
    }

    /// Writes the record.
    ///
    /// Errors: the new file could not be written or renamed (its path said).
    fn save(&self) -> Result<(), String> {
        let mut text = String::new();
        for ((pid, (dev, ino), name), out) in &self.out {
            let word = if *out { "out" } else { "in" };
            text.push_str(&format!("{word} {pid} {dev} {ino} {name}\n"));
        }
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        // Memfoldd's own (mode 0600): which guests of which QEMUs are opted out is the
        // operator's business, and the socket's folder is readable to all. Made anew
        // (`O_EXCL`, no symbolic link followed), as the socket's lock is: a file or link
        // left there by another must not be written through.
        let write = || {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            match std::fs::remove_file(&tmp) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)?
                .write_all(text.as_bytes())
        };
        write()
            .and_then(|()| std::fs::rename(&tmp, &self.path))
            .map_err(|e| format!("the opt-out record {}: {e}", self.path.display()))
    }
}

/// One line: `out|in PID DEV INO NAME` (the name the rest of the line: names are printable,
/// `memfold_wire::check_name`, so hold no newline).
fn parse(line: &str) -> Option<(GuestKey, bool)> {
    let mut f = line.splitn(5, ' ');
    let out = match f.next()? {
        "out" => true,
        "in" => false,
        _ => return None,
    };
    let pid = f.next()?.parse().ok()?;
    let dev = f.next()?.parse().ok()?;
    let ino = f.next()?.parse().ok()?;
    let name = f.next().filter(|n| !n.is_empty())?.to_string();
    Some(((pid, (dev, ino), name), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is set is read back by the next memfoldd, names with spaces included; lines
    /// that do not parse and guests of QEMUs gone are dropped (and gone from the file).
    /// Fails if the record is not written, or not read.
    #[test]
    fn opt_outs_are_read_back_by_the_next_memfoldd() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("memfoldd.sock");
        let mut o = OptOuts::load(&socket, |_| true);
        let web = (7, (1, 2), "web prod/ram0".to_string());
        let db = (8, (1, 3), "db".to_string());
        let dead = (9, (1, 4), "old".to_string());
        o.set(vec![web.clone(), dead.clone()], true).unwrap();
        o.set(vec![db.clone()], false).unwrap();
        let path = dir.path().join("memfoldd.sock.opt-outs");
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("out 1 2\nsideways 1 2 3 x\n");
        std::fs::write(&path, text).unwrap();

        let o = OptOuts::load(&socket, |pid| pid != 9);
        assert_eq!(o.of(&web), Some(true));
        assert_eq!(o.of(&db), Some(false));
        assert_eq!(o.of(&dead), None);
        assert_eq!(o.of(&(7, (1, 9), "web prod/ram0".into())), None);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains(" old") && !text.contains("sideways"),
            "{text}"
        );
    }

    /// A symbolic link planted where the new file is made is not written through: the
    /// file it names keeps its bytes. Fails with the link followed.
    #[test]
    fn a_link_at_the_new_file_s_path_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("s.opt-outs.new")).unwrap();
        let mut o = OptOuts::load(&socket, |_| true);
        o.set(vec![(7, (1, 2), "web".to_string())], true).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(
            OptOuts::load(&socket, |_| true).of(&(7, (1, 2), "web".into())),
            Some(true)
        );
    }

    /// A released guest's entry goes from the file.
    #[test]
    fn a_released_guest_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s");
        let mut o = OptOuts::load(&socket, |_| true);
        let web = (7, (1, 2), "web".to_string());
        o.set(vec![web.clone()], true).unwrap();
        o.forget(std::slice::from_ref(&web));
        assert_eq!(OptOuts::load(&socket, |_| true).of(&web), None);
    }
}
