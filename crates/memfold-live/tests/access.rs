//! Who may talk to memfoldd (issue 14, "Authentication"): with an agent group, QEMUs that
//! run as an unprivileged user in that group may attach (each user its own sharing
//! domain) and read their own guests' statistics (no other tenant's, no host-wide
//! figure), but only root and memfoldd's own user are operators — a
//! tenant's QEMU cannot opt another guest out nor take a census of every guest's pages; a
//! user outside the group is refused at the door. The test re-runs this binary as child processes under uid 65534 (`nobody`) with
//! group 65534 (the agent group) or 65533 (a stranger), each checking what it is allowed.

mod common;

use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use memfold_core::{EngineConfig, Policy};
use memfold_live::daemon::{tenant_connection_cap, DaemonConfig, DomainRule};
use memfold_sys::memfd;
use memfold_wire::{Conn, ToAgent, ToClient, ToDaemon, PROTOCOL_VERSION};

const ROLE: &str = "MEMFOLD_ACCESS_ROLE";
const SOCKET: &str = "MEMFOLD_ACCESS_SOCKET";
const AGENT_GID: u32 = 65534;
/// The tenant's cap on connections, for the crowd child.
const CAP: &str = "MEMFOLD_ACCESS_CAP";

fn client(socket: &Path, req: &ToDaemon) -> ToClient {
    let c = Conn::connect(socket).unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let hello = ToDaemon::ClientHello {
        version: PROTOCOL_VERSION,
    };
    c.send(&hello, &[]).unwrap();
    let _ = c.send(req, &[]);
    c.recv::<ToClient>().unwrap().expect("an answer").0
}

/// A hello for guest `name` of `pages` pages (a memfd of its own), and memfoldd's answer;
/// the connection stays open while the caller holds it.
fn attach(socket: &Path, name: &str, pages: u64) -> ((Conn, std::os::fd::OwnedFd), ToAgent) {
    let c = Conn::connect(socket).unwrap();
    let ram = memfd::create(name).unwrap();
    memfd::set_len(ram.as_fd(), pages * 4096).unwrap();
    let hello = ToDaemon::AgentHello {
        version: PROTOCOL_VERSION,
        name: name.into(),
        pid: 0,
        ram_bytes: pages * 4096,
        shared: 0,
        opted_out: false,
    };
    c.send(&hello, &[ram.as_fd()]).unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let (reply, _) = c.recv::<ToAgent>().unwrap().expect("an answer");
    ((c, ram), reply)
}

/// What each child checks, as the user it runs as. Run only by [`run_child`] (ignored
/// otherwise: on its own it would check nothing).
#[test]
#[ignore = "a child process of the access tests, run by them"]
fn child_role() {
    let role = std::env::var(ROLE).expect("run by the access tests' run_child");
    let socket = std::path::PathBuf::from(std::env::var(SOCKET).unwrap());
    match role.as_str() {
        "tenant" => {
            // It may attach its own guest.
            let (_c, reply) = attach(&socket, "tenant-guest", 64);
            assert!(matches!(reply, ToAgent::Welcome { .. }), "{reply:?}");
            // Its statistics list its own guest, not the operator's, and no host-wide
            // figure (they count the other guests too).
            let ToClient::Stats(stats) = client(&socket, &ToDaemon::Stats) else {
                panic!("no statistics for a tenant");
            };
            let names: Vec<&str> = stats.vms.iter().map(|v| v.name.as_str()).collect();
            assert_eq!(names, ["tenant-guest"], "a tenant saw another's guests");
            assert_eq!(stats.tenant_uid, Some(65534));
            assert_eq!((stats.domains, stats.frames, stats.cpu_s), (0, 0, 0.0));
            // Asked again within the second: the same answer (its uptime too), the books
            // not read again for it. Tried a few times: a pair may straddle the second's
            // end on a loaded machine. Fails with every ask answered afresh.
            let uptime = || match client(&socket, &ToDaemon::Stats) {
                ToClient::Stats(s) => s.uptime_s,
                other => panic!("{other:?}"),
            };
            assert!(
                (0..5).any(|_| uptime() == uptime()),
                "a tenant's asks each read every guest's books"
            );
            // A second guest past its quota (512 KiB of RAM here): refused, by name of the
            // bound. memfoldd books every page a guest has, and a sparse memfd is free.
            let (_c2, reply) = attach(&socket, "tenant-guest-2", 96);
            assert!(
                matches!(&reply, ToAgent::Refused { message } if message.contains("tenant-max-gib")),
                "a tenant's guests went past its quota: {reply:?}"
            );
            let out = ToDaemon::OptOut {
                name: "operator-guest".into(),
                out: true,
            };
            let reply = client(&socket, &out);
            assert!(
                matches!(&reply, ToClient::Error { message } if message.contains("only root")),
                "a tenant opted a guest out: {reply:?}"
            );
            // Nor take a census: it counts every guest's pages, another tenant's too, so
            // a page it writes in its own guest would tell whether theirs hold it.
            let census = client(&socket, &ToDaemon::Census);
            assert!(
                matches!(&census, ToClient::Error { message } if message.contains("only root")),
                "a tenant took a census: {census:?}"
            );
            // Nor may it speak as a block device (its reports make memfoldd read guest
            // pages): refused at the hello, with a message.
            let c = Conn::connect(&socket).unwrap();
            c.set_recv_timeout(Duration::from_secs(5)).unwrap();
            let hello = ToDaemon::DeviceHello {
                version: PROTOCOL_VERSION,
                bases: vec![],
            };
            c.send(&hello, &[]).unwrap();
            let (reply, _) = c.recv::<ToClient>().unwrap().expect("an answer");
            assert!(
                matches!(&reply, ToClient::Error { message } if message.contains("block device")),
                "a tenant spoke as a block device: {reply:?}"
            );
        }
        "stranger" => {
            // The socket's mode keeps it out (0660, the agent group's); were it open, the
            // peer check would refuse it with a message.
            match Conn::connect(&socket) {
                Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}"),
                Ok(_) => {
                    let reply = client(&socket, &ToDaemon::Stats);
                    assert!(
                        matches!(&reply, ToClient::Error { message } if message.contains("may not talk")),
                        "a stranger was let in: {reply:?}"
                    );
                }
            }
        }
        "crowd" => {
            // Room for the crowd's descriptors (a soft limit of 1024 is common).
            let (_, hard) = common::nofile();
            common::set_nofile(hard.min(1 << 16), hard);
            let hello = ToDaemon::ClientHello {
                version: PROTOCOL_VERSION,
            };
            // Each kept connection is served once before the next opens: its hello has
            // been read, so it is counted among the tenant's open ones, not among those
            // waiting for a hello (a bound of its own, which a burst could reach first).
            let open = |n: usize, served: bool| -> Vec<Conn> {
                (0..n)
                    .map(|i| {
                        let c = Conn::connect(&socket).unwrap();
                        let _ = c.send(&hello, &[]);
                        if served {
                            c.set_recv_timeout(Duration::from_secs(10)).unwrap();
                            c.send(&ToDaemon::Stats, &[]).unwrap();
                            assert!(
                                matches!(c.recv::<ToClient>(), Ok(Some((ToClient::Stats(_), _)))),
                                "connection {i} of the tenant's {n} was not served"
                            );
                        }
                        c
                    })
                    .collect()
            };
            let cap: usize = std::env::var(CAP).unwrap().parse().unwrap();
            let kept = open(cap, true);
            let past = open(8, false);
            for c in &past {
                c.set_recv_timeout(Duration::from_secs(5)).unwrap();
                let _ = c.send(&ToDaemon::Stats, &[]);
                assert!(
                    !matches!(c.recv::<ToClient>(), Ok(Some(_))),
                    "a connection past the tenant's {cap} was served"
                );
            }
            // Those within the bound are.
            let last = kept.last().unwrap();
            last.set_recv_timeout(Duration::from_secs(5)).unwrap();
            last.send(&ToDaemon::Stats, &[]).unwrap();
            assert!(matches!(
                last.recv::<ToClient>(),
                Ok(Some((ToClient::Stats(_), _)))
            ));
        }
        "after-crowd" => {
            // The crowd's places were given back with its connections (each once its
            // reader saw the end: within 10 s on a loaded host).
            let t = std::time::Instant::now();
            loop {
                let c = Conn::connect(&socket).unwrap();
                c.set_recv_timeout(Duration::from_secs(5)).unwrap();
                let hello = ToDaemon::ClientHello {
                    version: PROTOCOL_VERSION,
                };
                let _ = c.send(&hello, &[]);
                let _ = c.send(&ToDaemon::Stats, &[]);
                match c.recv::<ToClient>() {
                    Ok(Some((ToClient::Stats(_), _))) => break,
                    other => assert!(
                        t.elapsed() < Duration::from_secs(10),
                        "the crowd's places were not given back: {other:?}"
                    ),
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn run_child(socket: &Path, role: &str, gid: u32) {
    run_child_with(socket, role, gid, 0)
}

/// [`run_child`], telling the child memfoldd's cap on a tenant's connections.
fn run_child_with(socket: &Path, role: &str, gid: u32, cap: usize) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_role", "--nocapture"])
        .env(ROLE, role)
        .env(CAP, cap.to_string())
        .env(SOCKET, socket)
        .uid(65534)
        .gid(gid)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{role}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // libtest passes a run whose filter matched no test: the child must have run.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{role}: the child ran no test: {stdout}"
    );
}

#[test]
fn tenants_of_the_agent_group_attach_but_are_not_operators() {
    let dir = tempfile::tempdir().unwrap();
    // The folder lets the tenant reach the socket; the socket's mode decides the rest.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let socket = dir.path().join("memfoldd.sock");
    let cfg = DaemonConfig {
        socket: socket.clone(),
        engine: EngineConfig {
            policy: Policy::sharing_only(),
            clock_interval_us: None,
            ..EngineConfig::default()
        },
        swap_dir: dir.path().to_path_buf(),
        swap_capacity: 1 << 20,
        domains: DomainRule::User,
        agent_gid: Some(AGENT_GID),
        never_share: Default::default(),
        claim: memfold_core::ClaimPolicy::Never,
        allowance: 0,
        guest_channels: None,
        // Room for the tenant's guest of 256 KiB, not for its second.
        tenant_max_bytes: 512 << 10,
    };
    common::start_memfoldd_with(cfg);
    // The operator's own guest, which no tenant may see (and no tenant's quota bounds).
    let _operator = common::attach_fake_qemu(&socket, "operator-guest", &[3u8; 256 * 4096]);
    run_child(&socket, "tenant", AGENT_GID);
    run_child(&socket, "stranger", AGENT_GID - 1);
    // The operator (this process, root) may.
    let reply = client(
        &socket,
        &ToDaemon::OptOut {
            name: "tenant-guest".into(),
            out: true,
        },
    );
    assert!(
        matches!(reply, ToClient::OptedOut { .. } | ToClient::Error { .. }),
        "{reply:?}"
    );
    if let ToClient::Error { message } = &reply {
        assert!(message.contains("no guest named"), "{message}");
    }
    let census = client(&socket, &ToDaemon::Census);
    assert!(matches!(census, ToClient::Census(_)), "{census:?}");
    // The operator sees every guest and the host-wide figures.
    let ToClient::Stats(stats) = client(&socket, &ToDaemon::Stats) else {
        panic!("no statistics for the operator");
    };
    assert!(stats.vms.iter().any(|v| v.name == "operator-guest"));
    assert_eq!(stats.tenant_uid, None);
    assert!(stats.domains >= 1);
    // The operator's are fresh at every ask.
    let ToClient::Stats(again) = client(&socket, &ToDaemon::Stats) else {
        panic!("no statistics for the operator");
    };
    assert!(
        again.uptime_s > stats.uptime_s,
        "the operator was given a copy"
    );
}

/// A tenant has at most [`tenant_connection_cap`] connections open at once: past them
/// its new ones are closed unread (each held a thread and descriptors, and one tenant's
/// thousands ran memfoldd out of them for every other). Fails without the bound: the
/// crowd's connections past it are served.
#[test]
fn a_tenants_open_connections_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // The cap is an eighth of memfoldd's descriptor limit, at least 1024: with a soft
    // limit of 8192 (this process's, memfoldd's here), 1024 — a crowd of a test's size.
    let (_, hard) = common::nofile();
    common::set_nofile(hard.min(8192), hard);
    let socket = common::start_memfoldd_with(DaemonConfig {
        agent_gid: Some(AGENT_GID),
        ..common::daemon_config(dir.path(), EngineConfig::default())
    });
    let cap = tenant_connection_cap();
    assert!(cap <= 4096, "a crowd of {cap} is too many for a test");
    run_child_with(&socket, "crowd", AGENT_GID, cap);
    // The operator is not bound, and the tenant's places came back when the crowd left.
    assert!(matches!(
        client(&socket, &ToDaemon::Stats),
        ToClient::Stats(_)
    ));
    run_child(&socket, "after-crowd", AGENT_GID);
}
