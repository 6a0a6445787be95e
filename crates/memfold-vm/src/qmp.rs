//! A QMP client: JSON commands over QEMU's monitor socket.

use std::io::{BufRead, BufReader, Write};
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
}

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
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
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
        if self.reader.read_line(&mut line)? == 0 {
            return Err(QmpError::Protocol("connection closed".into()));
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
        loop {
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
    }
}
