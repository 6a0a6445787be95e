//! A stored page written outside QEMU's mapping, found as the agent re-attaches: before
//! it attaches to a new memfoldd the agent writes every stashed page back into guest
//! RAM's memfd (`unstash_all`). A page whose hole was filled since (a `pwrite`, a second
//! mapping: a vhost-user backend) is no page the guest wrote, and writing the stored page
//! over it would silently undo that write; the agent fails closed on it, as a fault on
//! the page does (`fail_closed.rs`). It wrote the stored page back and re-attached.
//!
//! The test re-runs this binary as a child that plays QEMU (as `fail_closed.rs` does):
//! guest RAM a shared `memory-backend-memfd` mapping, the agent run in it with
//! `FailMode::Pause`, and a fake memfoldd that stashes page [`STASHED`], `pwrite`s
//! [`BYPASS`] into the memfd at it, then closes its connection and waits for the next.
//! The parent expects the child stopped, its log naming the page, and the memfd holding
//! the written bytes.

mod common;

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{accept_hello, next, region, welcome, write};
use memfold_agent::{AgentConfig, ClockRBits, FailMode};
use memfold_codecs::{page_checksum, Page, PAGE_SIZE};
use memfold_sys::memfd;
use memfold_wire::{BatchId, Blob, BlobHome, Gfn, Listener, StashPage, ToAgent, ToDaemon};

/// Set in the child: its work folder.
const ROLE: &str = "MEMFOLD_UNSTASH_BYPASS_DIR";
const PAGES: usize = 16;
/// The page the fake memfoldd stashes.
const STASHED: usize = 5;
/// What the bypass writer writes at [`BYPASS_AT`] of page [`STASHED`] once it is stashed.
const BYPASS: [u8; 16] = [0xab; 16];
const BYPASS_AT: usize = 64;
const TEST: &str = "a_stored_page_written_outside_qemus_mapping_fails_closed_at_the_re_attach";

/// Page `g` as the guest writes it: never zero, no two alike.
fn pattern(g: usize) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|i| (g * 131 + i * 7 + 1) as u8)
        .collect()
}

/// The child: QEMU, its guest and a fake memfoldd; stopped by the agent (or killed).
fn child(dir: &Path) -> ! {
    let (fd, ptr) = region(PAGES);
    for g in 0..PAGES {
        write(ptr, g, &pattern(g));
    }
    let socket = dir.join("memfoldd.sock");
    let listener = Listener::bind(&socket).unwrap();
    let cfg = AgentConfig {
        socket,
        name: "g".into(),
        ram_bytes: 0,
        vma_budget: None,
        on_failure: FailMode::Pause,
        clock_rbits: ClockRBits::Userfault,
    };
    std::thread::spawn(move || memfold_agent::run(cfg));
    let c = accept_hello(&listener);
    let pool = memfd::create("fake-pool").unwrap();
    let store = memfd::create("fake-store").unwrap();
    let page: Page = pattern(STASHED).try_into().unwrap();
    memfd::pwrite_all(store.as_fd(), &page, 0).unwrap();
    welcome(&c, &pool, &store);
    let stash = StashPage {
        gfn: Gfn(STASHED as u32),
        blob: Blob::Raw,
        home: BlobHome::Store,
        offset: 0,
        len: PAGE_SIZE as u32,
        moving: false,
        checksum: page_checksum(&page),
    };
    let batch = BatchId(1);
    c.send(
        &ToAgent::Stash {
            batch,
            pages: vec![stash],
        },
        &[],
    )
    .unwrap();
    let stashed = next(&c, |m| match m {
        ToDaemon::StashDone { stashed, .. } => Some(stashed.clone()),
        _ => None,
    });
    assert_eq!(stashed, [Gfn(STASHED as u32)], "the agent stashed the page");
    // Not through QEMU's mapping: the hole fills, no fault is raised.
    let at = (STASHED * PAGE_SIZE + BYPASS_AT) as u64;
    memfd::pwrite_all(fd.as_fd(), &BYPASS, at).unwrap();
    eprintln!("child: wrote page {STASHED} through the memfd");
    // memfoldd gone: the agent's next attach writes its stashed pages back first.
    drop(c);
    let _c = accept_hello(&listener);
    eprintln!("child: the agent re-attached");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The child process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether process `pid` and every thread of it is stopped (`T`).
fn stopped(pid: u32) -> bool {
    let state = |stat: String| stat.rsplit_once(") ").and_then(|s| s.1.chars().next());
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let states: Vec<_> = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .map(state)
        .collect();
    !states.is_empty() && states.iter().all(|&s| s == Some('T'))
}

#[test]
fn a_stored_page_written_outside_qemus_mapping_fails_closed_at_the_re_attach() {
    if let Some(dir) = std::env::var_os(ROLE) {
        child(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("child.log");
    let out = File::create(&log_path).unwrap();
    let mut q = Killed(
        Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, dir.path())
            .env_remove("MEMFOLD_SOCKET")
            .env_remove("MEMFOLD_FAIL")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap(),
    );
    let pid = q.0.id();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    // Guest RAM's memfd, through the child's descriptors.
    let ram = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .find(|e| {
                let l = std::fs::read_link(e.path()).unwrap_or_default();
                l.to_string_lossy()
                    .starts_with("/memfd:memory-backend-memfd")
            })
            .map(|e| File::open(e.path()).unwrap())
            .expect("guest RAM's memfd among the child's descriptors")
    };
    let stashed_page = || {
        let mut p = vec![0u8; PAGE_SIZE];
        ram()
            .read_exact_at(&mut p, (STASHED * PAGE_SIZE) as u64)
            .unwrap();
        p
    };
    let t = Instant::now();
    while !stopped(pid) {
        if log().contains("child: the agent re-attached") {
            let lost = stashed_page()[BYPASS_AT..BYPASS_AT + 16] != BYPASS;
            panic!(
                "re-attached over a stored page written outside QEMU's mapping (the write lost: {lost}); the child's log:\n{}",
                log()
            );
        }
        assert!(q.0.try_wait().unwrap().is_none(), "exited:\n{}", log());
        assert!(
            // As fail_closed's: a loaded CI host starts and re-attaches the child slowly.
            t.elapsed() < Duration::from_secs(120),
            "not stopped:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = log();
    let line = log
        .lines()
        .find(|l| l.starts_with("memfold-agent: failing closed"))
        .unwrap_or_else(|| panic!("no fail-closed line:\n{log}"));
    for must in [
        "restoring stashed pages before a re-attach",
        &format!("gfn {STASHED} is stored by memfold, but guest RAM's memfd was written"),
        "VM PAUSED",
    ] {
        assert!(
            line.contains(must),
            "the fail-closed line lacks {must:?}: {line}"
        );
    }
    assert!(!log.contains("re-attached"), "{log}");
    // The write stands (the hole's zeros around it), and every other page is the guest's.
    let mut want = vec![0u8; PAGE_SIZE];
    want[BYPASS_AT..BYPASS_AT + 16].copy_from_slice(&BYPASS);
    assert!(stashed_page() == want, "page {STASHED} in the memfd");
    let mut p = vec![0u8; PAGE_SIZE];
    for g in (0..PAGES).filter(|&g| g != STASHED) {
        ram().read_exact_at(&mut p, (g * PAGE_SIZE) as u64).unwrap();
        assert!(p == pattern(g), "page {g} in the memfd");
    }
}
