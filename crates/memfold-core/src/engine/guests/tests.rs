//! Attach, detach and adoption tests (split from guests.rs, which was near 800 lines).

use super::{Attach, Sharing};
use crate::backing::mem::{ManualClock, MemBacking, MemGuestRam};
use crate::ids::{DomainId, VmId};
use crate::{Command, Engine, EngineConfig, EngineError, Policy, PAGE_SIZE};

fn engine() -> (Engine, ManualClock) {
    let cfg = EngineConfig {
        policy: Policy::sharing_only(),
        rate: 0,
        clock_interval_us: None,
        min_scan_interval_us: 10_000,
        max_scan_interval_us: 10_000,
        quiet_scan_period: 1,
        ..EngineConfig::default()
    };
    let clock = ManualClock::new();
    let mut e = Engine::new(cfg, Box::new(clock.clone()), 0).unwrap();
    e.add_domain(DomainId(0), Box::new(MemBacking::new()));
    e.add_domain(DomainId(1), Box::new(MemBacking::new()));
    (e, clock)
}

/// Guest `pid` of 4 pages, every page filled with `fill`, in `domain`.
fn attach(e: &mut Engine, pid: u32, domain: u32, sharing: Sharing) -> Result<VmId, EngineError> {
    let ram = MemGuestRam::new(4);
    {
        let mut f = ram.file();
        f.bytes[..4 * PAGE_SIZE].fill(7);
        f.touch(0, 4 * PAGE_SIZE as u64);
    }
    e.attach(Attach {
        name: format!("g{pid}"),
        pid,
        pages: 4,
        ram: Box::new(ram),
        mapped: vec![],
        domain: DomainId(domain),
        store: Box::new(MemBacking::new()),
        swap: None,
        sharing,
    })
}

/// The never-share invariant (Satori §4.3): a never-share guest is alone in its
/// domain. Fails if `Engine::attach`'s check is removed.
#[test]
fn never_share_guest_is_alone_in_its_domain() {
    let (mut e, _) = engine();
    attach(&mut e, 1, 0, Sharing::Domain).unwrap();
    // A never-share guest into a domain that holds another guest: refused.
    let r = attach(&mut e, 2, 0, Sharing::NeverShare);
    assert!(
        matches!(&r, Err(EngineError::Attach { why, .. }) if why.contains("never-share")),
        "{r:?}"
    );
    // Alone in a domain: accepted; then no other guest may join it.
    let n = attach(&mut e, 3, 1, Sharing::NeverShare).unwrap();
    let r = attach(&mut e, 4, 1, Sharing::Domain);
    assert!(matches!(r, Err(EngineError::Attach { .. })), "{r:?}");
    let r = attach(&mut e, 5, 1, Sharing::NeverShare);
    assert!(matches!(r, Err(EngineError::Attach { .. })), "{r:?}");
    // Its own re-attach (same QEMU, detached) is not another guest.
    e.detach(n);
    assert_eq!(attach(&mut e, 3, 1, Sharing::NeverShare).unwrap(), n);
    e.check_invariants().unwrap();
}

/// An adopted frame memfoldd cannot read, which a re-attaching agent maps, stays
/// booked (withdrawn) past the adoption's end. Fails with the page booked private:
/// the frame was freed while the agent still mapped it (its guest then read zeros,
/// and later another guest's page).
#[test]
fn an_unreadable_adopted_frame_a_guest_maps_outlives_the_adoption() {
    use crate::ids::{FrameId, Gfn};
    let (mut e, _) = engine();
    let d = DomainId(0);
    // The old pool's file holds no bytes: frame 0, held, cannot be read.
    assert!(e.adopt_pool(d, Box::new(MemBacking::new()), 4, [FrameId(0)]));
    let v = e
        .attach(Attach {
            name: "a".into(),
            pid: 1,
            pages: 4,
            ram: Box::new(MemGuestRam::new(4)),
            mapped: vec![(Gfn(0), super::Mapped::Frame(FrameId(0)))],
            domain: d,
            store: Box::new(MemBacking::new()),
            swap: None,
            sharing: Sharing::Domain,
        })
        .unwrap();
    e.end_adoption(d);
    assert!(e.frame_held(d, FrameId(0)));
    assert_eq!(
        e.vms[&v].state(Gfn(0)),
        crate::p2m::PageState::Shared(FrameId(0))
    );
    assert!(
        e.withdrawn(d, FrameId(0)),
        "its bytes unknown: never joined"
    );
    e.check_invariants().unwrap();
}

/// An adopted frame claimed again (its guest let it go and re-attached to it) whose
/// bytes changed in between is listed under its new hash only. Fails without
/// `claim_adopted` removing the old entry: the share table still lists the frame under
/// the hash of bytes it no longer holds — a page equal to those would be checked against
/// it for nothing, and once the frame is freed and reused, joined to a free frame.
#[test]
fn an_adopted_frame_claimed_again_with_new_bytes_is_listed_once() {
    // Claimed first with other bytes, then first as zeros (it must then leave the zero
    // frames: a page marked never-share on it would not withdraw it).
    for first in [1u8, 0] {
        claimed_again(first);
    }
}

/// Attaches guest `pid` of 4 pages to domain `d`, re-attaching with `mapped`.
fn attach_mapping(
    e: &mut Engine,
    d: DomainId,
    pid: u32,
    mapped: Vec<(crate::ids::Gfn, super::Mapped)>,
) -> VmId {
    e.attach(Attach {
        name: format!("g{pid}"),
        pid,
        pages: 4,
        ram: Box::new(MemGuestRam::new(4)),
        mapped,
        domain: d,
        store: Box::new(MemBacking::new()),
        swap: None,
        sharing: Sharing::Domain,
    })
    .unwrap()
}

/// An engine whose domain 0 adopted a pool of 4 pages (the pool, kept to change its
/// bytes later) with frame 0 in use, holding `bytes`.
fn adopted_frame(bytes: u8) -> (Engine, DomainId, crate::ids::FrameId, MemBacking) {
    use crate::backing::Backing;
    let (mut e, _) = engine();
    let d = DomainId(0);
    let f = crate::ids::FrameId(0);
    let mut pool = MemBacking::new();
    pool.resize(4 * PAGE_SIZE as u64).unwrap();
    pool.write(f.offset(), &[bytes; PAGE_SIZE]).unwrap();
    assert!(e.adopt_pool(d, Box::new(pool.clone()), 4, [f]));
    (e, d, f, pool)
}

/// An adopted frame of `first` bytes claimed, let go, rewritten with 2s and claimed again:
/// listed once in the share table, and not a zero frame any more.
fn claimed_again(first: u8) {
    use crate::backing::Backing;
    use crate::ids::Gfn;
    let (mut e, d, f, mut pool) = adopted_frame(first);
    let attach_a = |e: &mut Engine, mapped| attach_mapping(e, d, 1, mapped);
    let on_f = vec![(Gfn(0), super::Mapped::Frame(f))];
    let a = attach_a(&mut e, on_f.clone());
    assert_eq!(e.domains[&d].zero_frames.contains(&f), first == 0);
    // Let go (still pinned by the adoption), its bytes changed, claimed again.
    e.detach(a);
    attach_a(&mut e, vec![]);
    assert!(e.frame_held(d, f));
    pool.write(f.offset(), &[2u8; PAGE_SIZE]).unwrap();
    e.detach(a);
    attach_a(&mut e, on_f);
    let listed = e.domains[&d]
        .share
        .entries()
        .filter(|&(_, x)| x == crate::share::ShareEntry::Shared(f))
        .count();
    assert_eq!(listed, 1, "{f} listed {listed} times (first bytes {first})");
    assert!(
        !e.domains[&d].zero_frames.contains(&f),
        "{f} of 2s still a zero frame (first bytes {first})"
    );
    e.check_invariants().unwrap();
}

/// An adopted frame claimed (listed in the share table) and let go (pinned by the
/// adoption at refcount 0, still listed), then mapped by another re-attaching guest while
/// the pool cannot be read there: withdrawn, and so out of the share table (the invariant
/// in never_share.rs). Fails without the removal in `reconcile`: 'domain 0: share table
/// names frame 0, withdrawn (...)' (the reference model's long run 4).
#[test]
fn an_adopted_frame_withdrawn_as_unreadable_leaves_the_share_table() {
    // Of other bytes, and of zeros (it must then leave the zero frames too: a page on it
    // would be counted as a zero page, and a never-share page on it not taken back).
    for bytes in [1u8, 0] {
        withdrawn_as_unreadable(bytes);
    }
}

/// [`an_adopted_frame_withdrawn_as_unreadable_leaves_the_share_table`] with a frame of
/// `bytes`.
fn withdrawn_as_unreadable(bytes: u8) {
    use crate::backing::Backing;
    use crate::ids::Gfn;
    let (mut e, d, f, mut pool) = adopted_frame(bytes);
    let attach_on = |e: &mut Engine, pid, mapped| attach_mapping(e, d, pid, mapped);
    let listed = |e: &Engine| {
        e.domains[&d]
            .share
            .entries()
            .any(|(_, x)| x == crate::share::ShareEntry::Shared(f))
    };
    let on_f = vec![(Gfn(0), super::Mapped::Frame(f))];
    let a = attach_on(&mut e, 1, on_f.clone());
    e.detach(a);
    attach_on(&mut e, 1, vec![]);
    assert!(
        e.frame_held(d, f) && listed(&e),
        "claimed, let go, still listed"
    );
    // The pool cannot be read there any more (a failed read, as the model injects).
    pool.resize(0).unwrap();
    attach_on(&mut e, 2, on_f);
    assert!(e.withdrawn(d, f), "its bytes unknown: withdrawn");
    e.check_invariants().unwrap();
    assert!(!listed(&e), "still listed (bytes {bytes})");
    assert!(
        !e.domains[&d].zero_frames.contains(&f),
        "still a zero frame (bytes {bytes})"
    );
}

/// A guest that leaves gives its page space back, and nothing names it when the next
/// guest — here of another domain — gets it: its domain's hints are purged. Fails
/// without the purge in `Engine::remove` (and so does the reference model's
/// `check_invariants`: a hint at a page no guest holds).
#[test]
fn a_removed_guests_hints_are_purged_before_its_space_is_reused() {
    let (mut e, clock) = engine();
    // A guest that stays keeps domain 0 (and its share table).
    attach(&mut e, 3, 0, Sharing::Domain).unwrap();
    let ram = MemGuestRam::new(4);
    {
        let mut f = ram.file();
        for p in 0..4 {
            f.bytes[p * PAGE_SIZE..(p + 1) * PAGE_SIZE].fill(p as u8 + 1);
        }
        f.touch(0, 4 * PAGE_SIZE as u64);
    }
    let a = e
        .attach(Attach {
            name: "a".into(),
            pid: 1,
            pages: 4,
            ram: Box::new(ram),
            mapped: vec![],
            domain: DomainId(0),
            store: Box::new(MemBacking::new()),
            swap: None,
            sharing: Sharing::Domain,
        })
        .unwrap();
    clock.advance(10_000);
    e.scan_step().unwrap();
    let base = e.vms[&a].base;
    let hints = |e: &Engine| {
        e.domains[&DomainId(0)]
            .share
            .entries()
            .filter(|(_, x)| {
                matches!(x, crate::share::ShareEntry::Hint(g) if g.0 >= base.0 && g.0 < base.0 + 4)
            })
            .count()
    };
    assert_eq!(hints(&e), 4, "its 4 distinct pages hinted");
    e.remove(a);
    assert_eq!(hints(&e), 0);
    let b = attach(&mut e, 2, 1, Sharing::Domain).unwrap();
    assert_eq!(e.vms[&b].base, base, "the space is given to the next guest");
    e.check_invariants().unwrap();
}

/// Guest ids are never given twice: past 2^32 attaches a new guest is refused, and
/// the page space it took is given back. Fails with the count wrapping (the new
/// guest is booked with the last id, and the next would overwrite guest 0).
#[test]
fn guest_ids_run_out_rather_than_wrap() {
    let (mut e, _) = engine();
    let first = attach(&mut e, 1, 0, Sharing::Domain).unwrap();
    e.next_vm = u32::MAX;
    let r = attach(&mut e, 2, 0, Sharing::Domain);
    assert!(
        matches!(&r, Err(EngineError::Attach { why, .. }) if why.contains("2^32")),
        "{r:?}"
    );
    assert_eq!(e.vms.len(), 1);
    assert_eq!(e.vms[&first].pid, 1);
    e.check_invariants().unwrap();
}

/// A QEMU of two RAM regions of one size has a guest each (`NAME/ramK`); with both
/// detached, each region's re-attach finds its own guest, by name. Fails (region 1
/// re-attached as region 0's guest) when the re-attach matches by pid and size only.
#[test]
fn each_region_of_a_qemu_re_attaches_as_itself() {
    let (mut e, _) = engine();
    let region = |e: &mut Engine, k: u32| {
        e.attach(Attach {
            name: format!("q/ram{k}"),
            pid: 9,
            pages: 4,
            ram: Box::new(MemGuestRam::new(4)),
            mapped: vec![],
            domain: DomainId(0),
            store: Box::new(MemBacking::new()),
            swap: None,
            sharing: Sharing::Domain,
        })
        .unwrap()
    };
    let (r0, r1) = (region(&mut e, 0), region(&mut e, 1));
    e.detach(r0);
    e.detach(r1);
    assert_eq!(region(&mut e, 1), r1);
    assert_eq!(region(&mut e, 0), r0);
    assert_eq!(e.vms.len(), 2);
    e.check_invariants().unwrap();
}

/// Requests still queued when an agent detaches were never sent: undone, but not
/// refusals — no VMA pressure (which would share its pages without a mapping for 30 s)
/// and no refusal counted. Seen failing with them answered Refused.
#[test]
fn requests_queued_at_a_detach_are_not_refusals() {
    let (mut e, clock) = engine();
    let id = attach(&mut e, 1, 0, Sharing::Domain).unwrap();
    let mut steps = 0;
    while !e.vms[&id]
        .queue
        .iter()
        .any(|c| matches!(c, Command::Share { .. }))
    {
        clock.advance(10_000);
        e.scan_step().unwrap();
        steps += 1;
        assert!(steps < 100, "no share queued");
    }
    e.detach(id);
    assert_eq!(e.vms[&id].books.share_refused, 0);
    assert!(!e.vma_pressure(id));
    assert!(e.vms[&id].queue.is_empty());
    e.check_invariants().unwrap();
}

/// A never-share guest's identical pages are still shared with each other (ESX's
/// salting: sharing within the VM), on one frame. That it never shares with another
/// guest is `never_share_guest_is_alone_in_its_domain`'s (and the live
/// `never_share.rs`'s): here the two are in domains of their own.
#[test]
fn never_share_guest_still_shares_within_itself() {
    let (mut e, clock) = engine();
    let other = attach(&mut e, 1, 0, Sharing::Domain).unwrap();
    let n = attach(&mut e, 2, 1, Sharing::NeverShare).unwrap();
    for _ in 0..3 {
        clock.advance(20_000);
        e.scan_step().unwrap();
    }
    let frames = |e: &mut Engine, vm| -> Vec<_> {
        e.take_commands(vm)
            .into_iter()
            .filter_map(|c| match c {
                Command::Share { frame, .. } | Command::Fill { frame, .. } => Some(frame),
                _ => None,
            })
            .collect()
    };
    let (fo, fn_) = (frames(&mut e, other), frames(&mut e, n));
    assert_eq!(
        fo.len(),
        4,
        "the other guest's 4 equal pages share one frame"
    );
    assert_eq!(fn_.len(), 4, "so do the never-share guest's, within itself");
    e.check_invariants().unwrap();
    assert!(fn_.iter().all(|f| *f == fn_[0]), "one frame: {fn_:?}");
}

/// A pool of more frames than a P2M entry can name is not adopted (the daemon caps
/// adoption lower; the engine does not rely on it). Fails without the bound: adopted.
#[test]
fn a_pool_larger_than_a_p2m_entry_can_name_is_not_adopted() {
    use crate::ids::FrameId;
    use crate::p2m::P2mEntry;
    let (mut e, _) = engine();
    let d = DomainId(0);
    let past = P2mEntry::MAX_PAYLOAD + 1;
    assert!(!e.adopt_pool(d, Box::new(MemBacking::new()), past, [FrameId(past - 1)]));
    assert!(e.pool_untouched(d), "nothing adopted");
    assert!(e.adopt_pool(d, Box::new(MemBacking::new()), 4, [FrameId(0)]));
}
