//! Guests coming and going: attach, re-attach after a lost connection or a memfoldd
//! restart (reconciling the books with what the agent maps), detach, removal when QEMU
//! exits; and the adoption of a previous memfoldd's pool.

use super::{Engine, EngineError, Outcome};
use crate::backing::{Backing, GuestRam};
use crate::blobs::{BlobHome, BlobSpace};
use crate::clock::ClockHand;
use crate::frames::FrameTable;
use crate::ids::{DomainId, FrameId, Gfn, VmId};
use crate::p2m::{BlobId, P2mEntry, PageState};
use crate::share::ShareEntry;
use crate::{Page, PAGE_SIZE};

use super::books::VmBooks;
use super::Vm;

/// An attach (or re-attach) of a guest.
pub struct Attach {
    /// Guest name.
    pub name: String,
    /// QEMU's pid (from the socket's peer credentials, not the peer's word).
    pub pid: u32,
    /// Guest RAM, pages.
    pub pages: u32,
    /// Its RAM.
    pub ram: Box<dyn GuestRam>,
    /// What the agent maps now (re-attach): pool frames and reclaimed zero pages.
    pub mapped: Vec<(Gfn, Mapped)>,
    /// Its sharing domain (must exist: [`Engine::add_domain`], [`Engine::adopt_pool`]);
    /// a re-attach must name the domain of its first attach.
    pub domain: DomainId,
    /// Its own store (host memory) for patches and compressed pages, empty.
    pub store: Box<dyn Backing>,
    /// Its own swap file, empty (under a host budget; `None`: it never swaps).
    pub swap: Option<Box<dyn Backing>>,
    /// Whom its pages may be shared with: [`Sharing::NeverShare`] keeps it alone in its
    /// domain (Satori §4.3).
    pub sharing: Sharing,
}

/// Whom a guest's pages may be shared with: the operator's per-VM never-share policy
/// (Satori §4.3: memory "never to be shared", against the write-latency side channel of
/// a CoW break; ESX's salting for a whole VM).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharing {
    /// With every guest of its sharing domain (whom the domain holds, its rule decides).
    #[default]
    Domain,
    /// Never across VMs: the guest is alone in its sharing domain, so none of its pages is
    /// mapped onto a frame another VM's page maps, patched against another VM's page, or
    /// used as another VM's reference page (each domain has its own pool, share table and
    /// similarity index), and another VM can never time a CoW break on a page equal to
    /// one of its pages. Identical pages *within* the guest are still shared with each
    /// other, and its own pages still patched against its own (ESX's salting semantics);
    /// zero pages are reclaimed as for any guest.
    NeverShare,
}

/// A page a re-attaching agent maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// Onto this pool frame.
    Frame(FrameId),
    /// A reclaimed zero page (a hole the agent refills).
    Zero,
}

impl Engine {
    /// Whether domain `d` may still adopt a pool: it does not exist yet, or its pool is
    /// untouched (no frame ever allocated, no guest attached).
    pub fn pool_untouched(&self, d: DomainId) -> bool {
        self.domains
            .get(&d)
            .is_none_or(|dom| dom.frames.size() == 0 && !self.vms.values().any(|v| v.domain == d))
    }

    /// Domain `d` adopts the pool of a previous memfoldd, handed back by a re-attaching
    /// agent of that domain: its `frames` frames, of which those in `held` hold data. Those
    /// stay pinned until [`Engine::end_adoption`]: an agent not yet re-attached may map
    /// any of them. Creates the domain if it does not exist.
    ///
    /// Refuses (returns false) unless [`Engine::pool_untouched`], and a pool of more
    /// frames than a P2M entry can name ([`crate::p2m::P2mEntry::MAX_PAYLOAD`]): a held
    /// frame past it that a re-attaching agent maps would panic the books.
    pub fn adopt_pool(
        &mut self,
        d: DomainId,
        pool: Box<dyn Backing>,
        frames: u32,
        held: impl IntoIterator<Item = FrameId>,
    ) -> bool {
        if !self.pool_untouched(d) || frames > crate::p2m::P2mEntry::MAX_PAYLOAD {
            return false;
        }
        self.domains.remove(&d);
        self.add_domain(d, pool);
        let dom = self.domain_mut(d);
        dom.frames = FrameTable::adopted(frames, held);
        dom.adopted = true;
        true
    }

    /// Ends the adoption of domain `d`'s pool: every process that held the old pool has
    /// re-attached or exited, so adopted frames no guest maps are freed.
    pub fn end_adoption(&mut self, d: DomainId) {
        let Some(dom) = self.domains.get_mut(&d) else {
            return;
        };
        for f in dom.frames.end_adoption() {
            self.forget_frame(d, f);
        }
        self.drop_domain_if_empty(d);
    }

    /// Whether adopted frames of domain `d` are still pinned.
    pub fn adoption_pending(&self, d: DomainId) -> bool {
        self.domains
            .get(&d)
            .is_some_and(|dom| dom.frames.adoption_pending())
    }

    /// Drops domain `d` (and its pool) if no guest is in it and no frame held (a detached
    /// guest still counts: it re-attaches into it). Removing a domain's last guest and
    /// ending its adoption drop it too.
    pub fn drop_domain_if_empty(&mut self, d: DomainId) {
        let empty = self
            .domains
            .get(&d)
            .is_some_and(|dom| dom.frames.in_use() == 0 && !dom.frames.adoption_pending())
            && !self.vms.values().any(|v| v.domain == d);
        if empty {
            self.domains.remove(&d);
            // What it kept by domain goes with it (one entry a guest ever attached, under
            // a domain a guest).
            self.kept_hints.remove(&d);
            self.fills.index.remove(&d);
            tracing::info!(domain = %d, "domain dropped: no guest, no frame");
        }
    }

    /// Attaches a guest, or re-attaches one whose connection was lost while its QEMU
    /// lived (same pid and name, detached): its agent wrote every stashed page back before re-attaching, so
    /// their blobs are released; what it maps now (`a.mapped`) replaces what the books said,
    /// including requests lost in doubt. Frames of an adopted pool that a guest maps are
    /// read, hashed and entered in the share table; one that cannot be read is booked
    /// and withdrawn from sharing (its bytes unknown).
    ///
    /// Errors: [`EngineError::Attach`] for a guest of 0 pages, pages no free range of the
    /// 2^31-page global page space holds, a domain that does not exist, or a re-attach
    /// naming another domain than its first attach.
    pub fn attach(&mut self, a: Attach) -> Result<VmId, EngineError> {
        let refuse = |why: String| EngineError::Attach {
            name: a.name.clone(),
            pid: a.pid,
            why,
        };
        if !self.domains.contains_key(&a.domain) {
            return Err(refuse(format!("{} does not exist", a.domain)));
        }
        // INVARIANT (never-share, Satori §4.3): a guest marked [`Sharing::NeverShare`] is
        // the only guest of its domain, while it is attached or detached. Sharing,
        // patching and reference pages never cross a domain (each has its own share
        // table and similarity index), so this alone keeps every page of a never-share
        // guest from being shared with, patched against or used as reference by another
        // VM. Refused both ways: a never-share guest joining a domain that holds another
        // guest, and any guest joining a never-share guest's domain.
        // (`check_invariants` checks it; `never_share_guest_is_alone_in_its_domain` fails
        // without this check.)
        // Its own re-attach: the same QEMU and region (a QEMU of several RAM regions has a
        // guest each, by name), detached.
        let same = |v: &super::Vm| {
            v.pid == a.pid && v.name == a.name && !v.attached && v.pages() == a.pages
        };
        if let Some(other) = self.vms.values().find(|v| {
            v.domain == a.domain
                && !same(v)
                && (a.sharing == Sharing::NeverShare || v.sharing == Sharing::NeverShare)
        }) {
            return Err(refuse(format!(
                "{} holds {} ({}), and a never-share guest is alone in its domain",
                a.domain,
                other.name,
                if other.sharing == Sharing::NeverShare {
                    "never-share"
                } else {
                    "shares"
                }
            )));
        }
        let cap = self.swap_capacity;
        let swap_space =
            |b: Option<Box<dyn Backing>>| b.map(|b| BlobSpace::new(BlobHome::Swap, b, Some(cap)));
        let old = self.vms.iter().find(|(_, v)| same(v)).map(|(id, _)| *id);
        let id = match old {
            Some(id) => {
                if self.vms[&id].domain != a.domain {
                    return Err(refuse(format!(
                        "re-attach names {}, its first attach {}",
                        a.domain, self.vms[&id].domain
                    )));
                }
                self.release_blobs(id);
                let swap = swap_space(a.swap);
                let v = self.vms.get_mut(&id).expect("found above");
                v.ram = a.ram;
                // Its RAM's data runs are asked again of the new descriptor.
                v.run_end = 0;
                v.sharing = a.sharing;
                // Its old store and swap file hold nothing now; new ones replace them.
                v.store = BlobSpace::new(BlobHome::Store, a.store, None);
                v.swap = swap;
                id
            }
            None => {
                if a.pages == 0 {
                    return Err(refuse("a guest of 0 pages".into()));
                }
                let Some(base) = self.gpns.take(a.pages) else {
                    return Err(refuse(format!(
                        "no room for {} pages in the 2^31-page global page space ({} held)",
                        a.pages,
                        self.gpns.held_pages()
                    )));
                };
                // INVARIANT: a guest id is never given twice (blobs, fills and books are
                // keyed by it; a wrapped count would overwrite a live guest).
                let Some(next_vm) = self.next_vm.checked_add(1) else {
                    self.gpns.give_back(base, a.pages);
                    return Err(refuse(
                        "2^32 guests attached since memfoldd started: restart it".into(),
                    ));
                };
                let id = VmId(self.next_vm);
                let now = self.now_us();
                self.next_vm = next_vm;
                self.by_base.insert(base, id);
                let n = a.pages as usize;
                let swap = swap_space(a.swap);
                self.vms.insert(
                    id,
                    Vm {
                        name: a.name,
                        pid: a.pid,
                        base,
                        domain: a.domain,
                        sharing: a.sharing,
                        ram: a.ram,
                        store: BlobSpace::new(BlobHome::Store, a.store, None),
                        swap,
                        attached: false,
                        opted_out: false,
                        p2m: vec![P2mEntry::PRIVATE; n],
                        cursor: 0,
                        scanned_this_pass: false,
                        run_end: 0,
                        hints: super::page_hints::PageHints::new(n),
                        queue: Vec::new(),
                        clock: ClockHand::new(n),
                        share_refused_us: None,
                        unmapping: Default::default(),
                        early: Default::default(),
                        lost_page_outs: Default::default(),
                        unmapped_ages: super::unmapped::UnmappedAges::new(now),
                        read_sharing: Default::default(),
                        read_shared_at: Default::default(),
                        read_backoff: Default::default(),
                        categories: None,
                        categories_at_us: 0,
                        clock_wp_only: Vec::new(),
                        zap_shared_slices: 0,
                        never_share_pass_us: None,
                        sweep: 0,
                        free_watch: Default::default(),
                        wait: Default::default(),
                        books: VmBooks::default(),
                    },
                );
                id
            }
        };
        self.reconcile(id, &a.mapped)?;
        let v = self.vms.get_mut(&id).expect("attached above");
        v.attached = true;
        v.scanned_this_pass = false;
        // Take-backs and read shares in doubt ended with the connection: what the agent
        // maps now is the truth, and a later CoW break of these pages is the guest's write.
        v.unmapping.clear();
        v.read_sharing.clear();
        v.early.clear();
        self.forget_landed(id);
        let v = self.vms.get_mut(&id).expect("attached above");
        // Its watch round ended with the connection (rounds keep counting: a report
        // that followed an old round never names a new one).
        v.free_watch.end();
        v.free_watch.held.clear();
        if v.opted_out {
            // Its take-backs were dropped with the connection: ask again.
            self.opt_out(id);
        }
        // So were its never-share take-backs, and a share the agent's list confirmed
        // (`reconcile`) never passed `never_share_landed`: ask again (Satori §4.3).
        self.take_back_never_share(id);
        self.retake_own_partners(id);
        let v = &self.vms[&id];
        tracing::info!(
            vm = %id, name = %v.name, pid = v.pid, pages = v.pages(), domain = %v.domain,
            sharing = ?v.sharing, shared = v.books.shared_pages, "attached"
        );
        Ok(id)
    }

    /// Makes the books of guest `id` say what its agent maps (`mapped`): requests in
    /// doubt end, mappings no longer there are dropped, new ones are counted.
    fn reconcile(&mut self, id: VmId, mapped: &[(Gfn, Mapped)]) -> Result<(), EngineError> {
        let pages = self.vms[&id].pages();
        let d = self.dom(id);
        let mut now = vec![None; pages as usize];
        // One line for all the entries refused, not one each: the list is the peer's, and
        // a line per entry of a 64 GiB guest's was 16 Mi lines on the main loop.
        let (mut refused, mut first) = (0u64, None);
        for &(g, m) in mapped {
            let ok = g.0 < pages
                && match m {
                    Mapped::Frame(f) => self.frame_held(d, f),
                    Mapped::Zero => true,
                };
            if ok {
                now[g.index()] = Some(m);
            } else {
                refused += 1;
                first = first.or(Some(g));
            }
        }
        if let Some(g) = first {
            tracing::warn!(vm = %id, "re-attach lists {refused} pages memfoldd cannot hold (the first {g}); ignored");
        }
        // New holds first, then the old ones go: a frame whose only holder was a request
        // in doubt must not be freed before the mapping the agent reports takes it over.
        let mut page = [0u8; PAGE_SIZE];
        let mut changes = Vec::new();
        for (i, is) in now.into_iter().enumerate() {
            let g = Gfn(i as u32);
            let was = self.vms[&id].state(g);
            let next = match is {
                Some(Mapped::Frame(f)) => PageState::Shared(f),
                Some(Mapped::Zero) => PageState::Zero,
                None => PageState::Private,
            };
            if let PageState::Shared(f) = next {
                let frames = &self.domain(d).frames;
                if frames.is_adopted(f)
                    && frames.refcount(f) == 0
                    && !self.claim_adopted(d, f, &mut page)
                {
                    // An adopted frame memfoldd cannot read is still booked — the agent
                    // maps it, and a frame no book holds is freed at the adoption's end
                    // (its guest then reads zeros, and later another guest's page) — but
                    // withdrawn: its bytes unknown, it is never a share target, a patch
                    // reference or a fill. Its guest's CoW break lets it go.
                    // INVARIANT (never_share.rs): a withdrawn frame is never in the share
                    // table. One claimed readable by an earlier re-attach, its pages gone
                    // since (pinned by the adoption at refcount 0), is still listed.
                    let dom = self.domain_mut(d);
                    dom.withdrawn.insert(f);
                    dom.share.remove(dom.frames.hash(f), ShareEntry::Shared(f));
                    // Nor a zero frame: its bytes are not known to be zeros any more.
                    dom.zero_frames.remove(&f);
                    dom.similar.forget_frame(f);
                }
            }
            // The agent's paged-out bits are not in its list: every mark goes at a
            // (re-)attach (at worst the page is read back in once), or one whose
            // `PagedIn` was lost with the connection would stay for good (kernel_swap.rs).
            if self.vms[&id].paged_out_or_going(g) {
                self.vms
                    .get_mut(&id)
                    .expect("attached")
                    .set(g, PageState::Private);
            }
            if was == next {
                continue;
            }
            if let PageState::Shared(f) = next {
                self.domain_mut(d).frames.incref(f, false);
            }
            changes.push((g, was, next));
        }
        for (g, was, next) in changes {
            match was {
                // Requests in doubt end here: the agent's list says what happened.
                PageState::Sharing(f) => self.frame_answer(d, f, false),
                PageState::Shared(f) => self.frame_decref(d, f, false),
                _ => {}
            }
            self.vms.get_mut(&id).expect("live").set(g, next);
        }
        let zero = self.domain(d).zero_frames.clone();
        let v = self.vms.get_mut(&id).expect("live");
        let count =
            |want: fn(PageState) -> bool| v.p2m.iter().filter(|e| want(e.state())).count() as u64;
        v.books.shared_pages = count(|s| matches!(s, PageState::Shared(_)));
        v.books.zero_reclaimed_pages = count(|s| s == PageState::Zero);
        v.books.free_reclaimed_pages = v.p2m.iter().filter(|e| e.is_free_hole()).count() as u64;
        v.books.zero_shared_pages = v
            .p2m
            .iter()
            .filter(|e| matches!(e.state(), PageState::Shared(f) if zero.contains(&f)))
            .count() as u64;
        Ok(())
    }

    /// An adopted frame of domain `d` a re-attaching guest maps: read, hash and list it
    /// once. False (logged) if the pool cannot be read there: a pool handed back by a peer
    /// is the peer's word, and never stops memfoldd.
    fn claim_adopted(&mut self, d: DomainId, f: FrameId, page: &mut Page) -> bool {
        let hash = self.cfg.page_hash;
        let zero_hash = self.zero_hash;
        let dom = self.domain_mut(d);
        if let Err(e) = dom.pool.read(f.offset(), page) {
            tracing::warn!("{d}: adopted {f} unreadable ({e}); not booked");
            return false;
        }
        let h = hash(page);
        if dom.frames.hash(f) != h || !dom.share.lookup(h).any(|e| e == ShareEntry::Shared(f)) {
            // Claimed before with other bytes: forget_frame removes only the new hash's entry.
            dom.share.remove(dom.frames.hash(f), ShareEntry::Shared(f));
            dom.frames.set_hash(f, h);
            // INVARIANT (never_share.rs): a withdrawn frame stays out of the share table,
            // whoever still maps it until its take-back — here a guest that re-attaches
            // after a restart to a frame withdrawn while adopted (found by the reference
            // model's seeded run, which fails without this check).
            if !dom.withdrawn.contains(&f) {
                dom.share.insert(h, ShareEntry::Shared(f));
            }
        }
        if h == zero_hash && crate::is_zero_page(page) {
            dom.zero_frames.insert(f);
        } else {
            // Claimed before as zeros, other bytes now: no longer the zero frame (a page
            // marked never-share on it would not withdraw it, and it would count as zeros).
            dom.zero_frames.remove(&f);
        }
        true
    }

    /// The agent of guest `id` is gone but its QEMU may live: requests not yet handed out
    /// are dropped (their pages as they were); requests sent stay in doubt until it
    /// re-attaches ([`Engine::attach`]) or its QEMU exits ([`Engine::remove`]).
    pub fn detach(&mut self, id: VmId) {
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        let queued = std::mem::take(&mut v.queue);
        for c in queued {
            self.outcome(id, &c, Outcome::NotSent);
        }
        self.vms.get_mut(&id).expect("checked").attached = false;
        tracing::info!(vm = %id, "detached");
    }

    /// Guest `id`'s QEMU has exited: its mappings are gone. Releases every frame
    /// reference, request and blob it held.
    pub fn remove(&mut self, id: VmId) {
        if !self.vms.contains_key(&id) {
            return;
        }
        self.release_blobs(id);
        self.forget_landed(id);
        let v = self.vms.remove(&id).expect("checked");
        let d = v.domain;
        self.by_base.remove(&v.base);
        for e in &v.p2m {
            match e.state() {
                PageState::Shared(f) => {
                    self.frame_decref(d, f, false);
                }
                PageState::Sharing(f) => {
                    self.frame_answer(d, f, false);
                }
                _ => {}
            }
        }
        // Nothing may name its page space when the next guest gets it, maybe in another
        // domain (`check_invariants`: every hint and candidate names a page of its own
        // domain; `a_removed_guests_hints_are_purged_before_its_space_is_reused` fails
        // without the purge).
        let gpns = v.base.0..v.base.0 + v.pages();
        if let Some(dom) = self.domains.get_mut(&d) {
            dom.share.forget_hints(gpns.clone());
            dom.similar.forget_guest_pages(gpns.clone());
        }
        if let Some(ring) = self.kept_hints.get_mut(&d) {
            ring.retain(|&(_, g)| !gpns.contains(&g.0));
        }
        self.gpns.give_back(v.base, v.pages());
        tracing::info!(vm = %id, name = %v.name, pid = v.pid, "released");
        self.drop_domain_if_empty(d);
    }

    /// Releases every blob guest `id` holds, and every frame its pages shared without a
    /// mapping hold (its agent wrote its stashed pages back, or its QEMU is gone): the
    /// pages are private again and its stash counters zero.
    pub(crate) fn release_blobs(&mut self, id: VmId) {
        let pages = self.vms[&id].pages();
        for i in 0..pages {
            let g = Gfn(i);
            let st = self.vms[&id].state(g);
            if let PageState::Unmapped(_) = st {
                self.take_unmapped(id, g);
                continue;
            }
            let held: [Option<BlobId>; 2] = match st {
                PageState::Stored(b) | PageState::Stashing(b) => [Some(b), None],
                PageState::Moving(b) => [Some(b), self.blobs.replaces(b)],
                _ => continue,
            };
            for b in held.into_iter().flatten() {
                self.release_blob(b);
            }
            self.vms
                .get_mut(&id)
                .expect("live")
                .set(g, PageState::Private);
        }
        let mine: Vec<BlobId> = self
            .orphans
            .iter()
            .copied()
            .filter(|&b| self.blobs.get(b).vm == id)
            .collect();
        for b in mine {
            self.orphans.remove(&b);
            self.release_blob(b);
        }
        let v = self.vms.get_mut(&id).expect("live");
        v.books.patched_pages = 0;
        v.books.unmapped_pages = 0;
        v.books.compressed_pages = 0;
        v.books.swapped_pages = 0;
    }
}

#[cfg(test)]
mod tests;
