//! Failing closed (issue 14): when the agent cannot serve a fault, QEMU is paused with
//! guest RAM intact (`MEMFOLD_FAIL=pause`, the default), or aborted (`abort`).
//!
//! Each test re-runs this test binary as a child that plays QEMU: the agent starts in it
//! from the environment (the library's constructor, as `LD_PRELOAD` starts it in QEMU),
//! guest RAM is a shared memfd mapping (as `memory-backend-memfd` makes it) filled with
//! a known pattern, and a thread plays memfoldd, speaking the wire. Then the child makes
//! the agent fail:
//!
//! - a corrupt blob: the fake memfoldd stashes a page, then flips a byte of its blob in
//!   the store; the guest reads the page, the decoded page fails its checksum;
//! - a panic on the agent thread: the child's logger (QEMU's process, the agent's
//!   subscriber) panics on the agent's warning that it refused a stash;
//! - the agent's loop ending with an error: the child lowers its RLIMIT_NOFILE to 0, so
//!   the agent's next `poll` fails (`EINVAL`);
//! - a stored page written outside QEMU's mapping: the fake memfoldd stashes a page, then
//!   `pwrite`s a few bytes into guest RAM's memfd at it (as a vhost-user backend could),
//!   filling its hole; the guest reads the page, a minor fault on a page the agent holds
//!   as stored (before the fix: a wake, forever);
//! - `EIO` from the swap file, for good: the fake memfoldd hands the agent
//!   `/proc/self/mem` as its swap file, swaps page [`STASHED`] out to an anonymous page of
//!   its own (the agent reads it back and checks it before it punches the page), then
//!   maps a page past the end of an empty memfd there: every read of the blob is `EIO`
//!   from then on, as from a failed disk. The guest reads the page; the agent retries the fault for
//!   `FAULT_GIVE_UP` (30 s), then fails closed;
//! - the host out of memory for the page the agent installs (`ENOMEM` from `UFFDIO_COPY`):
//!   the fake memfoldd stashes page [`STASHED`]; the child then joins a memory cgroup
//!   (v1) of the parent's with its OOM killer off, and fills it with a memfd ballast
//!   (`fallocate`, which fails cleanly at the limit). The guest reads the page; every
//!   `UFFDIO_COPY` fails with `ENOMEM`, the agent retries for 30 s, then fails closed.
//!
//! The test process watches the child: stopped (`/proc/PID/stat` state `T`, every
//! thread), its userfaultfd still open, every page it wrote still reading the same
//! through `/proc/PID/mem`, one log line that says what failed and how to inspect or end
//! it; or, with `MEMFOLD_FAIL=abort`, dead by `SIGABRT`. Children are killed when a test
//! ends, however it ends.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use memfold_codecs::PAGE_SIZE;
use memfold_sys::memfd;
use memfold_wire::Gfn;
use rustix::process::{Pid, Signal};

/// Set in a child: what to make fail.
const ROLE: &str = "MEMFOLD_FAIL_CLOSED_ROLE";
/// Set in a child: its work folder (the fake memfoldd's socket).
const DIR: &str = "MEMFOLD_FAIL_CLOSED_DIR";
/// Guest RAM, pages.
const PAGES: usize = 64;
/// The page the fake memfoldd stashes.
const STASHED: usize = 7;
/// The memfd's name: the parent finds guest RAM in the child's maps by it.
const RAM_NAME: &str = "fail-closed-guest-ram";
/// What the bypass writer writes into guest RAM's memfd at [`BYPASS_AT`] of page
/// [`STASHED`] once it is stashed.
const BYPASS: [u8; 16] = [0xab; 16];
/// Where in the page.
const BYPASS_AT: usize = 64;
/// Longest wait for the child to stop, exit or log a line: only ever a wait for
/// something that should happen, so generous (a loaded CI host starts the child, its
/// agent and fake memfoldd slowly); a failure is seen as soon as the child exits.
const WAIT: Duration = Duration::from_secs(120);

/// Byte `i` of page `g` as the guest writes it: no page is zero or equal to another.
fn pattern(g: usize, i: usize) -> u8 {
    (g * 131 + i * 7 + 1) as u8 ^ (i >> 8) as u8
}

// ---- the child: QEMU, its guest and a fake memfoldd ----

/// What the child makes fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// A stashed page's blob changed in the store, then read by the guest.
    CorruptBlob,
    /// A stashed page's blob changed in the store, then memfoldd's connection lost: the
    /// agent finds it as it brings its stashed pages home to re-attach; the guest never
    /// reads the page.
    CorruptBlobReattach,
    /// A panic on the agent thread.
    Panic,
    /// The agent's loop ends with an error.
    LoopError,
    /// A stashed page's hole in guest RAM's memfd filled by a `pwrite`, then read by the
    /// guest.
    BypassWrite,
    /// A swapped page whose blob reads as `EIO` for good, then read by the guest.
    SwapEio,
    /// A stashed page read by the guest with no memory left to install it in.
    CopyEnomem,
}

impl Failure {
    fn name(self) -> &'static str {
        match self {
            Failure::CorruptBlob => "corrupt-blob",
            Failure::CorruptBlobReattach => "corrupt-blob-reattach",
            Failure::Panic => "panic",
            Failure::LoopError => "loop-error",
            Failure::BypassWrite => "bypass-write",
            Failure::SwapEio => "swap-eio",
            Failure::CopyEnomem => "copy-enomem",
        }
    }

    /// Byte `i` of page [`STASHED`] in guest RAM's memfd once the child failed: a hole,
    /// with what the bypass writer wrote.
    fn stashed_memfd_byte(self, i: usize) -> u8 {
        let written = self == Failure::BypassWrite && (BYPASS_AT..BYPASS_AT + 16).contains(&i);
        if written {
            BYPASS[i - BYPASS_AT]
        } else {
            0
        }
    }
}

#[path = "fail_closed/child.rs"]
mod child;
use child::{child, child_role, enomem_cgroup, CGROUP};

// ---- the parent: watches the child ----

/// A child playing QEMU; killed when dropped, stopped or not.
struct Qemu {
    child: Child,
    failure: Failure,
    /// The child's stdout and stderr: a memfd whose pages the parent allocated, so that
    /// a child out of memory still logs (writing a file would need page cache it has no
    /// room to charge).
    log: File,
    dir: tempfile::TempDir,
}

/// Bytes of the child's log (allocated up front).
const LOG_BYTES: u64 = 4 << 20;

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Qemu {
    /// Runs test `test` of this binary as a child with role `failure`; `fail`: the
    /// child's `MEMFOLD_FAIL` (`None`: unset).
    fn start(test: &str, failure: Failure, fail: Option<&str>) -> Qemu {
        let dir = tempfile::tempdir().unwrap();
        let log = File::from(memfd::create("child-log").unwrap());
        rustix::fs::fallocate(&log, rustix::fs::FallocateFlags::empty(), 0, LOG_BYTES).unwrap();
        let out = log.try_clone().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(ROLE, failure.name())
            .env(DIR, dir.path())
            .env(CGROUP, enomem_cgroup())
            .env("MEMFOLD_VM_NAME", "fail-closed")
            .env("MEMFOLD_RAM_BYTES", (PAGES * PAGE_SIZE).to_string())
            .env_remove("MEMFOLD_FAIL")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if failure == Failure::Panic {
            // The child starts the agent itself once its logger is in.
            cmd.env_remove("MEMFOLD_SOCKET");
        } else {
            cmd.env("MEMFOLD_SOCKET", dir.path().join("memfoldd.sock"));
        }
        if let Some(f) = fail {
            cmd.env("MEMFOLD_FAIL", f);
        }
        if failure == Failure::CopyEnomem {
            // One heap for every thread (no arena of a thread's own, mapped later), 32 MiB
            // of slack on it and none given back, allocations under 32 MiB from it: the
            // pages the agent may allocate in once the cgroup is full are in the heap the
            // child locks before joining it.
            cmd.env(
                "GLIBC_TUNABLES",
                "glibc.malloc.arena_max=1:glibc.malloc.top_pad=33554432:\
                 glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432",
            );
        }
        Qemu {
            child: cmd.spawn().unwrap(),
            failure,
            log,
            dir,
        }
    }

    /// The child's work folder (and current directory).
    fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the child printed so far.
    fn log(&self) -> String {
        let mut buf = vec![0u8; LOG_BYTES as usize];
        let n = self.log.read_at(&mut buf, 0).unwrap_or(0);
        let end = buf[..n].iter().position(|&b| b == 0).unwrap_or(n);
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }

    /// Where the child's threads wait (each one's name, state and kernel wait channel)
    /// and, for a child in the ENOMEM cgroup, its `memory.oom_control`: a thread that
    /// faults in a new page once the cgroup is full waits there for good (the OOM killer
    /// is off), which shows as `under_oom 1` and `mem_cgroup_oom_synchronize`-like waits.
    fn where_stuck(&self) -> String {
        let mut out = Vec::new();
        for t in self.tasks() {
            let read = |f: &str| std::fs::read_to_string(t.join(f)).unwrap_or_default();
            let state = state_of(&read("stat")).unwrap_or('?');
            out.push(format!(
                "{} {state} {}",
                read("comm").trim(),
                read("wchan").trim()
            ));
        }
        if self.failure == Failure::CopyEnomem {
            let oom = std::fs::read_to_string(enomem_cgroup().join("memory.oom_control"))
                .unwrap_or_default();
            out.push(oom.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        format!("threads: {}", out.join("; "))
    }

    /// The state letter of each of the child's threads (`/proc/PID/task/*/stat`).
    fn thread_states(&self) -> Vec<char> {
        self.tasks()
            .iter()
            .filter_map(|t| std::fs::read_to_string(t.join("stat")).ok())
            .filter_map(|s| state_of(&s))
            .collect()
    }

    /// The child's threads' folders (`/proc/PID/task/*`); none once it is gone.
    fn tasks(&self) -> Vec<PathBuf> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid())) else {
            return Vec::new();
        };
        tasks.flatten().map(|t| t.path()).collect()
    }

    /// Waits until the process and every thread of it is stopped (`T`).
    fn wait_stopped(&mut self, what: &str) {
        self.wait_stopped_within(what, WAIT)
    }

    /// The guest touched page [`STASHED`], whose fault fails with `error` every time: the
    /// agent retries it (logged), not giving up at once, and pauses QEMU after its 30 s
    /// give-up time with every other page intact; the guest never read the page.
    fn given_up_after_retrying(&mut self, error: &str) {
        self.wait_log("child: the guest touches page", 1);
        let t = Instant::now();
        self.wait_log(&format!("{error}; retrying"), 1);
        self.wait_stopped_within(error, Duration::from_secs(60));
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_secs(25),
            "gave up after {waited:?}, before the 30 s retry time; the child's log:\n{}",
            self.log()
        );
        self.check_paused(Some(STASHED), "still fails after 30s");
        assert!(
            !self.log().contains("the guest got past"),
            "the guest read the page:\n{}",
            self.log()
        );
    }

    /// As [`Qemu::wait_stopped`], waiting at most `limit`.
    fn wait_stopped_within(&mut self, what: &str, limit: Duration) {
        let t = Instant::now();
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()));
            let threads = self.thread_states();
            if stat.as_deref().ok().and_then(state_of) == Some('T')
                && !threads.is_empty()
                && threads.iter().all(|&s| s == 'T')
            {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{what}: the child exited ({status}) instead of pausing; its log:\n{}",
                    self.log()
                );
            }
            assert!(
                t.elapsed() < limit,
                "{what}: the child is not stopped after {limit:?} (threads {threads:?}); its log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the child to exit.
    fn wait_exit(&mut self, what: &str) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                t.elapsed() < WAIT,
                "{what}: the child did not exit in {WAIT:?} (state {:?}); its log:\n{}",
                self.thread_states(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the child's log has `n` lines containing `text`.
    /// Fails at once if the child exits first (a wait it failed on inside, say for its
    /// fake memfoldd, shows as its own panic in the log, not as this wait's timeout).
    fn wait_log(&mut self, text: &str, n: usize) {
        let t = Instant::now();
        while self.log().matches(text).count() < n {
            if let Ok(Some(status)) = self.child.try_wait() {
                // It may have written the line just before exiting.
                assert!(
                    self.log().matches(text).count() >= n,
                    "the child exited ({status}) before {n} lines with {text:?}; its log:\n{}",
                    self.log()
                );
                return;
            }
            assert!(
                t.elapsed() < WAIT,
                "no {n} lines with {text:?} in the child's log after {WAIT:?} ({}); its log:\n{}",
                self.where_stuck(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: Signal) {
        let pid = Pid::from_raw(self.pid() as i32).unwrap();
        rustix::process::kill_process(pid, sig).unwrap();
    }

    /// Checks the paused child: its userfaultfd still open (write-protection and missing
    /// pages still in force), each page but `except` reading what the guest wrote through
    /// `/proc/PID/mem` at guest RAM's address and in the memfd, and the one line saying
    /// what failed, how to inspect and how to end it.
    fn check_paused(&self, except: Option<usize>, failed: &str) {
        let pid = self.pid();
        let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|p| p.display().to_string())
            .collect();
        assert!(
            fds.iter().any(|f| f == "anon_inode:[userfaultfd]"),
            "the paused child no longer holds its userfaultfd (write-protection would be gone on SIGCONT): {fds:?}"
        );
        let base = ram_address(pid);
        let mem = File::open(format!("/proc/{pid}/mem")).unwrap();
        let mut page = vec![0u8; PAGE_SIZE];
        for g in (0..PAGES).filter(|&g| Some(g) != except) {
            mem.read_exact_at(&mut page, base + (g * PAGE_SIZE) as u64)
                .unwrap_or_else(|e| panic!("reading page {g} of the paused guest: {e}"));
            let bad = (0..PAGE_SIZE).find(|&i| page[i] != pattern(g, i));
            assert_eq!(
                bad, None,
                "page {g} of the paused guest does not read what it wrote"
            );
        }
        let log = self.log();
        let line = log
            .lines()
            .find(|l| l.starts_with("memfold-agent: failing closed"))
            .unwrap_or_else(|| panic!("no fail-closed line in the child's log:\n{log}"));
        for must in [
            failed,
            "VM PAUSED",
            &format!("pid {pid}"),
            &format!("gcore {pid}"),
            &format!("/proc/{pid}/mem"),
            &format!("kill -9 {pid}"),
        ] {
            assert!(
                line.contains(must),
                "the fail-closed line lacks {must:?}: {line}"
            );
        }
        // The memfd the line names holds the same pages (a stashed one is a hole there,
        // but for what a bypass writer wrote).
        let memfd = line
            .split(&format!("/proc/{pid}/fd/"))
            .nth(1)
            .map(|r| {
                r.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .unwrap_or_else(|| panic!("the fail-closed line names no memfd: {line}"));
        let ram = File::open(format!("/proc/{pid}/fd/{memfd}"))
            .unwrap_or_else(|e| panic!("the memfd the fail-closed line names: {e}: {line}"));
        for g in 0..PAGES {
            ram.read_exact_at(&mut page, (g * PAGE_SIZE) as u64)
                .unwrap_or_else(|e| panic!("page {g} of the memfd the line names: {e}"));
            let want = |i| {
                if Some(g) == except {
                    self.failure.stashed_memfd_byte(i)
                } else {
                    pattern(g, i)
                }
            };
            let bad = (0..PAGE_SIZE).find(|&i| page[i] != want(i));
            assert_eq!(
                bad, None,
                "page {g} of the memfd the fail-closed line names"
            );
        }
    }
}

/// The state letter of a `/proc/PID/stat` line (after the command, which may hold
/// spaces and parentheses).
fn state_of(stat: &str) -> Option<char> {
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Address of guest RAM in process `pid`: its memfd's shared mapping.
fn ram_address(pid: u32) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let line = maps
        .lines()
        .find(|l| l.contains(&format!("/memfd:{RAM_NAME}")))
        .unwrap_or_else(|| panic!("no guest RAM mapping in the child:\n{maps}"));
    u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap()
}

// ---- the tests ----

#[test]
fn a_corrupt_blob_pauses_qemu_by_default_with_its_ram_intact() {
    if let Some(f) = child_role() {
        child(f);
    }
    let mut q = Qemu::start(
        "a_corrupt_blob_pauses_qemu_by_default_with_its_ram_intact",
        Failure::CorruptBlob,
        None,
    );
    q.wait_stopped("a corrupt blob with MEMFOLD_FAIL unset");
    q.check_paused(Some(STASHED), "does not match its checksum");
    assert!(
        !q.log().contains("the guest got past"),
        "the guest went past the corrupt page:\n{}",
        q.log()
    );

    // Stopped for good the first time: nothing continued it yet.
    let continued = |q: &Qemu| {
        let log = q.log();
        let lines = log.lines();
        lines
            .filter(|l| l.starts_with("memfold-agent: ") && l.contains("was continued"))
            .count()
    };
    assert_eq!(
        continued(&q),
        0,
        "stopped only after running on:\n{}",
        q.log()
    );
    // Continued, it stops again at once: the fault is still unserved.
    q.signal(Signal::CONT);
    q.wait_log("was continued", 1);
    q.wait_stopped("after SIGCONT");
    q.check_paused(Some(STASHED), "does not match its checksum");
    assert_eq!(continued(&q), 1, "{}", q.log());

    // The way to a core dump the docs give: SIGABRT waits until SIGCONT.
    q.signal(Signal::ABORT);
    q.wait_stopped("SIGABRT pending");
    q.signal(Signal::CONT);
    let status = q.wait_exit("kill -ABRT then -CONT");
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{status}");
}

#[test]
fn a_corrupt_blob_found_as_the_agent_re_attaches_pauses_qemu() {
    if let Some(f) = child_role() {
        child(f);
    }
    // Before: every attach postponed for good ("restoring stashed pages: ... attach
    // postponed" each second), the guest unmanaged and never paused.
    let mut q = Qemu::start(
        "a_corrupt_blob_found_as_the_agent_re_attaches_pauses_qemu",
        Failure::CorruptBlobReattach,
        None,
    );
    q.wait_stopped("a corrupt blob found at the re-attach");
    q.check_paused(Some(STASHED), "restoring stashed pages before a re-attach");
    q.check_paused(Some(STASHED), "does not match its checksum");
}

#[test]
fn a_corrupt_blob_aborts_qemu_with_memfold_fail_abort() {
    if let Some(f) = child_role() {
        child(f);
    }
    let mut q = Qemu::start(
        "a_corrupt_blob_aborts_qemu_with_memfold_fail_abort",
        Failure::CorruptBlob,
        Some("abort"),
    );
    let status = q.wait_exit("a corrupt blob with MEMFOLD_FAIL=abort");
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "{status}; the child's log:\n{}",
        q.log()
    );
    let log = q.log();
    assert!(
        log.contains("failing closed, aborting QEMU")
            && log.contains("does not match its checksum")
            && !log.contains("the guest got past"),
        "{log}"
    );
    assert!(!q.dir().join("core").exists(), "a core file was left");
}

#[test]
fn a_panic_on_the_agent_thread_pauses_qemu_holding_its_userfaultfd() {
    if let Some(f) = child_role() {
        child(f);
    }
    let mut q = Qemu::start(
        "a_panic_on_the_agent_thread_pauses_qemu_holding_its_userfaultfd",
        Failure::Panic,
        Some("pause"),
    );
    q.wait_stopped("a panic on the agent thread");
    q.check_paused(None, "the agent thread panicked: injected");
}

#[test]
fn the_agent_loop_ending_with_an_error_pauses_qemu() {
    if let Some(f) = child_role() {
        child(f);
    }
    let mut q = Qemu::start(
        "the_agent_loop_ending_with_an_error_pauses_qemu",
        Failure::LoopError,
        None,
    );
    q.wait_stopped("the agent's loop ending with an error");
    q.check_paused(None, "the agent's loop ended: Invalid argument");
}

#[test]
fn a_mistyped_failure_mode_leaves_the_guest_unmanaged() {
    if let Some(f) = child_role() {
        child(f);
    }
    // The agent refuses to guess: no agent, so the fake memfoldd never sees it attach
    // and the child stays up, running (never stopped) and aborts nothing.
    let mut q = Qemu::start(
        "a_mistyped_failure_mode_leaves_the_guest_unmanaged",
        Failure::CorruptBlob,
        Some("abrot"),
    );
    q.wait_log("MEMFOLD_FAIL=\"abrot\": expected pause or abort", 1);
    std::thread::sleep(Duration::from_millis(300));
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", q.pid()))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        !fds.iter().any(|f| f == "anon_inode:[userfaultfd]"),
        "an agent started with a bad MEMFOLD_FAIL"
    );
}

#[test]
fn a_stored_page_written_outside_qemus_mapping_pauses_qemu() {
    if let Some(f) = child_role() {
        child(f);
    }
    let mut q = Qemu::start(
        "a_stored_page_written_outside_qemus_mapping_pauses_qemu",
        Failure::BypassWrite,
        Some("pause"),
    );
    q.wait_stopped("a stored page written through guest RAM's memfd");
    // Neither version reaches the guest: not the stored page (the write lost), not the
    // memfd's (zeros the guest never wrote).
    q.check_paused(
        Some(STASHED),
        &format!("gfn {STASHED} is stored by memfold, but guest RAM's memfd was written at that page outside QEMU's mapping"),
    );
    assert!(
        !q.log().contains("the guest got past"),
        "the guest read the page:\n{}",
        q.log()
    );
}

#[test]
fn a_swap_file_failing_with_eio_for_good_pauses_qemu_after_the_give_up_time() {
    if let Some(f) = child_role() {
        child(f);
    }
    let mut q = Qemu::start(
        "a_swap_file_failing_with_eio_for_good_pauses_qemu_after_the_give_up_time",
        Failure::SwapEio,
        None,
    );
    q.given_up_after_retrying("Input/output error (os error 5)");
}

#[test]
fn no_memory_for_a_stored_page_pauses_qemu_after_the_give_up_time() {
    if let Some(f) = child_role() {
        child(f);
    }
    let root = Path::new("/sys/fs/cgroup/memory");
    if !root.join("memory.oom_control").exists() {
        memfold_sys::testing::skipped(
            "no_memory_for_a_stored_page_pauses_qemu_after_the_give_up_time",
            "no cgroup v1 memory controller here",
        );
        return;
    }
    // The child's own: its new pages are charged here, against 16 MiB, with no OOM
    // killer (allocations outside page faults fail instead).
    let group = memfold_sys::reclaim::MemCgroup::create(&format!(
        "memfold-fail-closed-{}",
        std::process::id()
    ))
    .unwrap();
    let dir = group.procs_file().parent().unwrap().to_path_buf();
    assert!(group.set_limit(16 << 20).unwrap());
    std::fs::write(dir.join("memory.oom_control"), "1").unwrap();
    assert_eq!(dir, enomem_cgroup());
    let mut q = Qemu::start(
        "no_memory_for_a_stored_page_pauses_qemu_after_the_give_up_time",
        Failure::CopyEnomem,
        None,
    );
    q.given_up_after_retrying("Cannot allocate memory (os error 12)");
    // The child goes first (the group cannot go with a process in it).
    drop(q);
}
