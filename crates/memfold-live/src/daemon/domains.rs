//! Sharing domains (issue 14): which guests share frames and patch against each other's
//! pages ([`DomainRule`], decided from what the kernel says of the peer), the domain a new
//! guest joins, and the domain of a pool a re-attaching agent brings after a restart.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use memfold_core::ids::{DomainId, FrameId, Gfn};
use memfold_sys::memfd;

use super::backings::FileBacking;
use super::{Daemon, PAGE};

/// The largest pool memfoldd adopts from a re-attaching agent, frames (64 GiB of shared
/// frames in one domain): its frame table is sized by the pool's length, which the peer
/// sets.
const MAX_ADOPTED_FRAMES: u64 = 1 << 24;

/// The most domains one key may have at once: its own and pools adopted after restarts
/// (each domain's frame table is sized by its pool, which the peer sets; without a bound
/// a tenant's agent handing a new sparse memfd at every re-attach made memfoldd book,
/// and walk at each count, up to 64 GiB of frames a hello, outside its RAM quota). An
/// honest key gets one more at each restart at which a new guest of it attached before
/// the old guests' agents, kept until those guests exit; past the bound such guests are
/// refused (they run on unmanaged, their data their own) and the log says why.
pub(super) const MAX_DOMAINS_PER_KEY: usize = 16;

/// Which guests form a sharing domain: they share frames and patch against each other's
/// pages, and each of their QEMUs holds the domain's pool (issue 14). Decided from what
/// the kernel says of the peer, never from what the peer says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DomainRule {
    /// The guests whose QEMU runs as one user (uid from SO_PEERCRED): a host that runs
    /// each tenant's VMs as a user of its own keeps tenants apart.
    #[default]
    User,
    /// Each guest alone: pages are shared only within one VM (the strict setting, as
    /// ESX's salting); nothing of one VM is in any descriptor another QEMU holds.
    Vm,
}

impl DomainRule {
    /// The rules' names, for the command line.
    pub const NAMES: [&'static str; 2] = ["user", "vm"];

    /// The rule of `name` (one of [`DomainRule::NAMES`]).
    pub fn by_name(name: &str) -> Option<DomainRule> {
        match name {
            "user" => Some(DomainRule::User),
            "vm" => Some(DomainRule::Vm),
            _ => None,
        }
    }
}

/// What a domain is keyed by under its rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum DomainKey {
    /// A user's guests.
    User(u32),
    /// One guest: its RAM memfd's (device, inode), the same on every re-attach.
    Vm(u64, u64),
}

impl Daemon {
    /// The domain a new guest of `key` joins (created on first use).
    ///
    /// Errors (a refusal's message): [`Self::new_domain`]'s.
    pub(super) fn domain_for(&mut self, key: DomainKey) -> Result<DomainId, String> {
        if let Some(&d) = self.keys.get(&key) {
            return Ok(d);
        }
        let d = self.new_domain(key)?;
        self.keys.insert(key, d);
        Ok(d)
    }

    /// A new domain's id, for `key`.
    ///
    /// Errors (a refusal's message): 2^32 domains were made since memfoldd started.
    /// INVARIANT: a domain id is never given twice — a guest given a live domain's id
    /// would be handed that domain's pool (another tenant's frames), and a dropped
    /// domain's id may still name its blocks and hints. Under `DomainRule::Vm` each
    /// attach makes a domain, so the count could wrap in a long enough life.
    fn new_domain(&mut self, key: DomainKey) -> Result<DomainId, String> {
        let d = DomainId(self.next_domain);
        self.next_domain = self.next_domain.checked_add(1).ok_or_else(|| {
            "memfoldd made 2^32 sharing domains since it started: restart it".to_string()
        })?;
        self.key_of.insert(d, key);
        Ok(d)
    }

    /// The domain of a re-attaching agent of `key` that maps pool `theirs`: the domain
    /// whose pool it is; else (a restart) the domain of `key` adopts it if it has not used
    /// a pool of its own yet; else — a new guest of `key` attached first and made a pool —
    /// a new domain of the same key adopts it, so both keep their frames (they share
    /// within each pool only, until the old one's guests are gone).
    ///
    /// Errors (a refusal's message): as [`Self::check_pool`]'s, or 2^32 domains made.
    #[cfg(test)]
    pub(super) fn pool_domain(
        &mut self,
        key: DomainKey,
        theirs: OwnedFd,
        ram_id: (u64, u64),
    ) -> Result<DomainId, String> {
        let plan = self
            .check_pool(key, &theirs, ram_id, std::process::id())
            .map_err(|r| match r {
                PoolRefusal::Refuse(why) => why,
                PoolRefusal::Leave(why) => format!("leave: {why}"),
            })?;
        self.take_pool(key, theirs, plan)
    }

    /// What pool `theirs` of a re-attaching agent of `key` (guest RAM `ram_id`) would be
    /// to memfoldd, checked with no side effect and no read of the pool, so that a hello
    /// to be refused for its pool is refused before anything costly is done for it (its
    /// re-attach list read; `attach.rs`).
    ///
    /// A guest keyed alone (`DomainKey::Vm`: never-share, or the `vm` rule) adopts a
    /// pool only if no process but its QEMU (`pid`) holds it. Under an earlier memfoldd
    /// and another rule its pool may be shared with other guests, whose QEMUs hold it and
    /// read it: frames memfoldd wrote into it for this guest would be theirs to read, and
    /// its pages shared onto frames they map — what keeping it alone (Satori §4.3's
    /// never-share) forbids. Its agent is told to leave the pool then
    /// ([`PoolRefusal::Leave`]): it copies its pages off the frames and attaches again
    /// with no pool, into a domain of its own.
    ///
    /// Errors: [`PoolRefusal::Leave`] for a guest kept alone whose pool other processes
    /// hold (or who holds it cannot be told), or that is another domain's;
    /// [`PoolRefusal::Refuse`] when the pool is another key's domain's (a guest not kept
    /// alone), its guest RAM, not a memfd open for reading and writing, larger than
    /// [`MAX_ADOPTED_FRAMES`], or a new domain would give `key` more than
    /// [`MAX_DOMAINS_PER_KEY`].
    pub(super) fn check_pool(
        &self,
        key: DomainKey,
        theirs: &OwnedFd,
        ram_id: (u64, u64),
        pid: u32,
    ) -> Result<PoolPlan, PoolRefusal> {
        let id = |f: &OwnedFd| memfd::file_id(f.as_fd()).ok();
        let Some(theirs_id) = id(theirs) else {
            return Err(PoolRefusal::Refuse("its pool is not a file".into()));
        };
        if !memfd::is_read_write_memfd(theirs.as_fd()) || theirs_id == ram_id {
            return Err(PoolRefusal::Refuse(
                "its pool is not a memfd open for reading and writing".into(),
            ));
        }
        let alone = matches!(key, DomainKey::Vm(..));
        if let Some((&d, _)) = self.pools.iter().find(|(_, p)| id(p) == Some(theirs_id)) {
            return if self.key_of.get(&d) == Some(&key) {
                Ok(PoolPlan::Known(d))
            } else {
                let why = format!("it maps the pool of {d}, another sharing domain's");
                Err(if alone {
                    PoolRefusal::Leave(why)
                } else {
                    PoolRefusal::Refuse(why)
                })
            };
        }
        let into = match self.keys.get(&key) {
            Some(&d) if self.engine.pool_untouched(d) => Some(d),
            _ => {
                let of_key = self.key_of.values().filter(|&&k| k == key).count();
                if of_key >= MAX_DOMAINS_PER_KEY {
                    return Err(PoolRefusal::Refuse(format!(
                        "it brings a pool memfoldd does not know, and its sharing domain has \
                         {of_key} pools already (its own and ones adopted after restarts, \
                         at most {MAX_DOMAINS_PER_KEY})"
                    )));
                }
                None
            }
        };
        if let DomainKey::Vm(..) = key {
            match super::guests::holders(theirs_id.0, theirs_id.1) {
                Some(h) if h.iter().all(|&p| p == pid) => {}
                Some(h) => {
                    let others: Vec<String> = h
                        .iter()
                        .filter(|&&p| p != pid)
                        .take(8)
                        .map(|p| p.to_string())
                        .collect();
                    return Err(PoolRefusal::Leave(format!(
                        "it is kept alone (never-share, or the vm rule) but brings a pool \
                         other processes hold too (pids {}): shared under an earlier \
                         memfoldd",
                        others.join(", ")
                    )));
                }
                None => {
                    return Err(PoolRefusal::Leave(
                        "it is kept alone (never-share, or the vm rule) and brings a \
                         pool whose holders memfoldd cannot read"
                            .into(),
                    ))
                }
            }
        }
        let size = memfd::size(theirs.as_fd()).unwrap_or(0);
        if size / PAGE > MAX_ADOPTED_FRAMES {
            return Err(PoolRefusal::Refuse(format!(
                "its pool of {size} bytes is over the {} GiB memfoldd adopts",
                (MAX_ADOPTED_FRAMES * PAGE) >> 30
            )));
        }
        Ok(PoolPlan::Adopt { into, size })
    }

    /// The domain of pool `theirs` of an agent of `key`, as [`Self::check_pool`] found
    /// it (`plan`, with nothing changed since: both run on the main thread): its known
    /// domain, or the domain that adopts it now, of the size checked (a pool grown since
    /// is cut back to it when counted).
    ///
    /// Errors (a refusal's message): 2^32 domains made; the pool's descriptor cannot be
    /// duplicated.
    pub(super) fn take_pool(
        &mut self,
        key: DomainKey,
        theirs: OwnedFd,
        plan: PoolPlan,
    ) -> Result<DomainId, String> {
        let (into, size) = match plan {
            PoolPlan::Known(d) => return Ok(d),
            PoolPlan::Adopt { into, size } => (into, size),
        };
        let d = match into {
            Some(d) => d,
            None => {
                let d = self.new_domain(key)?;
                self.keys.entry(key).or_insert(d);
                d
            }
        };
        let frames = (size / PAGE) as u32;
        let held: Vec<FrameId> = memfd::data_runs(theirs.as_fd(), Gfn(0), Gfn(frames))
            .into_iter()
            .flat_map(|(a, b)| (a.0..b.0).map(FrameId))
            .collect();
        let mine = theirs.try_clone().map_err(|e| format!("its pool: {e}"))?;
        tracing::info!(
            "{d} adopts the pool of a previous memfoldd: {frames} frames, {} held",
            held.len()
        );
        self.engine
            .adopt_pool(d, Box::new(FileBacking::adopt(mine, size)), frames, held);
        self.pools.insert(d, theirs);
        Ok(d)
    }
}

/// How long a guest told to leave its pool counts as still copying, against the host's
/// available memory ([`Leaving`]).
const LEAVING_FOR: Duration = Duration::from_secs(30);

/// Guests told lately to leave a pool ([`PoolRefusal::Leave`]): each copies the pages it
/// had on frames into its own RAM, as KSM's unmerge does, and a restart that keeps
/// guests alone (the `vm` rule, or never-share marks) tells every guest that shared. Told
/// all at once, they could ask for more memory than the host has, and its OOM killer
/// would pick QEMUs. So a guest is told only while the host's available memory, less
/// what the guests told in the last [`LEAVING_FOR`] may still be copying, covers its
/// pages (the hello's count of pages on frames or reclaimed: an upper bound of what it
/// copies) and a reserve of a sixteenth of the host's RAM; otherwise it is
/// refused for now, says why, and its agent tries again after its back-off (30 s),
/// unmanaged meanwhile, its pages as they are.
#[derive(Debug, Default)]
pub(super) struct Leaving {
    /// (when, bytes to copy) of each guest told, oldest first.
    told: VecDeque<(Instant, u64)>,
}

impl Leaving {
    /// Whether a guest that lists `pages` (on frames or reclaimed) may be told to leave its
    /// pool at `now`, the host having `available` bytes free (`None`: not known; only the
    /// guests told lately are weighed) of `total`: Ok books its copy; Err is the reason,
    /// for its refusal.
    pub(super) fn admit(
        &mut self,
        now: Instant,
        pages: u64,
        available: Option<u64>,
        total: u64,
    ) -> Result<(), String> {
        while self
            .told
            .front()
            .is_some_and(|&(t, _)| now.duration_since(t) >= LEAVING_FOR)
        {
            self.told.pop_front();
        }
        let copying: u64 = self.told.iter().map(|&(_, b)| b).sum();
        let need = pages.saturating_mul(PAGE);
        let free = available.unwrap_or(u64::MAX).saturating_sub(copying);
        let reserve = total / 16;
        if free < need.saturating_add(reserve) {
            return Err(format!(
                "leaving its pool copies {} MiB, and the host has {} MiB available less {} MiB \
                 other guests leaving theirs are copying, short of that plus a reserve of {} MiB: \
                 tried again later",
                need >> 20,
                available.unwrap_or(0) >> 20,
                copying >> 20,
                reserve >> 20
            ));
        }
        self.told.push_back((now, need));
        Ok(())
    }
}

/// Why a re-attaching agent's pool is not taken ([`Daemon::check_pool`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum PoolRefusal {
    /// The guest is refused, for this reason: it runs on unmanaged.
    Refuse(String),
    /// The guest is kept alone and may not keep this pool, for this reason: its agent is
    /// told to leave it ([`memfold_wire::ToAgent::LeavePool`]) and attach again with none.
    /// INVARIANT (never-share, Satori §4.3): a guest kept alone is never attached onto a
    /// pool another process holds — its pages there are on frames the others map, its
    /// writes CoW breaks they can time, and frames written for it theirs to read.
    Leave(String),
}

/// What a re-attaching agent's pool is to memfoldd ([`Daemon::check_pool`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PoolPlan {
    /// The pool of this domain, of the agent's key.
    Known(DomainId),
    /// A pool of `size` bytes to adopt: into the key's domain that has used no pool of
    /// its own yet, or (`None`) a new domain of the key.
    Adopt { into: Option<DomainId>, size: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::{DaemonConfig, DomainRule};

    fn config(dir: &std::path::Path, domains: DomainRule) -> DaemonConfig {
        DaemonConfig {
            socket: dir.join("s"),
            engine: memfold_core::EngineConfig::default(),
            swap_dir: dir.to_path_buf(),
            swap_capacity: 0,
            domains,
            agent_gid: None,
            never_share: Default::default(),
            claim: memfold_core::ClaimPolicy::Never,
            allowance: 0,
            guest_channels: None,
            tenant_max_bytes: u64::MAX,
        }
    }

    /// A sparse pool memfd of `pages` pages, as an agent may hand one.
    fn pool(pages: u64) -> OwnedFd {
        let fd = memfd::create("test-pool").unwrap();
        memfd::set_len(fd.as_fd(), pages * PAGE).unwrap();
        fd
    }

    /// Pools a key's agents hand that memfoldd does not know each get a domain, up to
    /// [`MAX_DOMAINS_PER_KEY`] for the key; then refused, with a message. A pool already
    /// adopted is still found, and another key still adopts. Fails without the bound (a
    /// fifth, sixth... sparse 64 GiB pool adopted).
    #[test]
    fn a_key_adopts_a_bounded_number_of_pools() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon::new(&config(dir.path(), DomainRule::User)).unwrap();
        let key = DomainKey::User(5);
        let ram = (u64::MAX, u64::MAX);
        let mut first = None;
        for i in 0..MAX_DOMAINS_PER_KEY {
            let p = pool(1 << 10);
            let again = p.try_clone().unwrap();
            let dom = d.pool_domain(key, p, ram).unwrap();
            first.get_or_insert((dom, again));
            assert_eq!(d.key_of.values().filter(|&&k| k == key).count(), i + 1);
        }
        let r = d.pool_domain(key, pool(1 << 10), ram);
        assert!(
            matches!(&r, Err(why) if why.contains("at most 16")),
            "{r:?}"
        );
        let (dom, again) = first.unwrap();
        assert_eq!(d.pool_domain(key, again, ram), Ok(dom));
        assert!(d.pool_domain(DomainKey::User(6), pool(1), ram).is_ok());
    }

    /// A guest kept alone (never-share, or the vm rule) does not adopt a pool another
    /// process holds — here a child given it as its standard input, as another guest's
    /// QEMU of an earlier memfoldd's shared domain holds it: frames written into it for
    /// this guest would be that process's to read. It is told to leave it (not refused,
    /// which left it unmanaged with its shared pages on the others' frames). A
    /// user-keyed guest still adopts it; once the other holder is gone, the guest kept
    /// alone does too. Fails without the check (the pool adopted into the guest's own
    /// domain), and with the refusal kind it had.
    #[test]
    fn a_guest_kept_alone_adopts_no_pool_another_process_holds() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon::new(&config(dir.path(), DomainRule::Vm)).unwrap();
        let (p, shared) = (pool(1 << 10), pool(1 << 10));
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::from(p.try_clone().unwrap()))
            .stdout(std::fs::File::from(shared.try_clone().unwrap()))
            .spawn()
            .unwrap();
        let ram = (u64::MAX, u64::MAX);
        assert!(d.pool_domain(DomainKey::User(5), shared, ram).is_ok());
        let r = d.check_pool(DomainKey::Vm(1, 1), &p, ram, std::process::id());
        assert!(
            matches!(&r, Err(PoolRefusal::Leave(why)) if why.contains(&format!("pids {}", other.id()))),
            "{r:?}"
        );
        other.kill().unwrap();
        other.wait().unwrap();
        assert!(d.pool_domain(DomainKey::Vm(1, 1), p, ram).is_ok());
    }

    /// Leaves are told while the host's memory covers their copies: one whose pages do
    /// not fit beside the reserve is refused; a second is weighed against the first's
    /// copy until that is [`LEAVING_FOR`] old. Fails without the reserve, or with the
    /// guests told lately left out.
    #[test]
    fn guests_are_told_to_leave_their_pools_while_the_host_can_hold_the_copies() {
        let mib = |m: u64| m << 20;
        let pages = |m: u64| mib(m) / PAGE;
        let t0 = Instant::now();
        let mut l = Leaving::default();
        // 1 GiB of RAM: a reserve of 64 MiB.
        let r = l.admit(t0, pages(100), Some(mib(150)), mib(1024));
        assert!(
            matches!(&r, Err(why) if why.contains("reserve of 64 MiB")),
            "{r:?}"
        );
        assert_eq!(l.admit(t0, pages(100), Some(mib(200)), mib(1024)), Ok(()));
        let r = l.admit(t0, pages(100), Some(mib(200)), mib(1024));
        assert!(
            matches!(&r, Err(why) if why.contains("less 100 MiB")),
            "{r:?}"
        );
        let later = t0 + LEAVING_FOR;
        assert_eq!(
            l.admit(later, pages(100), Some(mib(200)), mib(1024)),
            Ok(())
        );
    }

    /// A guest kept alone that brings the pool of a live domain of another key (another
    /// guest adopted it first after a restart) is told to leave it, and one not kept
    /// alone is refused. Fails with either kind swapped.
    #[test]
    fn a_guest_kept_alone_leaves_another_domain_s_pool() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon::new(&config(dir.path(), DomainRule::User)).unwrap();
        let p = pool(1 << 10);
        let ram = (u64::MAX, u64::MAX);
        let pid = std::process::id();
        assert!(d
            .pool_domain(DomainKey::User(5), p.try_clone().unwrap(), ram)
            .is_ok());
        let r = d.check_pool(DomainKey::Vm(1, 1), &p, ram, pid);
        assert!(
            matches!(&r, Err(PoolRefusal::Leave(why)) if why.contains("another sharing domain")),
            "{r:?}"
        );
        let r = d.check_pool(DomainKey::User(6), &p, ram, pid);
        assert!(
            matches!(&r, Err(PoolRefusal::Refuse(why)) if why.contains("another sharing domain")),
            "{r:?}"
        );
    }

    /// Domain ids are never given twice: past 2^32 domains the attach is refused (a
    /// wrapped id handed a new guest a live domain's pool). Fails with the count wrapping.
    #[test]
    fn domain_ids_run_out_rather_than_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon::new(&config(dir.path(), DomainRule::Vm)).unwrap();
        assert_eq!(d.domain_for(DomainKey::Vm(1, 1)), Ok(DomainId(0)));
        d.next_domain = u32::MAX - 1;
        assert_eq!(
            d.domain_for(DomainKey::Vm(1, 2)),
            Ok(DomainId(u32::MAX - 1))
        );
        let r = d.domain_for(DomainKey::Vm(1, 3));
        assert!(matches!(&r, Err(why) if why.contains("2^32")), "{r:?}");
        // A key that has its domain still joins it.
        assert_eq!(d.domain_for(DomainKey::Vm(1, 1)), Ok(DomainId(0)));
    }
}
