//! Sharing at disk read (Satori §4.1, "sharing-aware block devices"): the block device
//! (`memfold-blk`) reports every guest page a read request filled, and the engine looks
//! each up at once instead of waiting for the rate-limited scan to reach it. Most
//! shareable pages between guests are page cache (Satori §2: 63.8–93.0%), and their
//! content is known the moment the disk read lands; a scanner finds short-lived page
//! cache late or never.
//!
//! A landed page goes the scan's way ([`Engine::consider_seen`] with [`Seen::Read`]):
//! zero → reclaimed, equal to a frame or a hinted page → shared, else a hint. The page
//! holds new data the guest is about to read, whatever class the clock found it in
//! before: the clock takes it as referenced from now on (C2, `ClockHand::landed`), so
//! it is shared mapped — now, or when its twin lands later. The bytes
//! are still read from guest RAM, hashed and compared, and the agent compares them again
//! under write-protection before it maps anything (Satori §5.2 trusts the block number;
//! memfold trusts no peer, so a report only says where to look first).
//!
//! Each share a landed page leads to — its own, and its hinted twin's in another guest —
//! is remembered with the time the page landed (`Vm::read_sharing`): the books count
//! the shares made at read apart from the scanner's ([`super::VmBooks::read_shares`])
//! and time each, landing to mapped ([`super::Books::read_share_us`]).

use super::unmapped::Seen;
use super::Engine;
use crate::ids::{DomainId, Gfn, Gpn, VmId};
use crate::p2m::PageState;
use crate::share::ShareEntry;
use crate::{Page, PAGE_SIZE};

/// Pages of one report looked up at most; the rest are left to the scan (a report is a
/// hint from a peer, and one peer must not hold the engine's loop).
pub const MAX_LANDED: usize = 4096;

/// Hints kept across full scans, per domain, at most (16 bytes each; the latest kept).
/// The scan's hints live one full scan (ESX §4.3: a hint is only good until the page
/// may have changed). Two kinds outlive it:
/// - landed pages: a page the disk filled is reported again if it changes by another
///   read, and its twin often lands seconds later in another guest — after the next
///   pass began. Without these, most reads find no twin (measured by `memfold bench
///   read-share`: 61 of 2 048 pages shared at read);
/// - with partitioned hints (`share_passes` > 1), the hinted page of a pair the scan
///   left to the clock (both cold by a class found before the scan read them, no VMA
///   pressure: `Identical::Defer`): the clock's slice, which shares them, may come scans
///   later, and a quiet page is hinted only one scan in 8 × `share_passes` (`scan.rs`).
///   Without these, with 5 passes, the cold pairs of `engine::unmapped`'s tests stayed
///   private.
///
/// A kept hint is dropped once its page is no longer private (shared, stored) or is of
/// another domain, and copies of one are dropped at each restore; one whose page changed
/// and stayed private is restored under its old hash (a stale hint, compared before use)
/// until newer ones push it out.
pub const KEPT_HINTS: usize = 1 << 16;

/// A share made at read that a write undid within this long (µs) was not worth its two
/// round trips (the share and the CoW break): the page is a read buffer the guest fills
/// again and again (an `O_DIRECT` buffer, a database's buffer pool slot), not page cache
/// that stays. Satori §4.3's no-copy-on-write spares such a page its copy; here the page
/// is not shared at read at all for a while ([`READ_BACKOFF_US`]), so neither the share
/// nor the break is paid. The scan still finds it if it stays.
pub const REUSED_WITHIN_US: u64 = 250_000;

/// How long a reused read buffer is passed over at read after its first strike, µs;
/// doubled with each strike, up to [`READ_BACKOFF_MAX_US`]. Long: a page whose share at
/// read a write undid within [`REUSED_WITHIN_US`] is a buffer, and a buffer read into
/// every few seconds (an `O_DIRECT` reader's rounds) paid a share and a break per round
/// while the back-off grew from 250 ms (`memfold bench disk-io`, docs/sharing-at-read.md);
/// a page-cache page is not reused that fast, and the scan still shares what stays.
pub const READ_BACKOFF_US: u64 = 30_000_000;

/// The longest back-off of a reused read buffer, µs.
pub const READ_BACKOFF_MAX_US: u64 = 480_000_000;

/// Pages remembered per guest, at most, as shared at read lately and as reused read
/// buffers (16 and 24 bytes each): past it, expired entries are dropped first, then new
/// ones are not kept (a page not kept is only shared as before).
pub const READ_REUSE_PAGES: usize = 1 << 16;

/// What one read report came to ([`Engine::read_landed`]), pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Landed {
    /// Pages looked up (private pages of an attached guest).
    pub looked_up: u32,
    /// Of those, pages whose share or zero reclaim was requested.
    pub acted: u32,
    /// Pages passed over: not private (shared, stored, in flight), out of the guest's
    /// RAM, unreadable, past [`MAX_LANDED`], of a guest that is not attached, or reused
    /// read buffers backing off (`REUSED_WITHIN_US`).
    pub passed_over: u32,
}

impl Engine {
    /// A disk read filled pages `gfns` of guest `id` `age_us` µs ago (Satori §4.1; shares
    /// it leads to are timed from then): each private one
    /// is read from guest RAM, hashed and looked up in its domain's share table now —
    /// reclaimed if zero, shared (mapped) with an equal frame or hinted page, or left as a
    /// hint for the next read or scan of its twin. Pages that are not private, beyond the
    /// guest's RAM or past the first [`MAX_LANDED`] are passed over (the scan finds them).
    /// Counted in [`super::VmBooks::read_landed`]; never fails (a page that cannot be read
    /// is passed over).
    pub fn read_landed(&mut self, id: VmId, gfns: &[Gfn], age_us: u64) -> Landed {
        let mut out = Landed::default();
        let Some(v) = self.vms.get(&id).filter(|v| v.attached && !v.opted_out) else {
            out.passed_over = gfns.len() as u32;
            return out;
        };
        let pages = v.pages();
        let wall = self.now_us();
        let now = wall.saturating_sub(age_us);
        let mut page: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        for (k, &g) in gfns.iter().enumerate() {
            // The read wrote the page: in RAM again if it was paged out (kernel_swap.rs).
            if let Some(v) = self
                .vms
                .get_mut(&id)
                .filter(|v| g.0 < pages && v.paged_out_or_going(g))
            {
                v.set(g, PageState::Private);
            }
            // A page its guest marked never-share is not shared at read (never_share.rs).
            if k >= MAX_LANDED || g.0 >= pages || !self.sharable(id, g) || self.never_share(id, g) {
                out.passed_over += 1;
                continue;
            }
            let v = self.vms.get_mut(&id).expect("checked above");
            v.books.read_landed += 1;
            if v.read_backoff
                .get(&g)
                .is_some_and(|&(_, until)| until > wall)
            {
                v.books.read_backoffs += 1;
                out.passed_over += 1;
                continue;
            }
            if v.ram.read(g, &mut page[..]).is_err() {
                out.passed_over += 1;
                continue;
            }
            out.looked_up += 1;
            v.clock.landed(g.0);
            self.landed_us = Some(now);
            self.consider_seen(id, g, &page, Seen::Read);
            self.landed_us = None;
            if matches!(
                self.vms[&id].state(g),
                PageState::Sharing(_) | PageState::Reclaiming
            ) {
                out.acted += 1;
            }
        }
        out
    }

    /// Page `gpn` of domain `d` with content hash `h` was left as a hint that must
    /// outlive the full scan (a landed page, or a pair left to the clock): kept to be
    /// hinted again after the next full scans ([`KEPT_HINTS`]).
    pub(crate) fn keep_hint(&mut self, d: DomainId, h: u64, gpn: Gpn) {
        let ring = self.kept_hints.entry(d).or_default();
        if ring.len() >= KEPT_HINTS {
            ring.pop_front();
        }
        ring.push_back((h, gpn));
    }

    /// After a full scan dropped the hints: hints again for the pages kept whose guest
    /// is still of their domain and whose page is still private (each is still only a
    /// hint: compared before anything is shared), once each: others, and copies (a
    /// page kept again while its hint was kept), are forgotten, and the ring's room given
    /// back when it is over 4 times what is left.
    pub(crate) fn restore_kept_hints(&mut self) {
        let mut rings = std::mem::take(&mut self.kept_hints);
        for (&d, ring) in rings.iter_mut() {
            let mut once = std::collections::HashSet::with_capacity(ring.len());
            ring.retain(|&(h, gpn)| {
                self.locate(gpn).is_some_and(|(id, g)| {
                    self.vms[&id].domain == d && self.vms[&id].state(g) == PageState::Private
                }) && once.insert((h, gpn))
            });
            if ring.capacity() > 4 * ring.len() {
                ring.shrink_to_fit();
            }
            if let Some(dom) = self.domains.get_mut(&d) {
                for &(h, gpn) in ring.iter() {
                    let e = ShareEntry::Hint(gpn);
                    if !dom.share.lookup(h).any(|x| x == e) {
                        dom.share.insert(h, e);
                    }
                }
            }
        }
        self.kept_hints = rings;
    }

    /// The share of page `g` of guest `id` was answered (`mapped` or not): if a disk read
    /// asked for it, book it as a share made at read and time it.
    pub(crate) fn read_share_answered(&mut self, id: VmId, g: Gfn, mapped: bool) {
        let now = self.now_us();
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        let Some(landed_us) = v.read_sharing.remove(&g) else {
            return;
        };
        if mapped {
            v.books.read_shares += 1;
            self.books.record_read_share(now.saturating_sub(landed_us));
            if room(&mut v.read_shared_at, g, |&t| {
                now.saturating_sub(t) < REUSED_WITHIN_US
            }) {
                v.read_shared_at.insert(g, now);
            }
        }
    }

    /// Page `g` of guest `id` was shared and is private again by a write (a CoW break):
    /// if it had been shared at read less than [`REUSED_WITHIN_US`] ago, it is a reused
    /// read buffer — a strike, and no share at read for [`READ_BACKOFF_US`] doubled per
    /// strike; if longer, the share paid off and its strikes are forgotten.
    pub(crate) fn read_share_undone(&mut self, id: VmId, g: Gfn) {
        let now = self.now_us();
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        let Some(at) = v.read_shared_at.remove(&g) else {
            return;
        };
        if now.saturating_sub(at) >= REUSED_WITHIN_US {
            v.read_backoff.remove(&g);
            return;
        }
        let strikes = v
            .read_backoff
            .get(&g)
            .map_or(0, |s| s.0)
            .saturating_add(1)
            .min(16);
        let wait = (READ_BACKOFF_US << (strikes - 1)).min(READ_BACKOFF_MAX_US);
        if room(&mut v.read_backoff, g, |&(_, until)| until > now) {
            v.read_backoff.insert(g, (strikes, now + wait));
        }
    }
}

/// Whether `map` has room for key `g` (held already, or under [`READ_REUSE_PAGES`] once
/// the entries `keep` rejects are dropped).
fn room<V>(map: &mut std::collections::HashMap<Gfn, V>, g: Gfn, keep: impl Fn(&V) -> bool) -> bool {
    if map.len() < READ_REUSE_PAGES || map.contains_key(&g) {
        return true;
    }
    map.retain(|_, v| keep(v));
    map.len() < READ_REUSE_PAGES
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::Rig;
    use crate::{EngineConfig, Policy};

    const PAGES: u32 = 32;

    /// The Difference Engine with a clock and a sharing scan that never starts its first
    /// full scan in these tests (every share is made at read), cold pages shared
    /// without a mapping by the clock.
    fn cfg() -> EngineConfig {
        EngineConfig {
            policy: Policy::difference_engine(),
            rate: 0,
            clock_interval_us: Some(100_000),
            min_scan_interval_us: 3_600_000_000,
            max_scan_interval_us: 3_600_000_000,
            share_cold_unmapped: true,
            ..EngineConfig::default()
        }
    }

    /// Bytes unique to `seed`, none zero.
    fn page(seed: u32) -> Vec<u8> {
        let mut x = 0x2545_f491_4f6c_dd1du64 ^ (seed as u64) << 17;
        (0..PAGE_SIZE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x as u8) | 1
            })
            .collect()
    }

    /// A guest of unique pages whose clock has found them all cold, with no scan.
    fn rig() -> Rig {
        let mut r = Rig::new(cfg(), PAGES).unwrap();
        for g in 0..PAGES {
            r.agent.write(Gfn(g), 0, &page(1000 + g)).unwrap();
        }
        // Run the clock only (no scan step) for 2 s: every page idle, C4.
        for _ in 0..200 {
            r.clock.advance(10_000);
            r.engine.clock_step();
            r.carry_out();
        }
        r
    }

    /// A disk read of content `seed` into pages `gfns`, reported.
    fn disk_read(r: &mut Rig, gfns: &[u32], seed: u32) -> Landed {
        for &g in gfns {
            r.agent.write(Gfn(g), 0, &page(seed)).unwrap();
        }
        let gfns: Vec<Gfn> = gfns.iter().map(|&g| Gfn(g)).collect();
        r.engine.read_landed(r.vm, &gfns, 0)
    }

    fn state(r: &Rig, g: u32) -> PageState {
        r.engine.page_state(r.vm, Gfn(g)).unwrap()
    }

    /// The first read of a content leaves a hint; the second read of it shares both pages
    /// at once, mapped (the guest is about to read them), though the clock last found
    /// both cold: with no scan at all. Both shares are booked as made at read, and timed.
    #[test]
    fn a_second_read_of_a_content_shares_both_pages_at_once_mapped() {
        let mut r = rig();
        assert!(r.engine.books().vms[0].books.nru_pages[3] >= PAGES as u64 - 1);
        let first = disk_read(&mut r, &[3], 7);
        assert_eq!((first.looked_up, first.acted), (1, 0));
        assert_eq!(state(&r, 3), PageState::Private);
        r.clock.advance(2_000);
        let second = disk_read(&mut r, &[20], 7);
        assert_eq!((second.looked_up, second.acted), (1, 1));
        r.clock.advance(3_000);
        r.carry_out();
        let (a, b) = (state(&r, 3), state(&r, 20));
        assert!(matches!(a, PageState::Shared(_)) && a == b, "{a:?} {b:?}");
        let books = r.engine.books();
        let vb = &books.vms[0].books;
        assert_eq!((vb.read_landed, vb.read_shares, vb.shares), (2, 2, 2));
        // Both landed-to-mapped times are the 3 ms between the read and the answers
        // (the histogram keeps 2 significant digits).
        let &[(us, 2)] = &books.read_share_us[..] else {
            panic!("{:?}", books.read_share_us)
        };
        assert!(us.abs_diff(3_000) <= 30, "{us}");
        assert_eq!(r.agent.peek(Gfn(20)).unwrap().to_vec(), page(7));
        r.engine.check_invariants().unwrap();
    }

    /// The device writes `seed` into page `g` (a CoW break if shared, delivered first, as
    /// the device's write faults before it reports), then reports it landed.
    fn reuse(r: &mut Rig, g: u32, seed: u32) -> Landed {
        r.agent.write(Gfn(g), 0, &page(seed)).unwrap();
        r.carry_out();
        let l = r.engine.read_landed(r.vm, &[Gfn(g)], 0);
        r.clock.advance(1_000);
        r.carry_out();
        l
    }

    /// A read buffer the guest fills again and again — each read undoing, within 250 ms,
    /// the share at read its last read made — is passed over at read for
    /// [`READ_BACKOFF_US`] after its first strike, twice that after its second; a share
    /// at read that lived longer clears its strikes. Without the back-off every read into
    /// it pays a share and a CoW break.
    #[test]
    fn a_reused_read_buffer_backs_off_sharing_at_read() {
        let mut r = rig();
        // Twins of contents 7..=12 in other pages (hints), so that every landing in the
        // buffer, page 20, would be shared at once.
        for (k, g) in (3..9).enumerate() {
            disk_read(&mut r, &[g], 7 + k as u32);
        }
        let shared = |r: &Rig| matches!(state(r, 20), PageState::Shared(_));
        assert_eq!(reuse(&mut r, 20, 7).acted, 1);
        assert!(shared(&r));
        // 10 ms later the next read: the share is undone (strike 1), this landing skipped.
        r.clock.advance(10_000);
        let l = reuse(&mut r, 20, 8);
        assert_eq!((l.acted, l.passed_over), (0, 1));
        assert!(!shared(&r));
        // Still backing off just before the back-off ends; over after it.
        r.clock.advance(READ_BACKOFF_US - 100_000);
        assert_eq!(reuse(&mut r, 20, 9).passed_over, 1, "still backing off");
        r.clock.advance(200_000);
        assert_eq!(reuse(&mut r, 20, 9).acted, 1);
        // Undone again within 250 ms (strike 2): twice as long now.
        r.clock.advance(10_000);
        assert_eq!(reuse(&mut r, 20, 10).passed_over, 1);
        r.clock.advance(READ_BACKOFF_US + 100_000);
        assert_eq!(reuse(&mut r, 20, 11).passed_over, 1, "still backing off");
        r.clock.advance(READ_BACKOFF_US);
        assert_eq!(reuse(&mut r, 20, 12).acted, 1);
        // This share lives 1 s: the write that ends it clears the strikes.
        r.clock.advance(1_000_000);
        r.agent.write(Gfn(20), 0, &page(99)).unwrap();
        r.carry_out();
        assert_eq!(
            reuse(&mut r, 20, 7).acted,
            1,
            "no back-off after a lasting share"
        );
        let vb = &r.engine.books().vms[0].books;
        assert_eq!(vb.read_backoffs, 4);
        r.engine.check_invariants().unwrap();
    }

    /// A hint kept again while it was kept (a pair the scan defers scan after scan) is
    /// kept once: copies go when the next scan begins, so they cannot push landed
    /// pages' hints out of the ring. So do hints of pages no longer private.
    #[test]
    fn a_hint_kept_twice_is_kept_once_and_gone_once_its_page_is_not_private() {
        let mut r = rig();
        let d = r.engine.dom(r.vm);
        let gpn = |g: u32| crate::ids::Gpn(r.engine.vms[&r.vm].base.0 + g);
        let (a, b) = (gpn(3), gpn(4));
        for _ in 0..3 {
            r.engine.keep_hint(d, 0xabc << 32, a);
        }
        r.engine.keep_hint(d, 0xdef << 32, b);
        r.engine.restore_kept_hints();
        assert_eq!(r.engine.kept_hints[&d].len(), 2);
        assert_eq!(r.engine.domain(d).share.lookup(0xabc << 32).count(), 1);
        // Page 4 stored (any state but private): its hint is forgotten.
        r.engine
            .vms
            .get_mut(&r.vm)
            .unwrap()
            .set(Gfn(4), PageState::Reclaiming);
        r.engine.restore_kept_hints();
        assert_eq!(
            r.engine.kept_hints[&d].iter().collect::<Vec<_>>(),
            [&(0xabc << 32, a)]
        );
    }

    /// A landed page's hint outlives the full scan that would drop it (the scan's own
    /// hints do not): its twin landing after the next pass began still finds it. Without
    /// the landed hints kept, the second read would find nothing.
    #[test]
    fn a_landed_hint_outlives_the_start_of_the_next_full_scan() {
        let mut r = rig();
        let first = disk_read(&mut r, &[3], 7);
        assert_eq!((first.looked_up, first.acted), (1, 0));
        // A full scan begins: hints dropped, landed ones restored.
        for dom in r.engine.domains.values_mut() {
            dom.share.end_pass();
        }
        r.engine.restore_kept_hints();
        let second = disk_read(&mut r, &[20], 7);
        assert_eq!((second.looked_up, second.acted), (1, 1));
        r.clock.advance(3_000);
        r.carry_out();
        let (a, b) = (state(&r, 3), state(&r, 20));
        assert!(matches!(a, PageState::Shared(_)) && a == b, "{a:?} {b:?}");
        // A landed page that changed since is hinted no more.
        let third = disk_read(&mut r, &[5], 8);
        assert_eq!(third.acted, 0);
        r.agent.write(Gfn(5), 0, b"changed").unwrap();
        for dom in r.engine.domains.values_mut() {
            dom.share.end_pass();
        }
        r.engine.restore_kept_hints();
        let fourth = disk_read(&mut r, &[6], 8);
        assert_eq!(fourth.acted, 0, "the changed page is no twin");
        r.engine.check_invariants().unwrap();
    }

    /// The scan, finding the same pair cold, would leave it to the clock (no mapping);
    /// a read does not: the difference is [`Seen::Read`].
    #[test]
    fn the_scan_defers_what_a_read_shares() {
        let mut r = rig();
        for g in [3, 20] {
            r.agent.write(Gfn(g), 0, &page(7)).unwrap();
        }
        let p: Box<Page> = r.agent.peek(Gfn(3)).unwrap().into();
        r.engine.consider_seen(r.vm, Gfn(20), &p, Seen::Scan);
        let p: Box<Page> = r.agent.peek(Gfn(20)).unwrap().into();
        let found = r.engine.consider_seen(r.vm, Gfn(3), &p, Seen::Scan);
        assert_ne!(found, crate::engine::unmapped::Found::Acted);
        assert_eq!(state(&r, 3), PageState::Private);
    }

    /// Zero pages a read filled are reclaimed; pages not private, beyond RAM, of a guest
    /// that is not attached, or past [`MAX_LANDED`] are passed over; a read share whose
    /// answer went with the connection is forgotten at re-attach.
    #[test]
    fn zeros_are_reclaimed_and_what_is_not_private_is_passed_over() {
        let mut r = rig();
        r.agent.write(Gfn(5), 0, &[0u8; PAGE_SIZE]).unwrap();
        let l = r
            .engine
            .read_landed(r.vm, &[Gfn(5), Gfn(PAGES), Gfn(PAGES + 7)], 0);
        assert_eq!((l.looked_up, l.acted, l.passed_over), (1, 1, 2));
        r.carry_out();
        assert_eq!(state(&r, 5), PageState::Zero);
        let l = r.engine.read_landed(r.vm, &[Gfn(5)], 0);
        assert_eq!((l.looked_up, l.passed_over), (0, 1));
        let many = vec![Gfn(9); MAX_LANDED + 3];
        assert_eq!(r.engine.read_landed(r.vm, &many, 0).passed_over, 3);
        // A share asked, its answer lost with the connection: after re-attach nothing of
        // it is booked as in doubt.
        disk_read(&mut r, &[10], 9);
        disk_read(&mut r, &[11], 9);
        let lost = r.engine.take_commands(r.vm);
        assert_eq!(lost.len(), 2);
        r.engine.check_invariants().unwrap();
        r.engine.detach(r.vm);
        let l = r.engine.read_landed(r.vm, &[Gfn(12)], 0);
        assert_eq!((l.looked_up, l.passed_over), (0, 1), "detached");
        assert_eq!(r.reattach().unwrap(), r.vm);
        r.engine.check_invariants().unwrap();
        assert!(r.engine.vms[&r.vm].read_sharing.is_empty());
    }
}
