use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use memfold_core::backing::mem::{ManualClock, MemBacking, MemGuestRam};
use memfold_core::engine::{Attach, Mapped};
use memfold_core::ids::{DomainId, FrameId, Gfn};
use memfold_core::{EngineConfig, Policy, PAGE_SIZE};
use serde_json::{json, Value};

use super::*;

const MIB: u64 = 1 << 20;

#[test]
fn a_guest_asks_by_its_environment_and_a_bad_value_is_named() {
    let env = |kvs: &[&str]| kvs.join("\0").into_bytes();
    assert_eq!(guest_asks(&env(&["PATH=/bin", "HOME=/"])), Ok((None, None)));
    assert_eq!(
        guest_asks(&env(&["MEMFOLD_CLAIM=never", "MEMFOLD_ALLOWANCE_MIB=128"])),
        Ok((Some(ClaimPolicy::Never), Some(128 << 20)))
    );
    let e = guest_asks(&env(&["MEMFOLD_CLAIM=all"])).unwrap_err();
    assert!(
        e.contains("expected never, allowance-only, at-once or under-pressure"),
        "{e}"
    );
    let e = guest_asks(&env(&["MEMFOLD_ALLOWANCE_MIB=lots"])).unwrap_err();
    assert!(e.contains("MEMFOLD_ALLOWANCE_MIB=\"lots\""), "{e}");
}

/// A new memfoldd whose domain 0 adopts the previous one's pool of `frames` frames, each
/// held and of its own bytes. The adoption is pending.
fn restarted(frames: u32) -> (Engine, DomainId) {
    let mut e = engine();
    let d = DomainId(0);
    let pool = MemBacking::new();
    {
        let mut f = pool.file();
        f.bytes = vec![7; frames as usize * PAGE_SIZE];
        for (i, page) in f.bytes.chunks_mut(PAGE_SIZE).enumerate() {
            page[..4].copy_from_slice(&(i as u32).to_le_bytes());
        }
    }
    assert!(e.adopt_pool(d, Box::new(pool), frames, (0..frames).map(FrameId)));
    assert!(e.adoption_pending(d));
    (e, d)
}

/// A new engine, sharing only, no clock and no scan.
fn engine() -> Engine {
    let cfg = EngineConfig {
        policy: Policy::sharing_only(),
        clock_interval_us: None,
        rate: 0,
        ..EngineConfig::default()
    };
    Engine::new(cfg, Box::new(ManualClock::new()), 0).unwrap()
}

/// Region `name` (16 MiB) of a QEMU that is this process (a live pid with a start time)
/// re-attaches to domain 0, mapping frame `f` at page `g` for each `(g, f)` of `map`.
fn reattach(e: &mut Engine, name: &str, map: impl Iterator<Item = (u32, u32)>) {
    attach_region(e, name, 4096, map);
}

/// Region `name` of `pages` pages of a QEMU that is this process attaches to domain 0,
/// mapping frame `f` at page `g` for each `(g, f)` of `map`.
fn attach_region(e: &mut Engine, name: &str, pages: u32, map: impl Iterator<Item = (u32, u32)>) {
    e.attach(Attach {
        name: name.into(),
        pid: std::process::id(),
        pages,
        ram: Box::new(MemGuestRam::new(pages)),
        mapped: map
            .map(|(g, f)| (Gfn(g), Mapped::Frame(FrameId(f))))
            .collect(),
        domain: DomainId(0),
        store: Box::new(MemBacking::new()),
        swap: None,
        sharing: Default::default(),
    })
    .unwrap();
}

/// Claims under `policy` over an 8 MiB allowance, with a claimer for this process (a
/// QEMU that started at `started`) that has no thread: its inbox and state are returned.
fn claims_with_idle_claimer(
    policy: ClaimPolicy,
    started: u64,
) -> (Claims, mpsc::Receiver<u64>, Arc<Mutex<BalloonState>>) {
    let mut c = Claims::new(policy, 8 * MIB, Arc::default());
    let (tx, rx) = mpsc::channel();
    let state = Arc::new(Mutex::new(BalloonState::default()));
    c.by_qemu.insert(
        std::process::id(),
        Claimer {
            started,
            targets: tx,
            state: Arc::clone(&state),
            target: None,
            asks: Some((policy, 8 * MIB)),
            adopting_since: None,
        },
    );
    (c, rx, state)
}

/// The claim's ceiling is the guest's RAM as its QEMU says, when memfoldd manages less
/// of it (a region refused, or not re-attached yet): a guest of 16 MiB of which one
/// 4 MiB region is managed is held at its 8 MiB allowance, not at 4 MiB. Its QEMU's word
/// never lowers the ceiling below the regions'. Fails with the regions' sum alone.
#[test]
fn the_ceiling_is_the_guests_ram_as_qemu_says_not_only_its_managed_regions() {
    let mut e = engine();
    assert!(e.add_domain(DomainId(0), Box::new(MemBacking::new())));
    attach_region(&mut e, "g/ram0", 1024, std::iter::empty());
    let target_with = |qemu_ram: Option<u64>| {
        let (mut c, rx, state) = claims_with_idle_claimer(ClaimPolicy::AllowanceOnly, my_start());
        state.lock().unwrap().qemu_ram = qemu_ram;
        c.tick(&e);
        rx.try_recv().ok()
    };
    assert_eq!(target_with(None), Some(4 * MIB), "the managed region's RAM");
    assert_eq!(target_with(Some(16 * MIB)), Some(8 * MIB), "the allowance");
    assert_eq!(
        target_with(Some(MIB)),
        Some(4 * MIB),
        "never lowered by QEMU"
    );
}

fn my_start() -> u64 {
    started(std::process::id()).expect("this process has a start time")
}

/// After a restart, no target is set while the books are half rebuilt, and one is once
/// the adoption ends. Regions `a` and `b` share 512 frames; `a` re-attaches first, and
/// until `b` does its frames have rank 1 and its entitlement reads 0. Seen failing without
/// the mend: a target of the allowance, 8 MiB, sent at the first tick (`a`'s balloon
/// inflated for sharing that never broke).
#[test]
fn no_target_is_set_while_a_restarted_memfoldd_adopts_the_pool() {
    let (mut e, d) = restarted(512);
    let (mut c, rx, _) = claims_with_idle_claimer(ClaimPolicy::AtOnce, my_start());
    reattach(&mut e, "a", (0..512).map(|g| (g, g)));
    c.tick(&e);
    assert_eq!(rx.try_recv(), Err(mpsc::TryRecvError::Empty));
    reattach(&mut e, "b", (0..512).map(|g| (g, g)));
    c.tick(&e);
    assert_eq!(rx.try_recv(), Err(mpsc::TryRecvError::Empty));
    assert_eq!(c.by_qemu[&std::process::id()].target, None);
    e.end_adoption(d);
    c.tick(&e);
    // 8 MiB of allowance + 256 pages of entitlement for each region.
    assert_eq!(rx.try_recv(), Ok(10 * MIB));
}

/// An adoption that does not end (a holder of the pool paused on a failure, or refused)
/// holds back a policy that reads the books only for a grace period, and one that does
/// not read them (`allowance-only`) not at all. Seen failing without the mend: no target,
/// for as long as the adoption lasted.
#[test]
fn an_adoption_that_does_not_end_holds_targets_back_only_for_a_while() {
    let (mut e, _d) = restarted(512);
    reattach(&mut e, "a", (0..512).map(|g| (g, g)));
    let (mut c, rx, _) = claims_with_idle_claimer(ClaimPolicy::AllowanceOnly, my_start());
    c.tick(&e);
    assert_eq!(rx.try_recv(), Ok(8 * MIB), "allowance-only reads no books");
    let (mut c, rx, _) = claims_with_idle_claimer(ClaimPolicy::AtOnce, my_start());
    c.tick(&e);
    assert_eq!(
        rx.try_recv(),
        Err(mpsc::TryRecvError::Empty),
        "within the grace"
    );
    c.adoption_grace = Duration::ZERO;
    c.tick(&e);
    // The books as they stand: `a`'s 512 frames of rank 1 earn nothing yet.
    assert_eq!(rx.try_recv(), Ok(8 * MIB));
}

/// Under `under-pressure`, a claimer that has set no target (a new memfoldd's) starts from
/// what the balloon leaves the guest — not from the allowance, which would cut a guest
/// that had grown past it straight back — and sets nothing until that is known. Seen
/// failing without the mend: 8 MiB (the allowance) sent at the first tick.
#[test]
fn under_pressure_a_new_claimer_starts_where_the_balloon_stands() {
    // 1025 mappings of one frame: 1024 pages (4 MiB) of entitlement.
    let (mut e, d) = restarted(1);
    reattach(&mut e, "a", (0..1025).map(|g| (g, 0)));
    e.end_adoption(d);
    let (mut c, rx, state) = claims_with_idle_claimer(ClaimPolicy::UnderPressure, my_start());
    // The balloon not read yet: nothing set.
    c.tick(&e);
    assert_eq!(rx.try_recv(), Err(mpsc::TryRecvError::Empty));
    // It leaves the guest 10 MiB and 3 pages (it had grown to that under the last
    // memfoldd): held there, in whole MiB, inside allowance + entitlement (8 + 4 MiB).
    state.lock().unwrap().actual = Some(10 * MIB + 3 * PAGE_SIZE as u64);
    c.tick(&e);
    assert_eq!(rx.try_recv(), Ok(10 * MIB));
    // Past allowance + entitlement: what it drew beyond them is repaid at once.
    let (mut c, rx, state) = claims_with_idle_claimer(ClaimPolicy::UnderPressure, my_start());
    state.lock().unwrap().actual = Some(15 * MIB);
    c.tick(&e);
    assert_eq!(rx.try_recv(), Ok(12 * MIB));
}

/// A claimer of another QEMU that had the same pid (another start time) is replaced by
/// one of this QEMU's own: its target and asks go with it. Seen failing without the mend:
/// the old claimer (allowance 1 MiB, allowance-only) was kept.
#[test]
fn a_reused_pid_gets_a_claimer_of_its_own() {
    let (mut e, d) = restarted(1);
    reattach(&mut e, "a", [(0, 0)].into_iter());
    e.end_adoption(d);
    let me = std::process::id();
    let (mut c, old_inbox, _) = claims_with_idle_claimer(ClaimPolicy::AtOnce, my_start() + 1);
    {
        let old = c.by_qemu.get_mut(&me).unwrap();
        old.asks = Some((ClaimPolicy::AllowanceOnly, MIB));
        old.target = Some(MIB);
    }
    tick_until_asked(&mut c, &e);
    let new = &c.by_qemu[&me];
    assert_eq!(
        (new.started, new.asks),
        (my_start(), Some((ClaimPolicy::AtOnce, 8 * MIB)))
    );
    // The old claimer's thread sees its inbox closed, and ends.
    assert_eq!(old_inbox.recv(), Err(mpsc::RecvError));
}

/// A claimer whose thread cannot be spawned is not kept (it would never drive its
/// balloon, and say nothing); it is started at a later tick. Seen failing without the
/// mend: the claimer was kept.
#[test]
fn a_claimer_whose_thread_cannot_start_is_not_kept() {
    let (mut e, d) = restarted(1);
    reattach(&mut e, "a", [(0, 0)].into_iter());
    e.end_adoption(d);
    let mut c = Claims::new(ClaimPolicy::AtOnce, 8 * MIB, Arc::default());
    // A stack no thread can have: the spawn fails as it does on a host out of threads
    // (EAGAIN).
    c.stack = Some(1 << 60);
    c.tick(&e);
    assert!(c.by_qemu.is_empty());
    assert_eq!(c.state(std::process::id()), None);
    c.stack = None;
    tick_until_asked(&mut c, &e);
    assert_eq!(c.by_qemu[&std::process::id()].target, Some(8 * MIB));
}

/// Ticks until this process's claimer has heard what its QEMU's environment asks (its
/// thread reads it), at most 5 s.
fn tick_until_asked(c: &mut Claims, e: &Engine) {
    let t = std::time::Instant::now();
    loop {
        c.tick(e);
        if c.by_qemu
            .get(&std::process::id())
            .is_some_and(|k| k.asks.is_some())
        {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "no asks read");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The threads that read a QEMU's environment (the test's reader records them).
static READ_ON: Mutex<Vec<std::thread::ThreadId>> = Mutex::new(Vec::new());

/// A QEMU's environment is read on its claimer's thread, never on the main loop's: the
/// kernel reads it from the QEMU's memory, which a QEMU can back with a FUSE file whose
/// server never answers — the main loop, every guest's, would wait for good. Until it is
/// read, no target is set. Seen failing without the mend: read by `tick`, on this thread.
#[test]
fn a_qemus_environment_is_read_off_the_main_loop() {
    let (mut e, d) = restarted(1);
    reattach(&mut e, "a", [(0, 0)].into_iter());
    e.end_adoption(d);
    let mut c = Claims::new(ClaimPolicy::AtOnce, 8 * MIB, Arc::default());
    c.environ = |_| {
        READ_ON.lock().unwrap().push(std::thread::current().id());
        Ok(b"MEMFOLD_ALLOWANCE_MIB=4".to_vec())
    };
    tick_until_asked(&mut c, &e);
    let read_on = READ_ON.lock().unwrap().clone();
    assert_eq!(read_on.len(), 1, "read once");
    assert_ne!(
        read_on[0],
        std::thread::current().id(),
        "read on the main loop"
    );
    let k = &c.by_qemu[&std::process::id()];
    assert_eq!(k.asks, Some((ClaimPolicy::AtOnce, 4 * MIB)));
    assert_eq!(k.target, Some(4 * MIB));
}

/// A guest as its fake QEMU monitor shows it.
#[derive(Default)]
struct FakeGuest {
    /// What the balloon leaves it, bytes.
    actual: u64,
    /// Its memory available (`stat-available-memory`), bytes.
    available: u64,
    /// At which `balloon` command (1 for the first) its driver inflates to the target.
    inflates_at: usize,
    /// Every `balloon` command's value, bytes.
    asked: Vec<u64>,
    /// The `desc` of the error it answers `query-balloon` with, if any.
    query_error: Option<String>,
    /// A command it answers only after this long, if any.
    late: Option<(&'static str, Duration)>,
    /// Every command it was sent, in order.
    commands: Vec<String>,
    /// It closes the monitor after its first answer of guest statistics.
    close_after_stats: bool,
}

/// A QMP monitor served by this process, at `dir/qmp.sock`, for `guest`: a balloon at
/// `/machine/peripheral/balloon0` with guest statistics.
fn fake_qemu(dir: &Path, guest: Arc<Mutex<FakeGuest>>) -> PathBuf {
    let path = dir.join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let r = BufReader::new(s.try_clone().unwrap());
        writeln!(s, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
        for line in r.lines() {
            let Ok(line) = line else { return };
            let m: Value = serde_json::from_str(&line).unwrap();
            let command = m["execute"].as_str().unwrap().to_string();
            let late = guest.lock().unwrap().late;
            if let Some((_, after)) = late.filter(|l| l.0 == command) {
                std::thread::sleep(after);
            }
            let mut g = guest.lock().unwrap();
            g.commands.push(command);
            if let (Some(desc), "query-balloon") = (&g.query_error, m["execute"].as_str().unwrap())
            {
                let e =
                    json!({ "error": { "class": "GenericError", "desc": desc }, "id": m["id"] });
                if writeln!(s, "{e}").is_err() {
                    return;
                }
                continue;
            }
            let ret = match m["execute"].as_str().unwrap() {
                "balloon" => {
                    let v = m["arguments"]["value"].as_u64().unwrap();
                    g.asked.push(v);
                    if g.asked.len() >= g.inflates_at {
                        g.actual = v;
                    }
                    json!({})
                }
                "query-balloon" => json!({ "actual": g.actual }),
                "query-memory-size-summary" => json!({ "base-memory": 512 * MIB }),
                "qom-list" if m["arguments"]["path"] == "/machine/peripheral" => {
                    json!([{ "name": "balloon0", "type": "child<virtio-balloon-pci>" }])
                }
                "qom-get" if m["arguments"]["property"] == "guest-stats" => json!({
                    "stats": {
                        "stat-available-memory": g.available,
                        "stat-total-memory": g.actual,
                    }
                }),
                _ => json!({}),
            };
            if writeln!(s, "{}", json!({ "return": ret, "id": m["id"] })).is_err() {
                return;
            }
            if g.close_after_stats && m["arguments"]["property"] == "guest-stats" {
                return;
            }
        }
    });
    path
}

/// A claimer's reporter for this process, into `state`.
fn reporter(state: Arc<Mutex<BalloonState>>) -> Reporter {
    Reporter {
        pid: std::process::id(),
        state,
        said: None,
        off_target_since: None,
    }
}

/// A claimer's pace in these tests: the monitor read every 20 ms, asked again after 200 ms.
const FAST: Pace = Pace {
    poll: Duration::from_millis(20),
    ask_again_after: Duration::from_millis(200),
};

/// The `balloon` commands a claimer sends in `secs` to `guest`, which deflated 64 MiB
/// past its 256 MiB target, read every 20 ms, asked again after 200 ms at most.
fn asked_of_deflated_guest(mut guest: FakeGuest, secs: f64) -> Vec<u64> {
    let dir = tempfile::tempdir().unwrap();
    guest.actual = 320 * MIB;
    let guest = Arc::new(Mutex::new(guest));
    let path = fake_qemu(dir.path(), Arc::clone(&guest));
    let q = Qmp::connect_served_by(&path, std::process::id(), MONITOR_TIMEOUT).unwrap();
    let (tx, rx) = mpsc::channel();
    let driving = std::thread::spawn(move || {
        let mut r = reporter(Arc::default());
        drive(q, &rx, &mut Some(256 * MIB), &mut r, FAST)
    });
    std::thread::sleep(Duration::from_secs_f64(secs));
    drop(tx);
    assert_eq!(driving.join().unwrap(), Ok(()));
    let asked = std::mem::take(&mut guest.lock().unwrap().asked);
    asked
}

/// A guest that deflated on OOM, and is no longer short, is asked for its target again
/// (its driver inflates only at a new `balloon` command) until it inflates; then no more.
/// Seen failing without the mend: asked once, `[256 MiB]`, the repayment never made.
#[test]
fn a_balloon_deflated_past_its_target_is_asked_again_until_it_inflates() {
    let asked = asked_of_deflated_guest(
        FakeGuest {
            available: 200 * MIB,
            inflates_at: 2,
            ..FakeGuest::default()
        },
        1.0,
    );
    assert_eq!(asked, [256 * MIB, 256 * MIB]);
}

/// Asked again at most once per interval (200 ms here), not at every reading (20 ms).
/// Seen failing without the mend: asked once.
#[test]
fn a_deflated_balloon_is_asked_again_at_most_once_an_interval() {
    let asked = asked_of_deflated_guest(
        FakeGuest {
            available: 200 * MIB,
            inflates_at: usize::MAX,
            ..FakeGuest::default()
        },
        1.0,
    );
    assert!((2..=6).contains(&asked.len()), "{asked:?}");
    assert!(asked.iter().all(|&t| t == 256 * MIB), "{asked:?}");
}

/// A guest still short of memory is not asked again: it would only deflate again.
#[test]
fn a_deflated_balloon_is_not_asked_again_while_its_guest_is_short() {
    let asked = asked_of_deflated_guest(
        FakeGuest {
            available: 8 * MIB,
            inflates_at: 2,
            ..FakeGuest::default()
        },
        0.8,
    );
    assert_eq!(asked, [256 * MIB]);
}

/// A claimer reads its guest's RAM from the monitor as it connects
/// (`query-memory-size-summary`), for the claim's ceiling. Fails if `drive` does not ask.
#[test]
fn a_claimer_reads_its_guests_ram_from_the_monitor() {
    let dir = tempfile::tempdir().unwrap();
    let guest = Arc::new(Mutex::new(FakeGuest {
        actual: 256 * MIB,
        available: 128 * MIB,
        inflates_at: 1,
        ..FakeGuest::default()
    }));
    let path = fake_qemu(dir.path(), guest);
    let q = Qmp::connect_served_by(&path, std::process::id(), MONITOR_TIMEOUT).unwrap();
    let state: Arc<Mutex<BalloonState>> = Arc::default();
    let mut r = reporter(Arc::clone(&state));
    let (tx, rx) = mpsc::channel::<u64>();
    drop(tx);
    assert_eq!(drive(q, &rx, &mut None, &mut r, FAST), Ok(()));
    assert_eq!(state.lock().unwrap().qemu_ram, Some(512 * MIB));
}

/// A QEMU that answers `query-balloon` with a 300 KB error, escapes and newlines in it,
/// has its balloon's problem shown escaped and short, in the log and in every reader's
/// statistics (unbounded, it made that guest's statistics too large to send: every
/// operator's `memfold status` and `/metrics` failed). Fails with the text kept whole.
#[test]
fn a_qemus_long_error_is_kept_short_and_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let desc = format!("\u{1b}[2J\nforged line {}", "A".repeat(300_000));
    let guest = Arc::new(Mutex::new(FakeGuest {
        actual: 256 * MIB,
        query_error: Some(desc),
        ..FakeGuest::default()
    }));
    let path = fake_qemu(dir.path(), guest);
    let q = Qmp::connect_served_by(&path, std::process::id(), MONITOR_TIMEOUT).unwrap();
    let state: Arc<Mutex<BalloonState>> = Arc::default();
    let mut r = reporter(Arc::clone(&state));
    let (_tx, rx) = mpsc::channel::<u64>();
    let why = drive(q, &rx, &mut None, &mut r, FAST).unwrap_err();
    assert!(
        why.len() > 300_000,
        "the monitor's words, whole: {}",
        why.len()
    );
    // As `claim_loop` says it.
    r.problem(Some(why));
    let p = state.lock().unwrap().problem.clone().expect("a problem");
    assert!(p.len() <= PROBLEM_CHARS + 3, "{} bytes", p.len());
    assert!(
        p.starts_with("query-balloon: QMP command query-balloon failed"),
        "{p}"
    );
    assert!(p.contains("\\u{1b}[2J\\nforged line AAA"), "{p}");
    assert!(p.chars().all(|c| c == ' ' || c.is_ascii_graphic()), "{p}");
}

/// A QEMU that answers `query-memory-size-summary` after the session's 300 ms: the
/// claimer gives the session up at once (its answer comes late, and would be taken for
/// the next command's), says why, and asks nothing more on it; `claim_loop` connects anew.
/// Seen failing without the mend: the claimer asked on (`qom-list`, ...), answers out of
/// step.
#[test]
fn a_claimer_gives_up_a_session_whose_answer_came_late() {
    let dir = tempfile::tempdir().unwrap();
    let guest = Arc::new(Mutex::new(FakeGuest {
        actual: 256 * MIB,
        late: Some(("query-memory-size-summary", Duration::from_millis(600))),
        ..FakeGuest::default()
    }));
    let path = fake_qemu(dir.path(), Arc::clone(&guest));
    let limit = Duration::from_millis(300);
    let q = Qmp::connect_served_by(&path, std::process::id(), limit).unwrap();
    let mut r = reporter(Arc::default());
    let (_tx, rx) = mpsc::channel::<u64>();
    let t0 = Instant::now();
    let why = drive(q, &rx, &mut Some(256 * MIB), &mut r, FAST).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert!(why.contains("out of step"), "{why}");
    assert!(why.contains("query-memory-size-summary"), "{why}");
    // The late answer goes out; nothing more was asked.
    std::thread::sleep(Duration::from_millis(500));
    let commands = guest.lock().unwrap().commands.clone();
    assert_eq!(
        commands,
        ["qmp_capabilities", "query-memory-size-summary"],
        "asked on a session out of step"
    );
}

/// A guest short of memory whose monitor then closes: once the session ends, the state no
/// longer says it is short (nor what it had), or the main loop would grow its claim every
/// second on that stale word. Seen failing before: `short` stayed `Some(true)`.
#[test]
fn a_guests_shortage_is_forgotten_when_its_monitor_session_ends() {
    let dir = tempfile::tempdir().unwrap();
    let guest = Arc::new(Mutex::new(FakeGuest {
        actual: 256 * MIB,
        available: MIB,
        close_after_stats: true,
        ..FakeGuest::default()
    }));
    let path = fake_qemu(dir.path(), Arc::clone(&guest));
    let q = Qmp::connect_served_by(&path, std::process::id(), MONITOR_TIMEOUT).unwrap();
    let state = Arc::new(Mutex::new(BalloonState::default()));
    let mut r = reporter(Arc::clone(&state));
    let (_tx, rx) = mpsc::channel::<u64>();
    assert!(drive(q, &rx, &mut Some(256 * MIB), &mut r, FAST).is_err());
    let commands = guest.lock().unwrap().commands.clone();
    assert!(
        commands.iter().any(|c| c == "qom-get"),
        "guest statistics never read: {commands:?}"
    );
    let s = state.lock().unwrap().clone();
    assert_eq!((s.short, s.available), (None, None), "{s:?}");
}
