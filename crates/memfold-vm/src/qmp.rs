//! A QMP client: JSON commands over QEMU's monitor socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// QMP failures.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be reached in time.
    #[error("QMP socket {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// Reading or writing the socket failed (QEMU exited?).
    #[error("QMP I/O: {0}")]
    Io(#[from] std::io::Error),
    /// QEMU answered with an error.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QMP error class.
        class: String,
        /// QMP error description.
        desc: String,
    },
    /// Something that is not QMP came back.
    #[error("QMP protocol: {0}")]
    Protocol(String),
    /// The socket is served by another process than the guest's QEMU: a path a peer gave
    /// that would reach some other VM's monitor (refused, see
    /// [`Qmp::connect_served_by`]).
    #[error("QMP socket {path} is served by pid {found:?}, not the guest's QEMU (pid {expected})")]
    WrongServer {
        /// Socket path.
        path: String,
        /// The guest's QEMU.
        expected: u32,
        /// The process serving the socket (`None`: the kernel did not say).
        found: Option<u32>,
    },
}

/// The longest QMP message read, bytes: a peer cannot make its reader hold more.
pub const MAX_MESSAGE: u64 = 1 << 20;

/// Asynchronous events skipped while waiting for one command's answer: a QEMU that
/// floods events gets an error, not a reader stuck for ever.
const MAX_EVENTS_PER_COMMAND: usize = 10_000;

/// A connected QMP session in command mode.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects to the socket (retrying until `timeout` while QEMU starts), reads the
    /// greeting and enters command mode.
    ///
    /// Errors: [`QmpError::Connect`] after the timeout, [`QmpError::Protocol`].
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let start = Instant::now();
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if start.elapsed() < timeout => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(source) => {
                    return Err(QmpError::Connect {
                        path: path.display().to_string(),
                        source,
                    })
                }
            }
        };
        Self::start(stream, Duration::from_secs(120))
    }

    /// Connects to the QMP socket at `path` — a path a peer named, so untrusted — only if
    /// the process serving it is `pid` (the kernel's `SO_PEERCRED` of the connection: the
    /// process that made the listening socket), with `timeout` on every read and write.
    /// This keeps a guest's QEMU from pointing memfoldd at another guest's monitor.
    ///
    /// Errors: [`QmpError::Connect`], [`QmpError::WrongServer`], [`QmpError::Protocol`],
    /// [`QmpError::Io`] (a timeout included).
    pub fn connect_served_by(path: &Path, pid: u32, timeout: Duration) -> Result<Self, QmpError> {
        // Not a blocking connect: a listener that never accepts would hold the caller.
        let stream = memfold_sys::socket::connect_stream_at_once(path).map_err(|source| {
            QmpError::Connect {
                path: path.display().to_string(),
                source,
            }
        })?;
        let found = rustix::net::sockopt::socket_peercred(&stream)
            .ok()
            .map(|c| c.pid.as_raw_nonzero().get() as u32);
        if found != Some(pid) {
            return Err(QmpError::WrongServer {
                path: path.display().to_string(),
                expected: pid,
                found,
            });
        }
        stream.set_write_timeout(Some(timeout))?;
        Self::start(stream, timeout)
    }

    /// Reads the greeting of a connected monitor and enters command mode.
    fn start(stream: UnixStream, read_timeout: Duration) -> Result<Self, QmpError> {
        stream.set_read_timeout(Some(read_timeout))?;
        let mut q = Qmp {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        };
        let greeting = q.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("no greeting: {greeting}")));
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        if (&mut self.reader).take(MAX_MESSAGE).read_line(&mut line)? == 0 {
            return Err(QmpError::Protocol("connection closed".into()));
        }
        if !line.ends_with('\n') {
            return Err(QmpError::Protocol(format!(
                "a message of more than {MAX_MESSAGE} bytes, or cut short"
            )));
        }
        serde_json::from_str(&line)
            .map_err(|e| QmpError::Protocol(format!("bad JSON {line:?}: {e}")))
    }

    /// Runs a command and returns its `return` value; asynchronous events are skipped.
    ///
    /// Errors: [`QmpError::Command`] when QEMU refuses, [`QmpError::Io`].
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        writeln!(self.writer, "{msg}")?;
        for _ in 0..=MAX_EVENTS_PER_COMMAND {
            let v = self.read_message()?;
            if v.get("event").is_some() {
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: command.into(),
                    class: e["class"].as_str().unwrap_or("?").into(),
                    desc: e["desc"].as_str().unwrap_or("?").into(),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected reply {v}")));
        }
        Err(QmpError::Protocol(format!(
            "more than {MAX_EVENTS_PER_COMMAND} events and no answer to {command}"
        )))
    }

    /// Asks the guest's balloon to leave it `bytes` of RAM (QMP `balloon`; the guest's
    /// driver inflates or deflates in its own time).
    ///
    /// Errors: as [`Qmp::execute`] (`DeviceNotActive`: no balloon device or driver).
    pub fn balloon(&mut self, bytes: u64) -> Result<(), QmpError> {
        self.execute("balloon", Some(json!({ "value": bytes })))
            .map(|_| ())
    }

    /// The QOM path of the guest's virtio balloon (`None`: it has none), among the
    /// devices given an id (`/machine/peripheral`) and those without (`…-anon`).
    ///
    /// Errors: as [`Qmp::execute`].
    pub fn balloon_path(&mut self) -> Result<Option<String>, QmpError> {
        for dir in ["/machine/peripheral", "/machine/peripheral-anon"] {
            let list = self.execute("qom-list", Some(json!({ "path": dir })))?;
            let found = list.as_array().into_iter().flatten().find_map(|p| {
                let ty = p.get("type")?.as_str()?;
                let name = p.get("name")?.as_str()?;
                ty.starts_with("child<virtio-balloon")
                    .then(|| format!("{dir}/{name}"))
            });
            if found.is_some() {
                return Ok(found);
            }
        }
        Ok(None)
    }

    /// Asks the guest's balloon driver, through the balloon at QOM `path`, for its
    /// statistics every `secs` seconds.
    ///
    /// Errors: as [`Qmp::execute`].
    pub fn balloon_stats_every(&mut self, path: &str, secs: u32) -> Result<(), QmpError> {
        self.execute(
            "qom-set",
            Some(
                json!({ "path": path, "property": "guest-stats-polling-interval", "value": secs }),
            ),
        )
        .map(|_| ())
    }

    /// The guest's last balloon statistics, as (available, total) bytes — each `None`
    /// when the guest does not report it (QEMU says -1, or the driver sent none yet).
    ///
    /// Errors: as [`Qmp::execute`].
    pub fn balloon_guest_memory(
        &mut self,
        path: &str,
    ) -> Result<(Option<u64>, Option<u64>), QmpError> {
        let r = self.execute(
            "qom-get",
            Some(json!({ "path": path, "property": "guest-stats" })),
        )?;
        let stat = |k: &str| {
            r.get("stats")
                .and_then(|s| s.get(k))
                .and_then(Value::as_i64)
                .and_then(|v| u64::try_from(v).ok())
        };
        Ok((stat("stat-available-memory"), stat("stat-total-memory")))
    }

    /// QEMU's split of an x86 guest's RAM, bytes: how much it maps from guest-physical 0
    /// and how much from 4 GiB (the PCI host bridge's `below-4g-mem-size` and
    /// `above-4g-mem-size`: q35's `/machine/q35`, pc's `/machine/i440fx`); `None` for a
    /// machine whose host bridge does not say (QEMU 7.2's pc has no such properties).
    ///
    /// Errors: as [`Qmp::execute`]; [`QmpError::Protocol`] for a size that is no number.
    pub fn ram_split(&mut self) -> Result<Option<(u64, u64)>, QmpError> {
        for host in ["/machine/q35", "/machine/i440fx"] {
            let size = |q: &mut Self, property: &str| -> Result<u64, QmpError> {
                let v = q.execute(
                    "qom-get",
                    Some(json!({ "path": host, "property": property })),
                )?;
                v.as_u64().ok_or_else(|| {
                    QmpError::Protocol(format!("{host} {property}: not a size: {v}"))
                })
            };
            // No such host (the other machine type), or a host without the property
            // (pc's before QEMU 8): not this one.
            let below = match size(self, "below-4g-mem-size") {
                Err(QmpError::Command { class, desc, .. })
                    if class == "DeviceNotFound" || desc.contains("not found") =>
                {
                    continue
                }
                r => r?,
            };
            return Ok(Some((below, size(self, "above-4g-mem-size")?)));
        }
        Ok(None)
    }

    /// The guest's RAM as QEMU has it, bytes: `query-memory-size-summary`'s base memory
    /// plus the memory plugged since (DIMMs; 0 if not said).
    ///
    /// Errors: as [`Qmp::execute`]; [`QmpError::Protocol`] without a base size, or sizes
    /// whose sum overflows.
    pub fn memory_size(&mut self) -> Result<u64, QmpError> {
        let r = self.execute("query-memory-size-summary", None)?;
        let base = r.get("base-memory").and_then(Value::as_u64);
        let plugged = match r.get("plugged-memory") {
            None => Some(0),
            Some(v) => v.as_u64(),
        };
        base.zip(plugged)
            .and_then(|(b, p)| b.checked_add(p))
            .ok_or_else(|| QmpError::Protocol(format!("query-memory-size-summary: {r}")))
    }

    /// The RAM the guest's balloon leaves it now, bytes (`query-balloon`'s `actual`).
    ///
    /// Errors: as [`Qmp::execute`]; [`QmpError::Protocol`] without a number.
    pub fn balloon_actual(&mut self) -> Result<u64, QmpError> {
        let r = self.execute("query-balloon", None)?;
        r.get("actual")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("query-balloon without actual: {r}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A monitor served by this process that greets, answers `qmp_capabilities`, then
    /// plays `script` to the next command.
    fn fake_monitor(
        dir: &Path,
        script: impl FnOnce(&mut UnixStream) + Send + 'static,
    ) -> std::path::PathBuf {
        let path = dir.join("qmp.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            writeln!(s, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
            r.read_line(&mut line).unwrap();
            writeln!(s, r#"{{"return": {{}}}}"#).unwrap();
            line.clear();
            r.read_line(&mut line).unwrap();
            script(&mut s);
        });
        path
    }

    #[test]
    fn a_monitor_served_by_another_process_than_the_guests_qemu_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_monitor(dir.path(), |_| {});
        let me = std::process::id();
        let e = Qmp::connect_served_by(&path, me + 1, Duration::from_secs(2))
            .err()
            .unwrap();
        assert!(
            matches!(e, QmpError::WrongServer { expected, found: Some(f), .. } if expected == me + 1 && f == me),
            "{e}"
        );
    }

    #[test]
    fn the_balloon_is_read_and_set_through_the_guests_own_monitor() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_monitor(dir.path(), |s| {
            writeln!(
                s,
                r#"{{"event": "BALLOON_CHANGE", "data": {{"actual": 1}}}}"#
            )
            .unwrap();
            writeln!(s, r#"{{"return": {{"actual": 268435456}}}}"#).unwrap();
        });
        let mut q =
            Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
        assert_eq!(q.balloon_actual().unwrap(), 256 << 20);
    }

    #[test]
    fn a_monitor_that_floods_gets_an_error_not_a_reader_that_holds_it_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_monitor(dir.path(), |s| {
            let big = vec![b'x'; (MAX_MESSAGE + 10) as usize];
            let _ = s.write_all(&big);
        });
        let mut q =
            Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
        let e = q.balloon_actual().unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
    }

    #[test]
    fn a_monitor_that_sends_only_events_gets_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_monitor(dir.path(), |s| {
            for _ in 0..=MAX_EVENTS_PER_COMMAND + 1 {
                if writeln!(s, r#"{{"event": "X"}}"#).is_err() {
                    return;
                }
            }
        });
        let mut q =
            Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
        let e = q.balloon(1 << 30).unwrap_err();
        assert!(e.to_string().contains("events and no answer"), "{e}");
    }
}
