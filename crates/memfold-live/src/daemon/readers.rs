//! The socket's accept thread and one reader thread per connection: they only read and
//! forward to the main thread ([`Input`]).
//!
//! A connection's first message says who speaks (an agent, a block device, a client). It
//! must come within [`HELLO_TIMEOUT`], and one user has at most [`MAX_HELLOS_WAITING`]
//! connections waiting for theirs (past that its new connections are closed at once):
//! a peer that connects and says nothing held a thread and a descriptor for good, and
//! could make memfoldd start threads without bound. The kind and version are read before
//! the hello is decoded whole (`memfold_wire::hello`): an agent of another version, or
//! whose hello does not decode, is refused in its own terms ([`ToAgent::Refused`]).
//!
//! A tenant (a user not an operator) has at most [`tenant_connection_cap`] connections
//! open at once, said hello or not: each holds a reader thread and descriptors (an
//! agent's, a writer thread and its guest's store and swap file too), and one tenant
//! opening thousands ran memfoldd out of descriptors or threads for every other tenant —
//! their agents, re-attaching after a restart, got no welcome.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use memfold_sys::socket::Peer;
use memfold_wire::hello::{version_refusal, HelloHead};
use memfold_wire::{decode, shown, Conn, Listener, ToAgent, ToClient, ToDaemon, PROTOCOL_VERSION};

/// What the reader threads hand the main thread.
pub(crate) enum Input {
    /// An agent's hello, with the descriptors it passed and the pid the kernel says the
    /// peer has (SO_PEERCRED; the hello's own pid is never trusted).
    Attach {
        token: u64,
        conn: Conn,
        hello: ToDaemon,
        fds: Vec<OwnedFd>,
        pid: u32,
        /// The peer's user (SO_PEERCRED), which names its sharing domain by default.
        uid: u32,
    },
    /// A message from an attached agent.
    Agent { token: u64, msg: ToDaemon },
    /// An agent's connection ended.
    Gone { token: u64 },
    /// A block device said hello (only operators' devices are heard): its connection to
    /// answer on and the base images it showed, checked ([`super::devices`]).
    DeviceHello {
        token: u64,
        conn: Conn,
        bases: Vec<(memfold_core::ids::DiskId, std::fs::File)>,
        /// The device's pid (SO_PEERCRED): whose descriptors show which guest RAM it
        /// holds.
        pid: u32,
        /// A pidfd of the process that connected: a look at `/proc/PID` is believed only
        /// while it runs (the pid is then still its own).
        pidfd: std::os::fd::OwnedFd,
    },
    /// A block device's report of guest pages a disk read filled
    /// ([`ToDaemon::ReadLanded`]) or its request for a fill ([`ToDaemon::FillRead`]).
    Device { token: u64, msg: ToDaemon },
    /// A block device's connection ended.
    DeviceGone { token: u64 },
    /// A client's request; `operator`: the peer is root or memfoldd's own user, who may
    /// change what memfoldd does (an opt-out) and see every guest; `uid`: the peer's (a
    /// tenant sees only its own guests' statistics). The answer
    /// goes back to the connection's reader, which sends it: the main thread never
    /// waits on a client that does not read, and a client has one request in flight.
    Client {
        reply: mpsc::Sender<ToClient>,
        msg: ToDaemon,
        operator: bool,
        uid: u32,
    },
}

/// How long a new connection may take to say its hello before it is closed.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Most connections of one user (uid, from the kernel) waiting for their hello; a user's
/// connections past it are closed unread. Each holds a thread for up to
/// [`HELLO_TIMEOUT`]; a user's silent connections hold only that user's places. Room for
/// a host's QEMUs of one user (libvirt's) all re-attaching at once after a restart: one
/// closed unread tries again a second later (the agent's `attach.rs`).
pub const MAX_HELLOS_WAITING: usize = 256;

/// How long a send to a peer may wait before the peer is taken as gone: a peer that
/// stops reading must not stall memfoldd.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// Fewest connections one tenant (a uid not an operator's) may have open at once
/// ([`tenant_connection_cap`]).
pub const MIN_TENANT_CONNECTIONS: usize = 1024;

/// How many connections one tenant may have open at once: an eighth of memfoldd's
/// descriptor limit (`RLIMIT_NOFILE`, read now; each connection holds two to four
/// descriptors), at least [`MIN_TENANT_CONNECTIONS`]. Under the packaged unit's
/// `LimitNOFILE=65536`, 8192: a host's worth of one user's guests — libvirt runs every
/// QEMU as one user — at one connection a RAM region, while no tenant can take most of
/// memfoldd's descriptors. Past it, a tenant's new connections are closed unread; an
/// agent tries again later.
pub fn tenant_connection_cap() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        0
    };
    usize::try_from(soft / 8)
        .unwrap_or(usize::MAX)
        .max(MIN_TENANT_CONNECTIONS)
}

/// Connections counted by user, at most `limit` each: those waiting for their hello
/// ([`MAX_HELLOS_WAITING`]), or a tenant's open ones ([`tenant_connection_cap`]).
struct Waiting(Mutex<HashMap<u32, usize>>, usize);

impl Waiting {
    /// No connection counted yet, at most `limit` a user.
    fn new(limit: usize) -> Arc<Waiting> {
        Arc::new(Waiting(Mutex::new(HashMap::new()), limit))
    }
}

/// A place among a user's [`Waiting`] connections, given back when dropped.
struct Place {
    waiting: Arc<Waiting>,
    uid: u32,
}

impl Waiting {
    /// A place for a connection of `uid`; `None` if it has its limit.
    fn enter(self: &Arc<Self>, uid: u32) -> Option<Place> {
        let mut by_uid = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = by_uid.entry(uid).or_default();
        if *n >= self.1 {
            return None;
        }
        *n += 1;
        Some(Place {
            waiting: Arc::clone(self),
            uid,
        })
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut by_uid = self.waiting.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                by_uid.remove(&self.uid);
            }
        }
    }
}

/// Accepts connections until the listener is shut down; each gets a reader thread, while
/// its user has fewer than [`MAX_HELLOS_WAITING`] waiting for their hello.
/// `agent_gid`: a group whose members' QEMUs may attach too (besides root and memfoldd's
/// user).
pub(crate) fn accept_loop(
    listener: &Listener,
    tx: mpsc::SyncSender<Input>,
    agent_gid: Option<u32>,
) {
    let mut token = 0u64;
    let waiting = Waiting::new(MAX_HELLOS_WAITING);
    let tenant_cap = tenant_connection_cap();
    let open = Waiting::new(tenant_cap);
    let me = memfold_sys::socket::my_uid();
    // When a closed connection was last logged: a user that keeps connecting must not
    // flood the log.
    let mut logged: Option<Instant> = None;
    loop {
        let conn = match listener.accept() {
            Ok(c) => c,
            // EINVAL: the listener was shut down (memfoldd stops).
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return,
            Err(e) => {
                tracing::warn!("accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        token += 1;
        let t = token;
        let peer = match conn.peer() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("connection {t}: no peer credentials ({e}); closed");
                continue;
            }
        };
        // Every check of a peer (its guest RAM under /proc/PID, a pool's holders, its
        // pidfd) goes by its pid: one outside memfoldd's pid namespace has none here.
        if peer.pid == 0 {
            tracing::warn!(
                "connection {t}: from a process outside memfoldd's pid namespace (uid {}), which it cannot check; closed",
                peer.uid
            );
            continue;
        }
        // Held for the connection's life, a tenant's (operators are not bound).
        let tenant_place = if peer.trusted_by(me) {
            None
        } else {
            match open.enter(peer.uid) {
                Some(p) => Some(p),
                None => {
                    if logged.is_none_or(|l| l.elapsed() >= Duration::from_secs(10)) {
                        logged = Some(Instant::now());
                        tracing::warn!(
                            "connection {t} from pid {}: uid {} has {tenant_cap} \
                             connections open; closed (logged once each 10 s)",
                            peer.pid,
                            peer.uid
                        );
                    }
                    continue;
                }
            }
        };
        let Some(place) = waiting.enter(peer.uid) else {
            if logged.is_none_or(|l| l.elapsed() >= Duration::from_secs(10)) {
                logged = Some(Instant::now());
                tracing::warn!(
                    "connection {t} from pid {}: uid {} has {MAX_HELLOS_WAITING} connections \
                     waiting for their hello; closed (logged once each 10 s)",
                    peer.pid,
                    peer.uid
                );
            }
            continue;
        };
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("conn{t}"))
            .spawn(move || {
                let _open = tenant_place;
                read_loop(t, conn, peer, tx, agent_gid, place)
            });
        if let Err(e) = spawned {
            tracing::warn!("no thread for connection {t}: {e}");
        }
    }
}

/// Reads one connection of `peer` (from the kernel): an agent's messages, a block
/// device's, or a client's requests. Only root, memfoldd's own user and members of the
/// agent group may talk to memfoldd (the socket is mode 0600, or 0660 for the agent
/// group, and the peer's credentials are checked again here); anyone else is refused
/// with a message. Only root and memfoldd's user are operators: a QEMU of the agent
/// group may attach and read statistics, never opt another guest out. `place` is the
/// connection's among its user's waiting for their hello, given back once it came.
fn read_loop(
    t: u64,
    conn: Conn,
    peer: Peer,
    tx: mpsc::SyncSender<Input>,
    agent_gid: Option<u32>,
    place: Place,
) {
    let operator = peer.trusted_by(memfold_sys::socket::my_uid());
    if !operator && agent_gid != Some(peer.gid) {
        let message = format!(
            "uid {} (gid {}) may not talk to memfoldd (root, uid {}{} only)",
            peer.uid,
            peer.gid,
            memfold_sys::socket::my_uid(),
            agent_gid.map_or(String::new(), |g| format!(" or group {g}"))
        );
        tracing::warn!("connection {t} from pid {}: {message}", peer.pid);
        let _ = conn.send(&ToClient::Error { message }, &[]);
        return;
    }
    let first = match conn.set_recv_timeout(HELLO_TIMEOUT) {
        Ok(()) => conn.recv_bytes(),
        Err(e) => Err(e.into()),
    };
    let (bytes, fds) = match first {
        Ok(Some(m)) => m,
        Ok(None) => return,
        Err(e) => {
            tracing::debug!(
                "connection {t} from pid {}: no hello ({e}); closed",
                peer.pid
            );
            return;
        }
    };
    drop(place);
    // After the hello a connection may stay quiet for good (an idle client, an agent).
    if let Err(e) = conn.clear_recv_timeout() {
        tracing::warn!("connection {t}: {e}; closed");
        return;
    }
    let Ok(writer) = conn.try_clone() else {
        return;
    };
    if let Err(e) = writer.set_send_timeout(SEND_TIMEOUT) {
        tracing::warn!("connection {t}: {e}");
    }
    let Some(hello) = hello_of(t, &peer, &bytes, &writer) else {
        return;
    };
    // Its room is a message's (256 KiB), for a connection that may live for weeks.
    drop(bytes);
    match hello {
        ToDaemon::AgentHello {
            version, ref name, ..
        } if version == PROTOCOL_VERSION => {
            // A name is kept, logged and sent in every operator's statistics: one over
            // 255 bytes or unprintable is refused here, shown escaped and shortened, before
            // the main thread or the log sees it (test `many_guests.rs`).
            if let Err(e) = memfold_wire::check_name(name) {
                tracing::warn!("connection {t} from pid {}: {e}; refused", peer.pid);
                let message = e.to_string();
                let _ = writer.send(&ToAgent::Refused { message }, &[]);
                return;
            }
            if tx
                .send(Input::Attach {
                    token: t,
                    conn: writer,
                    hello,
                    fds,
                    pid: peer.pid,
                    uid: peer.uid,
                })
                .is_err()
            {
                return;
            }
            if forward(&conn, &tx, "connection", t, |msg| Input::Agent {
                token: t,
                msg,
            }) {
                let _ = tx.send(Input::Gone { token: t });
            }
        }
        // A block device's reports make memfoldd read guest pages: an operator's only.
        ToDaemon::DeviceHello { version, bases } if version == PROTOCOL_VERSION && operator => {
            tracing::info!("connection {t}: a block device (pid {})", peer.pid);
            let pidfd = match conn.peer_pidfd() {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!("connection {t}: the block device's pidfd: {e}; refused");
                    return;
                }
            };
            let bases = super::devices::checked_bases(t, &bases, fds);
            let hello = Input::DeviceHello {
                token: t,
                conn: writer,
                bases,
                pid: peer.pid,
                pidfd,
            };
            if tx.send(hello).is_err() {
                return;
            }
            let device = |msg| Input::Device { token: t, msg };
            if forward(&conn, &tx, "block device connection", t, device) {
                let _ = tx.send(Input::DeviceGone { token: t });
            }
        }
        ToDaemon::ClientHello { version } if version == PROTOCOL_VERSION => {
            // A client passes none: any it did would stay open for the connection's life.
            drop(fds);
            while let Ok(Some((msg, _))) = conn.recv::<ToDaemon>() {
                let (reply, answer) = mpsc::channel();
                let input = Input::Client {
                    reply,
                    msg,
                    operator,
                    uid: peer.uid,
                };
                if tx.send(input).is_err() {
                    return;
                }
                // The next request is read only once this one is answered. Statistics
                // too large for one message go in parts, encoded and sent here, off the
                // main thread (`memfold_wire::stats_parts`; test `many_guests.rs`).
                let Ok(answer) = answer.recv() else { return };
                let messages = match answer {
                    ToClient::Stats(stats) => memfold_wire::stats_messages(*stats),
                    other => vec![other],
                };
                for m in &messages {
                    if let Err(e) = writer.send(m, &[]) {
                        tracing::debug!("client connection {t}: its answer: {e}; closed");
                        return;
                    }
                }
            }
        }
        other => {
            let message = format!(
                "expected a hello of protocol version {PROTOCOL_VERSION}, got {}",
                hello_kind(&other)
            );
            tracing::warn!("connection {t}: {message}");
            let _ = writer.send(&ToClient::Error { message }, &[]);
        }
    }
}

/// The hello in `bytes`, decoded; `None` if it was answered and refused. An agent's hello
/// of another protocol version, or one that does not decode (an older agent's lacks
/// fields added since), gets a [`ToAgent::Refused`] naming the versions, which the agent
/// can read; anything else undecodable an error.
/// Hands each message of connection `t` (`what`: its kind, for the log) to the main loop
/// as `input` makes it, until the peer closes or a read fails. False if the main loop is
/// gone (nothing more to tell it), true once the connection ended.
fn forward(
    conn: &Conn,
    tx: &mpsc::SyncSender<Input>,
    what: &str,
    t: u64,
    input: impl Fn(ToDaemon) -> Input,
) -> bool {
    loop {
        match conn.recv::<ToDaemon>() {
            Ok(Some((msg, _))) => {
                if tx.send(input(msg)).is_err() {
                    return false;
                }
            }
            Ok(None) => return true,
            Err(e) => {
                tracing::warn!("{what} {t}: {e}; dropped");
                return true;
            }
        }
    }
}

fn hello_of(t: u64, peer: &Peer, bytes: &[u8], writer: &Conn) -> Option<ToDaemon> {
    let head = HelloHead::of(bytes);
    let is_agent = head.as_ref().is_some_and(HelloHead::is_agent);
    let version = head.and_then(|h| h.version);
    let why = if is_agent && version != Some(PROTOCOL_VERSION) {
        version_refusal(version)
    } else {
        match decode::<ToDaemon>(bytes) {
            Ok(hello) => return Some(hello),
            Err(e) if is_agent => format!(
                "an agent hello of protocol version {PROTOCOL_VERSION} memfoldd cannot read: {}",
                shown(&e.to_string())
            ),
            Err(e) => {
                let message = format!(
                    "expected a hello of protocol version {PROTOCOL_VERSION}: {}",
                    shown(&e.to_string())
                );
                tracing::warn!("connection {t} from pid {}: {message}", peer.pid);
                let _ = writer.send(&ToClient::Error { message }, &[]);
                return None;
            }
        }
    };
    tracing::warn!("connection {t} from pid {}: {why}; refused", peer.pid);
    let _ = writer.send(&ToAgent::Refused { message: why }, &[]);
    None
}

/// What a first message that is no hello memfoldd serves was, in words.
fn hello_kind(m: &ToDaemon) -> String {
    match m {
        ToDaemon::AgentHello { version, .. } => format!("an agent hello of version {version}"),
        ToDaemon::ClientHello { version } => format!("a client hello of version {version}"),
        ToDaemon::DeviceHello { version, .. } if *version == PROTOCOL_VERSION => {
            "a block device's hello from a peer that is not root or memfoldd's user".into()
        }
        ToDaemon::DeviceHello { version, .. } => {
            format!("a block device's hello of version {version}")
        }
        other => format!("a message of kind {}", other.kind()),
    }
}
