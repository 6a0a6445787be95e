//! A socket's reading end whose reads meet one deadline for a whole message.
//!
//! A read timeout alone (`SO_RCVTIMEO`) restarts with every byte, so a peer trickling a
//! byte every few seconds holds its reader, and the thread and descriptors behind it,
//! for good: here every read is bounded by `until` (the caller sets it per message), and
//! a reader whose stop flag is set gives up within `look`.

use std::io::{self, ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A stream read against [`DeadlineReader::until`] and an optional stop flag. A read past
/// the deadline, or once stopped, fails with `TimedOut` (not `Interrupted`, which
/// `read_line` would call again).
#[derive(Debug)]
pub struct DeadlineReader {
    stream: UnixStream,
    /// When the message being read must be in.
    pub until: Instant,
    stop: Option<Arc<AtomicBool>>,
    look: Duration,
}

impl DeadlineReader {
    /// Reads `stream` until `until`, looking at `stop` (if any) at least every `look`.
    pub fn new(
        stream: UnixStream,
        until: Instant,
        stop: Option<Arc<AtomicBool>>,
        look: Duration,
    ) -> DeadlineReader {
        DeadlineReader {
            stream,
            until,
            stop,
            look,
        }
    }

    /// Whether the stop flag is set.
    pub fn stopped(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed))
    }
}

impl Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let left = self.until.saturating_duration_since(Instant::now());
            if left.is_zero() || self.stopped() {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    "no whole message in time, or told to stop",
                ));
            }
            let wait = if self.stop.is_some() {
                left.min(self.look)
            } else {
                left
            };
            self.stream.set_read_timeout(Some(wait))?;
            match self.stream.read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                r => return r,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A peer that sends a byte every 300 ms never completes a line: the reader gives
    /// up at its deadline, not 300 ms after the last byte; and within `look` of a stop.
    #[test]
    fn a_trickle_ends_at_the_deadline_and_a_stop_within_a_look() {
        let (a, mut b) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            while b.write_all(b"x").is_ok() {
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        let t = Instant::now();
        let mut r = DeadlineReader::new(a, t + Duration::from_secs(1), None, Duration::ZERO);
        let mut sink = Vec::new();
        let e = r.read_to_end(&mut sink).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        // The trickle goes on for good: a reader that took each byte as new time would
        // never end. The bound is well past the 1 s deadline, with room for a loaded
        // host.
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

        let (a, _b) = UnixStream::pair().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            s.store(true, Ordering::Relaxed);
        });
        let t = Instant::now();
        let mut r = DeadlineReader::new(
            a,
            t + Duration::from_secs(30),
            Some(stop),
            Duration::from_millis(100),
        );
        assert!(r.read(&mut [0; 8]).is_err());
        // Well under the 30 s deadline: the stop ended it.
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }
}
