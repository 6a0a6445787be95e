//! A QMP client: JSON commands over QEMU's monitor socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memfold_sys::deadline::DeadlineReader;
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
    /// A whole message did not come within the exchange's time limit.
    #[error("QMP socket {path}: no whole {what} within {limit:?}")]
    TimedOut {
        /// Socket path.
        path: String,
        /// What was awaited (the greeting, a command's answer).
        what: String,
        /// The exchange's time limit.
        limit: Duration,
    },
    /// The session's stop flag was set while it waited ([`Qmp::connect_served_by_unless`]).
    #[error("QMP socket {path}: told to stop while waiting for the {what}")]
    Stopped {
        /// Socket path.
        path: String,
        /// What was awaited.
        what: String,
    },
    /// An earlier exchange of this session failed half way ([`Qmp::unusable`]): the
    /// socket may still hold its late answer, so nothing more is asked on it.
    #[error("QMP socket {path}: session unusable after an earlier failure ({why}); reconnect")]
    Unusable {
        /// Socket path.
        path: String,
        /// The earlier failure.
        why: String,
    },
}

/// The longest QMP message read, bytes: a peer cannot make its reader hold more.
pub const MAX_MESSAGE: u64 = 1 << 20;

/// Asynchronous events skipped while waiting for one command's answer: a QEMU that
/// floods events gets an error, not a reader stuck for ever.
const MAX_EVENTS_PER_COMMAND: usize = 10_000;

/// How long a session opened by [`Qmp::connect`] may take for its greeting and for each
/// command's answer (a `pmemsave` of a guest's RAM answers only when done).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// How often a reader with a stop flag looks at it while waiting.
const STOP_LOOK: Duration = Duration::from_millis(200);

/// Most characters of a peer's message quoted in a [`QmpError::Protocol`].
const QUOTED_CHARS: usize = 200;

/// A connected QMP session in command mode.
///
/// Every exchange has a deadline for the whole of it — the greeting and
/// `qmp_capabilities` as it connects, then each command and its answer — however the
/// answer's bytes trickle in. Each command carries an `id`, and only the answer with that
/// id is taken; after an exchange fails half way (a timeout, I/O, a line that is not
/// QMP) the session refuses further commands ([`QmpError::Unusable`]), so no command
/// ever gets an earlier one's late answer.
pub struct Qmp {
    reader: BufReader<DeadlineReader>,
    writer: UnixStream,
    /// The socket's path, for errors.
    path: String,
    /// How long each exchange may take, whole.
    limit: Duration,
    /// The `id` of the last command sent.
    last_id: u64,
    /// Why the session may no longer be used, once an exchange failed half way.
    broken: Option<String>,
}

impl Qmp {
    /// Connects to the socket (retrying until `timeout` while QEMU starts), reads the
    /// greeting and enters command mode; the greeting, and each command's answer later,
    /// may take up to 120 s each (a `pmemsave` answers when done). A caller that must not
    /// wait that long (a stop) uses [`Qmp::connect_within`].
    ///
    /// Errors: [`QmpError::Connect`] after the timeout, [`QmpError::TimedOut`],
    /// [`QmpError::Protocol`], [`QmpError::Io`].
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let stream = reach(path, Instant::now() + timeout)?;
        Self::start(stream, path, ANSWER_TIMEOUT, None)
    }

    /// Connects to the socket (retrying while QEMU starts), reads the greeting and enters
    /// command mode, all within `limit`; each command's answer later must come within
    /// `limit` too.
    ///
    /// Errors: [`QmpError::Connect`] (nothing listens, `limit` passed),
    /// [`QmpError::TimedOut`], [`QmpError::Protocol`], [`QmpError::Io`].
    pub fn connect_within(path: &Path, limit: Duration) -> Result<Self, QmpError> {
        let until = Instant::now() + limit;
        let stream = reach(path, until)?;
        Self::start_by(stream, path, limit, until, None)
    }

    /// Connects to the QMP socket at `path` — a path a peer named, so untrusted — only if
    /// the process serving it is `pid` (the kernel's `SO_PEERCRED` of the connection: the
    /// process that made the listening socket). The greeting and `qmp_capabilities` must
    /// be done within `timeout`, and each command's answer later within `timeout` too,
    /// however a peer trickles its bytes. This keeps a guest's QEMU from pointing memfoldd
    /// at another guest's monitor, or holding its thread.
    ///
    /// Errors: [`QmpError::Connect`], [`QmpError::WrongServer`], [`QmpError::TimedOut`],
    /// [`QmpError::Protocol`], [`QmpError::Io`].
    pub fn connect_served_by(path: &Path, pid: u32, timeout: Duration) -> Result<Self, QmpError> {
        Self::connect_served_by_unless(path, pid, timeout, None)
    }

    /// As [`Qmp::connect_served_by`], and every wait of the session — as it connects and
    /// for each answer — ends within about 200 ms once `stop` is set
    /// ([`QmpError::Stopped`]): a thread told to stop is never held by its QEMU.
    ///
    /// Errors: as [`Qmp::connect_served_by`]; [`QmpError::Stopped`].
    pub fn connect_served_by_unless(
        path: &Path,
        pid: u32,
        timeout: Duration,
        stop: Option<Arc<AtomicBool>>,
    ) -> Result<Self, QmpError> {
        // Not a blocking connect: a listener that never accepts would hold the caller.
        let stream = memfold_sys::socket::connect_stream_at_once(path).map_err(|source| {
            QmpError::Connect {
                path: path.display().to_string(),
                source,
            }
        })?;
        let found = memfold_sys::socket::peer_of(std::os::fd::AsFd::as_fd(&stream))
            .ok()
            .map(|p| p.pid);
        if found != Some(pid) {
            return Err(QmpError::WrongServer {
                path: path.display().to_string(),
                expected: pid,
                found,
            });
        }
        Self::start(stream, path, timeout, stop)
    }

    /// Reads the greeting of a connected monitor and enters command mode, within `limit`.
    fn start(
        stream: UnixStream,
        path: &Path,
        limit: Duration,
        stop: Option<Arc<AtomicBool>>,
    ) -> Result<Self, QmpError> {
        Self::start_by(stream, path, limit, Instant::now() + limit, stop)
    }

    /// Reads the greeting of a connected monitor and enters command mode by `until`;
    /// later exchanges get `limit` each.
    fn start_by(
        stream: UnixStream,
        path: &Path,
        limit: Duration,
        until: Instant,
        stop: Option<Arc<AtomicBool>>,
    ) -> Result<Self, QmpError> {
        let mut q = Qmp {
            reader: BufReader::new(DeadlineReader::new(
                stream.try_clone()?,
                until,
                stop,
                STOP_LOOK,
            )),
            writer: stream,
            path: path.display().to_string(),
            limit,
            last_id: 0,
            broken: None,
        };
        let greeting = q.read_message("greeting")?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "no greeting: {}",
                quoted(&greeting.to_string())
            )));
        }
        q.exchange("qmp_capabilities", None, until)?;
        Ok(q)
    }

    /// Why this session may no longer be used (an exchange failed half way: its answer
    /// may still come); `None` while it may.
    pub fn unusable(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The next message, by the reader's deadline; `what`: what is awaited, for errors.
    fn read_message(&mut self, what: &str) -> Result<Value, QmpError> {
        let mut line = String::new();
        match (&mut self.reader).take(MAX_MESSAGE).read_line(&mut line) {
            Ok(0) => return Err(QmpError::Protocol("connection closed".into())),
            Ok(_) => {}
            Err(e) => {
                let d = self.reader.get_ref();
                let (path, what) = (self.path.clone(), what.to_string());
                return Err(if d.stopped() {
                    QmpError::Stopped { path, what }
                } else if e.kind() == std::io::ErrorKind::TimedOut && Instant::now() >= d.until {
                    QmpError::TimedOut {
                        path,
                        what,
                        limit: self.limit,
                    }
                } else {
                    QmpError::Io(e)
                });
            }
        }
        if !line.ends_with('\n') {
            return Err(QmpError::Protocol(format!(
                "a message of more than {MAX_MESSAGE} bytes, or cut short"
            )));
        }
        serde_json::from_str(&line)
            .map_err(|e| QmpError::Protocol(format!("bad JSON {}: {e}", quoted(&line))))
    }

    /// Runs a command and returns its `return` value; asynchronous events are skipped.
    /// The command and its answer must be done within the session's time limit.
    ///
    /// Errors: [`QmpError::Command`] when QEMU refuses, [`QmpError::TimedOut`],
    /// [`QmpError::Stopped`], [`QmpError::Io`], [`QmpError::Protocol`] — after any of
    /// these but the first the session is unusable, and every later command is refused
    /// with [`QmpError::Unusable`].
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        if let Some(why) = &self.broken {
            return Err(QmpError::Unusable {
                path: self.path.clone(),
                why: why.clone(),
            });
        }
        let r = self.exchange(command, arguments, Instant::now() + self.limit);
        if let Err(e) = &r {
            if !matches!(e, QmpError::Command { .. }) {
                self.broken = Some(e.to_string());
            }
        }
        r
    }

    /// Sends `command` with the next `id` and reads its answer, by `until`.
    fn exchange(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        until: Instant,
    ) -> Result<Value, QmpError> {
        self.last_id += 1;
        let id = self.last_id;
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        // A zero timeout would mean none: at least a millisecond.
        let left = until.saturating_duration_since(Instant::now());
        self.writer
            .set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        self.writer.write_all(line.as_bytes())?;
        self.reader.get_mut().until = until;
        let what = format!("answer to {command}");
        for _ in 0..=MAX_EVENTS_PER_COMMAND {
            let v = self.read_message(&what)?;
            if v.get("event").is_some() {
                continue;
            }
            if v.get("id") != Some(&Value::from(id)) {
                return Err(QmpError::Protocol(format!(
                    "{command} (id {id}) answered by a message of another id: {}",
                    quoted(&v.to_string())
                )));
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
            return Err(QmpError::Protocol(format!(
                "unexpected reply {}",
                quoted(&v.to_string())
            )));
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
                    QmpError::Protocol(format!(
                        "{host} {property}: not a size: {}",
                        quoted(&v.to_string())
                    ))
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
            .ok_or_else(|| {
                QmpError::Protocol(format!(
                    "query-memory-size-summary: {}",
                    quoted(&r.to_string())
                ))
            })
    }

    /// The RAM the guest's balloon leaves it now, bytes (`query-balloon`'s `actual`).
    ///
    /// Errors: as [`Qmp::execute`]; [`QmpError::Protocol`] without a number.
    pub fn balloon_actual(&mut self) -> Result<u64, QmpError> {
        let r = self.execute("query-balloon", None)?;
        r.get("actual").and_then(Value::as_u64).ok_or_else(|| {
            QmpError::Protocol(format!(
                "query-balloon without actual: {}",
                quoted(&r.to_string())
            ))
        })
    }
}

/// Connects to the socket at `path`, retrying while nothing listens there yet (QEMU
/// starting) or its backlog is full, until `until`. Never a blocking connect: a listener
/// that never accepts would hold the caller past any deadline.
fn reach(path: &Path, until: Instant) -> Result<UnixStream, QmpError> {
    loop {
        match memfold_sys::socket::connect_stream_at_once(path) {
            Ok(s) => return Ok(s),
            Err(_) if Instant::now() < until => {
                let left = until.saturating_duration_since(Instant::now());
                std::thread::sleep(left.min(Duration::from_millis(50)));
            }
            Err(source) => {
                return Err(QmpError::Connect {
                    path: path.display().to_string(),
                    source,
                })
            }
        }
    }
}

/// At most `QUOTED_CHARS` characters of a peer's message, quoted with its control
/// characters escaped (`"…"`): an error that quotes a QEMU stays one short line.
fn quoted(text: &str) -> String {
    let cut: String = text.chars().take(QUOTED_CHARS).collect();
    let more = if cut.len() < text.len() { "..." } else { "" };
    format!("{cut:?}{more}")
}

#[cfg(test)]
mod tests;
