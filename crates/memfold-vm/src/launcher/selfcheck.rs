//! Whether a guest's self-check is still running.
//!
//! The built-in images run a self-check that verifies known data in a loop and prints a
//! pass line (`MEMFOLD-CHECK ok N`, `MEMFOLD-COLD-CHECK ok N`) every few passes; a
//! mismatch is printed as `MEMFOLD-MISMATCH`. A self-check that stops (killed by the
//! guest's OOM killer, stuck on a hung disk, a vCPU that no longer runs it) prints no
//! mismatch either: 0 mismatches would then say nothing. The watch reads the console as
//! it grows and marks a guest whose self-check made no new pass for [`SELF_CHECK_STALL`]
//! after its first (a guest that runs none — the tiny image's marker and probe modes —
//! is never marked). The mark stays once made: a gap that ended is still a stretch in
//! which the guest's memory went unverified. A gap is measured between looks: a pass
//! read at a look was printed after the look before, so the gap it ends is counted up to
//! that earlier look (callers look every second or so; one that looks rarely sees less).

use std::time::{Duration, Instant};

/// The longest time, after its first pass, a guest's self-check may go without a new pass
/// line before the guest is marked. Generous: pass lines come every fourth pass at least
/// (every pass on the tiny image), and a pass reads a few MiB of files and sleeps 2 s; a
/// self-check that slow under load is worth a look anyway.
pub const SELF_CHECK_STALL: Duration = Duration::from_secs(300);

/// A guest's self-check progress, as read from its console.
#[derive(Debug, Default)]
pub(crate) struct SelfCheckWatch {
    /// Bytes of the console read so far: up to the end of the last whole line.
    pub(crate) read: u64,
    /// The highest pass number seen.
    last_pass: Option<u64>,
    /// When the last new pass was seen (the first, then each new one).
    progress_at: Option<Instant>,
    /// When the console was last looked at.
    looked_at: Option<Instant>,
    /// The longest stretch without progress seen so far, and the pass it followed.
    worst: Option<(Duration, Option<u64>)>,
}

impl SelfCheckWatch {
    /// Reads `new` (the console's bytes from [`SelfCheckWatch::read`] on), looked at at
    /// `now`; a line not yet ended is left for the next look.
    pub(crate) fn observe(&mut self, new: &[u8], now: Instant) {
        let whole = new.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        for line in String::from_utf8_lossy(&new[..whole]).lines() {
            if let Some(n) = pass_number(line) {
                if self.last_pass.is_none_or(|p| n > p) {
                    // Printed since the last look: the stretch ended no earlier than it.
                    if let Some(before) = self.looked_at {
                        self.gap(before);
                    }
                    self.last_pass = Some(n);
                    self.progress_at = Some(now);
                }
            }
        }
        self.read += whole as u64;
        self.looked_at = Some(now);
        self.gap(now);
    }

    /// Records the stretch from the last progress to `now` if it is the longest.
    fn gap(&mut self, now: Instant) {
        if let Some(p) = self.progress_at {
            let d = now.saturating_duration_since(p);
            if self.worst.is_none_or(|(w, _)| d > w) {
                self.worst = Some((d, self.last_pass));
            }
        }
    }

    /// The console line that marks a stalled self-check, or `None`: the longest stretch
    /// seen without a new pass is under [`SELF_CHECK_STALL`] (or no pass was ever seen).
    pub(crate) fn stall_line(&self) -> Option<String> {
        let (d, after) = self.worst.filter(|&(d, _)| d >= SELF_CHECK_STALL)?;
        Some(format!(
            "MEMFOLD-SELF-CHECK-STALLED: no new self-check pass for {} s ({}): its memory went unverified",
            d.as_secs(),
            after.map_or("none yet".to_string(), |n| format!("after pass {n}"))
        ))
    }
}

/// The pass number of a self-check pass line, wherever on the line it is (kernel messages
/// share the console).
fn pass_number(line: &str) -> Option<u64> {
    ["MEMFOLD-CHECK ok ", "MEMFOLD-COLD-CHECK ok "]
        .iter()
        .find_map(|m| {
            let rest = &line[line.find(m)? + m.len()..];
            let digits = rest.split(|c: char| !c.is_ascii_digit()).next()?;
            digits.parse().ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_self_check_that_stops_passing_is_marked_and_stays_marked() {
        let t0 = Instant::now();
        let mut w = SelfCheckWatch::default();
        w.observe(b"boot\nMEMFOLD-READY web 6.1\n", t0);
        w.observe(b"MEMFOLD-COLD-CHECK ok 4\n", t0 + 20 * S);
        w.observe(b"MEMFOLD-RATE web-req/s 100\n", t0 + 200 * S);
        assert_eq!(w.stall_line(), None);
        w.observe(
            b"MEMFOLD-RATE web-req/s 100\n",
            t0 + 20 * S + SELF_CHECK_STALL,
        );
        let line = w.stall_line().expect("300 s without a pass");
        assert!(line.contains("after pass 4"), "{line}");
        // It passes again: the stretch without verification happened all the same.
        w.observe(b"[ 1.0] x MEMFOLD-CHECK ok 30\n", t0 + 400 * S);
        assert!(w.stall_line().is_some());
    }

    #[test]
    fn passes_that_keep_coming_leave_the_guest_unmarked() {
        let t0 = Instant::now();
        let mut w = SelfCheckWatch::default();
        w.observe(b"MEMFOLD-READY tiny 6.1\n", t0);
        for k in 1..100u64 {
            let line = format!("MEMFOLD-CHECK ok {k}\n");
            w.observe(line.as_bytes(), t0 + Duration::from_secs(10 * k));
        }
        assert_eq!(w.stall_line(), None);
        assert_eq!(w.last_pass, Some(99));
    }

    #[test]
    fn a_line_cut_mid_way_is_read_whole_at_the_next_look() {
        let t0 = Instant::now();
        let mut w = SelfCheckWatch::default();
        w.observe(b"MEMFOLD-READY tiny 6.1\nMEMFOLD-CHECK ok 1", t0);
        assert_eq!((w.read, w.last_pass), (23, None));
        // The next look reads from `read` on: the whole line.
        w.observe(b"MEMFOLD-CHECK ok 12\n", t0 + S);
        assert_eq!(w.last_pass, Some(12));
        // A pass number that does not grow (a repeated or older line) is no progress.
        w.observe(b"MEMFOLD-CHECK ok 3\n", t0 + 200 * S);
        assert_eq!(w.stall_line(), None);
        w.observe(b"", t0 + SELF_CHECK_STALL + 2 * S);
        assert!(w.stall_line().is_some());
    }

    #[test]
    fn a_guest_that_runs_no_self_check_is_not_marked() {
        let t0 = Instant::now();
        let mut w = SelfCheckWatch::default();
        w.observe(b"MEMFOLD-READY tiny 6.1\nMEMFOLD-MARKER x\n", t0);
        w.observe(b"still no pass\n", t0 + 2 * SELF_CHECK_STALL);
        assert_eq!(w.stall_line(), None);
    }

    /// Passes printed all along, read at a look long after the one before: the stretch
    /// is counted to that earlier look, not to this one.
    #[test]
    fn passes_read_at_a_late_look_end_their_stretch_at_the_look_before() {
        let t0 = Instant::now();
        let mut w = SelfCheckWatch::default();
        w.observe(b"MEMFOLD-CHECK ok 1\n", t0);
        w.observe(b"", t0 + 10 * S);
        let many: String = (2..100)
            .map(|k| format!("MEMFOLD-CHECK ok {k}\n"))
            .collect();
        w.observe(many.as_bytes(), t0 + 2 * SELF_CHECK_STALL);
        assert_eq!(w.stall_line(), None);
    }
}
