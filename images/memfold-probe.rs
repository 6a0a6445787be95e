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
//! Built by memfold-vm's build script (a statically linked binary, no crates) and put in
//! the `tiny` image's initramfs by images/build.sh; tiny-init runs it when the kernel
//! command line has `memfold.probe=ROLE,ARG,...`.

use std::hint::black_box;
use std::io::Write;
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
        "usage: memfold-probe victim SEED ROUNDS TRIALS PAGES\n       memfold-probe attacker SEED ROUNDS TRIALS PAGES CONTROLS WAIT_MS SETTLE_MS"
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
        _ => usage(),
    }
}
