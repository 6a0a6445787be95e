//! memfoldd as a service (issue 20), through its binary: it starts from a configuration
//! file, logs journald-style lines when stderr is not a terminal, answers clients, stops
//! on SIGTERM and SIGINT with exit code 0 and its socket removed, starts again on the same
//! path over a stale socket file, refuses to start beside a running memfoldd (before it
//! tries that one's metrics port), and stops with the file, the line and the key on a
//! bad configuration.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// memfoldd with `args`, stderr captured (a pipe: not a terminal).
fn memfoldd(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_memfoldd"))
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("JOURNAL_STREAM")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memfoldd starts")
}

/// Waits until memfoldd at `socket` answers a request for statistics.
fn wait_answering(socket: &Path, child: &mut Child) {
    let t = Instant::now();
    while memfold_live::query_stats(socket).is_err() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("memfoldd exited ({status}): {}", stderr(child));
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memfoldd did not answer"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr(child: &mut Child) -> String {
    let mut s = String::new();
    child
        .stderr
        .take()
        .expect("stderr captured")
        .read_to_string(&mut s)
        .unwrap();
    s
}

/// Sends `sig` and returns the exit code (within 10 s) and what memfoldd logged.
fn stop(child: &mut Child, sig: i32) -> (Option<i32>, String) {
    // SAFETY: kill() takes no pointers; the pid is our own child's, not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memfoldd did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.code(), stderr(child))
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn memfoldd_starts_from_its_file_stops_on_sigterm_and_restarts_on_the_same_path() {
    let dir = tempfile::tempdir().unwrap();
    let socket: PathBuf = dir.path().join("run/memfoldd.sock");
    let conf = dir.path().join("memfoldd.toml");
    std::fs::write(
        &conf,
        format!(
            "# as /etc/memfold/memfoldd.toml\nsocket = \"{}\"\nswap-dir = \"{}\"\npolicy = \"sharing\"\nrate = 5000\n",
            path_str(&socket),
            path_str(dir.path())
        ),
    )
    .unwrap();

    // A free port for the metrics endpoint.
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut d = memfoldd(&[
        "--config",
        path_str(&conf),
        "--rate",
        "7000",
        "--metrics-listen",
        &metrics,
    ]);
    wait_answering(&socket, &mut d);
    let s = memfold_live::query_stats(&socket).unwrap();
    assert!(s.vms.is_empty(), "no guest yet: {s:?}");

    // Beside a running memfoldd, another does not start (and leaves the socket alone),
    // refused for the socket before it tries the first one's metrics port.
    let out = Command::new(env!("CARGO_BIN_EXE_memfoldd"))
        .args(["--config", "none", "--socket", path_str(&socket)])
        .args(["--metrics-listen", &metrics])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("another memfoldd is listening there"), "{err}");
    memfold_live::query_stats(&socket).expect("the first still answers");
    let mut http = std::net::TcpStream::connect(&metrics).expect("its metrics port");
    std::io::Write::write_all(&mut http, b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    http.read_to_string(&mut page).unwrap();
    assert!(
        page.starts_with("HTTP/1.0 200") || page.starts_with("HTTP/1.1 200"),
        "{page}"
    );

    let (code, log) = stop(&mut d, libc::SIGTERM);
    assert_eq!(code, Some(0), "SIGTERM: exit 0; log:\n{log}");
    assert!(!socket.exists(), "the socket is removed");
    let lines: Vec<&str> = log.lines().collect();
    let starting = format!(
        "<6>memfoldd {} starting: configuration {}, policy sharing, rate 7000 pages/s",
        env!("CARGO_PKG_VERSION"),
        conf.display()
    );
    assert!(
        lines.iter().any(|l| l.starts_with(&starting)),
        "the start names the file and the command line wins over it:\n{log}"
    );
    for want in [
        "<6>listening on ",
        "<6>stopping: no new work",
        "<6>stopped: socket ",
    ] {
        assert!(
            lines.iter().any(|l| l.starts_with(want)),
            "{want:?} in:\n{log}"
        );
    }
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with('<') && !l.contains('\u{1b}')),
        "every line has its priority, no colour:\n{log}"
    );

    // A stale socket file (a killed memfoldd's) at the path: the next one takes over.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let mut d = memfoldd(&["--config", path_str(&conf)]);
    wait_answering(&socket, &mut d);
    let (code, log) = stop(&mut d, libc::SIGINT);
    assert_eq!(code, Some(0), "SIGINT: exit 0; log:\n{log}");
    assert!(
        log.contains("a stale socket (nothing listens): replaced"),
        "{log}"
    );
    assert!(!socket.exists());
}

#[test]
fn a_bad_configuration_stops_memfoldd_with_the_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("memfoldd.toml");
    let run = |text: &str, extra: &[&str]| {
        std::fs::write(&conf, text).unwrap();
        let mut args = vec!["--config", path_str(&conf)];
        args.extend(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_memfoldd"))
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run("rate = 1\nsocket_path = \"/x\"\n", &[]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains(&format!("{}:2: unknown key `socket_path`", conf.display())),
        "{err}"
    );
    assert!(err.contains("valid keys: agent-gid, "), "{err}");
    let (code, err) = run("policy = \"everything\"\n", &[]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains(":1: `policy`: invalid value 'everything'"),
        "{err}"
    );
    let (code, err) = run("", &["--config", "/nonexistent/memfoldd.toml"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("/nonexistent/memfoldd.toml: cannot read"),
        "{err}"
    );
}
