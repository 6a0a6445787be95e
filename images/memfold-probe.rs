//! memfold-probe: the write-latency side channel of page sharing, played inside two `tiny`
//! guests (Satori §4.3; issue 17, "Proof"; docs/side-channel.md). One program, two roles:
//!
//! - `memfold-probe victim SEED ROUNDS TRIALS PAGES`: holds, for every round and trial,
//!   a secret of PAGES pages — the attacker's guess (present) or bytes of its own
//!   (absent), exactly half of each round's trials present, chosen at random — prints
//!   which (`MEMFOLD-PROBE-TRUTH round bits`, for the host's scoring only: the attacker
//!   never sees it) and keeps them resident.
//! - `memfold-probe attacker SEED ROUNDS TRIALS PAGES CONTROLS WAIT_MS SETTLE_MS`: waits
//!   SETTLE_MS after boot (memfoldd's attach of a new guest: its first scans share the
//!   boot pages it has in common with others, which on a busy host takes seconds); each round,
//!   builds every trial's guessed secret in fresh pages, and CONTROLS pages of its own
//!   no other guest holds; waits WAIT_MS (past memfoldd's scan interval: a page equal to
//!   another VM's is then shared, and its next write is a copy-on-write break); then
//!   times one write to every page, in a random order, and prints the times, ns
//!   (`MEMFOLD-PROBE-T round trial t1,t2,..` and `MEMFOLD-PROBE-K round t1,t2,..`).
//!
//! - `memfold-probe diskio SEQ_MIB RAND_READS SEED` (`memfold bench disk-io`): reads the
//!   data disk with `O_DIRECT` (no guest page cache), round after round until stopped:
//!   SEQ_MIB MiB in 4 KiB reads, RAND_READS 4 KiB reads at random 4 KiB-aligned offsets,
//!   SEQ_MIB MiB in 1 MiB reads; prints each pass's bytes and ns (`MEMFOLD-IO round kind
//!   bytes ns`).
//! - `memfold-probe holder PAGES` (`memfold bench read-share`): maps the data disk's first
//!   PAGES pages and reads each (into the guest's page cache), prints
//!   `MEMFOLD-PROBE-HELD`, and keeps them mapped.
//! - `memfold-probe reader FIRST PAGES CHUNK GAP_MS ROUNDS ROUND_GAP_MS SETTLE_MS`: after
//!   SETTLE_MS, ROUNDS times reads the next PAGES pages of the data disk from page FIRST on
//!   through a mapping without readahead, CHUNK pages at a time GAP_MS apart; before each
//!   chunk prints `MEMFOLD-PROBE-R round chunk`, after it the pages' guest frames
//!   (`MEMFOLD-PROBE-G round chunk gfn,gfn,..`, from /proc/self/pagemap), so that the host
//!   times each page from its read to its sharing. ROUND_GAP_MS between rounds.
//!
//! Built by memfold-vm's build script (a statically linked binary, no crates) and put in
//! the `tiny` image's initramfs by images/build.sh; tiny-init runs it when the kernel
//! command line has `memfold.probe=ROLE,ARG,...`.

use std::hint::black_box;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{compiler_fence, Ordering};
use std::time::{Duration, Instant};

const PAGE: usize = 4096;

/// Stream tags: what a page's bytes are derived from.
const SECRET: u64 = 0x5ec2_e700;
const VICTIM_OWN: u64 = 0x7_1c71;
const CONTROL: u64 = 0xc0_7201;
const TRUTH: u64 = 0x7_2074;
const ORDER: u64 = 0x02_de25;

/// One guest page, page-aligned.
#[repr(C, align(4096))]
struct Page([u8; PAGE]);

/// splitmix64's step.
fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seed for the stream of `tag` and its indices: each index goes through the full
/// mix, so distinct indices give unrelated streams (no two pages of the run are equal).
fn key(tag: u64, seed: u64, a: u64, b: u64, c: u64) -> u64 {
    let mut h = tag;
    for x in [seed, a, b, c] {
        let mut s = h ^ x;
        h = next(&mut s);
    }
    h
}

/// Fills `p` with the stream of `k`: no two keys' pages are equal, none is zero.
fn fill(p: &mut Page, k: u64) {
    let mut s = k;
    for w in p.0.chunks_mut(8) {
        w.copy_from_slice(&next(&mut s).to_le_bytes());
    }
}

fn pages(n: usize) -> Vec<Page> {
    (0..n).map(|_| Page([0; PAGE])).collect()
}

/// Fisher-Yates with the stream of `k`.
fn shuffle<T>(v: &mut [T], k: u64) {
    let mut s = k;
    for i in (1..v.len()).rev() {
        let j = (next(&mut s) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// Which of a round's `trials` trials the victim holds: exactly half, at random.
fn present(seed: u64, round: u64, trials: usize) -> Vec<bool> {
    let mut v: Vec<bool> = (0..trials).map(|t| t < trials / 2).collect();
    shuffle(&mut v, key(TRUTH, seed, round, 0, 0));
    v
}

/// One timed write to `p`, ns.
fn timed_write(p: &mut Page) -> u64 {
    let b = black_box(p.0[64]) ^ 0x5a;
    compiler_fence(Ordering::SeqCst);
    let t0 = Instant::now();
    compiler_fence(Ordering::SeqCst);
    // SAFETY: `p` is a live, exclusively borrowed page of this process; the write is
    // volatile only so that it is neither elided nor moved out of the timed span.
    unsafe { std::ptr::write_volatile(&mut p.0[64], b) };
    compiler_fence(Ordering::SeqCst);
    let dt = t0.elapsed();
    compiler_fence(Ordering::SeqCst);
    dt.as_nanos() as u64
}

fn usage() -> ! {
    eprintln!(
        "usage: memfold-probe victim SEED ROUNDS TRIALS PAGES\n       memfold-probe attacker SEED ROUNDS TRIALS PAGES CONTROLS WAIT_MS SETTLE_MS\n       memfold-probe diskio SEQ_MIB RAND_READS SEED\n       memfold-probe holder PAGES\n       memfold-probe reader FIRST PAGES CHUNK GAP_MS ROUNDS ROUND_GAP_MS SETTLE_MS"
    );
    std::process::exit(2)
}

fn victim(seed: u64, rounds: usize, trials: usize, per: usize) -> ! {
    let mut held = pages(rounds * trials * per);
    let mut out = std::io::stdout().lock();
    for r in 0..rounds {
        let truth = present(seed, r as u64, trials);
        for (t, &is) in truth.iter().enumerate() {
            for k in 0..per {
                let p = &mut held[(r * trials + t) * per + k];
                let tag = if is { SECRET } else { VICTIM_OWN };
                fill(p, key(tag, seed, r as u64, t as u64, k as u64));
            }
        }
        let bits: String = truth.iter().map(|&b| if b { '1' } else { '0' }).collect();
        let _ = writeln!(out, "MEMFOLD-PROBE-TRUTH {r} {bits}");
    }
    let _ = writeln!(out, "MEMFOLD-PROBE-VICTIM-READY {} pages", held.len());
    let _ = out.flush();
    drop(out);
    loop {
        std::thread::sleep(Duration::from_secs(3600));
        black_box(&held);
    }
}

fn attacker(
    seed: u64,
    rounds: usize,
    trials: usize,
    per: usize,
    controls: usize,
    wait_ms: u64,
    settle_ms: u64,
) {
    std::thread::sleep(Duration::from_millis(settle_ms));
    let mut out = std::io::stdout().lock();
    // Every round's pages stay allocated: a freed page's frame would come back to a later
    // round still shared from an earlier one.
    let mut kept: Vec<Vec<Page>> = Vec::new();
    for r in 0..rounds {
        let mut p = pages(trials * per + controls);
        for t in 0..trials {
            for k in 0..per {
                fill(
                    &mut p[t * per + k],
                    key(SECRET, seed, r as u64, t as u64, k as u64),
                );
            }
        }
        for c in 0..controls {
            fill(
                &mut p[trials * per + c],
                key(CONTROL, seed, r as u64, c as u64, 0),
            );
        }
        std::thread::sleep(Duration::from_millis(wait_ms));
        let mut order: Vec<usize> = (0..p.len()).collect();
        shuffle(&mut order, key(ORDER, seed, r as u64, 0, 0));
        let mut ns = vec![0u64; p.len()];
        for i in order {
            ns[i] = timed_write(&mut p[i]);
        }
        let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        for t in 0..trials {
            let _ = writeln!(
                out,
                "MEMFOLD-PROBE-T {r} {t} {}",
                list(&ns[t * per..(t + 1) * per])
            );
        }
        let _ = writeln!(out, "MEMFOLD-PROBE-K {r} {}", list(&ns[trials * per..]));
        let _ = out.flush();
        kept.push(p);
    }
    let _ = writeln!(out, "MEMFOLD-PROBE-DONE {rounds} rounds");
    let _ = out.flush();
    black_box(&kept);
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let n = |i: usize| -> u64 {
        a.get(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| usage())
    };
    match a.first().map(String::as_str) {
        Some("victim") if a.len() == 5 => victim(n(1), n(2) as usize, n(3) as usize, n(4) as usize),
        Some("attacker") if a.len() == 8 => attacker(
            n(1),
            n(2) as usize,
            n(3) as usize,
            n(4) as usize,
            n(5) as usize,
            n(6),
            n(7),
        ),
        Some("diskio") if a.len() == 4 => diskio(n(1), n(2), n(3)),
        Some("holder") if a.len() == 2 => holder(n(1) as usize),
        Some("reader") if a.len() == 8 => reader(&Reader {
            first: n(1) as usize,
            pages: n(2) as usize,
            chunk: n(3) as usize,
            gap_ms: n(4),
            rounds: n(5) as usize,
            round_gap_ms: n(6),
            settle_ms: n(7),
        }),
        _ => usage(),
    }
}

/// The data disk (`/sys/block/vdX/serial` is `memfold-data`, as tiny-init finds it).
fn data_disk() -> String {
    for e in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let serial = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
        if serial.trim() == "memfold-data" {
            return format!("/dev/{name}");
        }
    }
    println!("MEMFOLD-PROBE-FAILED no data disk");
    std::process::exit(1)
}

fn fail(what: &str, e: std::io::Error) -> ! {
    println!("MEMFOLD-PROBE-FAILED {what}: {e}");
    std::process::exit(1)
}

/// `O_DIRECT` on x86_64: reads bypass the guest's page cache.
const O_DIRECT: i32 = 0o40000;

/// Reads the data disk with `O_DIRECT` in rounds until the host stops the guest.
fn diskio(seq_mib: u64, rand_reads: u64, seed: u64) -> ! {
    let path = data_disk();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(O_DIRECT)
        .open(&path)
        .unwrap_or_else(|e| fail(&path, e));
    let disk_pages = f.metadata().map(|m| m.len()).unwrap_or(0) / PAGE as u64;
    let disk_pages = match disk_pages {
        0 => {
            // A block device's metadata length is 0: its size is in sysfs, 512-byte units.
            let dev = path.trim_start_matches("/dev/");
            let sectors: u64 = std::fs::read_to_string(format!("/sys/block/{dev}/size"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0);
            sectors / 8
        }
        n => n,
    };
    let seq_pages = (seq_mib * 256).min(disk_pages);
    if seq_pages < 256 {
        println!("MEMFOLD-PROBE-FAILED data disk of {disk_pages} pages: under 1 MiB");
        std::process::exit(1);
    }
    // One aligned 1 MiB buffer (O_DIRECT needs aligned memory).
    let mut buf = pages(256);
    let bytes = |b: &mut [Page]| {
        // SAFETY: `Page` is plain bytes, `repr(C)`, so a slice of them is one byte run.
        unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<u8>(), b.len() * PAGE) }
    };
    let read = |b: &mut [u8], at: u64| {
        if let Err(e) = f.read_exact_at(b, at) {
            fail(&format!("read of {} bytes at {at}", b.len()), e);
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "MEMFOLD-IO-START {path} {disk_pages} pages");
    let _ = out.flush();
    let mut s = key(ORDER, seed, 0, 0, 0);
    for r in 0u64.. {
        let t = Instant::now();
        for p in 0..seq_pages {
            read(bytes(&mut buf[..1]), p * PAGE as u64);
        }
        let _ = writeln!(out, "MEMFOLD-IO {r} seq-4k {} {}", seq_pages * PAGE as u64, t.elapsed().as_nanos());
        let _ = out.flush();
        let t = Instant::now();
        for _ in 0..rand_reads {
            read(bytes(&mut buf[..1]), next(&mut s) % disk_pages * PAGE as u64);
        }
        let _ = writeln!(out, "MEMFOLD-IO {r} rand-4k {} {}", rand_reads * PAGE as u64, t.elapsed().as_nanos());
        let _ = out.flush();
        let t = Instant::now();
        for m in 0..seq_pages / 256 {
            read(bytes(&mut buf), m << 20);
        }
        let _ = writeln!(out, "MEMFOLD-IO {r} seq-1m {} {}", seq_pages / 256 << 20, t.elapsed().as_nanos());
        let _ = out.flush();
    }
    unreachable!("the rounds never end")
}

extern "C" {
    fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
    fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
}

/// The data disk's first `pages` pages mapped read-only, shared (its page cache), with
/// readahead off (`MADV_RANDOM`): each first touch reads that page alone.
fn map_disk(pages: usize) -> (*const u8, File) {
    use std::os::fd::AsRawFd;
    let path = data_disk();
    let f = File::open(&path).unwrap_or_else(|e| fail(&path, e));
    const PROT_READ: i32 = 1;
    const MAP_SHARED: i32 = 1;
    const MADV_RANDOM: i32 = 1;
    // SAFETY: a fresh read-only mapping of the disk; nothing else is at the address.
    let p = unsafe { mmap(std::ptr::null_mut(), pages * PAGE, PROT_READ, MAP_SHARED, f.as_raw_fd(), 0) };
    if p as isize == -1 {
        fail("mmap of the data disk", std::io::Error::last_os_error());
    }
    // SAFETY: the range just mapped.
    if unsafe { madvise(p, pages * PAGE, MADV_RANDOM) } != 0 {
        fail("madvise", std::io::Error::last_os_error());
    }
    (p, f)
}

/// Touches page `i` of the mapping at `p` (a read: a page-cache miss reads it from disk).
fn touch(p: *const u8, i: usize) {
    // SAFETY: `i` is within the mapping (callers keep to its pages).
    black_box(unsafe { std::ptr::read_volatile(p.add(i * PAGE)) });
}

/// The guest frame of each of `n` pages from `p` (/proc/self/pagemap, bits 0-54; root).
fn gfns(pagemap: &File, p: *const u8, n: usize) -> Vec<u64> {
    let mut e = vec![0u8; n * 8];
    if let Err(err) = pagemap.read_exact_at(&mut e, p as u64 / PAGE as u64 * 8) {
        fail("pagemap", err);
    }
    e.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) & ((1 << 55) - 1))
        .collect()
}

/// Reads the disk's first `n` pages into the page cache and keeps them there.
fn holder(n: usize) -> ! {
    let (p, _f) = map_disk(n);
    let t = Instant::now();
    for i in 0..n {
        touch(p, i);
    }
    println!("MEMFOLD-PROBE-HELD {n} pages in {} ms", t.elapsed().as_millis());
    loop {
        std::thread::sleep(Duration::from_secs(3600));
        // Keep them referenced (the guest's reclaim would go for the coldest pages).
        for i in 0..n {
            touch(p, i);
        }
    }
}

/// The reader's schedule (see the module's documentation).
struct Reader {
    first: usize,
    pages: usize,
    chunk: usize,
    gap_ms: u64,
    rounds: usize,
    round_gap_ms: u64,
    settle_ms: u64,
}

fn reader(r: &Reader) {
    let end = r.first + r.pages * r.rounds;
    let (p, _f) = map_disk(end);
    let pagemap = File::open("/proc/self/pagemap").unwrap_or_else(|e| fail("pagemap", e));
    std::thread::sleep(Duration::from_millis(r.settle_ms));
    let mut out = std::io::stdout().lock();
    for round in 0..r.rounds {
        let from = r.first + round * r.pages;
        for (c, at) in (from..from + r.pages).step_by(r.chunk.max(1)).enumerate() {
            let n = r.chunk.max(1).min(from + r.pages - at);
            let _ = writeln!(out, "MEMFOLD-PROBE-R {round} {c}");
            let _ = out.flush();
            for i in at..at + n {
                touch(p, i);
            }
            // SAFETY: within the mapping.
            let g = gfns(&pagemap, unsafe { p.add(at * PAGE) }, n);
            let list: Vec<String> = g.iter().map(u64::to_string).collect();
            let _ = writeln!(out, "MEMFOLD-PROBE-G {round} {c} {}", list.join(","));
            let _ = out.flush();
            std::thread::sleep(Duration::from_millis(r.gap_ms));
        }
        let _ = writeln!(out, "MEMFOLD-PROBE-ROUND {round}");
        let _ = out.flush();
        std::thread::sleep(Duration::from_millis(r.round_gap_ms));
    }
    let _ = writeln!(out, "MEMFOLD-PROBE-DONE {} rounds", r.rounds);
    let _ = out.flush();
    // The pages stay mapped (read) until the host stops the guest.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
