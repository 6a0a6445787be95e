//! memfoldd against peers whose first message costs it: a hello refused for its pool
//! whose re-attach list is large, agents of another protocol version (newer, or older
//! and lacking fields added since), a request whose text would not fit an answer, and
//! connections that say nothing. Each is answered or closed in bounded time and work,
//! in words the peer reads; no guest or agent runs here.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use memfold_live::daemon::{HELLO_TIMEOUT, MAX_HELLOS_WAITING};
use memfold_live::query_stats;
use memfold_sys::memfd;
use memfold_sys::socket::Seqpacket;
use memfold_wire::{
    decode, Conn, FrameId, Gfn, ToAgent, ToClient, ToDaemon, WireError, MAX_MESSAGE,
    PROTOCOL_VERSION,
};

const PAGE: u64 = 4096;

fn memfoldd(dir: &std::path::Path) -> std::path::PathBuf {
    common::start_memfoldd(dir, common::fast_engine())
}

/// An agent's hello of this version for `pages` pages, re-attaching with `shared`.
fn hello(name: &str, pages: u64, shared: u64) -> ToDaemon {
    ToDaemon::AgentHello {
        version: PROTOCOL_VERSION,
        name: name.into(),
        pid: std::process::id(),
        ram_bytes: pages * PAGE,
        shared,
        opted_out: false,
    }
}

/// A memfd of `pages` pages.
fn ram(pages: u64) -> std::os::fd::OwnedFd {
    let fd = memfd::create("attacker-ram").unwrap();
    memfd::set_len(fd.as_fd(), pages * PAGE).unwrap();
    fd
}

/// The answer to the message `bytes` with `fds` on a new connection, as an agent reads it.
fn answer_to_raw(
    socket: &std::path::Path,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> ToAgent {
    let s = Seqpacket::connect(socket).unwrap();
    s.set_recv_timeout(Duration::from_secs(5)).unwrap();
    s.send(bytes, fds).unwrap();
    let mut buf = vec![0u8; MAX_MESSAGE];
    let p = s.recv(&mut buf).unwrap();
    assert!(p.len > 0, "no answer: the connection closed");
    decode::<ToAgent>(&buf[..p.len]).expect("an answer an agent can read")
}

/// A hello refused for its pool is refused before its re-attach list is read (the list,
/// up to 512 MiB, is read on memfoldd's main thread): the refusal names the pool, not
/// the list, though the list would not decode. Fails with the list read first ("re-attach
/// list: frame ... cannot be in a re-attach list").
#[test]
fn a_hello_refused_for_its_pool_is_refused_before_its_list_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let socket = memfoldd(dir.path());
    let pages = 64;
    let ram = ram(pages);
    // As many entries as the hello announces, none of which decodes.
    let list = memfd::create("list").unwrap();
    memfd::pwrite_all(list.as_fd(), &vec![0xff; (8 * pages) as usize], 0).unwrap();
    let write_only = {
        let fd = memfd::create("memfold-pool").unwrap();
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        std::os::fd::OwnedFd::from(f)
    };
    let huge = memfd::create("memfold-pool").unwrap();
    memfd::set_len(huge.as_fd(), (u32::MAX as u64) * PAGE).unwrap();
    for (what, pool, want) in [
        (
            "write-only",
            write_only,
            "not a memfd open for reading and writing",
        ),
        ("huge", huge, "over the 64 GiB memfoldd adopts"),
    ] {
        let c = Conn::connect(&socket).unwrap();
        let fds = [ram.as_fd(), pool.as_fd(), list.as_fd()];
        c.send(&hello(&format!("pool-{what}"), pages, pages), &fds)
            .unwrap();
        c.set_recv_timeout(Duration::from_secs(5)).unwrap();
        let (reply, _) = c.recv::<ToAgent>().unwrap().expect("an answer");
        assert!(
            matches!(&reply, ToAgent::Refused { message } if message.contains(want)),
            "{what} pool: {reply:?}"
        );
    }
}

/// An agent of another protocol version — newer, or older and lacking the fields added
/// since (`shared`, `opted_out`) — gets a refusal it can decode, naming both versions;
/// one of this version whose hello does not decode is told so. Fails with an error an
/// agent cannot decode (`ToClient::Error`), or no answer at all for the old hello.
#[test]
fn an_agent_of_another_version_is_refused_in_words_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let socket = memfoldd(dir.path());
    let ram = ram(16);
    let newer = ToDaemon::AgentHello {
        version: PROTOCOL_VERSION + 1,
        name: "newer".into(),
        pid: 1,
        ram_bytes: 16 * PAGE,
        shared: 0,
        opted_out: false,
    };
    let old = br#"{"type":"agent_hello","version":7,"name":"old","pid":1,"ram_bytes":65536}"#;
    let broken = format!(r#"{{"type":"agent_hello","version":{PROTOCOL_VERSION},"name":"x"}}"#);
    let ours = format!("protocol version {PROTOCOL_VERSION}");
    for (bytes, theirs) in [
        (
            memfold_wire::encode(&newer),
            format!("version {}", PROTOCOL_VERSION + 1),
        ),
        (old.to_vec(), "version 7".to_string()),
        (broken.into_bytes(), "cannot read".to_string()),
    ] {
        let reply = answer_to_raw(&socket, &bytes, &[ram.as_fd()]);
        assert!(
            matches!(&reply, ToAgent::Refused { message }
                if message.contains(&ours) && message.contains(&theirs)),
            "{}: {reply:?}",
            String::from_utf8_lossy(&bytes)
        );
    }
}

/// A request memfoldd does not serve is answered by its kind, whatever its size: its
/// Debug text (~400 KB here) went into the answer, which the wire refused to send (the
/// connection dropped, no answer). Fails with that text.
#[test]
fn an_unexpected_request_is_answered_by_its_kind() {
    let dir = tempfile::tempdir().unwrap();
    let socket = memfoldd(dir.path());
    let big = ToDaemon::CowBroken {
        breaks: (10_000..25_000).map(|i| (Gfn(i), FrameId(i))).collect(),
    };
    assert!(format!("{big:?}").len() > MAX_MESSAGE);
    let c = Conn::connect(&socket).unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    c.send(
        &ToDaemon::ClientHello {
            version: PROTOCOL_VERSION,
        },
        &[],
    )
    .unwrap();
    c.send(&big, &[]).unwrap();
    let reply = c.recv::<ToClient>().unwrap().map(|r| r.0);
    assert!(
        matches!(&reply, Some(ToClient::Error { message })
            if message == "unexpected request of kind cow_broken"),
        "{reply:?}"
    );
}

/// A connection that says nothing is closed after [`HELLO_TIMEOUT`] (it held a thread
/// and a descriptor for good); one that said its hello may then stay quiet for longer
/// and is still served. Fails without the timeout (our own receive times out first).
#[test]
fn a_connection_that_says_no_hello_is_closed_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let socket = memfoldd(dir.path());
    let quiet = Conn::connect(&socket).unwrap();
    quiet
        .set_recv_timeout(HELLO_TIMEOUT + Duration::from_secs(5))
        .unwrap();
    let client = Conn::connect(&socket).unwrap();
    client
        .send(
            &ToDaemon::ClientHello {
                version: PROTOCOL_VERSION,
            },
            &[],
        )
        .unwrap();
    let t = Instant::now();
    let r = quiet.recv::<ToClient>();
    assert!(matches!(r, Ok(None)), "{r:?} after {:?}", t.elapsed());
    assert!(
        t.elapsed() < HELLO_TIMEOUT + Duration::from_secs(3),
        "{:?}",
        t.elapsed()
    );
    // Quiet past the hello's timeout since its hello: still served.
    client.set_recv_timeout(Duration::from_secs(5)).unwrap();
    client.send(&ToDaemon::Stats, &[]).unwrap();
    let r = client.recv::<ToClient>().unwrap().map(|r| r.0);
    assert!(matches!(r, Some(ToClient::Stats(_))), "{r:?}");
}

/// One user has at most [`MAX_HELLOS_WAITING`] connections waiting for their hello: the
/// next is closed unread, and once those close, its connections are served again.
/// Fails without the bound (the next is served: memfoldd starts a thread a connection).
#[test]
fn a_users_connections_waiting_for_their_hello_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let socket = memfoldd(dir.path());
    let silent: Vec<Conn> = (0..MAX_HELLOS_WAITING)
        .map(|_| Conn::connect(&socket).unwrap())
        .collect();
    let extra = Conn::connect(&socket).unwrap();
    extra.set_recv_timeout(Duration::from_secs(3)).unwrap();
    // Sends may fail once memfoldd has closed it.
    let _ = extra.send(
        &ToDaemon::ClientHello {
            version: PROTOCOL_VERSION,
        },
        &[],
    );
    let _ = extra.send(&ToDaemon::Stats, &[]);
    let r = extra.recv::<ToClient>();
    let closed = match &r {
        Ok(None) => true,
        Err(WireError::Io(e)) => e.kind() == std::io::ErrorKind::ConnectionReset,
        _ => false,
    };
    assert!(closed, "the connection past the bound: {r:?}");
    drop(silent);
    let t = Instant::now();
    while query_stats(&socket).is_err() {
        assert!(t.elapsed() < Duration::from_secs(3), "not served again");
        std::thread::sleep(Duration::from_millis(50));
    }
}
