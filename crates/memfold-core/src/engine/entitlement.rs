//! Sharing entitlements (Satori §4.2): the memory sharing saves, credited to the guests
//! that share it, in proportion to what each shares.
//!
//! For a frame `p` holding `n(p)` guest pages (its sharing rank), sharing saves
//! `n(p) − 1` pages; each mapping earns `(n(p) − 1) / n(p)` of them, so guest `i`'s
//! entitlement is `s(i) = Σ_{p ∈ M(i)} (n(p) − 1) / n(p)` over the frames it maps, once
//! per mapping, and the entitlements of all guests add up to exactly the pages sharing
//! saves (less the frames held only as patch references, which no guest maps).
//!
//! The books keep the exact part: each guest's shared pages counted by the rank of the
//! frame they map ([`SharingRanks`], integers, recounted from the P2M and the frame table
//! whenever the books are read — memfoldd reads them every second, as Satori interrogates
//! entitlements). `s(i)` is derived from them.
//!
//! What earns entitlement — decided here, as the paper counts sharing only:
//! - content shared with other pages, of this guest or another of its sharing domain —
//!   mapped, or shared without a mapping (issue 19: a cold share, one over the VMA
//!   budget; the frame holds the page all the same, and its next touch maps it). A page
//!   left unmapped neither loses its own credit nor lowers its partners' rank;
//! - not zero pages, shared onto the zero frame or reclaimed as holes: they are the
//!   guest's free memory. Crediting them would pay a guest for memory it does not use,
//!   and what the balloon hands back is itself zero until used: a loop that would deflate
//!   every idle guest to its full RAM;
//! - not patched, compressed or swapped pages: those savings are the guest's own (no
//!   other guest is involved), the guest's next touch takes them back, and they are
//!   booked per guest by mechanism already ([`super::SavedBy`]).

use serde::Serialize;

use std::collections::{BTreeMap, HashMap};

use super::{Engine, Vm};
use crate::ids::{DomainId, FrameId, VmId};
use crate::p2m::PageState;

/// One guest's shared pages by the sharing rank of the frame each maps: `(rank, pages)`
/// pairs, rank ≥ 1 ascending, pages > 0. The zero frame is left out (see the module).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SharingRanks(pub Vec<(u32, u64)>);

impl SharingRanks {
    /// The sharing entitlement `s(i)` (Satori §4.2), pages: `Σ pages · (rank − 1) / rank`.
    pub fn entitlement_pages(&self) -> f64 {
        self.0
            .iter()
            .map(|&(n, pages)| pages as f64 * f64::from(n.saturating_sub(1)) / f64::from(n.max(1)))
            .sum()
    }

    /// The entitlement in whole bytes, rounded down (4 KiB pages).
    pub fn entitlement_bytes(&self) -> u64 {
        (self.entitlement_pages() * crate::PAGE_SIZE as f64) as u64
    }

    /// Pages counted (the guest's shared pages outside the zero frame).
    pub fn pages(&self) -> u64 {
        self.0.iter().map(|&(_, p)| p).sum()
    }
}

/// Ranks up to this are counted in an array; higher ones (a page shared by hundreds of
/// mappers) in a short list.
const DENSE_RANKS: usize = 64;

impl Engine {
    /// Guest `id`'s shared pages by rank (`None`: no such guest). O(its domain's pages):
    /// for every guest at once, [`Engine::all_sharing_ranks`].
    pub fn sharing_ranks(&self, id: VmId) -> Option<SharingRanks> {
        let v = self.vms.get(&id)?;
        Some(self.ranks_of(v, &self.unmapped_refs(v.domain)))
    }

    /// Every guest's shared pages by rank, each domain's pages walked twice in all (the
    /// books and the claimers ask every second). O(all guests' pages).
    pub fn all_sharing_ranks(&self) -> BTreeMap<VmId, SharingRanks> {
        let mut unmapped: HashMap<DomainId, HashMap<FrameId, u32>> = HashMap::new();
        self.vms
            .iter()
            .map(|(&id, v)| {
                let refs = unmapped
                    .entry(v.domain)
                    .or_insert_with(|| self.unmapped_refs(v.domain));
                (id, self.ranks_of(v, refs))
            })
            .collect()
    }

    /// Domain `d`'s pages shared without a mapping (issue 19: cold shares, shares over
    /// the VMA budget), by the frame each holds. Booked as patch references, they are
    /// sharing all the same: the frame's sharing rank counts them.
    fn unmapped_refs(&self, d: DomainId) -> HashMap<FrameId, u32> {
        let mut refs: HashMap<FrameId, u32> = HashMap::new();
        for v in self.vms.values().filter(|v| v.domain == d) {
            for e in v.p2m.iter() {
                if let PageState::Unmapped(f) = e.state() {
                    *refs.entry(f).or_default() += 1;
                }
            }
        }
        refs
    }

    /// Guest `v`'s shared pages by rank, given its domain's [`Engine::unmapped_refs`].
    fn ranks_of(&self, v: &Vm, unmapped: &HashMap<FrameId, u32>) -> SharingRanks {
        let dom = self.domain(v.domain);
        let mut dense = [0u64; DENSE_RANKS + 1];
        let mut sparse: Vec<(u32, u64)> = Vec::new();
        for e in v.p2m.iter() {
            let (PageState::Shared(f) | PageState::Unmapped(f)) = e.state() else {
                continue;
            };
            if dom.zero_frames.contains(&f) {
                continue;
            }
            // Pages only, mapped or not: a patch using the frame as its reference holds
            // no page of it.
            let without = unmapped.get(&f).copied().unwrap_or(0);
            let n = dom.frames.refcount(f) - (dom.frames.patch_refs(f) - without);
            if (n as usize) <= DENSE_RANKS {
                dense[n as usize] += 1;
            } else {
                match sparse.iter_mut().find(|(r, _)| *r == n) {
                    Some((_, c)) => *c += 1,
                    None => sparse.push((n, 1)),
                }
            }
        }
        sparse.sort_unstable();
        let mut ranks: Vec<(u32, u64)> = dense
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(n, &c)| (n as u32, c))
            .collect();
        ranks.extend(sparse);
        SharingRanks(ranks)
    }
}

/// How a guest claims its entitlement through its balloon (Satori §4.2: "guests can elect
/// to use more complex policies").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum ClaimPolicy {
    /// No balloon is driven: the guest keeps its RAM, sharing's saving stays with the
    /// host (memfold before entitlements).
    #[default]
    Never,
    /// The balloon holds the guest at its base allowance and its entitlement stays with
    /// the host: the fixed allocation Satori's macrobenchmarks compare against (§6), and
    /// what a guest that asks not to claim gets from a host that drives balloons.
    AllowanceOnly,
    /// The guest sees its base allowance plus its entitlement at all times (the paper's
    /// setup: "claim memory as soon as it becomes available").
    AtOnce,
    /// The guest grows past its allowance only while it is short of memory (its balloon's
    /// guest statistics), never past allowance + entitlement, and gives back what it
    /// drew beyond its entitlement at once ("a guest may refrain from using its
    /// entitlement if it experiences low memory demand").
    UnderPressure,
}

impl ClaimPolicy {
    /// What a guest that asks for this policy gets under a host's policy `ceiling`: no
    /// more memory than `ceiling` would leave it, so that an ask (the guest's environment,
    /// the peer's to write) can only cost its own guest memory.
    ///
    /// By the memory each leaves the guest: `AllowanceOnly` ≤ `UnderPressure` ≤
    /// `AtOnce`. Under a host that drives no balloons (`Never`) nothing is driven,
    /// whatever the guest asks; under one that does, a guest asking `never` is held at its
    /// allowance (`AllowanceOnly`) — not left its whole RAM, which would be more than the
    /// host gives any guest.
    pub fn at_most(self, ceiling: ClaimPolicy) -> ClaimPolicy {
        let rank = |p: ClaimPolicy| match p {
            ClaimPolicy::Never | ClaimPolicy::AllowanceOnly => 0,
            ClaimPolicy::UnderPressure => 1,
            ClaimPolicy::AtOnce => 2,
        };
        let asked = match self {
            ClaimPolicy::Never => ClaimPolicy::AllowanceOnly,
            p => p,
        };
        if ceiling == ClaimPolicy::Never {
            ClaimPolicy::Never
        } else if rank(asked) <= rank(ceiling) {
            asked
        } else {
            ceiling
        }
    }
}

impl std::str::FromStr for ClaimPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<ClaimPolicy, String> {
        match s {
            "never" => Ok(ClaimPolicy::Never),
            "allowance-only" => Ok(ClaimPolicy::AllowanceOnly),
            "at-once" => Ok(ClaimPolicy::AtOnce),
            "under-pressure" => Ok(ClaimPolicy::UnderPressure),
            other => Err(format!(
                "claim policy {other:?}: expected never, allowance-only, at-once or under-pressure"
            )),
        }
    }
}

/// Whether a guest is short of memory, from its balloon's guest statistics (bytes):
/// memory available to it without swapping (`stat-available-memory`, the kernel's
/// MemAvailable) under an eighth of its memory now (`stat-total-memory`: what the balloon
/// leaves it), or under 32 MiB. `None` when the guest reports neither.
pub fn short_of_memory(available: Option<u64>, total: Option<u64>) -> Option<bool> {
    let (a, t) = (available?, total?);
    Some(a < (t / 8).max(32 << 20))
}

/// The balloon's granularity: targets are whole MiB, so the target does not follow every
/// page the entitlement gains or loses (bytes).
pub const CLAIM_GRAIN: u64 = 1 << 20;

/// What one guest may see (bytes): the memory its balloon should leave it, Satori §4.2's
/// "allowance + entitlement", under `policy`. `None`: drive no balloon.
///
/// - `ram`: the guest's configured RAM; `allowance`: its base allowance (clamped to
///   `ram`); `entitlement_pages`: `s(i)` ([`SharingRanks::entitlement_pages`]);
/// - `now`: where the guest stands, bytes: the target set last, else (a claimer that has
///   set none yet, as after a memfoldd restart) what its balloon leaves it; `None`: not
///   known;
/// - `short`: whether the guest reports it is short of memory (for
///   [`ClaimPolicy::UnderPressure`]; `None`: unknown, taken as not short).
///
/// The result is a whole number of [`CLAIM_GRAIN`]s, at least the allowance and at most
/// `ram`. Repayment (§4.3) is the same rule: when broken sharing lowers a guest's
/// entitlement, its target falls with it at the next second and its balloon inflates —
/// only guests whose entitlement fell, that is, those whose sharing broke.
///
/// Under [`ClaimPolicy::UnderPressure`] the target follows `now` (rounded down to a
/// grain), so it is `None` while `now` is: a guest that had grown past its allowance is
/// not cut back to it only because its claimer does not know yet where it stands.
pub fn claim_target(
    policy: ClaimPolicy,
    ram: u64,
    allowance: u64,
    entitlement_pages: f64,
    now: Option<u64>,
    short: Option<bool>,
) -> Option<u64> {
    let grain = |b: u64| b / CLAIM_GRAIN * CLAIM_GRAIN;
    let allowance = grain(allowance.min(ram));
    let entitled = (entitlement_pages.max(0.0) * crate::PAGE_SIZE as f64) as u64;
    let ceiling = grain(allowance.saturating_add(entitled).min(ram));
    match policy {
        ClaimPolicy::Never => None,
        ClaimPolicy::AllowanceOnly => Some(allowance),
        ClaimPolicy::AtOnce => Some(ceiling),
        ClaimPolicy::UnderPressure => {
            let now = grain(now?).clamp(allowance, ceiling);
            Some(if short == Some(true) {
                // Grow by an eighth of the entitlement per second (at least one grain):
                // a pressure reading lags the memory it asks for.
                let step = grain((entitled / 8).max(CLAIM_GRAIN));
                (now + step).min(ceiling)
            } else {
                now
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    /// Pages in one MiB.
    const MIB_PAGES: f64 = 256.0;

    #[test]
    fn at_once_the_guest_sees_its_allowance_plus_its_entitlement_in_whole_mib() {
        let t = |e: f64| claim_target(ClaimPolicy::AtOnce, 512 * MIB, 256 * MIB, e, None, None);
        assert_eq!(t(0.0), Some(256 * MIB));
        assert_eq!(t(10.0 * MIB_PAGES + 100.0), Some(266 * MIB));
        // Never past the guest's RAM, never under its allowance.
        assert_eq!(t(1000.0 * MIB_PAGES), Some(512 * MIB));
        assert_eq!(t(-5.0), Some(256 * MIB));
        assert_eq!(
            claim_target(ClaimPolicy::AtOnce, 512 * MIB, 600 * MIB, 0.0, None, None),
            Some(512 * MIB)
        );
        assert_eq!(
            claim_target(ClaimPolicy::Never, 512 * MIB, 256 * MIB, 4096.0, None, None),
            None
        );
        // Allowance only: held at the allowance whatever the entitlement.
        assert_eq!(
            claim_target(
                ClaimPolicy::AllowanceOnly,
                512 * MIB,
                256 * MIB + 5,
                4096.0,
                None,
                None
            ),
            Some(256 * MIB)
        );
    }

    #[test]
    fn under_pressure_the_guest_grows_only_when_short_and_repays_at_once() {
        let t = |e: f64, now: Option<u64>, short: Option<bool>| {
            claim_target(
                ClaimPolicy::UnderPressure,
                512 * MIB,
                256 * MIB,
                e,
                now,
                short,
            )
        };
        let e = 64.0 * MIB_PAGES;
        // Not short (or not known): it stays where it is, in whole MiB.
        assert_eq!(t(e, Some(256 * MIB), None), Some(256 * MIB));
        assert_eq!(t(e, Some(256 * MIB), Some(false)), Some(256 * MIB));
        assert_eq!(t(e, Some(300 * MIB + 5), Some(false)), Some(300 * MIB));
        // Where it stands not known (no target set, the balloon not read yet): nothing
        // to set, short or not — not its allowance, which would cut a guest that had grown
        // past it straight back.
        assert_eq!(t(e, None, None), None);
        assert_eq!(t(e, None, Some(true)), None);
        // Short: it grows by an eighth of the entitlement a step, up to the ceiling.
        let mut now = 256 * MIB;
        let mut steps = 0;
        while now < 320 * MIB {
            now = t(e, Some(now), Some(true)).unwrap();
            steps += 1;
        }
        assert_eq!((now, steps), (320 * MIB, 8));
        assert_eq!(t(e, Some(now), Some(true)), Some(320 * MIB));
        // Sharing broke: the entitlement fell to 16 MiB, the guest repays at once, short or
        // not (§4.3).
        assert_eq!(t(16.0 * MIB_PAGES, Some(now), Some(true)), Some(272 * MIB));
        assert_eq!(t(16.0 * MIB_PAGES, Some(now), None), Some(272 * MIB));
    }

    #[test]
    fn a_guest_is_short_under_an_eighth_of_its_memory_available_or_32_mib() {
        assert_eq!(
            short_of_memory(Some(100 * MIB), Some(512 * MIB)),
            Some(false)
        );
        assert_eq!(short_of_memory(Some(63 * MIB), Some(512 * MIB)), Some(true));
        assert_eq!(short_of_memory(Some(31 * MIB), Some(128 * MIB)), Some(true));
        assert_eq!(
            short_of_memory(Some(40 * MIB), Some(128 * MIB)),
            Some(false)
        );
        assert_eq!(short_of_memory(None, Some(128 * MIB)), None);
        assert_eq!(short_of_memory(Some(1), None), None);
    }

    #[test]
    fn a_guest_may_ask_for_less_than_the_hosts_policy_never_more() {
        use ClaimPolicy::*;
        // A guest asking not to claim is held at its allowance, not left its whole RAM.
        assert_eq!(Never.at_most(AtOnce), AllowanceOnly);
        assert_eq!(Never.at_most(UnderPressure), AllowanceOnly);
        assert_eq!(Never.at_most(AllowanceOnly), AllowanceOnly);
        assert_eq!(UnderPressure.at_most(AtOnce), UnderPressure);
        assert_eq!(AtOnce.at_most(UnderPressure), UnderPressure);
        assert_eq!(AtOnce.at_most(AllowanceOnly), AllowanceOnly);
        assert_eq!(AllowanceOnly.at_most(AtOnce), AllowanceOnly);
        assert_eq!(AtOnce.at_most(AtOnce), AtOnce);
        // A host that drives no balloons drives none, whatever a guest asks.
        for asked in [Never, AllowanceOnly, UnderPressure, AtOnce] {
            assert_eq!(asked.at_most(Never), Never);
        }
    }

    #[test]
    fn claim_policies_parse_by_their_flag_names_only() {
        for (s, p) in [
            ("never", ClaimPolicy::Never),
            ("allowance-only", ClaimPolicy::AllowanceOnly),
            ("at-once", ClaimPolicy::AtOnce),
            ("under-pressure", ClaimPolicy::UnderPressure),
        ] {
            assert_eq!(s.parse::<ClaimPolicy>(), Ok(p));
        }
        let e = "AtOnce".parse::<ClaimPolicy>().unwrap_err();
        assert!(
            e.contains("expected never, allowance-only, at-once or under-pressure"),
            "{e}"
        );
    }
}
