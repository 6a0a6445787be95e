//! The QMP client's tests (split from qmp.rs), against monitors served by this process.

use super::*;
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

/// Writes `reply` (a JSON object) to `s` as the answer to `command`: its `id` echoed.
fn answer(s: &mut UnixStream, command: &Value, mut reply: Value) -> std::io::Result<()> {
    reply["id"] = command["id"].clone();
    writeln!(s, "{reply}")
}

/// Reads one command from `r`.
fn command(r: &mut impl BufRead) -> Value {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

/// A monitor served by this process that greets, answers `qmp_capabilities`, then
/// plays `script` to the next command (given it, and a reader of what follows).
fn fake_monitor(
    dir: &Path,
    script: impl FnOnce(&mut UnixStream, Value, &mut BufReader<UnixStream>) + Send + 'static,
) -> std::path::PathBuf {
    let path = dir.join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        writeln!(s, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
        let caps = command(&mut r);
        answer(&mut s, &caps, json!({ "return": {} })).unwrap();
        let c = command(&mut r);
        script(&mut s, c, &mut r);
    });
    path
}

#[test]
fn a_monitor_served_by_another_process_than_the_guests_qemu_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |_, _, _| {});
    let me = std::process::id();
    let e = Qmp::connect_served_by(&path, me + 1, Duration::from_secs(2))
        .err()
        .unwrap();
    assert!(
        matches!(e, QmpError::WrongServer { expected, found: Some(f), .. } if expected == me + 1 && f == me),
        "{e}"
    );
}

#[test]
fn the_balloon_is_read_and_set_through_the_guests_own_monitor() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |s, c, _| {
        writeln!(
            s,
            r#"{{"event": "BALLOON_CHANGE", "data": {{"actual": 1}}}}"#
        )
        .unwrap();
        answer(s, &c, json!({ "return": { "actual": 268435456 } })).unwrap();
    });
    let mut q = Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
    assert_eq!(q.balloon_actual().unwrap(), 256 << 20);
}

#[test]
fn a_monitor_that_floods_gets_an_error_not_a_reader_that_holds_it_all() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |s, _, _| {
        let big = vec![b'x'; (MAX_MESSAGE + 10) as usize];
        let _ = s.write_all(&big);
    });
    let mut q = Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
    let e = q.balloon_actual().unwrap_err();
    assert!(e.to_string().contains("more than"), "{e}");
}

#[test]
fn a_monitor_that_sends_only_events_gets_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |s, _, _| {
        for _ in 0..=MAX_EVENTS_PER_COMMAND + 1 {
            if writeln!(s, r#"{{"event": "X"}}"#).is_err() {
                return;
            }
        }
    });
    let mut q = Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
    let e = q.balloon(1 << 30).unwrap_err();
    assert!(e.to_string().contains("events and no answer"), "{e}");
}

/// Runs `f` on a thread of its own; its result, or `None` if it has not ended within
/// `within` (a test whose subject hangs fails instead of hanging).
fn ends_within<T: Send + 'static>(
    within: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(within).ok()
}

/// A QEMU (a guest escaped into it) that sends its greeting a byte a second: the
/// connection fails once its 2 s are up, not when the greeting ends. Seen failing without
/// the mend: a read timeout restarts at every byte, and the connect was still waiting 4 s
/// on (for good, were the greeting endless).
#[test]
fn a_greeting_trickled_a_byte_a_second_fails_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let greeting = r#"{"QMP": {"version": {}, "capabilities": []}}"#.repeat(10);
        for b in greeting.bytes() {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let t0 = Instant::now();
    let got = ends_within(Duration::from_secs(4), move || {
        Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).err()
    });
    let e = got
        .expect("connect still waiting 4 s on")
        .expect("an error");
    assert!(matches!(e, QmpError::TimedOut { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

/// A session whose stop flag is set while its QEMU trickles gives up within a second.
#[test]
fn a_session_told_to_stop_stops_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        while s.write_all(b"{").is_ok() {
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Some(Arc::clone(&stop));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r =
            Qmp::connect_served_by_unless(&path, std::process::id(), Duration::from_secs(60), flag);
        let _ = tx.send(r.err());
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let e = rx
        .recv_timeout(Duration::from_secs(1))
        .expect("still waiting")
        .expect("an error");
    assert!(matches!(e, QmpError::Stopped { .. }), "{e}");
}

/// A QEMU answers `query-balloon` after the 300 ms the command had: the next command
/// never takes that late answer for its own. Seen failing without the mend: the second
/// `query-balloon` returned the first's answer (1 byte), answers being matched by place.
#[test]
fn a_late_answer_is_never_taken_for_the_next_commands() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |s, c, r| {
        std::thread::sleep(Duration::from_millis(600));
        let _ = answer(s, &c, json!({ "return": { "actual": 1 } }));
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) > 0 {
            let c2: Value = serde_json::from_str(&line).unwrap();
            let _ = answer(s, &c2, json!({ "return": { "actual": 2 } }));
        }
        std::thread::sleep(Duration::from_secs(1));
    });
    let limit = Duration::from_millis(300);
    let mut q = Qmp::connect_served_by(&path, std::process::id(), limit).unwrap();
    let e = q.balloon_actual().unwrap_err();
    assert!(matches!(e, QmpError::TimedOut { .. }), "{e}");
    assert!(q.unusable().is_some());
    // The late answer is in by now.
    std::thread::sleep(Duration::from_millis(600));
    let second = q.balloon_actual();
    assert!(
        !matches!(second, Ok(1)),
        "the first command's answer: {second:?}"
    );
    assert!(
        matches!(second, Err(QmpError::Unusable { .. })),
        "{second:?}"
    );
}

/// An answer with another command's id is refused, and the session with it.
#[test]
fn an_answer_of_another_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |s, c, _| {
        let other = json!({ "id": c["id"].as_u64().unwrap() + 7 });
        let _ = answer(s, &other, json!({ "return": { "actual": 1 } }));
        std::thread::sleep(Duration::from_secs(1));
    });
    let mut q = Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
    let e = q.balloon_actual().unwrap_err();
    assert!(e.to_string().contains("another id"), "{e}");
    assert!(q.unusable().is_some());
}

/// A QEMU's refusal leaves the session usable: its answer came, in step.
#[test]
fn a_refused_command_leaves_the_session_usable() {
    let dir = tempfile::tempdir().unwrap();
    let path = fake_monitor(dir.path(), |s, c, r| {
        let e = json!({ "error": { "class": "DeviceNotActive", "desc": "no balloon" } });
        answer(s, &c, e).unwrap();
        let c2 = command(r);
        answer(s, &c2, json!({ "return": { "actual": 2 } })).unwrap();
    });
    let mut q = Qmp::connect_served_by(&path, std::process::id(), Duration::from_secs(2)).unwrap();
    assert!(matches!(q.balloon(1), Err(QmpError::Command { .. })));
    assert!(q.unusable().is_none());
    assert_eq!(q.balloon_actual().unwrap(), 2);
}

/// `connect_within` bounds the whole connection: a monitor that never greets costs its
/// caller (a stop) the limit, not 120 s.
#[test]
fn connect_within_bounds_a_silent_monitor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let (_s, _) = l.accept().unwrap();
        std::thread::sleep(Duration::from_secs(10));
    });
    let t0 = Instant::now();
    let got = ends_within(Duration::from_secs(3), move || {
        Qmp::connect_within(&path, Duration::from_millis(500)).err()
    });
    let e = got.expect("still waiting 3 s on").expect("an error");
    assert!(matches!(e, QmpError::TimedOut { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // Nothing listening: refused once the limit has passed.
    let gone = dir.path().join("none.sock");
    let t0 = Instant::now();
    let e = Qmp::connect_within(&gone, Duration::from_millis(200))
        .err()
        .unwrap();
    assert!(matches!(e, QmpError::Connect { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(1));
}

/// A message quoted in an error is cut short and its control characters escaped.
#[test]
fn quoted_messages_are_short_and_escaped() {
    let q = quoted(&format!("a\nb{}", "x".repeat(5000)));
    assert!(!q.contains('\n') && q.len() < QUOTED_CHARS + 10, "{q}");
    assert_eq!(quoted("ok"), "\"ok\"");
}
