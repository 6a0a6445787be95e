//! The `memfold-blk` binary keeps no descriptor per vhost-user connection: a peer that
//! connects and closes in a loop does not run it out of descriptors. Before, each
//! connection's daemon left its exit event's descriptor open (vhost-user-backend 0.24
//! registers it by `into_raw_fd` and never closes it): one more a connection. And every
//! descriptor it holds is close-on-exec.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Connections made and closed between the two counts.
const CONNECTIONS: usize = 64;
/// Descriptors the count may differ by (none is expected: the state counted is the same).
const MARGIN: usize = 3;

/// Kills the child when the test ends, passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Connects to `sock` as soon as the device listens there again (it makes a new listener
/// after each connection ends); `log` is its stderr, for a failure's message.
fn connect(sock: &Path, log: &Path) -> UnixStream {
    let t = Instant::now();
    loop {
        match UnixStream::connect(sock) {
            Ok(s) => return s,
            Err(e) => assert!(
                t.elapsed() < Duration::from_secs(10),
                "no listener on {} after 10 s ({e}): {}",
                sock.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            ),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Connections the device has seen end, by its log.
fn ended(log: &Path) -> usize {
    let err = std::fs::read_to_string(log).unwrap_or_default();
    err.matches("QEMU disconnected").count() + err.matches("connection ended").count()
}

/// Connects and closes at once, then waits for the device to have served the connection
/// to its end (a connection the kernel queued is not yet one the device took up).
fn connect_and_close(sock: &Path, log: &Path) {
    let n = ended(log);
    drop(connect(sock, log));
    wait_ended(n + 1, log);
}

/// Waits until the device's log says `n` connections ended.
fn wait_ended(n: usize, log: &Path) {
    let t = Instant::now();
    while ended(log) < n {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "connection {n} not ended after 10 s: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The descriptors `pid` holds: (number, whether close-on-exec).
fn fds(pid: u32) -> Vec<(u32, bool)> {
    let mut v: Vec<(u32, bool)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter_map(|fd: u32| {
            // Gone between the listing and this read: a descriptor being closed.
            let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
            let flags = u32::from_str_radix(flags.trim(), 8).ok()?;
            Some((fd, flags & libc::O_CLOEXEC as u32 != 0))
        })
        .collect();
    v.sort();
    v
}

/// Connects, lets the device take the connection up (accepted, its daemon's worker
/// thread started: more descriptors than while it listened, and the count unchanged over
/// three reads 100 ms apart, 10 s at most, so a loaded host's slow start is not counted
/// half-done), and counts its descriptors, the connection still open.
fn count_connected(pid: u32, sock: &Path, log: &Path) -> Vec<(u32, bool)> {
    let n = ended(log);
    let listening = fds(pid).len();
    let conn = connect(sock, log);
    let t = Instant::now();
    let mut held = fds(pid);
    let mut same = 0;
    while (same < 3 || held.len() <= listening) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
        let now = fds(pid);
        same = if now.len() == held.len() { same + 1 } else { 0 };
        held = now;
    }
    drop(conn);
    wait_ended(n + 1, log);
    held
}

#[test]
fn connections_made_and_closed_in_a_loop_leave_no_descriptor_behind() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let base = d.path().join("base.img");
    std::fs::write(&base, vec![7u8; 1 << 20]).unwrap();
    let (sock, log) = (d.path().join("blk.sock"), d.path().join("blk.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_memfold-blk"))
        .arg("--socket")
        .arg(&sock)
        .arg("--base")
        .arg(&base)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let child = Killed(child);
    let pid = child.0.id();
    // The first connection warms up what the process makes once (threads, tracing).
    drop(count_connected(pid, &sock, &log));
    let before = count_connected(pid, &sock, &log);
    for _ in 0..CONNECTIONS {
        connect_and_close(&sock, &log);
    }
    let after = count_connected(pid, &sock, &log);
    assert!(
        after.len() <= before.len() + MARGIN,
        "{} descriptors open after {CONNECTIONS} more connections, {} before: \
         {after:?} against {before:?}",
        after.len(),
        before.len()
    );
    // Those it inherited from this process (the test harness's) aside.
    let ours = fds(std::process::id());
    let open_at_exec: Vec<u32> = after
        .iter()
        .filter(|&&(fd, cloexec)| fd > 2 && !cloexec && !ours.contains(&(fd, false)))
        .map(|x| x.0)
        .collect();
    assert!(
        open_at_exec.is_empty(),
        "descriptors without close-on-exec: {open_at_exec:?} of {after:?}"
    );
}
