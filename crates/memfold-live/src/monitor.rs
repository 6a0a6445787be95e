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
use std::sync::Mutex;
use std::time::Duration;

use memfold_core::categories::RamLayout;
use memfold_vm::qmp::{Qmp, QmpError};
use memfold_wire::keyval::keyval;

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

/// The monitor QEMU `pid`'s command line names for memfoldd, connected (checked to be
/// served by `pid`), with `timeout` on each read and write.
///
/// Errors: why not, in words (no monitor on the command line, a socket served by another
/// process, QEMU not answering).
pub fn open_monitor(pid: u32, timeout: Duration) -> Result<Qmp, String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| format!("cannot read its command line: {e}"))?;
    let path = monitor_path(&cmdline).ok_or_else(|| {
        format!("no monitor for memfoldd: add -chardev socket,id={MONITOR_ID},path=PATH,server=on,wait=off -mon chardev={MONITOR_ID},mode=control")
    })?;
    Qmp::connect_served_by(&path, pid, timeout).map_err(|e| match e {
        QmpError::WrongServer { .. } => format!("{e}: refused"),
        e => e.to_string(),
    })
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
    /// Errors: the monitor's, in words; `Ok(false)`: a machine without the split (not
    /// pc or q35).
    pub fn ask(&self, pid: u32, q: &mut Qmp) -> Result<bool, String> {
        let Some(started) = started(pid) else {
            return Err(format!("QEMU pid {pid} is gone"));
        };
        let Some((below, above)) = q.ram_split().map_err(|e| e.to_string())? else {
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
    /// its monitor's (opened here for a moment).
    ///
    /// Errors: why there is none, in words (no monitor, a machine without the split, a
    /// split that does not fit `pages`: [`RamLayout::from_qemu`]).
    pub fn layout(&self, pid: u32, pages: u64) -> Result<RamLayout, String> {
        let s = match self.kept(pid) {
            Some(s) => s,
            None => {
                let asked =
                    open_monitor(pid, LAYOUT_TIMEOUT).and_then(|mut q| self.ask(pid, &mut q));
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
