//! The live mechanisms against a plain model of guest memory, without QEMU: this test
//! process plays QEMU. It maps a memfd as "guest RAM", runs the agent on it and memfoldd
//! (Difference Engine policy, a fast clock) in threads, and a guest thread reads and
//! writes random pages, checking every read against a plain copy (the model). Pages are
//! shared, CoW-broken, reclaimed as zero, patched, compressed, decoded back and tracked
//! by the clock while the guest runs; the guest must never read a byte it did not write.
//! The second test adds a host memory budget far under the guest's RAM, so that cold
//! pages are also swapped out to a swap file and read back (DE §4.6).

use std::time::{Duration, Instant};

use memfold_agent::{self as agent, AgentConfig, FailMode};
use memfold_core::{CompressCodec, PatchCodec, Policy};
use memfold_core::{EngineConfig, ZeroPolicy};
use memfold_live::daemon::{self, DaemonConfig, DomainRule};
use memfold_live::query_stats;
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Guest RAM of the first test, pages. The agent finds guest RAM by its size: the two
/// tests, which run in one process, use different sizes.
const PAGES: usize = 4096;
const PAGE: usize = 4096;

/// A page of text-like bytes that LZ4 compresses well below the cut-off.
fn texty(rng: &mut SmallRng, out: &mut [u8]) {
    let words: [&[u8]; 6] = [
        b"memory ", b"page ", b"guest ", b"frame ", b"share ", b"0x1f ",
    ];
    let mut i = 0;
    while i < out.len() {
        let w = words[rng.gen_range(0..words.len())];
        let n = w.len().min(out.len() - i);
        out[i..i + n].copy_from_slice(&w[..n]);
        i += n;
    }
}

/// Initial content by gfn: zero, copies of templates (share), templates with a few bytes
/// changed (patch), text (compress), random (left alone).
fn fill(gfn: usize, templates: &[Vec<u8>], rng: &mut SmallRng, out: &mut [u8]) {
    match gfn % 10 {
        0 | 1 => out.fill(0),
        2 | 3 => out.copy_from_slice(&templates[gfn % templates.len()]),
        4 | 5 => {
            out.copy_from_slice(&templates[gfn % templates.len()]);
            for _ in 0..16 {
                out[rng.gen_range(0..PAGE)] = rng.gen();
            }
        }
        6 | 7 => texty(rng, out),
        _ => rng.fill(out),
    }
}

#[test]
fn guest_reads_what_it_wrote_while_pages_are_shared_reclaimed_patched_and_compressed() {
    run_model(PAGES, None, 0.1, CompressCodec::Zstd);
}

#[test]
fn guest_reads_what_it_wrote_while_pages_are_also_swapped_out_and_in() {
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

/// Runs the model guest for up to 40 s, until every mechanism (and swap, with a budget)
/// has run, checking every read; then checks every page. `pages`: guest RAM, pages;
/// `cold`: the fraction of guest ops on a random page of all RAM (the rest go to a hot
/// set of 300 pages); `codec`: memfoldd's compressor (the default, zstd, in one test, LZ4
/// in the other).
fn run_model(pages: usize, host_budget: Option<u64>, cold: f64, codec: CompressCodec) {
    let work = tempfile::tempdir().unwrap();
    let socket = work.path().join("memfoldd.sock");
    let cfg = DaemonConfig {
        socket: socket.clone(),
        engine: EngineConfig {
            rate: 0,
            zero: ZeroPolicy::Reclaim,
            min_scan_interval_us: 100_000,
            max_scan_interval_us: 400_000,
            clock_interval_us: Some(300_000),
            policy: Policy::difference_engine(),
            patch_codec: PatchCodec::RunDiff,
            patch_cutoff: 2048,
            compress_codec: codec,
            compress_cutoff: 2048,
            host_budget,
            ..EngineConfig::default()
        },
        swap_dir: work.path().to_path_buf(),
        swap_capacity: 64 << 20,
        domains: DomainRule::User,
    };
    std::thread::spawn(move || daemon::run(cfg));

    // Guest RAM: a shared memfd mapping, as QEMU's memory-backend-memfd makes it.
    let bytes = pages * PAGE;
    // SAFETY: plain syscalls on fds and a mapping this test owns.
    let (fd, ram) = unsafe {
        let fd = libc::memfd_create(c"model-guest-ram".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, bytes as libc::off_t), 0);
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        (fd, p as *mut u8)
    };
    let mut rng = SmallRng::seed_from_u64(0x6d66);
    let templates: Vec<Vec<u8>> = (0..8)
        .map(|_| {
            let mut t = vec![0u8; PAGE];
            rng.fill(&mut t[..]);
            t
        })
        .collect();
    let mut model = vec![0u8; bytes];
    for g in 0..pages {
        fill(
            g,
            &templates,
            &mut rng,
            &mut model[g * PAGE..(g + 1) * PAGE],
        );
    }
    // SAFETY: `ram` maps `bytes` bytes.
    let guest = unsafe { std::slice::from_raw_parts_mut(ram, bytes) };
    // Pages the guest uses so far (the rest it writes later: never read before).
    let mut live = if host_budget.is_some() {
        pages / 5
    } else {
        pages
    };
    guest[..live * PAGE].copy_from_slice(&model[..live * PAGE]);

    let acfg = AgentConfig {
        socket: socket.clone(),
        name: "model".into(),
        ram_bytes: bytes as u64,
        vma_budget: None,
        // The agent runs in this test process: pausing would stop the test run for good.
        on_failure: FailMode::Abort,
    };
    std::thread::spawn(move || agent::run(acfg));

    // The guest: a hot set it uses all the time, and now and then a cold page.
    let mut page = vec![0u8; PAGE];
    let mut check = |g: usize, guest: &[u8], model: &[u8]| {
        page.copy_from_slice(&guest[g * PAGE..(g + 1) * PAGE]);
        assert!(
            page == model[g * PAGE..(g + 1) * PAGE],
            "gfn {g}: the guest read bytes it did not write"
        );
    };
    let hot = 300;
    let start = Instant::now();
    let mut ops = 0u64;
    let mut seen_all = false;
    while start.elapsed() < Duration::from_secs(40) {
        for _ in 0..200 {
            let g = if !rng.gen_bool(cold) {
                rng.gen_range(0..hot)
            } else {
                rng.gen_range(0..live)
            };
            let p = &mut model[g * PAGE..(g + 1) * PAGE];
            match rng.gen_range(0..10) {
                0..=5 => check(g, guest, &model),
                6 | 7 => {
                    let off = rng.gen_range(0..PAGE - 8);
                    let v: u64 = rng.gen();
                    p[off..off + 8].copy_from_slice(&v.to_le_bytes());
                    guest[g * PAGE + off..g * PAGE + off + 8].copy_from_slice(&v.to_le_bytes());
                }
                8 => {
                    fill(g, &templates, &mut rng, p);
                    guest[g * PAGE..(g + 1) * PAGE].copy_from_slice(p);
                }
                _ => {
                    p.fill(0);
                    guest[g * PAGE..(g + 1) * PAGE].fill(0);
                }
            }
            ops += 1;
        }
        std::thread::sleep(Duration::from_millis(5));
        if !seen_all && start.elapsed() > Duration::from_secs(8) {
            if let Ok(s) = query_stats(&socket) {
                let v = &s.vms[0];
                if live < pages && v.compressions > 50 {
                    eprintln!("the guest now uses all its RAM: {:?}", s.swap);
                    guest[live * PAGE..].copy_from_slice(&model[live * PAGE..]);
                    live = pages;
                }
                seen_all = v.shares > 0
                    && v.hot_skipped > 0
                    && v.cow_breaks > 0
                    && v.reclaims > 0
                    && v.refills > 0
                    && v.patches > 0
                    && v.compressions > 0
                    && v.unstashes > 0
                    && host_budget.is_none_or(|b| {
                        v.swap_outs > 0
                            && v.swap_ins > 0
                            && v.swap_moves > 0
                            && s.swap.host_used_pages <= b / PAGE as u64
                    });
                if seen_all {
                    eprintln!("after {:?}, {ops} guest ops: {s:#?}", start.elapsed());
                    break;
                }
            }
        }
    }
    let s = query_stats(&socket).unwrap();
    assert!(seen_all, "not every mechanism ran: {s:#?}");
    assert!(s.saved_pages > 0, "{s:#?}");
    if host_budget.is_some() {
        assert!(s.swap.swapped_pages > 0, "{s:#?}");
    }
    // Every page, hot or cold, still reads what the guest wrote.
    for g in 0..pages {
        check(g, guest, &model);
    }
    // The memfd and mapping stay until the process exits: the agent thread serves them.
    let _ = fd;
}
