//! Never-share (Satori §4.3; issue 17): a guest the operator marks never-share is a
//! sharing domain of its own whatever the rule, even beside a guest of the same user
//! under `--share-domains user`. This test process plays two QEMUs speaking the wire (one
//! user): a victim whose RAM holds a secret page twice and an attacker whose RAM holds
//! the same secret page once. Marked never-share (either of them), the victim's secret is
//! shared within the victim — its pool holds it — but the attacker is handed another
//! pool, which never holds it, and no share request pairs the attacker's copy with the
//! victim's. Unmarked (the control), both get the one pool holding the secret and the
//! attacker's copy is asked to map the victim's frame: what a timing attacker detects.

mod common;

use std::collections::BTreeSet;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use memfold_core::{EngineConfig, Policy};
use memfold_live::daemon::{DaemonConfig, DomainRule};
use memfold_sys::memfd;
use memfold_wire::{Conn, ToAgent};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGE: usize = 4096;
const PAGES: usize = 32;

fn holds_page(fd: &OwnedFd, page: &[u8]) -> bool {
    let size = memfd::size(fd.as_fd()).unwrap() as usize;
    let mut all = vec![0u8; size];
    memfd::pread_exact(fd.as_fd(), &mut all, 0).unwrap();
    all.chunks(PAGE).any(|c| c == page)
}

/// The share requests a connection received within `wait`, as (gfn, frame), or until
/// they include every gfn of `enough`.
fn shares(c: &Conn, wait: Duration, enough: &[u32]) -> Vec<(u32, u32)> {
    c.set_recv_timeout(Duration::from_millis(50)).unwrap();
    let t = Instant::now();
    let mut out: Vec<(u32, u32)> = Vec::new();
    while t.elapsed() < wait && !enough.iter().all(|g| out.iter().any(|s| s.0 == *g)) {
        while let Ok(Some((m, _))) = c.recv::<ToAgent>() {
            if let ToAgent::Share { pages, .. } = m {
                out.extend(pages.iter().map(|(g, f)| (g.0, f.0)));
            }
        }
    }
    out
}

struct Seen {
    /// The attacker's pool is the victim's.
    one_pool: bool,
    /// The victim's pool holds the secret (shared within the victim).
    victim_pool_has_secret: bool,
    /// The attacker's pool holds the secret.
    attacker_pool_has_secret: bool,
    /// The attacker was asked to map its copy of the secret (gfn 0) onto a frame.
    attacker_copy_shared: bool,
}

fn run(never_share: &[&str]) -> Seen {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("memfoldd.sock");
    let cfg = DaemonConfig {
        socket: socket.clone(),
        engine: EngineConfig {
            policy: Policy::sharing_only(),
            rate: 0,
            min_scan_interval_us: 50_000,
            max_scan_interval_us: 100_000,
            clock_interval_us: None,
            ..EngineConfig::default()
        },
        swap_dir: dir.path().to_path_buf(),
        swap_capacity: 1 << 20,
        domains: DomainRule::User,
        never_share: never_share
            .iter()
            .map(|s| s.to_string())
            .collect::<BTreeSet<_>>(),
        agent_gid: None,
        claim: memfold_core::ClaimPolicy::Never,
        allowance: 0,
        guest_channels: None,
        tenant_max_bytes: u64::MAX,
    };
    common::start_memfoldd_with(cfg);
    let mut rng = SmallRng::seed_from_u64(17);
    let mut secret = vec![0u8; PAGE];
    rng.fill(&mut secret[..]);
    // The victim: the secret at gfns 0 and 1, random pages after.
    let mut ram = vec![0u8; PAGES * PAGE];
    rng.fill(&mut ram[..]);
    ram[..PAGE].copy_from_slice(&secret);
    ram[PAGE..2 * PAGE].copy_from_slice(&secret);
    let (victim, victim_fds, _v) = common::attach_fake_qemu(&socket, "victim", &ram);
    // The attacker: its guess of the secret at gfn 0, random pages after.
    let mut mine = vec![0u8; PAGES * PAGE];
    rng.fill(&mut mine[..]);
    mine[..PAGE].copy_from_slice(&secret);
    let (attacker, attacker_fds, _a) = common::attach_fake_qemu(&socket, "attacker", &mine);
    let id = |f: &OwnedFd| memfd::file_id(f.as_fd()).unwrap();
    // Scans every 50-100 ms: once the victim's copies are shared, 3 s more cover many
    // scans of the attacker. The control, where its copy is to be shared, waits up to
    // 30 s for it (stopping once seen): a loaded host must not fail it.
    let victim_shares = shares(&victim, Duration::from_secs(30), &[0, 1]);
    let attacker_wait = Duration::from_secs(if never_share.is_empty() { 30 } else { 3 });
    let attacker_shares = shares(&attacker, attacker_wait, &[0]);
    assert!(
        victim_shares.iter().any(|s| s.0 == 0) && victim_shares.iter().any(|s| s.0 == 1),
        "the victim's two copies of its secret are shared with each other: {victim_shares:?}"
    );
    Seen {
        one_pool: id(&victim_fds[0]) == id(&attacker_fds[0]),
        victim_pool_has_secret: holds_page(&victim_fds[0], &secret),
        attacker_pool_has_secret: holds_page(&attacker_fds[0], &secret),
        attacker_copy_shared: attacker_shares.iter().any(|s| s.0 == 0),
    }
}

#[test]
fn a_never_share_victim_shares_only_within_itself() {
    let s = run(&["victim"]);
    assert!(s.victim_pool_has_secret, "sharing within the VM stays");
    assert!(!s.one_pool, "the never-share victim has a pool of its own");
    assert!(!s.attacker_pool_has_secret);
    assert!(
        !s.attacker_copy_shared,
        "the attacker's copy of the secret was shared across VMs"
    );
}

#[test]
fn a_never_share_attacker_is_kept_apart_too() {
    // Vice versa: the mark on either side keeps the two apart.
    let s = run(&["attacker"]);
    assert!(!s.one_pool);
    assert!(!s.attacker_pool_has_secret);
    assert!(!s.attacker_copy_shared);
}

#[test]
fn unmarked_guests_of_one_user_share_the_secret() {
    // The control: the same guests unmarked share one pool, and the attacker's copy of
    // the secret is mapped onto the victim's frame (the CoW break a write then times).
    let s = run(&[]);
    assert!(s.one_pool && s.victim_pool_has_secret && s.attacker_pool_has_secret);
    assert!(s.attacker_copy_shared);
}
