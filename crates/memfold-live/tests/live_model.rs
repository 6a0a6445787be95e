//! The live mechanisms against a plain model of guest memory, without QEMU: this test
//! process plays QEMU. It maps a memfd as "guest RAM", runs the agent on it and memfoldd
//! (Difference Engine policy, a fast clock) in threads, and several guest threads
//! (vCPUs) read and write random pages at once, checking every read. Pages are shared,
//! CoW-broken, reclaimed as zero, patched, compressed, decoded back and tracked by the
//! clock while the vCPUs run; no vCPU may ever read a byte that was not written.
//! The second test adds a host memory budget far under the guest's RAM, so that cold
//! pages are also swapped out to a swap file and read back (DE §4.6).
//!
//! How concurrent reads are checked exactly. Every page belongs to one of three sets:
//!
//! - **Owned** (most pages): vCPU `g % VCPUS` is the only writer of page `g` and keeps
//!   its model, against which it checks its own reads byte for byte. Every page carries a
//!   stamp in its last 8 bytes, a hash of the rest (0 for the zero page), and a per-page
//!   seqlock publishes the stamp of the page's current content: another vCPU's read, taken
//!   while the seqlock did not move, must be internally consistent and carry exactly the
//!   published stamp. A torn page, a stale one or another page's bytes fail.
//! - **Locked**: any vCPU writes them, holding the page's lock (the model is under it);
//!   reads are checked exactly under the lock, or lock-free by the seqlock as above, so
//!   that reads race with the CoW breaks of other vCPUs' writes on the same page.
//! - **Contended**: every vCPU writes its own word of the same page at the same moment
//!   (after a barrier), so several vCPUs fault on one shared or stored page at once. The
//!   rest of the page is one of two templates and the words name the pass over these
//!   pages (and in every other pass the page), so that pages are equal (shared) or near
//!   each other (patched). Their content is known from the round number, and every vCPU checks them
//!   exactly between rounds.

mod common;

use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use common::{fast_engine, start_agent, start_memfoldd, GuestRam, PAGE};
use memfold_core::sim::texty;
use memfold_core::{CompressCodec, EngineConfig};
use memfold_live::query_stats;
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Guest RAM of the first test, pages. The agent finds guest RAM by its size: the two
/// tests, which run in one process, use different sizes.
const PAGES: usize = 4096;
/// Guest threads.
const VCPUS: usize = 4;
/// Pages of the hot set the vCPUs use most of the time.
const HOT: usize = 300;
/// Guest operations of each vCPU between two rounds.
const OPS_PER_ROUND: usize = 64;
/// Contended pages are written every this many rounds, so that they stay quiet long
/// enough for the clock to let them be shared or patched in between.
const CONTENDED_EVERY: usize = 4;
/// The vCPUs run at least this long, even once every mechanism has run: concurrency bugs
/// are races, and more rounds find more of them.
const MIN_RUN: Duration = Duration::from_secs(10);
/// Where a page's stamp is: its last 8 bytes.
const STAMP_AT: usize = PAGE - 8;

/// Which set a page belongs to (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Set {
    /// Written only by this vCPU.
    Owned(usize),
    /// Written by any vCPU under the page's lock: `locked[g / 32]`.
    Locked,
    /// Written by every vCPU at once, a word each: `contended[g / 128]`.
    Contended,
}

fn set(g: usize) -> Set {
    if g % 128 == 127 {
        Set::Contended
    } else if g % 32 == 7 {
        Set::Locked
    } else {
        Set::Owned(g % VCPUS)
    }
}

/// A hash of a page's bytes before its stamp; a change of any one word changes it (each
/// step is a bijection of the running hash).
fn hash(page: &[u8]) -> u64 {
    page[..STAMP_AT].chunks_exact(8).fold(0x6d66_7632, |h, w| {
        (h ^ u64::from_ne_bytes(w.try_into().unwrap()))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29)
    })
}

/// The stamp a page's content calls for: zero for the zero page, so that zero pages
/// stay zero (and are reclaimed).
fn stamp_of(page: &[u8]) -> u64 {
    static ZERO: LazyLock<u64> = LazyLock::new(|| hash(&[0u8; PAGE]));
    hash(page) ^ *ZERO
}

/// The stamp a page carries.
fn stamp_in(page: &[u8]) -> u64 {
    u64::from_ne_bytes(page[STAMP_AT..].try_into().unwrap())
}

fn restamp(page: &mut [u8]) {
    let s = stamp_of(page);
    page[STAMP_AT..].copy_from_slice(&s.to_ne_bytes());
}

/// Content by gfn, stamped: zero, copies of templates (share), templates with a few bytes
/// changed (patch), text (compress), random (left alone).
fn fill(g: usize, templates: &[Vec<u8>], rng: &mut SmallRng, out: &mut [u8]) {
    match g % 10 {
        0 | 1 => out.fill(0),
        2 | 3 => out.copy_from_slice(&templates[g % templates.len()]),
        4 | 5 => {
            out.copy_from_slice(&templates[g % templates.len()]);
            for _ in 0..16 {
                out[rng.gen_range(0..STAMP_AT)] = rng.gen();
            }
        }
        6 | 7 => texty(rng, out),
        _ => rng.fill(out),
    }
    restamp(out);
}

/// A page's seqlock: `seq` is odd while the page is being written; `stamp` is the stamp of
/// its content once `seq` is even.
#[derive(Default)]
struct Seqlock {
    seq: AtomicU64,
    stamp: AtomicU64,
}

/// A vCPU's panic when another one failed first.
const OTHER_FAILED: &str = "another guest thread failed";
/// A round takes milliseconds: a vCPU this late is stuck (a fault never served), and
/// the test fails rather than hang.
const STUCK: Duration = Duration::from_secs(20);

/// A barrier that gives up when a vCPU has failed (a plain one would wait forever for
/// it).
struct Rendezvous {
    parties: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
    failed: AtomicBool,
}

impl Rendezvous {
    fn new(parties: usize) -> Rendezvous {
        Rendezvous {
            parties,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
            failed: AtomicBool::new(false),
        }
    }

    /// Waits for every party. Errors: a party failed meanwhile, or one did not come within
    /// [`STUCK`] (a fault never served): the rendezvous is then failed for all.
    fn wait(&self) -> Result<(), String> {
        let deadline = Instant::now() + STUCK;
        let mut st = self.state.lock().unwrap();
        let generation = st.1;
        st.0 += 1;
        if st.0 == self.parties {
            *st = (0, generation + 1);
            self.cv.notify_all();
            return Ok(());
        }
        while st.1 == generation {
            if self.failed.load(Ordering::SeqCst) {
                return Err(OTHER_FAILED.into());
            }
            if Instant::now() > deadline {
                self.failed.store(true, Ordering::SeqCst);
                return Err(format!(
                    "a guest thread did not come back within {STUCK:?}: stuck on a fault"
                ));
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        Ok(())
    }
}

/// Marks the rendezvous failed if its thread panics, so that the others stop waiting.
struct FailGuard<'a>(&'a Rendezvous);

impl Drop for FailGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.failed.store(true, Ordering::SeqCst);
        }
    }
}

/// What the vCPUs and the coordinator share.
struct Guest {
    ram: GuestRam,
    seqlocks: Vec<Seqlock>,
    /// Models of the locked pages, by `g / 32`.
    locked: Vec<Mutex<Vec<u8>>>,
    /// The contended pages' gfns, and the template each is made of.
    contended: Vec<usize>,
    contended_templates: [Vec<u8>; 2],
    templates: Vec<Vec<u8>>,
    /// Pages in use: cold accesses pick from `[0, live)`.
    live: AtomicUsize,
    /// Set by the coordinator between the two barriers of a round, read by the vCPUs
    /// after the second: all of them see the same value.
    stop: AtomicBool,
    grow: AtomicBool,
    rendezvous: Rendezvous,
    /// Reads of pages other vCPUs write, checked by the seqlock.
    cross_reads: AtomicU64,
    /// Those that raced with a writer and were taken again.
    retries: AtomicU64,
    /// Cross reads left unchecked: 1 000 tries in a row raced with a writer.
    gave_up: AtomicU64,
}

/// Contended page `i`'s word of vCPU `v`: spread over the page (different cache lines).
fn word_at(v: usize) -> usize {
    v * (PAGE / VCPUS)
}

/// The word vCPU `v` writes in the `k`-th contended write, to page `k % n`: it names the
/// vCPU and the pass `k / n` over the pages, so every write changes the word (a lost one
/// shows). In even passes pages of one template written in the same pass are equal (they
/// are shared); in odd passes the word also names the page, so pages are only near each
/// other (patched).
fn contended_word(v: usize, k: usize, n: usize) -> u64 {
    let pass = k / n;
    let page = if pass % 2 == 1 { k % n } else { 0 };
    ((v as u64 + 1) << 56) | (pass as u64) << 16 | page as u64
}

impl Guest {
    /// Contended page `i` after the contended writes `0..writes` (write `k` is to page
    /// `k % n`).
    fn contended_page(&self, i: usize, writes: usize) -> Vec<u8> {
        let mut p = self.contended_templates[i % 2].clone();
        let n = self.contended.len();
        let last = (writes > i).then(|| i + n * ((writes - 1 - i) / n));
        for v in 0..VCPUS {
            let w = last.map_or(0, |k| contended_word(v, k, n));
            p[word_at(v)..word_at(v) + 8].copy_from_slice(&w.to_ne_bytes());
        }
        p
    }

    /// Writes page `g` as `write` does, under its seqlock, and publishes `model`'s stamp
    /// (the page's content once written). Only the page's one writer calls this.
    fn publish(&self, g: usize, model: &[u8], write: impl FnOnce()) {
        let sl = &self.seqlocks[g];
        let s = sl.seq.load(Ordering::Relaxed);
        sl.seq.store(s + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        write();
        sl.stamp.store(stamp_in(model), Ordering::Relaxed);
        sl.seq.store(s + 2, Ordering::Release);
    }

    /// Reads page `g`, written by another vCPU, and checks it is the content its writer
    /// published: whole, stamped right, not another page's.
    fn check_published(&self, v: usize, g: usize, buf: &mut [u8]) {
        let sl = &self.seqlocks[g];
        for _ in 0..1000 {
            let s0 = sl.seq.load(Ordering::Acquire);
            if s0 % 2 == 1 {
                self.retries.fetch_add(1, Ordering::Relaxed);
                std::thread::yield_now();
                continue;
            }
            let published = sl.stamp.load(Ordering::Relaxed);
            self.ram.read(g, buf);
            fence(Ordering::Acquire);
            if sl.seq.load(Ordering::Relaxed) != s0 {
                self.retries.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            assert!(
                stamp_in(buf) == stamp_of(buf) && stamp_in(buf) == published,
                "gfn {g} ({:?}): vCPU {v} read bytes that were not written: stamp {:#x}, its content's {:#x}, published {published:#x}",
                set(g),
                stamp_in(buf),
                stamp_of(buf)
            );
            self.cross_reads.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Counted, not skipped silently: the run fails if many are left unchecked.
        self.gave_up.fetch_add(1, Ordering::Relaxed);
    }

    /// A random guest write to `page` (a model page of `g`): 8 bytes, a new page, zeros.
    /// Returns the write to make to guest RAM, as (offset, bytes) pairs.
    fn mutate(&self, g: usize, rng: &mut SmallRng, page: &mut [u8]) -> Vec<(usize, Vec<u8>)> {
        match rng.gen_range(0..4) {
            0 | 1 => {
                let off = rng.gen_range(0..STAMP_AT - 8);
                let v: u64 = rng.gen();
                page[off..off + 8].copy_from_slice(&v.to_ne_bytes());
                restamp(page);
                vec![
                    (off, v.to_ne_bytes().to_vec()),
                    (STAMP_AT, page[STAMP_AT..].to_vec()),
                ]
            }
            2 => {
                fill(g, &self.templates, rng, page);
                vec![(0, page.to_vec())]
            }
            _ => {
                page.fill(0);
                vec![(0, page.to_vec())]
            }
        }
    }

    fn write_parts(&self, g: usize, parts: &[(usize, Vec<u8>)]) {
        for (off, bytes) in parts {
            self.ram.write(g, *off, bytes);
        }
    }
}

/// One vCPU: its own pages' model, its random stream, its counters.
struct Vcpu {
    v: usize,
    /// Its owned pages, by `g / VCPUS`.
    model: Vec<u8>,
    rng: SmallRng,
    ops: u64,
}

impl Vcpu {
    fn own(&mut self, g: usize) -> &mut [u8] {
        let i = g / VCPUS;
        &mut self.model[i * PAGE..(i + 1) * PAGE]
    }

    /// Runs until the coordinator says stop; then checks every page.
    fn run(mut self, guest: &Guest, cold: f64) -> u64 {
        let _guard = FailGuard(&guest.rendezvous);
        let mut buf = vec![0u8; PAGE];
        let mut round = 0;
        let mut grown = false;
        loop {
            guest.rendezvous.wait().unwrap_or_else(|e| panic!("{e}"));
            if round % CONTENDED_EVERY == 0 {
                // Every vCPU writes its word of the same page now.
                let (k, n) = (round / CONTENDED_EVERY, guest.contended.len());
                let w = contended_word(self.v, k, n);
                guest
                    .ram
                    .write(guest.contended[k % n], word_at(self.v), &w.to_ne_bytes());
            }
            guest.rendezvous.wait().unwrap_or_else(|e| panic!("{e}"));
            round += 1;
            if guest.stop.load(Ordering::SeqCst) {
                break;
            }
            if guest.grow.load(Ordering::SeqCst) && !grown {
                grown = true;
                self.grow(guest);
            }
            let writes = round.div_ceil(CONTENDED_EVERY);
            for _ in 0..OPS_PER_ROUND {
                let live = guest.live.load(Ordering::Relaxed);
                let g = if !self.rng.gen_bool(cold) {
                    self.rng.gen_range(0..HOT)
                } else {
                    self.rng.gen_range(0..live)
                };
                self.op(guest, g, writes, &mut buf);
                self.ops += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Nobody writes any more: every page, hot or cold, reads what was written.
        let writes = round.div_ceil(CONTENDED_EVERY);
        for g in 0..guest.ram.pages {
            match set(g) {
                Set::Owned(o) if o == self.v => self.check_own(guest, g, &mut buf),
                Set::Owned(_) if self.v == 2 => guest.check_published(self.v, g, &mut buf),
                Set::Locked if self.v == 0 => {
                    let model = guest.locked[g / 32].lock().unwrap();
                    guest.ram.read(g, &mut buf);
                    assert!(
                        buf == *model,
                        "gfn {g} (locked): reads bytes that were not written"
                    );
                }
                Set::Contended if self.v == 1 => {
                    guest.ram.read(g, &mut buf);
                    assert!(
                        buf == guest.contended_page(g / 128, writes),
                        "gfn {g} (contended)"
                    );
                }
                _ => {}
            }
        }
        self.ops
    }

    fn check_own(&mut self, guest: &Guest, g: usize, buf: &mut [u8]) {
        guest.ram.read(g, buf);
        let v = self.v;
        assert!(
            buf == self.own(g),
            "gfn {g}: vCPU {v} read bytes it did not write (its own page)"
        );
    }

    /// One guest operation on page `g`: by its set, a read (checked) or a write.
    fn op(&mut self, guest: &Guest, g: usize, contended_writes: usize, buf: &mut [u8]) {
        let read = self.rng.gen_range(0..10) < 6;
        match set(g) {
            Set::Owned(o) if o != self.v => guest.check_published(self.v, g, buf),
            Set::Owned(_) if read => self.check_own(guest, g, buf),
            Set::Owned(_) => {
                let mut page = self.own(g).to_vec();
                let parts = guest.mutate(g, &mut self.rng, &mut page);
                self.own(g).copy_from_slice(&page);
                guest.publish(g, &page, || guest.write_parts(g, &parts));
            }
            Set::Locked if read && self.rng.gen_bool(0.5) => guest.check_published(self.v, g, buf),
            Set::Locked => {
                let mut model = guest.locked[g / 32].lock().unwrap();
                if read {
                    guest.ram.read(g, buf);
                    assert!(
                        *buf == *model,
                        "gfn {g} (locked): vCPU {} read bytes that were not written",
                        self.v
                    );
                } else {
                    let parts = guest.mutate(g, &mut self.rng, &mut model);
                    guest.publish(g, &model, || guest.write_parts(g, &parts));
                }
            }
            Set::Contended => {
                // Nobody writes contended pages between rounds: their content is known.
                guest.ram.read(g, buf);
                assert!(
                    *buf == guest.contended_page(g / 128, contended_writes),
                    "gfn {g} (contended): vCPU {} read bytes that were not written",
                    self.v
                );
            }
        }
    }

    /// The guest starts using all its RAM: each vCPU writes its pages beyond the first
    /// fifth (the old `live`), vCPU 0 the locked ones too.
    fn grow(&mut self, guest: &Guest) {
        let from = guest.ram.pages / 5;
        for g in from..guest.ram.pages {
            match set(g) {
                Set::Owned(o) if o == self.v => {
                    let mut page = vec![0u8; PAGE];
                    fill(g, &guest.templates, &mut self.rng, &mut page);
                    self.own(g).copy_from_slice(&page);
                    guest.publish(g, &page, || guest.ram.write(g, 0, &page));
                }
                Set::Locked if self.v == 0 => {
                    let mut model = guest.locked[g / 32].lock().unwrap();
                    fill(g, &guest.templates, &mut self.rng, &mut model);
                    guest.publish(g, &model, || guest.ram.write(g, 0, &model));
                }
                _ => {}
            }
        }
    }
}

#[test]
fn vcpus_read_what_was_written_while_pages_are_shared_reclaimed_patched_and_compressed() {
    run_model(PAGES, None, 0.1, CompressCodec::Zstd);
}

#[test]
fn vcpus_read_what_was_written_while_pages_are_also_swapped_out_and_in() {
    // A quarter of the guest's RAM. The guest first uses a fifth of its RAM (under the
    // budget: cold pages are patched and compressed into the store), then all of it: cold
    // pages must go to the swap file, stored ones move there, and the guest's RAM must
    // get under the budget. Cold pages are touched rarely enough (1% of the ops) for the
    // clock to find them cold; they are still read back now and then.
    let pages = PAGES + 1024;
    run_model(
        pages,
        Some((pages * PAGE / 4) as u64),
        0.01,
        CompressCodec::Lz4,
    );
}

/// Runs the vCPUs for at least [`MIN_RUN`] and up to 40 s, until every mechanism (and
/// swap, with a budget) has run and contended writes have hit pages that were shared and
/// pages that were stored, checking every read; then checks every page. `pages`: guest RAM, pages; `cold`: the fraction of guest ops
/// on a random page of all RAM (the rest go to the hot set); `codec`: memfoldd's
/// compressor (the default, zstd, in one test, LZ4 in the other).
fn run_model(pages: usize, host_budget: Option<u64>, cold: f64, codec: CompressCodec) {
    let work = tempfile::tempdir().unwrap();
    let engine = EngineConfig {
        compress_codec: codec,
        host_budget,
        ..fast_engine()
    };
    let socket = start_memfoldd(work.path(), engine);

    let mut rng = SmallRng::seed_from_u64(0x6d66);
    let stamped = |rng: &mut SmallRng| {
        let mut t = vec![0u8; PAGE];
        rng.fill(&mut t[..]);
        restamp(&mut t);
        t
    };
    let templates: Vec<Vec<u8>> = (0..8).map(|_| stamped(&mut rng)).collect();
    let contended_templates = [stamped(&mut rng), stamped(&mut rng)];
    // Pages the guest uses so far (the rest it writes later: not read before).
    let live = if host_budget.is_some() {
        pages / 5
    } else {
        pages
    };
    let ram = GuestRam::new("model-guest-ram", pages);
    let mut vcpus: Vec<Vcpu> = (0..VCPUS)
        .map(|v| Vcpu {
            v,
            model: vec![0u8; pages.div_ceil(VCPUS) * PAGE],
            rng: SmallRng::seed_from_u64(0x6d66 + 1 + v as u64),
            ops: 0,
        })
        .collect();
    let mut guest = Guest {
        ram,
        seqlocks: (0..pages).map(|_| Seqlock::default()).collect(),
        locked: (0..pages.div_ceil(32))
            .map(|_| Mutex::new(vec![0u8; PAGE]))
            .collect(),
        contended: (0..pages).filter(|&g| set(g) == Set::Contended).collect(),
        contended_templates,
        templates,
        live: AtomicUsize::new(live),
        stop: AtomicBool::new(false),
        grow: AtomicBool::new(false),
        rendezvous: Rendezvous::new(VCPUS + 1),
        cross_reads: AtomicU64::new(0),
        retries: AtomicU64::new(0),
        gave_up: AtomicU64::new(0),
    };
    // Initial content, before the agent and the vCPUs start. Contended pages are all
    // written now: nobody may write them between rounds.
    let mut page = vec![0u8; PAGE];
    for g in 0..pages {
        let s = set(g);
        if s == Set::Contended {
            page = guest.contended_page(g / 128, 0);
        } else if g < live {
            fill(g, &guest.templates, &mut rng, &mut page);
        } else {
            continue;
        }
        guest.ram.write(g, 0, &page);
        *guest.seqlocks[g].stamp.get_mut() = stamp_in(&page);
        match s {
            Set::Owned(v) => vcpus[v].own(g).copy_from_slice(&page),
            Set::Locked => guest.locked[g / 32]
                .get_mut()
                .unwrap()
                .copy_from_slice(&page),
            Set::Contended => {}
        }
    }
    start_agent(&socket, "model", &guest.ram);

    let guest = Arc::new(guest);
    let threads: Vec<_> = vcpus
        .into_iter()
        .map(|vcpu| {
            let guest = guest.clone();
            std::thread::Builder::new()
                .name(format!("vcpu-{}", vcpu.v))
                .spawn(move || vcpu.run(&guest, cold))
                .unwrap()
        })
        .collect();

    // The coordinator: a party of every round; between its two barriers it decides
    // whether the guest grows or stops.
    let start = Instant::now();
    let (mut round, mut last_poll) = (0, Instant::now());
    // Contended writes that hit a page that was shared, or stored (a hole in the memfd
    // that is not mapped from the pool): several vCPUs faulting on one such page at once.
    let (mut racing_shared, mut racing_stored) = (0, 0);
    let mut seen_all = false;
    let mut stats = None;
    let mut failed = None;
    loop {
        if round % CONTENDED_EVERY == 0 {
            let k = round / CONTENDED_EVERY;
            let g = guest.contended[k % guest.contended.len()];
            if guest.ram.on_pool(g) {
                racing_shared += 1;
            } else if !guest.ram.has_data(g) {
                racing_stored += 1;
            }
        }
        if let Err(e) = guest.rendezvous.wait() {
            failed = Some(e);
            break;
        }
        let timeout = start.elapsed() > Duration::from_secs(40);
        if timeout || seen_all && start.elapsed() > MIN_RUN {
            guest.stop.store(true, Ordering::SeqCst);
        } else if !seen_all
            && start.elapsed() > Duration::from_secs(3)
            && last_poll.elapsed() > Duration::from_millis(200)
        {
            last_poll = Instant::now();
            if let Ok(s) = query_stats(&socket) {
                let v = &s.vms[0];
                if guest.live.load(Ordering::SeqCst) < pages && v.compressions > 50 {
                    eprintln!("the guest now uses all its RAM: {:?}", s.swap);
                    guest.grow.store(true, Ordering::SeqCst);
                    guest.live.store(pages, Ordering::SeqCst);
                }
                seen_all = v.shares > 0
                    && v.hot_skipped > 0
                    && v.cow_breaks > 0
                    && v.reclaims > 0
                    && v.refills > 0
                    && v.patches > 0
                    && v.compressions > 0
                    && v.unstashes > 0
                    && racing_shared >= 3
                    && racing_stored >= 3
                    && host_budget.is_none_or(|b| {
                        v.swap_outs > 0
                            && v.swap_ins > 0
                            && v.swap_moves > 0
                            && s.swap.host_used_pages <= b / PAGE as u64
                    });
                if seen_all {
                    eprintln!(
                        "every mechanism ran after {:?}, {round} rounds; contended writes on {racing_shared} shared and {racing_stored} stored pages: {s:#?}",
                        start.elapsed()
                    );
                }
                stats = Some(s);
            }
        }
        if let Err(e) = guest.rendezvous.wait() {
            failed = Some(e);
            break;
        }
        round += 1;
        if guest.stop.load(Ordering::SeqCst) {
            break;
        }
    }
    // A vCPU's failure is the test's: the first that is not only a consequence of
    // another. A vCPU stuck on a fault is never joined.
    let deadline = Instant::now()
        + if failed.is_some() {
            Duration::from_secs(2)
        } else {
            STUCK
        };
    while threads.iter().any(|t| !t.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut ops, mut failures, mut stuck) = (Vec::new(), Vec::new(), Vec::new());
    for (v, t) in threads.into_iter().enumerate() {
        if !t.is_finished() {
            stuck.push(v);
            continue;
        }
        match t.join() {
            Ok(n) => ops.push(n),
            Err(e) => failures.push(e),
        }
    }
    let message =
        |e: &Box<dyn std::any::Any + Send>| e.downcast_ref::<String>().cloned().unwrap_or_default();
    if let Some(i) = (0..failures.len()).find(|&i| message(&failures[i]) != OTHER_FAILED) {
        std::panic::resume_unwind(failures.swap_remove(i));
    }
    assert!(
        stuck.is_empty(),
        "vCPUs {stuck:?} are stuck on a fault ({failed:?})"
    );
    assert!(failed.is_none(), "{failed:?}");
    eprintln!(
        "stopped after {:?}, {round} rounds; contended writes on {racing_shared} shared and {racing_stored} stored pages; guest ops by vCPU {ops:?}; {} cross reads checked, {} retaken",
        start.elapsed(),
        guest.cross_reads.load(Ordering::Relaxed),
        guest.retries.load(Ordering::Relaxed)
    );
    // A check given up on is no check: at most 1 in 100 (a vCPU writing the page
    // through 1 000 tries in a row, on a host of two loaded cores).
    let (checked, gave_up) = (
        guest.cross_reads.load(Ordering::Relaxed),
        guest.gave_up.load(Ordering::Relaxed),
    );
    assert!(
        checked > 0 && gave_up * 100 <= checked,
        "{gave_up} cross reads left unchecked, {checked} checked"
    );
    assert!(
        seen_all,
        "not every mechanism ran (contended writes on {racing_shared} shared and {racing_stored} stored pages): {stats:#?}"
    );
    // As memfoldd saw it when every mechanism had run (the vCPUs' final check of every
    // page has read all of them back since).
    let s = stats.unwrap();
    assert!(s.saved_pages > 0, "{s:#?}");
    if host_budget.is_some() {
        assert!(s.swap.swapped_pages > 0, "{s:#?}");
    }
    // The memfd and mapping stay until the process exits: the agent thread serves them.
}
