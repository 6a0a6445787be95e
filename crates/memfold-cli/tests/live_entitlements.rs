//! Sharing entitlements claimed through the balloon on two running `tiny` guests (Satori
//! §4.2–4.3): memfoldd (`--claim-entitlement at-once`) sets each guest's balloon to leave
//! it its allowance plus its entitlement, in whole MiB, and the guest sees that memory
//! (what its balloon driver holds by its kernel's count, printed each round, is exactly
//! RAM less the target). Then
//! guest `a` is opted out — all its sharing broken — and its entitlement is repaid: its
//! balloon inflates to the bare allowance, while `b`, which shares nothing with `a`, keeps
//! what it has. A third guest, `c`, has no balloon and no monitor for memfoldd: it earns
//! its entitlement, cannot claim it, is told why (`balloon_problem`), and nothing waits
//! on it. `b` asks for a smaller allowance of its own (`MEMFOLD_ALLOWANCE_MIB=128`, under
//! memfoldd's 160): it is given 128 MiB plus its entitlement. Each guest is a sharing domain of its own (`--share-domains vm`): in one
//! domain two tiny guests share their kernel's and their mechanism data's pages, and
//! breaking `a`'s sharing lowers `b`'s entitlement too (measured: 208 → 196 MiB) — as it
//! should, `b` being involved in the broken sharing. Self-checks pass throughout.

use std::path::Path;
use std::time::{Duration, Instant};

use memfold_live::{opt_out, query_stats};
use memfold_vm::images;
use memfold_vm::launcher::{agent_env, Accel, Guest, GuestSpec, RamBackend};
use memfold_wire::{Stats, VmStats};

const RAM_MIB: u64 = 256;
const ALLOWANCE_MIB: u64 = 160;
/// Guest `b` asks for a smaller allowance of its own (`MEMFOLD_ALLOWANCE_MIB`).
const B_ALLOWANCE_MIB: u64 = 128;
const MIB: u64 = 1 << 20;

mod common;
use common::{agent_lib, Killed};

fn vm<'a>(s: &'a Stats, name: &str) -> &'a VmStats {
    s.vms.iter().find(|v| v.name == name).expect("guest listed")
}

/// The allowance guest `name` has, MiB.
fn allowance_mib(name: &str) -> u64 {
    if name == "b" {
        B_ALLOWANCE_MIB
    } else {
        ALLOWANCE_MIB
    }
}

/// What the balloon should leave a guest with `entitlement_pages`: allowance plus the
/// entitlement, in whole MiB, at most its RAM.
fn want(name: &str, entitlement_pages: f64) -> u64 {
    let e = (entitlement_pages * 4096.0) as u64;
    ((allowance_mib(name) * MIB + e).min(RAM_MIB * MIB)) / MIB * MIB
}

/// The last value the guest printed after `marker`, KiB.
fn last_kib(g: &Guest, marker: &str) -> Option<u64> {
    g.serial()
        .lines()
        .filter_map(|l| l.strip_prefix(marker))
        .filter_map(|v| v.trim().parse().ok())
        .next_back()
}

/// Waits (polling memfoldd every 500 ms) until `ok` holds of its statistics and the
/// guests; returns those statistics.
fn wait_for(
    socket: &Path,
    guests: &[Guest],
    within: Duration,
    what: &str,
    ok: impl Fn(&Stats, &[Guest]) -> bool,
) -> Stats {
    let t = Instant::now();
    loop {
        for g in guests {
            assert!(
                g.mismatches().is_empty(),
                "{}: {:?}",
                g.name,
                g.mismatches()
            );
        }
        if let Ok(s) = query_stats(socket) {
            if ok(&s, guests) {
                return s;
            }
            assert!(
                t.elapsed() < within,
                "{what}: not within {within:?}; last statistics: {:#?}",
                s.vms
                    .iter()
                    .map(|v| (
                        &v.name,
                        v.entitlement_pages,
                        v.balloon_target_bytes,
                        v.balloon_actual_bytes,
                        &v.balloon_problem
                    ))
                    .collect::<Vec<_>>()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits (up to `within`) until every guest has passed a self-check round
/// (`MEMFOLD-CHECK ok`, images/tiny-init), failing at a mismatch: that none was printed
/// means nothing until a round has run.
fn checked_once(guests: &[Guest], within: Duration) {
    let t = Instant::now();
    let checked = |g: &Guest| {
        g.serial()
            .lines()
            .any(|l| l.starts_with("MEMFOLD-CHECK ok"))
    };
    while let Some(g) = guests.iter().find(|g| !checked(g)) {
        for g in guests {
            assert!(
                g.mismatches().is_empty(),
                "{}: {:?}",
                g.name,
                g.mismatches()
            );
        }
        assert!(
            t.elapsed() < within,
            "{}: no self-check round within {within:?}: {}",
            g.name,
            g.serial()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Each guest's balloon is where its entitlement says, and the guest sees it: the pages
/// its balloon driver holds by the guest kernel's own count (`MEMFOLD-BALLOON-KIB`, from
/// /proc/vmstat; MemTotal does not move under `deflate-on-oom`) are RAM less the target
/// (within 1 MiB).
fn claimed(s: &Stats, guests: &[Guest]) -> bool {
    guests.iter().all(|g| {
        let v = vm(s, &g.name);
        let target = want(&v.name, v.entitlement_pages);
        let seen = last_kib(g, "MEMFOLD-BALLOON-KIB ").is_some_and(|held| {
            let balloon_kib = (RAM_MIB * MIB).saturating_sub(target) / 1024;
            held.abs_diff(balloon_kib) <= 1024
        });
        v.balloon_problem.is_none()
            && v.balloon_target_bytes == Some(target)
            && v.balloon_actual_bytes == Some(target)
            && seen
    })
}

/// memfoldd claiming by `policy` with `allowance_mib`, each guest a sharing domain.
fn memfoldd(socket: &Path, policy: &str, allowance_mib: u64) -> Killed {
    common::memfoldd(
        socket,
        &[
            "--rate",
            "0",
            "--min-scan-interval-ms",
            "500",
            "--policy",
            "sharing",
            "--claim-entitlement",
            policy,
            "--share-domains",
            "vm",
            "--allowance-mib",
            &allowance_mib.to_string(),
        ],
    )
}

/// Boots tiny guests of [`RAM_MIB`] each, by name, with a balloon and a monitor for
/// memfoldd or (`false`) neither.
fn tiny_guests(cache: &Path, work: &Path, socket: &Path, names: &[(&str, bool)]) -> Vec<Guest> {
    let agent = agent_lib();
    let mut guests = Vec::new();
    for &(name, balloon) in names {
        let spec = GuestSpec {
            memfold_balloon: balloon,
            ..GuestSpec::new(name, "tiny", RAM_MIB as u32, RamBackend::Memfd)
        };
        let mut env = agent_env(&agent, socket, &spec);
        if name == "b" {
            env.push(("MEMFOLD_ALLOWANCE_MIB".into(), B_ALLOWANCE_MIB.to_string()));
        }
        guests.push(Guest::start_with_env(&spec, cache, work, Accel::Tcg, &env).unwrap());
    }
    for g in &mut guests {
        g.wait_ready(Duration::from_secs(180)).unwrap();
    }
    guests
}

/// One guest test at a time (two cores: guests booted side by side slow each other past
/// the tests' bounds).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn setup() -> (
    std::sync::MutexGuard<'static, ()>,
    std::path::PathBuf,
    tempfile::TempDir,
) {
    let lock = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    (lock, cache, tempfile::tempdir().unwrap())
}

#[test]
fn guests_that_share_get_their_entitlement_and_repay_it_when_their_sharing_breaks() {
    let (_one, cache, work) = setup();
    let socket = work.path().join("memfoldd.sock");
    let _daemon = memfoldd(&socket, "at-once", ALLOWANCE_MIB);
    // `c` has no balloon and no monitor for memfoldd: it earns, cannot claim, and is
    // told so, and nothing waits on it.
    let guests = tiny_guests(
        &cache,
        work.path(),
        &socket,
        &[("a", true), ("b", true), ("c", false)],
    );
    let ballooned = &guests[..2];

    // Each guest's duplicates (its own files copied eight times) earn it several MiB.
    let s = wait_for(
        &socket,
        &guests,
        Duration::from_secs(120),
        "entitlements claimed",
        |s, _| {
            s.vms.len() == 3
                && s.vms
                    .iter()
                    .all(|v| v.entitlement_pages * 4096.0 > 8.0 * MIB as f64)
                && claimed(s, ballooned)
                && vm(s, "c")
                    .balloon_problem
                    .as_deref()
                    .is_some_and(|p| p.contains("no monitor for memfoldd"))
        },
    );
    let c = vm(&s, "c");
    assert_eq!(
        (c.balloon_target_bytes, c.balloon_actual_bytes),
        (None, None),
        "{c:#?}"
    );
    let b_before = vm(&s, "b").balloon_actual_bytes;
    eprintln!(
        "claimed: {:?}",
        s.vms
            .iter()
            .map(|v| (
                &v.name,
                v.entitlement_pages / 256.0,
                v.balloon_actual_bytes.map(|b| b / MIB)
            ))
            .collect::<Vec<_>>()
    );

    // `a`'s sharing all broken: its entitlement falls to nothing and its balloon takes
    // the memory back; `b` is not touched.
    opt_out(&socket, "a", true).expect("opt-out reaches memfoldd");
    let s = wait_for(
        &socket,
        &guests,
        Duration::from_secs(120),
        "a repays",
        |s, _| {
            let a = vm(s, "a");
            a.shared_pages == 0
                && a.entitlement_pages == 0.0
                && a.balloon_actual_bytes == Some(ALLOWANCE_MIB * MIB)
                && claimed(s, ballooned)
        },
    );
    let b = vm(&s, "b");
    assert!(b.entitlement_pages * 4096.0 > 8.0 * MIB as f64, "{b:#?}");
    // Its own entitlement may cross a MiB boundary as its workload runs; no more.
    let (now, before) = (b.balloon_actual_bytes.unwrap(), b_before.unwrap());
    assert!(
        now.abs_diff(before) <= MIB,
        "b shares nothing with a: its memory must not move ({} → {} MiB)",
        before / MIB,
        now / MIB
    );
    checked_once(&guests, Duration::from_secs(60));
    for g in &guests {
        assert!(
            g.mismatches().is_empty(),
            "{}: {:?}",
            g.name,
            g.mismatches()
        );
    }
}

/// `under-pressure`: a guest left only a small allowance is short of memory by its own
/// balloon statistics, and is given more — never past allowance + entitlement.
#[test]
fn under_pressure_a_guest_short_of_memory_grows_up_to_its_entitlement() {
    // The guest's MemTotal is ~50 MiB under its RAM (205 of 256 MiB), and its initramfs,
    // agent and workload (a third of what was available at boot, in files in RAM) leave
    // it, at 128 MiB, under the 32 MiB that is short — within a second of its balloon
    // reaching the target, faster than memfoldd reads its statistics: the balloon's
    // `deflate-on-oom` keeps it alive until memfoldd grows it. (Measured: available 39 MiB
    // at 157 MiB, 9 MiB at 147; before deflate-on-oom the guest's kernel panicked, out of
    // memory, at ~150 MiB.)
    const SMALL_MIB: u64 = 128;
    let (_one, cache, work) = setup();
    let socket = work.path().join("memfoldd.sock");
    let _daemon = memfoldd(&socket, "under-pressure", SMALL_MIB);
    let guests = tiny_guests(&cache, work.path(), &socket, &[("p", true)]);
    let t = Instant::now();
    let mut most = 0;
    let mut seen_short = false;
    // (s, target MiB, actual MiB, available MiB, short) at each change: what a failure shows.
    type Sample = (u64, u64, Option<u64>, Option<u64>, Option<bool>);
    let mut trace: Vec<Sample> = Vec::new();
    // (when, ceiling) of the last readings.
    let mut ceilings: std::collections::VecDeque<(Instant, u64)> = Default::default();
    while t.elapsed() < Duration::from_secs(120) {
        assert!(
            guests[0].mismatches().is_empty(),
            "{:?}",
            guests[0].mismatches()
        );
        if let Ok(s) = query_stats(&socket) {
            if let Some(v) = s.vms.first() {
                let ceiling = ((SMALL_MIB * MIB + (v.entitlement_pages * 4096.0) as u64)
                    .min(RAM_MIB * MIB))
                    / MIB
                    * MIB;
                let target = v.balloon_target_bytes.unwrap_or(0);
                // Never more than the allowance plus what it earned (one grain of slack:
                // the entitlement moves between the target and this reading). The target
                // is set once a second: a fall in the entitlement reaches it by the next
                // tick (later on a loaded host), so it is held to the highest ceiling
                // read in the last 3 s.
                ceilings.push_back((Instant::now(), ceiling));
                ceilings.retain(|(at, _)| at.elapsed() < Duration::from_secs(3));
                let allowed = ceilings.iter().map(|c| c.1).max().unwrap_or(ceiling);
                assert!(
                    target <= allowed + MIB,
                    "target {target} over {allowed}: {v:#?}"
                );
                seen_short |= v.guest_short == Some(true);
                let sample = (
                    t.elapsed().as_secs(),
                    target / MIB,
                    v.balloon_actual_bytes.map(|b| b / MIB),
                    v.guest_available_bytes.map(|b| b / MIB),
                    v.guest_short,
                );
                if trace.last().is_none_or(|l| {
                    (l.1, l.2, l.3, l.4) != (sample.1, sample.2, sample.3, sample.4)
                }) {
                    trace.push(sample);
                }
                most = most.max(target);
                if seen_short && most > SMALL_MIB * MIB && v.guest_available_bytes.is_some() {
                    eprintln!(
                        "short, grown to {} MiB (allowance {SMALL_MIB}, entitled {:.1} MiB, available {:?} MiB)",
                        most / MIB,
                        v.entitlement_pages / 256.0,
                        v.guest_available_bytes.map(|b| b / MIB)
                    );
                    eprintln!("(s, target MiB, actual MiB, available MiB, short) {trace:?}");
                    // Its self-checks ran, and passed, through the squeeze.
                    checked_once(&guests, Duration::from_secs(60));
                    return;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!(
        "no growth under pressure: short seen {seen_short}, most {} MiB; \
         (s, target MiB, actual MiB, available MiB, short) {trace:?}; serial {}",
        most / MIB,
        guests[0].serial()
    );
}
