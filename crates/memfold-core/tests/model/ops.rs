//! The model's vocabulary: page contents, operations and engine setups, and their random
//! generators (the proptest strategies in `reference_model.rs` build the same).

use memfold_core::{Page, PAGE_SIZE};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Page content the generator picks from: few distinct pages, so that sharing and
/// similarity happen often.
#[derive(Clone, Copy, Debug)]
pub enum Content {
    Zero,
    /// One of 6 base pages.
    Base(u8),
    /// A base page with a few 8-byte runs changed (seeded).
    Similar(u8, u8),
    /// Text-like, compressible.
    Text(u8),
    /// Random bytes.
    Random(u64),
}

impl Content {
    pub fn render(self) -> Box<Page> {
        let mut p = Box::new([0u8; PAGE_SIZE]);
        match self {
            Content::Zero => {}
            Content::Base(b) => SmallRng::seed_from_u64(1000 + (b % 6) as u64).fill(&mut p[..]),
            Content::Similar(b, seed) => {
                SmallRng::seed_from_u64(1000 + (b % 6) as u64).fill(&mut p[..]);
                let mut r = SmallRng::seed_from_u64(seed as u64);
                for _ in 0..r.gen_range(1..12) {
                    let at = r.gen_range(0..PAGE_SIZE - 8);
                    r.fill(&mut p[at..at + 8]);
                }
            }
            Content::Text(seed) => {
                let words: [&[u8]; 4] = [b"guest ", b"frame ", b"share ", b"page\n"];
                let mut r = SmallRng::seed_from_u64(seed as u64);
                let mut i = 0;
                while i < PAGE_SIZE {
                    for &c in words[r.gen_range(0..4)] {
                        if i < PAGE_SIZE {
                            p[i] = c;
                            i += 1;
                        }
                    }
                }
            }
            Content::Random(s) => SmallRng::seed_from_u64(s).fill(&mut p[..]),
        }
        p
    }
}

/// One step. VM numbers and gfns are reduced modulo what exists when the step runs.
#[derive(Clone, Debug)]
pub enum Op {
    CreateVm {
        pages: u32,
    },
    /// QEMU exits.
    DestroyVm {
        vm: u32,
    },
    WritePage {
        vm: u32,
        gfn: u32,
        content: Content,
    },
    WritePartial {
        vm: u32,
        gfn: u32,
        offset: u16,
        len: u16,
        byte: u8,
    },
    Read {
        vm: u32,
        gfn: u32,
    },
    /// A disk read fills `n` pages from `gfn` on with disk blocks `block`, `block + 1`,
    /// … (the same blocks in every guest: duplicates across guests), written through
    /// QEMU's page tables as the block device does, then reported to the engine (Satori
    /// §4.1, `Engine::read_landed`) if the guest is attached.
    ReadLanded {
        vm: u32,
        gfn: u32,
        n: u8,
        block: u8,
    },
    /// A block device asks that a read of blocks `block`, `block + 1`, … into `n` pages
    /// from `gfn` on be filled from frames (Satori §5.2): it writes its nonce at the start
    /// of each first, through QEMU's page tables, then asks the engine if the guest is
    /// attached; when the answer comes it writes the disk's bytes into the pages not
    /// filled.
    FillRead {
        vm: u32,
        gfn: u32,
        n: u8,
        block: u8,
    },
    /// Guest `vm`'s oldest fill under way gives up waiting: the device writes the disk's
    /// bytes into its pages and completes, and the guest then writes its own bytes over
    /// each (its buffer reused) — which a fill that maps late would hide.
    FillGiveUp {
        vm: u32,
    },
    /// QEMU discards `n` pages from `gfn` on (a balloon, free page reporting): they read
    /// as zeros afterwards, and whatever memfold held of them is released.
    Discard {
        vm: u32,
        gfn: u32,
        n: u8,
    },
    /// The guest frees `n` pages from `gfn` on (issue 17): their bytes are no one's until
    /// it writes them again.
    Free {
        vm: u32,
        gfn: u32,
        n: u8,
    },
    /// The guest marks (`on`) or unmarks `n` pages from `gfn` on never to be shared
    /// (`memfold-guest never-share`); its next sample carries the marks.
    Mark {
        vm: u32,
        gfn: u32,
        n: u8,
        on: bool,
    },
    /// memfoldd asks the guest's agent (memfold-guest) which pages are free: it samples
    /// them now, and the answer is in flight until [`Op::GuestReport`]. `seed` draws the
    /// other pages' categories and LRU bits and the report's runs.
    GuestSample {
        vm: u32,
        seed: u64,
    },
    /// The guest's sampled report reaches memfoldd: its categories, then a free-page
    /// watch round or discard ([`memfold_core::Engine::discard_free`]).
    GuestReport {
        vm: u32,
    },
    /// The guest's kernel starts or stops poisoning free pages (`page_poisoning`,
    /// `init_on_free`): its reports from then on allow no discard, or do again.
    Poison {
        vm: u32,
    },
    /// The guest's agent says its threads have waited `pct`% of the time so far (a
    /// cumulative count that may fall: an agent that started over), for its wait target
    /// (issue 15, [`memfold_core::Engine::guest_waited`]).
    Waited {
        vm: u32,
        pct: u8,
    },
    /// Time passes; memfoldd scans, runs the clock, checks the budget and sends.
    Step {
        advance_ms: u32,
    },
    /// The agent carries out up to `n` of the commands it was sent (first answering any
    /// it held back); with `hold`, it holds their answers back until its next report,
    /// which gives the events that followed them first.
    Deliver {
        vm: u32,
        n: u8,
        refuse: bool,
        hold: bool,
    },
    /// The agent reports its events (CoW breaks, refills, decodes).
    Report {
        vm: u32,
    },
    /// The guest reads or writes (drawn from `seed`) each page whose answer its agent
    /// holds back: a CoW break, decode or refill it reports before those answers (the
    /// events `engine/early.rs` parks), which random writes seldom line up.
    TouchHeld {
        vm: u32,
        seed: u64,
    },
    /// The connection drops; the agent had received each sent command with 1/2 chance.
    Disconnect {
        vm: u32,
        seed: u64,
    },
    /// A disconnected agent re-attaches.
    Reattach {
        vm: u32,
    },
    /// memfoldd is killed and a new one starts, adopting the pool.
    Restart {
        seed: u64,
    },
    /// The operator opts a guest out of memfold (every page taken back) or in again.
    OptOut {
        vm: u32,
        out: bool,
    },
    /// A backing starts or stops failing: 0 pool writes, 1 store writes, 2 swap writes,
    /// 3 swap write-back, 4 growth of pools, stores and swap files, 5 memfoldd's reads
    /// (of its backings and of guest RAM).
    Fail {
        which: u8,
        on: bool,
    },
    /// A bit of the store (or the swap file) is flipped, as a compromised QEMU holding it
    /// could: from then on a page whose blob it hit must fail to decode (its checksum),
    /// never read as other bytes.
    Corrupt {
        swap: bool,
        at: u64,
        bit: u8,
    },
}

/// What the engine runs with.
#[derive(Clone, Debug)]
pub struct Setup {
    pub zero: u8,
    pub policy: u8,
    pub patch_codec: u8,
    pub compress_codec: u8,
    /// Host budget, pages (swapping past it).
    pub budget_pages: Option<u32>,
    pub swap_pages: u32,
    pub rate: u32,
    /// A content hash that collides for most pages: every match must be confirmed.
    pub collide_hashes: bool,
    /// Sharing domains (1..=3): guest of pid `p` is in domain `p % domains`.
    pub domains: u8,
    /// Guests of a pid divisible by 3 are never-share (`Sharing::NeverShare`), each alone
    /// in a domain of its own.
    pub never_share_guests: bool,
}

/// Four hash values in all: pages of different content collide all the time.
pub(super) fn colliding_hash(p: &Page) -> u64 {
    ((p[100] & 3) as u64) << 32
}

pub fn random_setup(rng: &mut SmallRng) -> Setup {
    Setup {
        zero: rng.gen(),
        policy: rng.gen(),
        patch_codec: rng.gen(),
        compress_codec: rng.gen(),
        budget_pages: rng.gen_bool(0.5).then(|| rng.gen_range(8..80)),
        swap_pages: rng.gen_range(0..96),
        rate: [0, 50, 1000][rng.gen_range(0..3)],
        collide_hashes: rng.gen_bool(0.2),
        domains: rng.gen_range(1..=3),
        never_share_guests: rng.gen_bool(0.25),
    }
}

fn random_content(rng: &mut SmallRng) -> Content {
    match rng.gen_range(0..10) {
        0 | 1 => Content::Zero,
        2..=4 => Content::Base(rng.gen()),
        5..=7 => Content::Similar(rng.gen(), rng.gen()),
        8 => Content::Text(rng.gen()),
        _ => Content::Random(rng.gen()),
    }
}

pub fn random_op(rng: &mut SmallRng) -> Op {
    let (vm, gfn) = (rng.gen(), rng.gen());
    match rng.gen_range(0..118) {
        0..=1 => Op::CreateVm {
            pages: rng.gen_range(1..40),
        },
        2 => Op::DestroyVm { vm },
        3..=17 => Op::WritePage {
            vm,
            gfn,
            content: random_content(rng),
        },
        18..=24 => Op::WritePartial {
            vm,
            gfn,
            offset: rng.gen(),
            len: rng.gen(),
            byte: rng.gen(),
        },
        25..=30 => Op::Read { vm, gfn },
        31..=33 => Op::ReadLanded {
            vm,
            gfn,
            n: rng.gen_range(1..9),
            block: rng.gen_range(0..4),
        },
        // Blocks a read landed lately, most often: reads of held blocks are what fills.
        34..=35 => Op::FillRead {
            vm,
            gfn,
            n: rng.gen_range(1..9),
            block: rng.gen_range(0..4),
        },
        36 => Op::Discard {
            vm,
            gfn,
            n: rng.gen_range(1..9),
        },
        // Free pages (issue 17): freed, sampled, reported late, written in between.
        100..=103 => Op::Free {
            vm,
            gfn,
            n: rng.gen_range(1..9),
        },
        104..=106 => Op::GuestSample {
            vm,
            seed: rng.gen(),
        },
        107..=109 => Op::GuestReport { vm },
        // Never-share marks (Satori §4.3), carried by the same reports.
        110..=112 => Op::Mark {
            vm,
            gfn,
            n: rng.gen_range(1..9),
            on: rng.gen_bool(0.7),
        },
        // Waits on the agent move the store floor (issue 15) where a target is set.
        113..=115 => Op::Waited {
            vm,
            pct: rng.gen_range(0..12),
        },
        116 => Op::Poison { vm },
        117 => Op::TouchHeld {
            vm,
            seed: rng.gen(),
        },
        37..=58 => Op::Step {
            advance_ms: rng.gen_range(0..1500),
        },
        59..=80 => Op::Deliver {
            vm,
            n: rng.gen_range(1..64),
            refuse: rng.gen_bool(0.05),
            hold: rng.gen_bool(0.1),
        },
        81..=88 => Op::Report { vm },
        89..=90 => Op::FillGiveUp { vm },
        91..=93 => Op::Disconnect {
            vm,
            seed: rng.gen(),
        },
        94..=95 => Op::Reattach { vm },
        96 => Op::OptOut {
            vm,
            out: rng.gen_bool(0.6),
        },
        97 => Op::Restart { seed: rng.gen() },
        98 if rng.gen_bool(0.05) => Op::Corrupt {
            swap: rng.gen(),
            at: rng.gen(),
            bit: rng.gen_range(0..8),
        },
        _ => {
            let which = rng.gen_range(0..6);
            // Failed reads stop every scan: on for less of the run.
            let on = rng.gen_bool(if which == 5 { 0.15 } else { 0.3 });
            Op::Fail { which, on }
        }
    }
}

/// An operation of a guest whose pages are freed and reused (issue 17's free-page
/// discard): random contents that stay private (nothing to share, patch or compress), so
/// that rounds of watches and discards happen often, with writes, reads, late reports,
/// lost answers and re-attaches between them.
/// The free-page discard's race, as a burst of ops on page `gfn` of guest `vm` (random
/// content and times): the page is freed and a report watches it, the next report is
/// sampled, then the page is written with bytes that
/// other pages hold (if it was free and watched, it is allocated again, and the scan may share it
/// again), the scan and the clock run and their requests are carried out, and only then
/// does the report arrive. A discard that trusted the report alone would take the page
/// with the guest's write.
pub fn free_race_burst(rng: &mut SmallRng, (vm, gfn): (u32, u32)) -> Vec<Op> {
    let deliver = Op::Deliver {
        vm,
        n: 63,
        refuse: false,
        hold: false,
    };
    let step = |rng: &mut SmallRng| Op::Step {
        advance_ms: rng.gen_range(200..800),
    };
    // Freed, then reported: a round watches it (or confirms an older round first).
    let mut ops = vec![Op::Free { vm, gfn, n: 1 }];
    for _ in 0..rng.gen_range(1..=2) {
        ops.extend([
            Op::GuestSample {
                vm,
                seed: rng.gen(),
            },
            Op::GuestReport { vm },
            deliver.clone(),
        ]);
    }
    ops.extend([
        Op::GuestSample {
            vm,
            seed: rng.gen(),
        },
        Op::WritePage {
            vm,
            gfn,
            content: Content::Base(rng.gen_range(0..4)),
        },
    ]);
    // Clock passes until the page is no longer recently modified (C1), so the scan may
    // share it again.
    for _ in 0..rng.gen_range(1..6) {
        ops.extend([step(rng), deliver.clone(), Op::Report { vm }]);
    }
    ops.extend([Op::GuestReport { vm }, deliver]);
    ops
}

/// A free-page discard's whole round on a random guest, undisturbed: pages are freed, a
/// report watches them, the watches are answered, the next report (sampled after them)
/// asks for their discard and the agent carries it out. Random ops alone seldom line these
/// up on one guest (the long run saw no free discard in most of its runs).
pub fn free_round_burst(rng: &mut SmallRng) -> Vec<Op> {
    let vm = rng.gen();
    let deliver = Op::Deliver {
        vm,
        n: 63,
        refuse: false,
        hold: false,
    };
    let mut ops = vec![Op::Free {
        vm,
        gfn: rng.gen(),
        n: rng.gen_range(1..9),
    }];
    for _ in 0..2 {
        ops.extend([
            Op::GuestSample {
                vm,
                seed: rng.gen(),
            },
            Op::GuestReport { vm },
            deliver.clone(),
        ]);
    }
    ops
}

/// Events before their answers, lined up on a random guest: its agent carries out what
/// was sent and holds the answers back, the guest touches those pages, and its report
/// gives the events first ([`Op::TouchHeld`]).
pub fn early_burst(rng: &mut SmallRng) -> Vec<Op> {
    let vm = rng.gen();
    vec![
        Op::Step {
            advance_ms: rng.gen_range(200..1500),
        },
        Op::Deliver {
            vm,
            n: 63,
            refuse: false,
            hold: true,
        },
        Op::TouchHeld {
            vm,
            seed: rng.gen(),
        },
        Op::Report { vm },
    ]
}

pub fn random_free_op(rng: &mut SmallRng, mixed: bool) -> Op {
    let (vm, gfn) = (rng.gen(), rng.gen());
    match rng.gen_range(0..100) {
        // Random pages stay private; with `mixed`, also contents that are shared,
        // patched, compressed or reclaimed, so that free pages are found in each state.
        0..=14 => Op::WritePage {
            vm,
            gfn,
            content: if mixed {
                // Few distinct contents: duplicates to share and re-share, near-copies
                // to patch.
                match rng.gen_range(0..10) {
                    0 => Content::Zero,
                    1..=4 => Content::Base(rng.gen_range(0..4)),
                    5 | 6 => Content::Similar(rng.gen_range(0..4), rng.gen()),
                    7 => Content::Text(rng.gen_range(0..4)),
                    _ => Content::Random(rng.gen()),
                }
            } else {
                Content::Random(rng.gen())
            },
        },
        15..=19 => Op::WritePartial {
            vm,
            gfn,
            offset: rng.gen(),
            len: rng.gen(),
            byte: rng.gen(),
        },
        20..=29 => Op::Read { vm, gfn },
        // With `mixed`, pages stay allocated long enough to go cold and be stored first.
        30..=41 if mixed && rng.gen_bool(0.75) => Op::Step {
            advance_ms: rng.gen_range(0..1500),
        },
        30..=41 => Op::Free {
            vm,
            gfn,
            n: if mixed { 1 } else { rng.gen_range(1..9) },
        },
        42..=51 => Op::GuestSample {
            vm,
            seed: rng.gen(),
        },
        52..=61 => Op::GuestReport { vm },
        62..=73 => Op::Step {
            advance_ms: rng.gen_range(0..1500),
        },
        74..=89 => Op::Deliver {
            vm,
            n: rng.gen_range(1..16),
            refuse: rng.gen_bool(0.05),
            hold: rng.gen_bool(0.1),
        },
        90..=93 => Op::Report { vm },
        94..=95 => Op::Disconnect {
            vm,
            seed: rng.gen(),
        },
        96..=97 => Op::Reattach { vm },
        98 => Op::Discard {
            vm,
            gfn,
            n: rng.gen_range(1..9),
        },
        _ => Op::Restart { seed: rng.gen() },
    }
}
