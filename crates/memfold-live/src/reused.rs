//! Answers reused for a while, so that a peer memfoldd does not trust cannot make it
//! work without bound by asking: a tenant's statistics request (memfoldd's main loop
//! reads every guest's books for it, O(all guests' pages)) and a `GET /metrics` (anyone
//! on the host who reaches the address) are answered from a copy at most
//! [`REUSE_FOR`] old. The operator's own requests are always fresh.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How long an answer is reused: 1 s, the live view's refresh; a Prometheus scrape is
/// 15 s apart by default.
pub const REUSE_FOR: Duration = Duration::from_secs(1);

/// Answers by key (a tenant's uid, or `()` for the one metrics answer), each reused
/// until it is `ttl` old. Holds one answer per key asked within the last `ttl`: entries
/// older are dropped at each ask, so the keys held are bounded by the askers of one
/// `ttl` (tenant uids: members of memfoldd's agent group).
#[derive(Debug)]
pub struct Reused<K, V> {
    ttl: Duration,
    held: HashMap<K, (Instant, V)>,
}

impl<K: Eq + Hash, V: Clone> Reused<K, V> {
    /// Nothing held; answers reused until `ttl` old.
    pub fn new(ttl: Duration) -> Self {
        Reused {
            ttl,
            held: HashMap::new(),
        }
    }

    /// The answer for `key` at `now`: the one held if younger than the `ttl`, else
    /// `make()`'s, held from `now`.
    pub fn get_or(&mut self, key: K, now: Instant, make: impl FnOnce() -> V) -> V {
        let ttl = self.ttl;
        // A clock read before an answer was held (another thread's `now`) is no age.
        self.held
            .retain(|_, (at, _)| now.checked_duration_since(*at).is_none_or(|a| a < ttl));
        if let Some((_, v)) = self.held.get(&key) {
            return v.clone();
        }
        let v = make();
        self.held.insert(key, (now, v.clone()));
        v
    }

    /// Keys held now (at most one per asker of the last `ttl`).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_made_once_per_key_and_ttl() {
        let t0 = Instant::now();
        let mut r: Reused<u32, u64> = Reused::new(Duration::from_secs(1));
        let mut made = 0;
        let mut ask = |r: &mut Reused<u32, u64>, key, at| {
            r.get_or(key, at, || {
                made += 1;
                made
            })
        };
        // A flood from one tenant within the second: one answer made.
        for i in 0..1000 {
            assert_eq!(ask(&mut r, 7, t0 + Duration::from_micros(i)), 1);
        }
        // Another key has its own.
        assert_eq!(ask(&mut r, 8, t0), 2);
        // Past the ttl: made again, and the stale key dropped.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(ask(&mut r, 7, later), 3);
        assert_eq!(r.len(), 1, "key 8's answer, 1 s old, is no longer held");
        assert_eq!(ask(&mut r, 7, later + Duration::from_millis(999)), 3);
        // A `now` earlier than the answer's (another thread's clock read): reused.
        assert_eq!(ask(&mut r, 7, t0), 3);
        assert!(!r.is_empty());
    }
}
