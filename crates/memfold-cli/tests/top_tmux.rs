//! `memfold top` in a real terminal: the memfoldd binary on a temporary socket, three
//! guests served by the real agent in this process (guest RAM is a memfd mapped here, as
//! QEMU's memory-backend-memfd makes it), and `memfold top` in a detached tmux session of
//! 160×40. The screen (tmux capture-pane) must show the header and every guest; `q` must
//! end it with status 0 and the terminal put back (the main screen, canonical mode).
//! tmux comes from scripts/setup.sh.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memfold_agent::{AgentConfig, FailMode};
use memfold_sys::memfd;

const PAGE: usize = 4096;

/// Kills memfoldd and the tmux server when the test ends, however it ends.
struct Cleanup {
    memfoldd: Child,
    tmux: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = self.memfoldd.kill();
        let _ = self.memfoldd.wait();
        let _ = Command::new("tmux")
            .args(["-L", &self.tmux, "kill-server"])
            .stderr(Stdio::null())
            .status();
    }
}

/// Guest RAM of `pages` pages: a memfd mapped shared, never unmapped (the agent serves it
/// until the process exits), every 3rd page a copy of one page (shared), the rest zeros
/// and a count. Returns the descriptor, which the test keeps open.
fn guest_ram(name: &str, pages: usize) -> OwnedFd {
    let fd = memfd::create(name).unwrap();
    memfd::set_len(fd.as_fd(), (pages * PAGE) as u64).unwrap();
    // SAFETY: a new shared mapping of a memfd this test owns, at an address the kernel
    // picks; it is never unmapped, and only this function writes it before the agent
    // starts.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    for g in 0..pages {
        let fill: u8 = if g % 3 == 0 { 0x5a } else { 0 };
        let page = [fill; PAGE];
        // SAFETY: page g lies inside the mapping made above.
        unsafe {
            std::ptr::copy_nonoverlapping(page.as_ptr(), (ptr as *mut u8).add(g * PAGE), PAGE);
            if g % 3 == 1 {
                *(ptr as *mut u8).add(g * PAGE) = g as u8 | 1;
            }
        }
    }
    fd
}

fn tmux(server: &str, args: &[&str]) -> String {
    let o = Command::new("tmux")
        .args(["-L", server])
        .args(args)
        .output()
        .expect("tmux runs (scripts/setup.sh installs it)");
    assert!(
        o.status.success(),
        "tmux {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Captures the pane until `done` holds; panics with the last screen after `limit`.
fn screen_until(server: &str, limit: Duration, what: &str, done: impl Fn(&str) -> bool) -> String {
    let t = Instant::now();
    loop {
        let s = tmux(server, &["capture-pane", "-p", "-t", "top"]);
        if done(&s) {
            return s;
        }
        assert!(
            t.elapsed() < limit,
            "{what}: not seen in {limit:?}; the screen:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_for_guests(socket: &Path, names: &[&str]) {
    let t = Instant::now();
    loop {
        if let Ok(s) = memfold_live::query_stats(socket) {
            if names.iter().all(|n| s.vms.iter().any(|v| &v.name == n)) {
                return;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the agents did not attach"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn top_in_tmux_shows_every_guest_and_q_restores_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("memfoldd.sock");
    let memfoldd = Command::new(env!("CARGO_BIN_EXE_memfoldd"))
        .arg("--socket")
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = format!("memfold-top-test-{}", std::process::id());
    let _cleanup = Cleanup {
        memfoldd,
        tmux: server.clone(),
    };
    let t = Instant::now();
    while memfold_live::query_stats(&socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memfoldd did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Three guests; the agent finds each one's RAM by its size.
    let names = ["top-web-1", "top-db-2", "top-py-3"];
    let mut rams = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let pages = 900 + 10 * i;
        rams.push(guest_ram(name, pages));
        let cfg = AgentConfig {
            socket: socket.clone(),
            name: name.to_string(),
            ram_bytes: (pages * PAGE) as u64,
            vma_budget: None,
            // In this test process: pausing would stop the test run for good.
            on_failure: FailMode::Abort,
            clock_rbits: memfold_agent::ClockRBits::Userfault,
        };
        std::thread::spawn(move || memfold_agent::run(cfg));
    }
    wait_for_guests(&socket, &names);

    // The pane runs top, then says how it ended and whether the tty is canonical again.
    let cmd = format!(
        "{} top --socket {} --interval 0.5; echo TOP-EXITED $?; stty -a | tr ' ;' '\\n\\n' | grep -x -- '-\\?icanon'; sleep 60",
        env!("CARGO_BIN_EXE_memfold"),
        socket.display()
    );
    tmux(
        &server,
        &[
            "new-session",
            "-d",
            "-x",
            "160",
            "-y",
            "40",
            "-s",
            "top",
            &cmd,
        ],
    );
    let s = screen_until(&server, Duration::from_secs(20), "every guest", |s| {
        s.contains("memfold top") && names.iter().all(|n| s.contains(n)) && s.contains("total")
    });
    for col in [
        "VM", "HOST MiB", "SHARED", "PATCHED", "COW/s", "FAULTS/s", "STATE",
    ] {
        assert!(s.contains(col), "no column {col}:\n{s}");
    }
    assert!(s.contains("3 guests"), "{s}");
    // Full screen: the alternate screen is on while top runs.
    assert_eq!(
        tmux(&server, &["display", "-p", "-t", "top", "#{alternate_on}"]).trim(),
        "1"
    );
    // Rates appear once a second sample is in.
    screen_until(&server, Duration::from_secs(10), "rates", |s| {
        s.contains("rates over the last")
    });
    println!("{s}");

    tmux(&server, &["send-keys", "-t", "top", "q"]);
    let after = screen_until(&server, Duration::from_secs(10), "top's exit", |s| {
        s.contains("TOP-EXITED")
    });
    assert!(after.contains("TOP-EXITED 0"), "{after}");
    // The terminal is back: main screen, canonical mode, top's frame gone.
    let after = screen_until(&server, Duration::from_secs(5), "stty", |s| {
        s.lines().any(|l| l.trim().ends_with("icanon"))
    });
    assert!(
        after.lines().any(|l| l.trim() == "icanon"),
        "still raw mode (-icanon) after top:\n{after}"
    );
    assert_eq!(
        tmux(&server, &["display", "-p", "-t", "top", "#{alternate_on}"]).trim(),
        "0"
    );
    assert!(!after.contains("HOST MiB"), "top's frame is left:\n{after}");
    drop(rams);
}
