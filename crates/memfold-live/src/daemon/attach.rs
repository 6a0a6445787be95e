//! An agent's hello: who the guest is (one RAM memfd, one guest), which sharing domain it
//! joins, and the backings memfoldd makes for it — everything a peer's attach can ask of
//! memfoldd, each failure that guest's refusal.

use std::os::fd::{AsFd, OwnedFd};

use memfold_core::backing::{Backing, BackingError};
use memfold_core::engine::{Attach, Mapped, Sharing};
use memfold_core::ids::DomainId;
use memfold_core::EngineError;
use memfold_sys::memfd;
use memfold_wire::{reattach, ToAgent, ToDaemon, PROTOCOL_VERSION};

use super::backings::{FileBacking, MemfdRam};
use super::domains::{DomainKey, PoolRefusal};
use super::{dup, outbox, Daemon, DomainRule, MAX_GUEST_PAGES, PAGE};

impl Daemon {
    /// An agent's hello: its guest RAM memfd, and when re-attaching after a restart the
    /// pool it maps and the list of what it maps. `pid` and `uid` are the peer's, from the
    /// kernel. The guest joins its domain (by `uid` or alone, as the rule says) and gets
    /// that domain's pool and a store and swap file of its own. Refusals are logged and
    /// sent to the agent, and the connection closed; the guest then runs on unmanaged.
    /// Nothing a peer sends, and no resource memfoldd lacks for it, ends memfoldd: every
    /// failure is that guest's refusal (test `fd_exhaustion.rs`). Its name was checked
    /// by the connection's reader (`memfold_wire::check_name`: at most 255 bytes,
    /// printable), so it may be logged and booked as it is.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attach(
        &mut self,
        token: u64,
        conn: memfold_wire::Conn,
        hello: ToDaemon,
        mut fds: Vec<OwnedFd>,
        pid: u32,
        uid: u32,
    ) {
        let ToDaemon::AgentHello {
            name,
            pid: claimed,
            ram_bytes,
            shared,
            opted_out,
            ..
        } = hello
        else {
            return;
        };
        let refuse = |why: String| {
            tracing::warn!("{name} (pid {pid}): {why}; left unmanaged");
            let _ = conn.send(&ToAgent::Refused { message: why }, &[]);
            conn.shutdown();
        };
        if claimed != pid {
            tracing::warn!(
                "{name}: the hello claims pid {claimed}, the kernel says {pid}: using {pid}"
            );
        }
        if fds.is_empty() || fds.len() > 3 {
            refuse(format!("{} descriptors in the hello (1 or 3)", fds.len()));
            return;
        }
        let ram = fds.remove(0);
        let list = (fds.len() == 2).then(|| fds.pop()).flatten();
        let their_pool = fds.pop();
        // Asked about (its size) and read on the main thread: a file whose calls could
        // block (on a FUSE mount its peer serves) would stall every guest. QEMU's RAM is a
        // memfd; `F_GET_SEALS` asks no file system.
        if !memfd::is_memory_file(ram.as_fd())
            || list
                .as_ref()
                .is_some_and(|l| !memfd::is_memory_file(l.as_fd()))
        {
            refuse("guest RAM and a re-attach list must be memfds".into());
            return;
        }
        let ram_size = memfd::size(ram.as_fd()).unwrap_or(0);
        if ram_bytes == 0 || ram_bytes % PAGE != 0 || ram_size < ram_bytes {
            refuse(format!(
                "guest RAM of {ram_bytes} bytes in a memfd of {ram_size} bytes"
            ));
            return;
        }
        if ram_bytes / PAGE > MAX_GUEST_PAGES {
            refuse(format!(
                "guest RAM of {ram_bytes} bytes: memfoldd manages guests of at most {} GiB",
                (MAX_GUEST_PAGES * PAGE) >> 30
            ));
            return;
        }
        let ram_id = match memfd::file_id(ram.as_fd()) {
            Ok(id) => id,
            Err(e) => {
                refuse(format!("guest RAM descriptor: {e}"));
                return;
            }
        };
        // INVARIANT: one RAM memfd, one guest, one (QEMU, name). A re-attach proves it is
        // the same VM: the same QEMU (pid from the kernel), the same region (name), the
        // same RAM memfd of the same size. The same memfd as a second guest would be
        // booked twice — one guest's share punching the page the other's books call
        // private — and the engine, which finds a guest to re-attach by pid, name and
        // size, could re-attach another than this memfd's. (Tests: `malicious_peers.rs`,
        // `one_ram_memfd_is_one_guest`.)
        let mut supersede = None;
        let known = match self.guests.holder_of_ram(ram_id) {
            Some((vm, holder_pid, holder, attached)) => {
                if holder_pid != pid || holder != name {
                    refuse(format!(
                        "its RAM memfd is guest {holder:?}'s (pid {holder_pid}){}",
                        if attached { "" } else { ", detached" }
                    ));
                    return;
                }
                let had = self.engine.ram_bytes(vm).unwrap_or(0);
                if had != ram_bytes {
                    refuse(format!(
                        "a re-attach of {ram_bytes} bytes of RAM; its guest has {had}"
                    ));
                    return;
                }
                // Its own QEMU connects again for it before memfoldd has seen the old
                // connection end (the two readers race): the new one replaces it.
                supersede = attached.then_some(vm);
                true
            }
            None if self.guests.named(pid, &name) => {
                refuse(format!(
                    "this QEMU's guest {name:?} is attached with another RAM memfd"
                ));
                return;
            }
            None => false,
        };
        // A tenant's guests hold at most its quota of RAM together (the bound on what one
        // tenant makes memfoldd book; test `access.rs`). Its own re-attach is counted. A
        // re-attach after a restart is not exempt (any hello may bring a memfd as its
        // pool); one refused keeps the pool it maps adopted, its frames kept
        // (`adoption.rs`).
        let operator = uid == 0 || uid == memfold_sys::socket::my_uid();
        if !operator && !known {
            let held = self.guests.ram_of_uid(uid, &self.engine);
            if held.saturating_add(ram_bytes) > self.tenant_max_bytes {
                refuse(format!(
                    "uid {uid}'s guests would hold {} MiB of RAM, over its {} MiB \
                     (memfoldd --tenant-max-gib)",
                    (held + ram_bytes) >> 20,
                    self.tenant_max_bytes >> 20
                ));
                return;
            }
        }
        if shared > ram_bytes / PAGE {
            refuse(format!(
                "a re-attach list of {shared} pages for a guest of {} pages",
                ram_bytes / PAGE
            ));
            return;
        }
        // Never-share (Satori §4.3): the guest is keyed alone, as under `vm`, so it joins
        // (or makes) a domain no other guest's key leads to; the engine refuses it
        // anything else (the invariant, `Engine::attach`).
        let sharing = if self.never_share.contains(&name) {
            Sharing::NeverShare
        } else {
            Sharing::Domain
        };
        let key = match (self.rule, sharing) {
            (DomainRule::User, Sharing::Domain) => DomainKey::User(uid),
            (DomainRule::Vm, _) | (_, Sharing::NeverShare) => DomainKey::Vm(ram_id.0, ram_id.1),
        };
        // The pool's checks before the list: the list (up to 512 MiB) is read on this
        // thread, and a hello refused for its pool must cost no more than the refusal
        // (test `hostile_hellos.rs`).
        let plan = match their_pool
            .as_ref()
            .map(|p| self.check_pool(key, p, ram_id, pid))
        {
            None => None,
            Some(Ok(plan)) => Some(plan),
            Some(Err(PoolRefusal::Refuse(why))) => {
                refuse(why);
                return;
            }
            // Kept alone, with a pool other QEMUs hold: not attached onto it (the
            // invariant at `PoolRefusal::Leave`); its agent copies its pages off the
            // frames and comes back with none, to a domain of its own.
            Some(Err(PoolRefusal::Leave(why))) => {
                let now = std::time::Instant::now();
                let available = memfold_sys::proc::host_available_bytes();
                let total = memfold_sys::proc::host_ram_bytes();
                if let Err(later) = self.leaving.admit(now, shared, available, total) {
                    refuse(format!("{why}; {later}"));
                    return;
                }
                tracing::warn!("{name} (pid {pid}): {why}; told to leave that pool");
                let _ = conn.send(&ToAgent::LeavePool { message: why }, &[]);
                conn.shutdown();
                return;
            }
        };
        let mapped = match list.map(|l| reattach::from_memfd(l.as_fd(), shared)) {
            None => Vec::new(),
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                refuse(format!("re-attach list: {e}"));
                return;
            }
        };
        let d = match (their_pool, plan) {
            (Some(p), Some(plan)) => self.take_pool(key, p, plan),
            _ => self.domain_for(key),
        };
        let d = match d {
            Ok(d) => d,
            Err(why) => {
                refuse(why);
                return;
            }
        };
        // memfoldd out of descriptors or memory is this guest's refusal, never memfoldd's
        // end: every other guest keeps its service (a peer can exhaust descriptors).
        let (store, store_fd, swap, swap_fd) = match self.backings_for(d, key) {
            Ok(b) => b,
            Err(e) => {
                refuse(format!("memfoldd could not make its backings: {e}"));
                return;
            }
        };
        let mapped = mapped
            .into_iter()
            .map(|(g, m)| {
                let m = match m {
                    memfold_wire::Mapped::Frame(f) => Mapped::Frame(f),
                    memfold_wire::Mapped::ReclaimedZero => Mapped::Zero,
                };
                (g, m)
            })
            .collect();
        // Its writer before the engine books it: no descriptor or thread for it is a
        // refusal, nothing attached. Nothing is queued before the welcome is sent.
        let outbox = match outbox::Outbox::new(&conn, &name) {
            Ok(o) => o,
            Err(e) => {
                refuse(format!("memfoldd has no writer for its connection: {e}"));
                return;
            }
        };
        if let Some(old) = supersede {
            if self.guests.supersede(old) {
                tracing::info!("{name}: connected again; its old connection is closed");
                self.executor.lost(&mut self.engine, old);
                self.engine.detach(old);
            }
        }
        let vm = match self.engine.attach(Attach {
            name: name.clone(),
            pid,
            pages: (ram_bytes / PAGE) as u32,
            ram: Box::new(MemfdRam::new(ram)),
            mapped,
            domain: d,
            store: Box::new(store),
            swap: swap.map(|s| Box::new(s) as Box<dyn Backing>),
            sharing,
        }) {
            Ok(vm) => vm,
            Err(EngineError::Attach { why, .. }) => {
                refuse(why);
                return;
            }
            Err(e) => {
                refuse(e.to_string());
                return;
            }
        };
        let mut send = vec![self.pools[&d].as_fd(), store_fd.as_fd()];
        send.extend(swap_fd.as_ref().map(|f| f.as_fd()));
        let welcome = ToAgent::Welcome {
            version: PROTOCOL_VERSION,
        };
        // Booked as attached either way: if the welcome is lost, the closed connection's
        // reader reports it gone, and the guest is detached and reaped with its QEMU.
        let sent = conn.send(&welcome, &send).is_ok();
        if !sent {
            conn.shutdown();
        }
        self.guests
            .attached(vm, &name, token, outbox, (pid, uid, ram_id));
        // A guest this memfoldd knew: its own record of the opt-out holds (an opt-in or
        // opt-out made while the agent was detached included). A guest it did not (a
        // restart): the record on disk (`opt_outs.rs`), else the agent's word, so an
        // opt-out outlives the restart — also one the agent never heard of.
        if !known {
            if self
                .opt_outs
                .of(&(pid, ram_id, name.clone()))
                .unwrap_or(opted_out)
            {
                let pages = self.engine.opt_out(vm).unwrap_or(0);
                tracing::info!(
                    "{name}: opted out before the restart; kept out, {pages} pages to take back"
                );
            } else if opted_out {
                tracing::info!("{name}: opted back in before the restart, as recorded; kept in");
            }
        }
        // The agent remembers what holds now, for the next restart.
        let out = self.engine.is_opted_out(vm);
        if let Some(c) = self.guests.conn(vm) {
            c.send_state(ToAgent::OptedOut { out });
        }
    }

    /// Domain `d`'s pool (made now if the engine has no such domain yet, for `key`), and
    /// a new guest's own store and swap file (its QEMU reads no other guest's blobs), each
    /// with the descriptor to hand its agent: (store, its fd, swap file, its fd).
    ///
    /// Errors: a memfd, the swap file or a `dup` failed (nothing was added).
    #[allow(clippy::type_complexity)]
    fn backings_for(
        &mut self,
        d: DomainId,
        key: DomainKey,
    ) -> Result<(FileBacking, OwnedFd, Option<FileBacking>, Option<OwnedFd>), BackingError> {
        let store = FileBacking::memfd("store")?;
        let store_fd = dup(&store)?;
        let swap = match &self.swap_dir {
            Some(dir) => Some(FileBacking::swap_file(dir)?),
            None => None,
        };
        let swap_fd = swap.as_ref().map(dup).transpose()?;
        if !self.engine.has_domain(d) {
            let pool = FileBacking::memfd("pool")?;
            self.pools.insert(d, dup(&pool)?);
            self.engine.add_domain(d, Box::new(pool));
            tracing::info!("{d}: new sharing domain ({key:?})");
        }
        Ok((store, store_fd, swap, swap_fd))
    }
}
