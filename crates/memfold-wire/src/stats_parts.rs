//! memfoldd's statistics in parts: one [`ToClient::Stats`] head, then its guests'
//! [`VmStats`] in [`ToClient::StatsVms`] parts when they do not fit one message.
//!
//! A `SOCK_SEQPACKET` message larger than the socket's send buffer fails whole
//! (`EMSGSIZE`; `net.core.wmem_default` is 212 992 bytes on common hosts, below
//! [`crate::MAX_MESSAGE`]), and an operator's statistics carry ~2–3 KB of JSON per guest:
//! past ~70 guests one message no longer went out, and no reader got anything. So
//! memfoldd ([`stats_messages`]) sends statistics whose JSON is over
//! [`STATS_PART_BYTES`] as a head with no guests, saying how many follow
//! ([`Stats::vms_following`]), then parts of at most [`STATS_PART_BYTES`] of JSON each,
//! measured by encoding, guests in order. A reader ([`assemble_stats`]) collects parts
//! until it has them all, with a bound ([`MAX_STATS_VMS`]) and a typed error
//! ([`StatsPartsError`]) if they do not add up or the connection ends early.
//!
//! Additive (no protocol version bump: agents never see these messages): statistics that
//! fit are one message, as before, without the field; a reader of before that gets a
//! split answer sees the head's totals and no guests.

use serde::Serialize;

use crate::stats::{Stats, VmStats};
use crate::{ToClient, WireError};

/// Most bytes of JSON memfoldd puts in one statistics message (the head, or a part),
/// unless a single guest's [`VmStats`] alone is larger (it is then a part of its own):
/// well under [`crate::MAX_MESSAGE`] and the socket's default send buffer.
pub const STATS_PART_BYTES: usize = 128 * 1024;

// A part is at most half a message, and ~80 KB under the socket's default send buffer
// (212 992 bytes).
const _: () = assert!(STATS_PART_BYTES <= crate::MAX_MESSAGE / 2);

/// Most guests a reader takes in one statistics answer (a head announcing more is an
/// error): far more than one memfoldd serves, and a bound on what a reader allocates.
pub const MAX_STATS_VMS: usize = 1 << 16;

/// Most bytes of each of a guest's strings in statistics: its name, its balloon's
/// problem, its guest agent's name and last error. Each may quote a peer (a QEMU's
/// monitor answer, a guest agent's words), and one guest's [`VmStats`] must fit a message:
/// with JSON's escapes (at most 6 bytes a byte) the four stay under 50 KiB together. A
/// longer string is cut and says so ([`stats_messages`]).
pub const MAX_VM_STRING_BYTES: usize = 2048;

// Four strings at their bound, every byte escaped, leave room in a part for the rest.
const _: () = assert!(4 * (6 * MAX_VM_STRING_BYTES + 64) <= STATS_PART_BYTES / 2);

/// `s` cut to [`MAX_VM_STRING_BYTES`] (at a character's boundary), saying how long it was.
fn cut(s: &mut String) {
    let len = s.len();
    if len <= MAX_VM_STRING_BYTES {
        return;
    }
    let mut at = MAX_VM_STRING_BYTES;
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    s.truncate(at);
    s.push_str(&format!("... ({len} bytes, cut by memfoldd)"));
}

/// `v` with each of its strings cut to [`MAX_VM_STRING_BYTES`]: whatever a peer made
/// memfoldd keep, one guest never makes the statistics too large to send (a QEMU's
/// 300 KB monitor error did, and every reader got nothing).
fn bounded(mut v: VmStats) -> VmStats {
    cut(&mut v.name);
    if let Some(p) = &mut v.balloon_problem {
        cut(p);
    }
    if let Some(g) = &mut v.guest_pages {
        cut(&mut g.agent);
        if let Some(e) = &mut g.last_error {
            cut(e);
        }
    }
    v
}

/// Bytes of `v`'s JSON, counted without keeping them.
fn json_len<T: Serialize>(v: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    serde_json::to_writer(&mut c, v).expect("statistics always serialize");
    c.0
}

/// The messages that carry `stats` to a client, in order: `[Stats]` when its JSON is at
/// most [`STATS_PART_BYTES`]; otherwise a head with no guests and
/// [`Stats::vms_following`] set, then [`ToClient::StatsVms`] parts, each at most
/// [`STATS_PART_BYTES`] of JSON (a guest larger than that alone is a part of its own),
/// every guest once, in `stats.vms`' order, each of its strings cut to
/// [`MAX_VM_STRING_BYTES`] (saying so) so that no guest alone outgrows a message.
pub fn stats_messages(mut stats: Stats) -> Vec<ToClient> {
    let vms: Vec<VmStats> = std::mem::take(&mut stats.vms)
        .into_iter()
        .map(bounded)
        .collect();
    stats.vms_following = 0;
    let lens: Vec<usize> = vms.iter().map(json_len).collect();
    let head = json_len(&ToClient::Stats(Box::new(stats.clone())));
    // JSON: `[a,b,c]` is `[]` plus each guest plus a comma between two.
    let listed = |lens: &[usize]| lens.iter().sum::<usize>() + lens.len().saturating_sub(1);
    if head + listed(&lens) <= STATS_PART_BYTES {
        stats.vms = vms;
        return vec![ToClient::Stats(Box::new(stats))];
    }
    stats.vms_following = u32::try_from(vms.len()).unwrap_or(u32::MAX);
    let empty_part = json_len(&ToClient::StatsVms { vms: Vec::new() });
    let mut out = vec![ToClient::Stats(Box::new(stats))];
    let mut part: Vec<VmStats> = Vec::new();
    let mut bytes = empty_part;
    for (v, len) in vms.into_iter().zip(lens) {
        let comma = usize::from(!part.is_empty());
        if !part.is_empty() && bytes + comma + len > STATS_PART_BYTES {
            out.push(ToClient::StatsVms {
                vms: std::mem::take(&mut part),
            });
            bytes = empty_part;
        }
        bytes += usize::from(!part.is_empty()) + len;
        part.push(v);
    }
    if !part.is_empty() {
        out.push(ToClient::StatsVms { vms: part });
    }
    out
}

/// Why statistics sent in parts could not be put together.
#[derive(Debug, thiserror::Error)]
pub enum StatsPartsError {
    /// The head announced more guests than a reader takes.
    #[error(
        "memfoldd's statistics announce {announced} guests to follow (at most {MAX_STATS_VMS})"
    )]
    TooMany {
        /// Guests announced to follow.
        announced: u32,
    },
    /// The connection ended before every part came.
    #[error(
        "memfoldd's statistics: the connection ended after {got} of {announced} guests' parts"
    )]
    Ended {
        /// Guests received in parts.
        got: usize,
        /// Guests announced to follow.
        announced: u32,
    },
    /// A part with no guests, or with more than were still to come.
    #[error("memfoldd's statistics: a part of {part} guests after {got} of {announced} announced")]
    BadPart {
        /// Guests in the part.
        part: usize,
        /// Guests received in parts before it.
        got: usize,
        /// Guests announced to follow.
        announced: u32,
    },
    /// A message other than a part came before every part had.
    #[error("memfoldd's statistics: {what} after {got} of {announced} guests' parts")]
    Unexpected {
        /// What came (its kind, or the error memfoldd sent).
        what: String,
        /// Guests received in parts before it.
        got: usize,
        /// Guests announced to follow.
        announced: u32,
    },
    /// Receiving a part failed.
    #[error("memfoldd's statistics: receiving a part: {0}")]
    Wire(#[from] WireError),
}

impl From<StatsPartsError> for std::io::Error {
    fn from(e: StatsPartsError) -> std::io::Error {
        match e {
            StatsPartsError::Wire(e) => e.into(),
            StatsPartsError::Ended { .. } => {
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, e)
            }
            e => std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        }
    }
}

/// The whole statistics from their `head` and, if it announces guests to follow
/// ([`Stats::vms_following`]), the parts `next` receives (`Ok(None)`: the connection
/// ended). The result lists the head's guests then the parts', and its
/// `vms_following` is 0. Reads no more than the parts announced.
///
/// Errors: [`StatsPartsError`]: more than [`MAX_STATS_VMS`] announced, the connection
/// ended early, a part empty or bringing more guests than announced, another message
/// in between, or a receive error.
pub fn assemble_stats(
    mut head: Stats,
    mut next: impl FnMut() -> Result<Option<ToClient>, WireError>,
) -> Result<Stats, StatsPartsError> {
    let announced = head.vms_following;
    if announced as usize > MAX_STATS_VMS {
        return Err(StatsPartsError::TooMany { announced });
    }
    let want = announced as usize;
    head.vms.reserve(want);
    let mut got = 0usize;
    while got < want {
        match next()? {
            None => return Err(StatsPartsError::Ended { got, announced }),
            Some(ToClient::StatsVms { vms }) => {
                if vms.is_empty() || vms.len() > want - got {
                    return Err(StatsPartsError::BadPart {
                        part: vms.len(),
                        got,
                        announced,
                    });
                }
                got += vms.len();
                head.vms.extend(vms);
            }
            Some(other) => {
                let what = match other {
                    ToClient::Error { message } => {
                        format!("an error ({})", crate::name::shown(&message))
                    }
                    ToClient::Stats(_) => "another head".into(),
                    ToClient::Census(_) => "a census".into(),
                    ToClient::OptedOut { .. } => "an opt-out's answer".into(),
                    ToClient::StatsVms { .. } => unreachable!("matched above"),
                };
                return Err(StatsPartsError::Unexpected {
                    what,
                    got,
                    announced,
                });
            }
        }
    }
    head.vms_following = 0;
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, encode};

    /// `n` guests whose counters are 10 digits and names `name_len` bytes (~3 KB each).
    fn stats(n: usize, name_len: usize) -> Stats {
        let vms = (0..n)
            .map(|i| VmStats {
                name: format!("{i:05}-{}", "n".repeat(name_len.saturating_sub(6))),
                pid: 4_000_000_000,
                pages: 9_999_999_999,
                shares: 9_999_999_999 - i as u64,
                cow_breaks: 1_234_567_890,
                sharing_ranks: vec![(2, 1_000_000_000), (3, 2_000_000_000)],
                nru_pages: [1_000_000_000; 4],
                ..Default::default()
            })
            .collect();
        Stats {
            policy: "de".into(),
            uptime_s: 12345.5,
            vms,
            ..Default::default()
        }
    }

    /// Sends `msgs` through encode and decode (as the socket would) and reassembles.
    fn through_the_wire(msgs: &[ToClient]) -> Result<Stats, StatsPartsError> {
        let mut wire = msgs.iter().map(|m| decode::<ToClient>(&encode(m)).unwrap());
        let Some(ToClient::Stats(head)) = wire.next() else {
            panic!("the head first")
        };
        assemble_stats(*head, || Ok(wire.next()))
    }

    /// Every message is under the part limit (so under the socket's buffer and
    /// [`crate::MAX_MESSAGE`]), every guest comes once and in order, and small statistics are
    /// one message with no `vms_following` on the wire, as before.
    #[test]
    fn parts_are_under_the_limit_and_carry_every_guest_once_in_order() {
        for (n, name_len) in [
            (0, 0),
            (1, 10),
            (40, 10),
            (41, 255),
            (70, 40),
            (100, 255),
            (1000, 255),
        ] {
            let s = stats(n, name_len);
            let msgs = stats_messages(s.clone());
            for m in &msgs {
                let len = encode(m).len();
                assert!(len <= STATS_PART_BYTES, "{n} guests: {len} bytes");
            }
            let whole = encode(&ToClient::Stats(Box::new(s.clone()))).len();
            if whole <= STATS_PART_BYTES {
                assert_eq!(msgs.len(), 1, "{n} guests, {whole} bytes: one message");
                assert!(!String::from_utf8(encode(&msgs[0]))
                    .unwrap()
                    .contains("vms_following"));
            } else {
                // Parts are full: the next part's first guest would not have fitted.
                for w in msgs[1..].windows(2) {
                    let (ToClient::StatsVms { .. }, ToClient::StatsVms { vms }) = (&w[0], &w[1])
                    else {
                        panic!("parts after the head")
                    };
                    let fuller = encode(&w[0]).len() + 1 + json_len(&vms[0]);
                    assert!(fuller > STATS_PART_BYTES, "{n} guests: a part left room");
                }
                let ToClient::Stats(head) = &msgs[0] else {
                    panic!()
                };
                assert!(head.vms.is_empty() && head.vms_following as usize == n);
            }
            assert_eq!(through_the_wire(&msgs).unwrap(), s, "{n} guests");
        }
        // 100 guests of ~3 KB: ~300 KB whole, which the socket refuses in one message.
        let whole = encode(&ToClient::Stats(Box::new(stats(100, 255)))).len();
        assert!(whole > 220_000, "{whole}");
    }

    /// A guest larger than a part alone goes in a part of its own; the others around it
    /// still share parts.
    #[test]
    fn a_guest_over_the_part_limit_is_a_part_of_its_own() {
        let mut s = stats(60, 10);
        s.vms[30].sharing_ranks = (0..20_000).map(|r| (r, u64::from(r))).collect();
        let big = json_len(&s.vms[30]);
        assert!(big > STATS_PART_BYTES, "{big}");
        let msgs = stats_messages(s.clone());
        let alone = msgs.iter().filter(|m| matches!(m, ToClient::StatsVms { vms } if vms.len() == 1 && vms[0].name == s.vms[30].name));
        assert_eq!(alone.count(), 1);
        assert_eq!(through_the_wire(&msgs).unwrap(), s);
    }

    /// A guest whose strings a peer made huge (a QEMU's 300 KB monitor error as its
    /// balloon's problem, a guest agent's words) still fits a message, each string cut
    /// and saying so; the other guests come whole. Fails without the cut (one message of
    /// over 300 KB, which the wire refuses to send).
    #[test]
    fn a_guest_with_huge_strings_still_fits_a_message() {
        let mut s = stats(3, 10);
        let v = &mut s.vms[1];
        v.balloon_problem = Some(format!("query-balloon: {}", "A".repeat(300_000)));
        v.guest_pages = Some(crate::GuestPages {
            agent: "\u{1b}".repeat(100_000),
            last_error: Some("é".repeat(100_000)),
            ..Default::default()
        });
        let msgs = stats_messages(s.clone());
        for m in &msgs {
            let len = encode(m).len();
            assert!(len <= crate::MAX_MESSAGE, "{len} bytes");
        }
        let got = through_the_wire(&msgs).unwrap();
        assert_eq!(got.vms[0], s.vms[0]);
        assert_eq!(got.vms[2], s.vms[2]);
        let p = got.vms[1].balloon_problem.as_deref().unwrap();
        assert!(p.starts_with("query-balloon: AAA"), "{p:.40}");
        assert!(p.ends_with("... (300015 bytes, cut by memfoldd)"), "{p}");
        let g = got.vms[1].guest_pages.as_ref().unwrap();
        assert!(
            g.agent.len() < MAX_VM_STRING_BYTES + 64,
            "{}",
            g.agent.len()
        );
        let e = g.last_error.as_deref().unwrap();
        assert!(
            e.ends_with("... (200000 bytes, cut by memfoldd)"),
            "{e:.40}"
        );
    }

    /// Parts that do not add up, another message in between, a connection that ends
    /// early and a head announcing too many are typed errors saying where.
    #[test]
    fn parts_that_do_not_add_up_are_typed_errors() {
        let msgs = stats_messages(stats(100, 255));
        assert!(msgs.len() >= 3);
        let e = through_the_wire(&msgs[..msgs.len() - 1]).unwrap_err();
        assert!(
            matches!(e, StatsPartsError::Ended { announced: 100, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("connection ended after"), "{e}");
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::UnexpectedEof);

        let mut extra = msgs.clone();
        let last = extra.len() - 1;
        if let ToClient::StatsVms { vms } = &mut extra[last] {
            vms.push(VmStats::default());
        }
        let e = through_the_wire(&extra).unwrap_err();
        assert!(matches!(e, StatsPartsError::BadPart { .. }), "{e}");

        let mut empty = msgs.clone();
        empty.insert(1, ToClient::StatsVms { vms: vec![] });
        let e = through_the_wire(&empty).unwrap_err();
        assert!(
            matches!(
                e,
                StatsPartsError::BadPart {
                    part: 0,
                    got: 0,
                    ..
                }
            ),
            "{e}"
        );

        let mut error = msgs.clone();
        error.insert(
            2,
            ToClient::Error {
                message: "gone\n".into(),
            },
        );
        let e = through_the_wire(&error).unwrap_err();
        assert!(e.to_string().contains("an error (gone\\n)"), "{e}");

        let mut head = stats(0, 0);
        head.vms_following = u32::MAX;
        let e = assemble_stats(head, || panic!("nothing read past a bad head")).unwrap_err();
        assert!(matches!(e, StatsPartsError::TooMany { .. }), "{e}");
    }
}
