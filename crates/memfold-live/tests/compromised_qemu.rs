//! A compromised QEMU (issue 14, "Least privilege per VM"): a process holding everything
//! one guest's agent receives from memfoldd — its domain's pool, its own store — must not
//! be able to read a page that only a guest of another sharing domain holds.
//!
//! This test process plays two QEMUs speaking the wire themselves: a victim whose RAM
//! holds a secret page twice (so memfoldd copies it into a pool frame to share it) and
//! compressible text it reports cold (so memfoldd compresses it into a store), and an
//! attacker that reads every byte of every descriptor memfoldd hands it. Under
//! `--share-domains vm` the attacker finds neither the secret nor any stored blob; under
//! `user` (both QEMUs are this process, one user) it reads the victim's secret from the
//! pool they share — what a domain means, and the control that the search would find it.

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memfold_core::{EngineConfig, Policy};
use memfold_live::daemon::{DaemonConfig, DomainRule};
use memfold_sys::memfd;
use memfold_wire::{ToAgent, ToDaemon};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGE: usize = 4096;
const PAGES: usize = 64;

fn memfoldd(dir: &Path, domains: DomainRule) -> PathBuf {
    let socket = dir.join("memfoldd.sock");
    let cfg = DaemonConfig {
        socket: socket.clone(),
        engine: EngineConfig {
            policy: Policy::difference_engine(),
            rate: 0,
            min_scan_interval_us: 100_000,
            max_scan_interval_us: 200_000,
            clock_interval_us: Some(200_000),
            ..EngineConfig::default()
        },
        swap_dir: dir.to_path_buf(),
        swap_capacity: 16 << 20,
        domains,
        agent_gid: None,
        never_share: Default::default(),
        claim: memfold_core::ClaimPolicy::Never,
        allowance: 0,
        guest_channels: None,
        tenant_max_bytes: u64::MAX,
    };
    common::start_memfoldd_with(cfg);
    socket
}

/// Every byte of a descriptor.
fn contents(fd: &OwnedFd) -> Vec<u8> {
    let size = memfd::size(fd.as_fd()).unwrap() as usize;
    let mut all = vec![0u8; size];
    memfd::pread_exact(fd.as_fd(), &mut all, 0).unwrap();
    all
}

fn holds_page(fd: &OwnedFd, page: &[u8]) -> bool {
    contents(fd).chunks(PAGE).any(|c| c == page)
}

/// What the attacker finds after the victim's pages were shared and stored: (whether its
/// pool holds the secret, bytes allocated in its store), and the same for the victim.
fn run(domains: DomainRule) -> ((bool, u64), (bool, u64)) {
    let dir = tempfile::tempdir().unwrap();
    let socket = memfoldd(dir.path(), domains);
    let mut rng = SmallRng::seed_from_u64(7);
    let mut secret = vec![0u8; PAGE];
    rng.fill(&mut secret[..]);
    // The victim: the secret twice, text, random.
    let mut ram = vec![0u8; PAGES * PAGE];
    for (g, page) in ram.chunks_mut(PAGE).enumerate() {
        match g % 4 {
            0 if g < 8 => page.copy_from_slice(&secret),
            1 | 2 => {
                for (i, b) in page.iter_mut().enumerate() {
                    *b = b"victim's text, cold and compressible "[i % 37];
                }
                page[0] = g as u8;
            }
            _ => rng.fill(page),
        }
    }
    let (victim, victim_fds, _victim_ram) = common::attach_fake_qemu(&socket, "victim", &ram);
    // The attacker: random pages of its own.
    let mut mine = vec![0u8; PAGES * PAGE];
    rng.fill(&mut mine[..]);
    let (_attacker, attacker_fds, _attacker_ram) =
        common::attach_fake_qemu(&socket, "attacker", &mine);

    // The victim reports every clock slice idle, so its text goes cold and is compressed;
    // it answers nothing else (shares stay requested: their frames are written already).
    victim.set_recv_timeout(Duration::from_millis(50)).unwrap();
    let t = Instant::now();
    loop {
        while let Ok(Some((m, _))) = victim.recv::<ToAgent>() {
            if let ToAgent::ClockScan {
                batch,
                first,
                count,
                ..
            } = m
            {
                let words = (count as usize).div_ceil(64);
                let bits = ToDaemon::ClockBits {
                    batch,
                    first,
                    count,
                    referenced: vec![0; words],
                    modified: vec![0; words],
                };
                victim.send(&bits, &[]).unwrap();
            }
        }
        let v = (
            holds_page(&victim_fds[0], &secret),
            memfd::allocated_bytes(victim_fds[1].as_fd()),
        );
        if v.0 && v.1 > 0 {
            let a = (
                holds_page(&attacker_fds[0], &secret),
                memfd::allocated_bytes(attacker_fds[1].as_fd()),
            );
            return (a, v);
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the victim's secret was never shared ({}) or its text never stored ({} bytes)",
            v.0,
            v.1
        );
    }
}

#[test]
fn a_qemu_cannot_read_pages_only_another_domain_holds() {
    let (attacker, victim) = run(DomainRule::Vm);
    assert!(victim.0, "the victim's pool holds its shared secret");
    assert!(victim.1 > 0, "the victim's store holds its compressed text");
    assert!(
        !attacker.0,
        "the attacker read the victim's secret from the pool it was handed"
    );
    assert_eq!(
        attacker.1, 0,
        "the attacker's store holds another guest's blobs"
    );
}

#[test]
fn guests_of_one_domain_share_a_pool_but_never_a_store() {
    // The control: the same search finds the secret when both are one user's guests.
    let (attacker, _) = run(DomainRule::User);
    assert!(attacker.0, "one domain's guests hold one pool");
    assert_eq!(attacker.1, 0, "each guest has a store of its own");
}
