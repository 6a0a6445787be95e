//! The guest channel (issue 17, PV §3.1): what memfoldd and `memfold-guest`, the agent
//! inside an enlightened guest, say to each other over the virtio-serial port
//! [`PORT_NAME`] (QEMU: `-device virtio-serial-pci -chardev socket,id=mfg,path=SOCK,
//! server=on,wait=off -device virtserialport,chardev=mfg,name=org.memfold.guest.0`; the
//! guest sees `/dev/virtio-ports/org.memfold.guest.0`).
//!
//! One JSON object a line, each at most [`MAX_GUEST_LINE`] bytes, every one carrying the
//! protocol version `v` ([`GUEST_PROTOCOL_VERSION`]). memfoldd asks
//! ([`ToGuest::Categories`]); the guest answers with the same `seq`: one
//! [`FromGuest::Ram`] (its System RAM ranges from `/proc/iomem` and a few `/proc/meminfo`
//! values), then [`FromGuest::Runs`] chunks in increasing frame order, each a run-length
//! list of `[code, pages]` over the guest's physical frames from `first` (codes as
//! `memfold_core::categories::PageInfo::code`: category in bits 0–2, active bit 3,
//! referenced bit 4), then [`FromGuest::End`] — or [`FromGuest::Error`]. The guest
//! speaks only when asked, so a port with nobody on the host side costs it nothing.
//!
//! Everything from the guest is untrusted: lines are bounded ([`LineReader`]), decoding
//! fails with a typed [`GuestWireError`], a chunk holds at most [`MAX_RUNS`] runs, a
//! report at most [`MAX_CHUNKS`] chunks; memfoldd then checks the report against the
//! guest's RAM (`memfold-live`'s `guest_channel`).

use std::io::{self, BufRead};

use serde::{Deserialize, Serialize};

/// The virtio-serial port's name.
pub const PORT_NAME: &str = "org.memfold.guest.0";

/// The guest channel's protocol version; a line of another is refused.
pub const GUEST_PROTOCOL_VERSION: u32 = 1;

/// Longest line either side sends, bytes (newline excluded).
pub const MAX_GUEST_LINE: usize = 1 << 20;

/// Most runs in one [`FromGuest::Runs`] chunk.
pub const MAX_RUNS: usize = 65_536;

/// Most chunks in one report.
pub const MAX_CHUNKS: u32 = 4096;

/// Most System RAM ranges in one [`FromGuest::Ram`].
pub const MAX_RANGES: usize = 256;

/// memfoldd to the guest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "req", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToGuest {
    /// Report every page's category now.
    Categories {
        /// Protocol version.
        v: u32,
        /// Request number, echoed in every line of the answer.
        seq: u64,
    },
}

/// A few of the guest's `/proc/meminfo` values, KiB (0 when the guest did not say).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GuestMeminfo {
    /// `MemTotal`.
    pub mem_total: u64,
    /// `MemFree`.
    pub mem_free: u64,
    /// `Buffers`.
    pub buffers: u64,
    /// `Cached`.
    pub cached: u64,
    /// `AnonPages`.
    pub anon_pages: u64,
    /// `Shmem`.
    pub shmem: u64,
    /// `Slab`.
    pub slab: u64,
}

/// The guest to memfoldd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum FromGuest {
    /// The start of an answer: where its RAM is and what its kernel counts.
    Ram {
        /// Protocol version.
        v: u32,
        /// The request's number.
        seq: u64,
        /// The guest agent's name and version.
        agent: String,
        /// Its kernel's release.
        kernel: String,
        /// Its "System RAM" ranges, frame numbers `[start, end)`, from `/proc/iomem`.
        ranges: Vec<[u64; 2]>,
        /// From `/proc/meminfo`.
        meminfo: GuestMeminfo,
        /// Its free pages may be discarded, reading as zeros afterwards (issue 17): its
        /// kernel does not check a free page's old bytes (no page poisoning). Absent
        /// (an older `memfold-guest`): false, nothing discarded.
        #[serde(default)]
        discard: bool,
    },
    /// Pages by category: consecutive runs of `[code, pages]` over physical frames from
    /// `first`.
    Runs {
        /// Protocol version.
        v: u32,
        /// The request's number.
        seq: u64,
        /// First frame.
        first: u64,
        /// `[code, pages]`.
        runs: Vec<[u32; 2]>,
    },
    /// The end of an answer.
    End {
        /// Protocol version.
        v: u32,
        /// The request's number.
        seq: u64,
        /// [`FromGuest::Runs`] chunks sent.
        chunks: u32,
        /// Frames the runs covered.
        frames: u64,
        /// The guest agent's own time reading its kernel's page flags
        /// (`/proc/kpageflags`, and `/proc/kpagecount` where the flags leave a frame's
        /// category open) and classifying them, µs: most of a report's cost (not its
        /// other reads, encoding or transfer). Absent (an older `memfold-guest`): 0. An
        /// older memfoldd refuses an `end` line that has it (`deny_unknown_fields`):
        /// images and daemon ship together.
        #[serde(default)]
        walk_us: u64,
    },
    /// The guest could not answer.
    Error {
        /// Protocol version.
        v: u32,
        /// The request's number.
        seq: u64,
        /// What failed.
        what: String,
    },
}

impl FromGuest {
    /// The request number the line answers.
    pub fn seq(&self) -> u64 {
        match self {
            FromGuest::Ram { seq, .. }
            | FromGuest::Runs { seq, .. }
            | FromGuest::End { seq, .. }
            | FromGuest::Error { seq, .. } => *seq,
        }
    }

    fn version(&self) -> u32 {
        match self {
            FromGuest::Ram { v, .. }
            | FromGuest::Runs { v, .. }
            | FromGuest::End { v, .. }
            | FromGuest::Error { v, .. } => *v,
        }
    }
}

/// What is wrong with what a guest sent.
#[derive(Debug, thiserror::Error)]
pub enum GuestWireError {
    /// A line longer than [`MAX_GUEST_LINE`].
    #[error("guest line over {MAX_GUEST_LINE} bytes")]
    TooLong,
    /// Not a message of the protocol.
    #[error("malformed guest line ({len} bytes): {source}")]
    Malformed {
        /// The line's length, bytes.
        len: usize,
        /// What could not be parsed.
        source: serde_json::Error,
    },
    /// A line of another protocol version.
    #[error("guest protocol version {got}, memfoldd speaks {GUEST_PROTOCOL_VERSION}")]
    Version {
        /// The line's version.
        got: u32,
    },
    /// A message over its limits.
    #[error("guest message over its limits: {what}")]
    Limit {
        /// Which limit.
        what: String,
    },
    /// The channel ended.
    #[error("guest channel closed")]
    Closed,
    /// Reading or writing the channel failed (a timeout included).
    #[error("guest channel: {0}")]
    Io(#[from] io::Error),
}

/// The line (without its newline) of `msg`.
pub fn encode_to_guest(msg: &ToGuest) -> Vec<u8> {
    let mut v = serde_json::to_vec(msg).expect("requests always serialize");
    v.push(b'\n');
    v
}

/// The line of `msg`, newline included (what a guest agent written in Rust sends; tests).
pub fn encode_from_guest(msg: &FromGuest) -> Vec<u8> {
    let mut v = serde_json::to_vec(msg).expect("guest messages always serialize");
    v.push(b'\n');
    v
}

/// The message in one line from a guest.
///
/// Errors: [`GuestWireError::TooLong`], [`GuestWireError::Malformed`],
/// [`GuestWireError::Version`], [`GuestWireError::Limit`] (a chunk over [`MAX_RUNS`],
/// ranges over [`MAX_RANGES`], strings over 256 bytes).
pub fn decode_from_guest(line: &[u8]) -> Result<FromGuest, GuestWireError> {
    if line.len() > MAX_GUEST_LINE {
        return Err(GuestWireError::TooLong);
    }
    let m: FromGuest =
        serde_json::from_slice(line).map_err(|source| GuestWireError::Malformed {
            len: line.len(),
            source,
        })?;
    if m.version() != GUEST_PROTOCOL_VERSION {
        return Err(GuestWireError::Version { got: m.version() });
    }
    let limit = |what: String| Err(GuestWireError::Limit { what });
    match &m {
        FromGuest::Runs { runs, .. } if runs.len() > MAX_RUNS => limit(format!(
            "{} runs in a chunk (at most {MAX_RUNS})",
            runs.len()
        )),
        FromGuest::Ram { ranges, .. } if ranges.len() > MAX_RANGES => limit(format!(
            "{} RAM ranges (at most {MAX_RANGES})",
            ranges.len()
        )),
        FromGuest::Ram { agent, kernel, .. } if agent.len() > 256 || kernel.len() > 256 => {
            limit("agent or kernel name over 256 bytes".into())
        }
        FromGuest::Error { what, .. } if what.len() > 4096 => {
            limit("error text over 4096 bytes".into())
        }
        FromGuest::End { chunks, .. } if *chunks > MAX_CHUNKS => {
            limit(format!("{chunks} chunks (at most {MAX_CHUNKS})"))
        }
        _ => Ok(m),
    }
}

/// Reads lines of at most [`MAX_GUEST_LINE`] bytes: a longer one is an error, not an
/// allocation of whatever size the peer chose.
pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
}

impl<R: BufRead> LineReader<R> {
    /// Lines from `inner`.
    pub fn new(inner: R) -> Self {
        LineReader {
            inner,
            buf: Vec::new(),
        }
    }

    /// The next line, without its newline.
    ///
    /// Errors: [`GuestWireError::TooLong`] (the rest of that line is not read: drop the
    /// channel), [`GuestWireError::Closed`] at the end (a partial last line dropped),
    /// [`GuestWireError::Io`].
    pub fn line(&mut self) -> Result<&[u8], GuestWireError> {
        self.buf.clear();
        loop {
            let avail = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            if avail.is_empty() {
                return Err(GuestWireError::Closed);
            }
            let (take, done) = match avail.iter().position(|&b| b == b'\n') {
                Some(i) => (i, true),
                None => (avail.len(), false),
            };
            if self.buf.len() + take > MAX_GUEST_LINE {
                return Err(GuestWireError::TooLong);
            }
            self.buf.extend_from_slice(&avail[..take]);
            self.inner.consume(take + done as usize);
            if done {
                return Ok(&self.buf);
            }
        }
    }

    /// The reader inside.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_bad_ones_are_typed_errors() {
        let r = ToGuest::Categories { v: 1, seq: 9 };
        let line = encode_to_guest(&r);
        assert_eq!(line, b"{\"req\":\"categories\",\"v\":1,\"seq\":9}\n");
        let m = decode_from_guest(
            br#"{"msg":"runs","v":1,"seq":3,"first":256,"runs":[[2,10],[17,1]]}"#,
        )
        .unwrap();
        assert_eq!(
            m,
            FromGuest::Runs {
                v: 1,
                seq: 3,
                first: 256,
                runs: vec![[2, 10], [17, 1]]
            }
        );
        assert!(matches!(
            decode_from_guest(br#"{"msg":"end","v":2,"seq":3,"chunks":1,"frames":4}"#),
            Err(GuestWireError::Version { got: 2 })
        ));
        assert!(matches!(
            decode_from_guest(br#"{"msg":"end","v":1,"seq":3,"chunks":99999,"frames":4}"#),
            Err(GuestWireError::Limit { .. })
        ));
        assert!(matches!(
            decode_from_guest(br#"{"msg":"runs","v":1,"seq":-1,"first":0,"runs":[]}"#),
            Err(GuestWireError::Malformed { .. })
        ));
        assert!(matches!(
            decode_from_guest(br#"{"msg":"end","v":1,"seq":3,"chunks":1,"frames":4,"x":1}"#),
            Err(GuestWireError::Malformed { .. })
        ));
        let many = format!(
            r#"{{"msg":"runs","v":1,"seq":1,"first":0,"runs":[{}[1,1]]}}"#,
            "[1,1],".repeat(MAX_RUNS)
        );
        assert!(matches!(
            decode_from_guest(many.as_bytes()),
            Err(GuestWireError::Limit { .. })
        ));
        let big = vec![b' '; MAX_GUEST_LINE + 1];
        assert!(matches!(
            decode_from_guest(&big),
            Err(GuestWireError::TooLong)
        ));
    }

    #[test]
    fn a_line_over_the_limit_is_refused_without_reading_it_all() {
        let mut data = b"short\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', MAX_GUEST_LINE + 10));
        data.extend(b"\nafter\n");
        let mut r = LineReader::new(io::BufReader::with_capacity(4096, &data[..]));
        assert_eq!(r.line().unwrap(), b"short");
        assert!(matches!(r.line(), Err(GuestWireError::TooLong)));
        let mut r = LineReader::new(&b"a\nno newline"[..]);
        assert_eq!(r.line().unwrap(), b"a");
        assert!(matches!(r.line(), Err(GuestWireError::Closed)));
        // Exactly at the limit is a line.
        let mut at = vec![b'y'; MAX_GUEST_LINE];
        at.push(b'\n');
        let mut r = LineReader::new(&at[..]);
        assert_eq!(r.line().unwrap().len(), MAX_GUEST_LINE);
    }
}
