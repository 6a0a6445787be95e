//! memfoldd's own monitor of each QEMU — the `-chardev socket,id=memfold-qmp` QEMU's
//! command line names (`memfold run` adds it; docs/entitlements.md says how by hand) —
//! and what memfoldd asks it besides the balloon ([`crate::daemon::balloon`]): where
//! the guest's RAM lies (issue 17: an enlightened guest reports by frame, memfold keeps
//! pages by gfn; [`QemuLayouts`]).
//!
//! The command line is the peer's to write (a QEMU may rewrite its own `argv`), so the
//! path is untrusted. *Invariant: memfoldd talks only to the monitor of the QEMU it
//! asks about*: it connects only to a socket whose listening end the kernel says that
//! QEMU made (`SO_PEERCRED`, [`Qmp::connect_served_by`]). What a QEMU answers can only
//! be wrong about its own guest, whose memory it holds anyway; a split that does not fit
//! the guest's RAM is refused ([`RamLayout::from_qemu`]).
//!
//! QEMU serves one client at a time on a monitor chardev: while a balloon claimer holds
//! it, another connection waits unanswered. So the claimer asks for the layout as soon
//! as it connects, and the answer is kept here for the guest channel
//! ([`QemuLayouts::layout`]), which opens the monitor itself only when none is kept.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memfold_core::categories::RamLayout;
use memfold_vm::qmp::{Qmp, QmpError};
use memfold_wire::keyval::keyval;
use memfold_wire::shown_within;

/// The `id` of the `-chardev socket` whose monitor memfoldd drives.
pub const MONITOR_ID: &str = "memfold-qmp";

/// The monitor socket QEMU's command line names (`-chardev socket,id=memfold-qmp,path=P`,
/// its items in any order), from the NUL-separated `cmdline`; read with QEMU's own option
/// syntax ([`memfold_wire::keyval`]: `,,` is a comma of the path).
pub fn monitor_path(cmdline: &[u8]) -> Option<PathBuf> {
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    args.windows(2).find_map(|w| {
        if w[0] != b"-chardev" && w[0] != b"--chardev" {
            return None;
        }
        let kv = keyval(std::str::from_utf8(w[1]).ok()?, Some("backend"));
        let is = |k: &str, v: &str| kv.get(k).is_some_and(|x| x == v);
        if !(is("backend", "socket") && is("id", MONITOR_ID)) {
            return None;
        }
        kv.get("path").map(PathBuf::from)
    })
}

/// Most characters of a reason memfoldd gives in words ([`open_monitor`],
/// [`QemuLayouts::ask`]), the closing `...` of a cut one included: such a reason may
/// quote the QEMU (its error's `desc`, a path from its command line).
pub const WHY_CHARS: usize = 400;

/// A reason that may quote a QEMU, as memfoldd keeps, logs and shows it: escaped (no
/// newline nor terminal escape reaches the log) and at most [`WHY_CHARS`] characters.
/// Giving it an already shown reason changes nothing.
pub fn said(why: &str) -> String {
    shown_within(why, WHY_CHARS - "...".len())
}

/// The monitor QEMU `pid`'s command line names for memfoldd, connected (checked to be
/// served by `pid`); the greeting, and each command's answer later, within `timeout`
/// each ([`Qmp::connect_served_by`]); every wait of the session given up within a
/// fraction of a second once `stop` (if any) is set.
///
/// Errors: why not, in words ([`said`]: escaped, short): no monitor on the command line,
/// a socket served by another process, QEMU not answering in time, told to stop.
pub fn open_monitor(
    pid: u32,
    timeout: Duration,
    stop: Option<&Arc<AtomicBool>>,
) -> Result<Qmp, String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| format!("QEMU pid {pid}: cannot read its command line: {e}"))?;
    let path = monitor_path(&cmdline).ok_or_else(|| {
        format!("no monitor for memfoldd: add -chardev socket,id={MONITOR_ID},path=PATH,server=on,wait=off -mon chardev={MONITOR_ID},mode=control")
    })?;
    let seen = as_qemu_sees(pid, &path);
    let connect =
        |p: &std::path::Path| Qmp::connect_served_by_unless(p, pid, timeout, stop.cloned());
    let got = match connect(&seen) {
        // Not there as the QEMU sees it: a memfoldd not root may not look into another
        // user's QEMU, and a QEMU run with -chroot made its sockets before it chrooted.
        // As written, then; who serves it is checked either way.
        Err(QmpError::Connect { .. }) if seen != path => connect(&path),
        got => got,
    };
    got.map_err(|e| match e {
        QmpError::WrongServer { .. } => said(&format!("{e}: refused")),
        e => said(&e.to_string()),
    })
}

/// The socket `path` QEMU `pid` named, as that QEMU sees it: through its root for an
/// absolute path, its working directory for a relative one (`/proc/PID/root`,
/// `/proc/PID/cwd`). memfoldd may see other mounts (the packaged unit's private `/tmp`)
/// and run in another folder, and found no socket, or another one (which the check of
/// who serves it then refused). A path too long for a socket address that way is taken
/// as written.
fn as_qemu_sees(pid: u32, path: &std::path::Path) -> PathBuf {
    let via = if path.is_absolute() {
        format!("/proc/{pid}/root{}", path.display())
    } else {
        format!("/proc/{pid}/cwd/{}", path.display())
    };
    // sun_path: 108 bytes with its NUL.
    if via.len() < 108 {
        via.into()
    } else {
        path.to_path_buf()
    }
}

/// How long the guest channel waits on a monitor for the layout.
const LAYOUT_TIMEOUT: Duration = Duration::from_secs(2);

/// QEMU's split of each guest's RAM, as its monitor said: by QEMU pid, with the
/// process's start time (so that a reused pid does not find another QEMU's answer).
#[derive(Default)]
pub struct QemuLayouts {
    known: Mutex<BTreeMap<u32, Split>>,
}

/// A QEMU's answer: its start time (clock ticks after boot), and its RAM's split
/// ([`Qmp::ram_split`]): bytes from guest-physical 0 and from 4 GiB.
#[derive(Clone, Copy, Debug)]
struct Split {
    started: u64,
    below: u64,
    above: u64,
}

impl QemuLayouts {
    /// Asks QEMU `pid`'s monitor `q` for its RAM's split and keeps the answer.
    ///
    /// Errors: the monitor's, in words ([`said`]: escaped, short, as QEMU's error text
    /// may be anything); `Ok(false)`: a machine without the split (not pc or q35).
    pub fn ask(&self, pid: u32, q: &mut Qmp) -> Result<bool, String> {
        let Some(started) = started(pid) else {
            return Err(format!("QEMU pid {pid} is gone"));
        };
        let split = q
            .ram_split()
            .map_err(|e| said(&format!("QEMU pid {pid}'s RAM split: {e}")))?;
        let Some((below, above)) = split else {
            return Ok(false);
        };
        if let Ok(mut k) = self.known.lock() {
            // Answers of QEMUs that ended go with the next one.
            k.retain(|&p, s| started_is(p, s.started));
            k.insert(
                pid,
                Split {
                    started,
                    below,
                    above,
                },
            );
        }
        Ok(true)
    }

    /// The exact layout of QEMU `pid`'s guest RAM of `pages` pages: the kept answer, else
    /// its monitor's (opened here for a moment, each exchange within 2 s, given up within
    /// a fraction of a second once `stop` is set: the caller's thread is never held).
    ///
    /// Errors: why there is none, in words ([`said`]: escaped, short): no monitor, a
    /// machine without the split, a split that does not fit `pages`
    /// ([`RamLayout::from_qemu`]), told to stop.
    pub fn layout(
        &self,
        pid: u32,
        pages: u64,
        stop: &Arc<AtomicBool>,
    ) -> Result<RamLayout, String> {
        let s = match self.kept(pid) {
            Some(s) => s,
            None => {
                let asked = open_monitor(pid, LAYOUT_TIMEOUT, Some(stop))
                    .and_then(|mut q| self.ask(pid, &mut q));
                // A claimer that holds the monitor asked as it connected.
                match (self.kept(pid), asked) {
                    (Some(s), _) => s,
                    (None, Ok(false)) => {
                        return Err("QEMU's machine has no below-4g/above-4g split".into())
                    }
                    (None, Ok(true)) => return Err(format!("QEMU pid {pid} is gone")),
                    (None, Err(why)) => return Err(why),
                }
            }
        };
        RamLayout::from_qemu(pages, s.below, s.above).map_err(|e| e.to_string())
    }

    fn kept(&self, pid: u32) -> Option<Split> {
        let k = self.known.lock().ok()?;
        k.get(&pid).copied().filter(|s| started_is(pid, s.started))
    }
}

/// When process `pid` started (clock ticks after boot: `/proc/PID/stat` field 22); `None`:
/// no such process. With the pid, which process it is: a reused pid has another start
/// time (the kept layouts here, the balloon claimers in [`crate::daemon::balloon`]).
pub(crate) fn started(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn started_is(pid: u32, at: u64) -> bool {
    started(pid) == Some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmdline(args: &[&str]) -> Vec<u8> {
        let mut v = Vec::new();
        for a in args {
            v.extend_from_slice(a.as_bytes());
            v.push(0);
        }
        v
    }

    /// A QEMU whose monitor socket is a path relative to its own working directory (as
    /// `memfold qemu` users write one) is reached there, not in memfoldd's folder. Seen
    /// failing without the mend: no such socket. The stand-in never greets, so reaching
    /// it ends in the greeting's time limit.
    #[test]
    fn a_monitor_at_a_path_relative_to_its_qemu_is_reached() {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let l = std::os::unix::net::UnixListener::bind(dir.path().join("mon.sock")).unwrap();
        let fd = l.as_raw_fd();
        let chardev = format!("socket,id={MONITOR_ID},path=mon.sock,server=on,wait=off");
        let mut c = std::process::Command::new("sh");
        c.args([
            "-c",
            "while :; do sleep 1; done",
            "qemu",
            "-chardev",
            &chardev,
        ])
        .current_dir(dir.path());
        // SAFETY: between fork and exec only listen(2), async-signal-safe, on a
        // descriptor the child inherited open (the listener, alive past spawn): the
        // child, not this process, is then the socket's server.
        unsafe {
            c.pre_exec(move || match libc::listen(fd, 4) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
        let mut qemu = c.spawn().unwrap();
        let got = open_monitor(qemu.id(), Duration::from_millis(500), None);
        let _ = qemu.kill();
        let _ = qemu.wait();
        let e = got.err().expect("a stand-in that never greets");
        assert!(e.contains("greeting"), "not reached: {e}");
    }

    /// A QEMU whose error text holds a newline, an escape and 5 000 characters: the
    /// reason memfoldd gives (and the guest channel logs) is one line of at most
    /// [`WHY_CHARS`] characters. Seen failing without the mend: the text came whole, the
    /// newline in it (a forged log line).
    #[test]
    fn a_qemus_error_text_is_escaped_and_cut() {
        use std::io::{BufRead, BufReader, Write};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let desc = format!("\n2026 WARN forged\u{1b}[2J {}", "A".repeat(5000));
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let r = BufReader::new(s.try_clone().unwrap());
            writeln!(s, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
            for line in r.lines() {
                let Ok(line) = line else { return };
                let m: serde_json::Value = serde_json::from_str(&line).unwrap();
                let reply = if m["execute"] == "qmp_capabilities" {
                    serde_json::json!({ "return": {}, "id": m["id"] })
                } else {
                    let e = serde_json::json!({ "class": "GenericError", "desc": desc });
                    serde_json::json!({ "error": e, "id": m["id"] })
                };
                if writeln!(s, "{reply}").is_err() {
                    return;
                }
            }
        });
        let me = std::process::id();
        let mut q = Qmp::connect_served_by(&path, me, Duration::from_secs(2)).unwrap();
        let why = QemuLayouts::default().ask(me, &mut q).unwrap_err();
        assert!(!why.contains('\n'), "{why}");
        assert!(
            why.chars().all(|c| c == ' ' || c.is_ascii_graphic()),
            "{why}"
        );
        assert!(why.chars().count() <= WHY_CHARS, "{} chars", why.len());
        assert!(why.contains("\\n2026 WARN forged\\u{1b}[2J AAA"), "{why}");
        // Said twice: the same.
        assert_eq!(said(&why), why);
    }

    #[test]
    fn a_process_start_time_is_read_past_its_name() {
        let me = std::process::id();
        let t = started(me).expect("this process has a start time");
        assert!(started_is(me, t) && !started_is(me, t + 1));
        assert_eq!(started(u32::MAX), None);
    }

    #[test]
    fn the_monitor_is_the_chardev_socket_with_memfolds_id_and_no_other() {
        let c = cmdline(&[
            "qemu-system-x86_64",
            "-qmp",
            "unix:/run/a/qmp.sock,server=on,wait=off",
            "-chardev",
            "socket,id=other,path=/run/a/other.sock,server=on",
            "-chardev",
            "socket,path=/run/a/memfold-qmp.sock,id=memfold-qmp,server=on,wait=off",
            "-mon",
            "chardev=memfold-qmp,mode=control",
        ]);
        assert_eq!(
            monitor_path(&c),
            Some(PathBuf::from("/run/a/memfold-qmp.sock"))
        );
        assert_eq!(
            monitor_path(&cmdline(&["qemu", "-qmp", "unix:/x,server=on"])),
            None
        );
        assert_eq!(
            monitor_path(&cmdline(&["qemu", "-chardev", "socket,id=memfold-qmp"])),
            None
        );
        assert_eq!(monitor_path(&cmdline(&["qemu", "-chardev"])), None);
        // A comma in the path is doubled on QEMU's command line (it was cut there).
        assert_eq!(
            monitor_path(&cmdline(&[
                "qemu",
                "-chardev",
                "socket,id=memfold-qmp,path=/run/vm,,1/memfold-qmp.sock,server=on,wait=off",
            ])),
            Some(PathBuf::from("/run/vm,1/memfold-qmp.sock"))
        );
        // An id=memfold-qmp inside another item's value is not the id.
        assert_eq!(
            monitor_path(&cmdline(&[
                "qemu",
                "-chardev",
                "socket,id=other,path=/run/a,,id=memfold-qmp",
            ])),
            None
        );
    }
}
