//! Guests: each guest's connection for replies (its readers are `readers`'), what its
//! agent last reported (fault counts, latencies), and whether its QEMU still lives.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use memfold_core::ids::VmId;
use memfold_wire::{AgentReport, OpLatencies, OpLatency, AGENT_OPS};

/// One guest memfoldd manages.
pub(crate) struct Guest {
    /// Its name, as its agent gave it (`NAME/ramK` for a region of a multi-region QEMU).
    pub(crate) name: String,
    /// Its RAM memfd's (device, inode): a re-attach must bring the same memfd.
    pub(crate) ram_id: (u64, u64),
    /// Its agent said the region is no longer mapped (`ToDaemon::RegionUnmapped`).
    pub(crate) unmapped: bool,
    /// The way its agent's messages go out; `None` while detached.
    pub(crate) conn: Option<super::outbox::Outbox>,
    /// The reader thread's token of that connection.
    pub(crate) token: Option<u64>,
    pub(crate) pid: u32,
    /// Its QEMU's uid (from the kernel): a tenant's statistics list its own guests only.
    pub(crate) uid: u32,
    /// The agent's counters and latency histograms, as last reported.
    pub(crate) wp_faults: u64,
    pub(crate) missing_faults: u64,
    pub(crate) minor_faults: u64,
    pub(crate) latency: [OpLatency; AGENT_OPS],
    /// Bytes of the agent's record of the region's pages.
    pub(crate) agent_state_bytes: u64,
    /// Its QEMU's mappings as the agent counts them.
    pub(crate) qemu_mappings: u64,
    /// Its agent's VMA budget (0: not said).
    pub(crate) vma_budget: u64,
    /// A warning that its QEMU is at its VMA budget was logged, and the mappings have
    /// not fallen under three quarters of it since.
    pub(crate) vma_warned: bool,
    /// When that warning was last logged.
    pub(crate) vma_warned_at: Option<Instant>,
    /// Whole-run CoW breaks at the VMA budget.
    pub(crate) run_breaks: u64,
    /// Pages broken ahead of a sequential writer.
    pub(crate) ahead_breaks: u64,
    /// Pages broken without a copy under a device's whole-page declaration.
    pub(crate) nocopy_breaks: u64,
    /// Runs the agent's clock scans zapped, and left alone as unmapped.
    pub(crate) clock_zaps: (u64, u64),
}

impl Guest {
    /// Guest `name` of QEMU `pid` (user `uid`) with RAM `ram_id`, not yet connected,
    /// nothing counted.
    fn detached(name: &str, pid: u32, uid: u32, ram_id: (u64, u64)) -> Guest {
        Guest {
            name: name.into(),
            ram_id,
            unmapped: false,
            conn: None,
            token: None,
            pid,
            uid,
            wp_faults: 0,
            missing_faults: 0,
            minor_faults: 0,
            latency: Default::default(),
            agent_state_bytes: 0,
            qemu_mappings: 0,
            vma_budget: 0,
            vma_warned: false,
            vma_warned_at: None,
            run_breaks: 0,
            ahead_breaks: 0,
            nocopy_breaks: 0,
            clock_zaps: (0, 0),
        }
    }
}

/// The guests, by engine id, and which connection is whose.
#[derive(Default)]
pub(crate) struct Guests {
    pub(crate) by_vm: BTreeMap<VmId, Guest>,
    by_token: HashMap<u64, VmId>,
    /// Pages block devices reported landed in RAM of no attached guest, or in reports over
    /// the batch limit: dropped (cumulative).
    pub(crate) landed_dropped: u64,
}

impl Guests {
    /// Ends every attached guest's connection (its agent sees memfoldd gone and keeps
    /// serving the guest); returns how many there were.
    pub(crate) fn close_all(&mut self) -> usize {
        let all: Vec<_> = self
            .by_vm
            .values_mut()
            .filter_map(|g| g.conn.take())
            .collect();
        let n = all.len();
        super::outbox::Outbox::close(all, std::time::Duration::from_secs(1));
        n
    }

    /// Records guest `vm` (re-)attached on connection `token`, its messages going out
    /// through `conn`, its RAM memfd `ram_id` in QEMU `pid` of user `uid`.
    pub(crate) fn attached(
        &mut self,
        vm: VmId,
        name: &str,
        token: u64,
        conn: super::outbox::Outbox,
        (pid, uid, ram_id): (u32, u32, (u64, u64)),
    ) {
        self.by_token.insert(token, vm);
        let g = self
            .by_vm
            .entry(vm)
            .or_insert_with(|| Guest::detached(name, pid, uid, ram_id));
        g.conn = Some(conn);
        g.token = Some(token);
    }

    /// The guest whose agent speaks on connection `token`.
    pub(crate) fn vm_of(&self, token: u64) -> Option<VmId> {
        self.by_token.get(&token).copied()
    }

    /// The attached guest whose RAM memfd is `ram_id` (device, inode).
    pub(crate) fn vm_of_ram(&self, ram_id: (u64, u64)) -> Option<VmId> {
        self.by_vm
            .iter()
            .find(|(_, g)| g.ram_id == ram_id && g.conn.is_some())
            .map(|(vm, _)| *vm)
    }

    /// Connection `token` ended: its guest is detached. Returns the guest.
    pub(crate) fn gone(&mut self, token: u64) -> Option<VmId> {
        let vm = self.by_token.remove(&token)?;
        // A guest attached on another connection since is not this one's to detach.
        let g = self.by_vm.get_mut(&vm).filter(|g| g.token == Some(token))?;
        g.conn = None;
        g.token = None;
        Some(vm)
    }

    /// The RAM memfds (device, inode) of the attached guests.
    pub(crate) fn attached_rams(&self) -> Vec<(u64, u64)> {
        let attached = self.by_vm.values().filter(|g| g.conn.is_some());
        attached.map(|g| g.ram_id).collect()
    }

    /// Guest RAM of the guests, attached or detached, whose QEMUs run as `uid`, bytes.
    pub(crate) fn ram_of_uid(&self, uid: u32, engine: &memfold_core::Engine) -> u64 {
        self.by_vm
            .iter()
            .filter(|(_, g)| g.uid == uid)
            .filter_map(|(vm, _)| engine.ram_bytes(*vm))
            .sum()
    }

    /// Whether QEMU `pid` has a guest `name`, attached or detached (a QEMU of several RAM
    /// regions has a guest each, `NAME/ramK`).
    pub(crate) fn named(&self, pid: u32, name: &str) -> bool {
        self.by_vm.values().any(|g| g.pid == pid && g.name == name)
    }

    /// The guest, attached or detached, whose RAM memfd is `ram_id`: its id, its QEMU's
    /// pid, its name and whether it is attached.
    pub(crate) fn holder_of_ram(&self, ram_id: (u64, u64)) -> Option<(VmId, u32, &str, bool)> {
        self.by_vm
            .iter()
            .find(|(_, g)| g.ram_id == ram_id)
            .map(|(vm, g)| (*vm, g.pid, g.name.as_str(), g.conn.is_some()))
    }

    /// Ends guest `vm`'s connection now, as if it were gone (its QEMU connected again for
    /// it: the new connection replaces it). Returns whether it was attached.
    pub(crate) fn supersede(&mut self, vm: VmId) -> bool {
        let Some(g) = self.by_vm.get_mut(&vm) else {
            return false;
        };
        if let Some(t) = g.token.take() {
            self.by_token.remove(&t);
        }
        match g.conn.take() {
            Some(c) => {
                c.end();
                true
            }
            None => false,
        }
    }

    /// The way to guest `vm`'s agent.
    pub(crate) fn conn(&self, vm: VmId) -> Option<&super::outbox::Outbox> {
        self.by_vm.get(&vm).and_then(|g| g.conn.as_ref())
    }

    /// Takes in an agent's report.
    pub(crate) fn report(&mut self, vm: VmId, r: &AgentReport) {
        let Some(g) = self.by_vm.get_mut(&vm) else {
            return;
        };
        g.wp_faults = r.wp_faults;
        g.missing_faults = r.missing_faults;
        g.minor_faults = r.minor_faults;
        g.agent_state_bytes = r.state_bytes;
        g.qemu_mappings = r.mappings;
        g.vma_budget = r.vma_budget;
        let since = g.vma_warned_at.map(|t| t.elapsed());
        match vma_warning(r.mappings, r.vma_budget, g.vma_warned, since) {
            Some(true) => {
                g.vma_warned = true;
                g.vma_warned_at = Some(Instant::now());
                tracing::warn!(
                    "{}: its QEMU has {} mappings of a VMA budget of {} (vm.max_map_count {}): \
                     shares that need a mapping are refused, cold ones go on without one; \
                     `memfoldd --max-map-count N` raises the limit (~10 000 mappings a GiB \
                     of guest RAM shared at the mixed set's density; docs/scale.md)",
                    g.name,
                    r.mappings,
                    r.vma_budget,
                    memfold_sys::max_map_count::read(),
                );
            }
            Some(false) => g.vma_warned = false,
            None => {}
        }
        g.run_breaks = r.run_breaks;
        g.ahead_breaks = r.ahead_breaks;
        g.nocopy_breaks = r.nocopy_breaks;
        g.clock_zaps = (r.clock_zaps, r.clock_zaps_skipped);
        g.latency = [
            &r.share_ns,
            &r.cow_break_ns,
            &r.fault_ns,
            &r.reclaim_ns,
            &r.track_ns,
            &r.stash_ns,
            &r.unstash_ns,
        ]
        .map(|p| OpLatency::from_pairs(p));
    }

    /// The agent's latency summaries for guest `vm`.
    pub(crate) fn latencies(&self, vm: VmId) -> OpLatencies {
        self.by_vm.get(&vm).map_or_else(OpLatencies::default, |g| {
            OpLatencies::from_histograms(&g.latency)
        })
    }

    /// Guest `vm`'s agent said its region is no longer mapped (hot-unplug). Returns the
    /// line to log.
    pub(crate) fn region_unmapped(&mut self, vm: VmId) -> String {
        match self.by_vm.get_mut(&vm) {
            Some(g) => {
                g.unmapped = true;
                format!(
                    "region {} ({vm}) is no longer mapped in QEMU pid {} (hot-unplug): its agent detaches",
                    g.name, g.pid
                )
            }
            None => format!("{vm}: its region is no longer mapped (hot-unplug)"),
        }
    }

    /// Detached guests memfoldd may let go, each with why: their QEMU has exited, or it
    /// runs on but neither maps nor holds their RAM memfd any more (a memory backend
    /// deleted after hot-unplug, its agent ended; its word, [`Guest::unmapped`], is not
    /// taken for it). Their mappings are gone, no agent can come back for them.
    ///
    /// Each QEMU's `/proc` files are read once a call, however many of its guests are
    /// detached (once a guest made a reap of many regions of one QEMU O(regions²)).
    pub(crate) fn released(&self) -> Vec<(VmId, Release)> {
        // Each QEMU once: `None` if it has exited, else its files (`None`: unreadable).
        let mut qemus: HashMap<u32, Option<Option<Files>>> = HashMap::new();
        self.by_vm
            .iter()
            .filter(|(_, g)| g.conn.is_none())
            .filter_map(|(vm, g)| {
                let qemu = qemus
                    .entry(g.pid)
                    .or_insert_with(|| process_alive(g.pid).then(|| files_of(g.pid)));
                match qemu {
                    None => Some((*vm, Release::Exited)),
                    Some(Some(f)) if !f.contains(&g.ram_id) => Some((*vm, Release::Unmapped)),
                    Some(_) => None,
                }
            })
            .collect()
    }

    /// The line memfoldd logs when it lets guest `vm` go ([`Guests::released`]).
    pub(crate) fn release_line(&self, vm: VmId, why: Release) -> String {
        let Some(g) = self.by_vm.get(&vm) else {
            return format!("{vm}: released");
        };
        match why {
            Release::Exited => format!(
                "{} ({vm}): its QEMU (pid {}) has exited; released",
                g.name, g.pid
            ),
            Release::Unmapped => format!(
                "region {} ({vm}) released (unmapped; QEMU pid {} runs on{})",
                g.name,
                g.pid,
                if g.unmapped {
                    ", its agent said so"
                } else {
                    ""
                }
            ),
        }
    }

    /// Forgets guest `vm`.
    pub(crate) fn remove(&mut self, vm: VmId) {
        self.by_vm.remove(&vm);
        self.by_token.retain(|_, v| *v != vm);
    }
}

/// Why a detached guest is let go ([`Guests::released`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Its QEMU has exited.
    Exited,
    /// Its QEMU runs on but no longer maps nor holds its RAM (a region unplugged).
    Unmapped,
}

/// Shortest time between two at-the-budget warnings of one guest: its agent (inside an
/// untrusted QEMU) says what its mappings are, and one that swings them around the
/// threshold must not flood memfoldd's log.
const VMA_WARN_EVERY: Duration = Duration::from_secs(60);

/// Whether an agent's report of `mappings` against its VMA `budget` calls for the
/// at-the-budget warning (`Some(true)`: log it now), ends one (`Some(false)`: the mappings
/// fell under three quarters of the budget, warn again next time), or neither. Shares stop
/// at seven eighths of the budget (`memfold-agent`'s `vmas.rs`); the warning comes once an
/// episode, not once a report, and at most once per [`VMA_WARN_EVERY`] (`since`: the time
/// since the guest's last warning, `None` if never). A budget of 0 (an agent that does
/// not say) never warns.
fn vma_warning(mappings: u64, budget: u64, warned: bool, since: Option<Duration>) -> Option<bool> {
    if budget == 0 {
        return None;
    }
    let at = mappings >= budget - budget / 8;
    let under = mappings < budget / 4 * 3;
    let due = since.is_none_or(|d| d >= VMA_WARN_EVERY);
    match (warned, at, under) {
        (false, true, _) if due => Some(true),
        (true, _, true) => Some(false),
        _ => None,
    }
}

/// Whether process `pid` lives (and is not a zombie).
pub(crate) fn process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            // The command name is the process's to choose, `x) Z` included: the state
            // follows the last ')'.
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
}

/// Whether process `pid` neither maps the file of (device, inode) `id` nor holds a
/// descriptor of it, as far as `/proc/PID/maps` and `/proc/PID/fd` say; `false` when
/// either cannot be read (it may still hold it).
#[cfg(test)]
fn ram_let_go(pid: u32, id: (u64, u64)) -> bool {
    files_of(pid).is_some_and(|f| !f.contains(&id))
}

/// Files by (device, inode).
type Files = BTreeSet<(u64, u64)>;

/// The files, (device, inode), process `pid` maps (`/proc/PID/maps`) or holds a
/// descriptor of (`/proc/PID/fd`); `None` when either cannot be read (it may hold any).
fn files_of(pid: u32) -> Option<Files> {
    use std::os::unix::fs::MetadataExt;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let mut files = BTreeSet::new();
    for l in maps.lines() {
        // address perms offset dev inode path: dev is "major:minor" in hex.
        let mut f = l.split_whitespace().skip(3);
        let (Some(dev), Some(ino)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((major, minor)) = dev.split_once(':') else {
            continue;
        };
        if let (Ok(major), Ok(minor), Ok(ino)) = (
            u32::from_str_radix(major, 16),
            u32::from_str_radix(minor, 16),
            ino.parse::<u64>(),
        ) {
            files.insert((libc::makedev(major, minor), ino));
        }
    }
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    for fd in fds.flatten() {
        if let Ok(m) = std::fs::metadata(fd.path()) {
            files.insert((m.dev(), m.ino()));
        }
    }
    Some(files)
}

/// Whether one of the descriptors listed in `fds` (entries of a `/proc/PID/fd` folder) is
/// of the file with this device and inode (each followed with a `stat`; nothing opened).
pub(crate) fn holds(fds: impl IntoIterator<Item = std::fs::DirEntry>, dev: u64, ino: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    fds.into_iter()
        .any(|fd| std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == dev && m.ino() == ino))
}

/// Pids of the processes (other than this one) holding a descriptor of the file with
/// this device and inode: who may still map an adopted pool. `None` if memfoldd cannot
/// tell: `/proc`, or a live process's descriptors, cannot be read (another user's, or
/// `hidepid`) — that process may hold it.
pub(crate) fn holders(dev: u64, ino: u64) -> Option<Vec<u32>> {
    let me = std::process::id();
    let procs = std::fs::read_dir("/proc").ok()?;
    let mut out = Vec::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let fds = match std::fs::read_dir(p.path().join("fd")) {
            Ok(fds) => fds,
            // Exited meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(_) => return None,
        };
        if holds(fds.flatten(), dev, ino) {
            out.push(pid);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    /// The at-the-budget warning comes once when the mappings reach the point where shares
    /// stop, not again while they stay near it, and again after they fell well under it.
    #[test]
    fn the_vma_warning_comes_once_an_episode() {
        let (long, soon) = (Some(VMA_WARN_EVERY), Some(VMA_WARN_EVERY / 2));
        // (mappings of a budget of 80 000, warned already, since the last warning, verdict)
        let cases = [
            (69_999, false, None, None, "under 7/8: shares still made"),
            (70_000, false, None, Some(true), "at 7/8: shares stop"),
            (71_000, true, long, None, "once, not every report"),
            (65_000, true, long, None, "not yet under 3/4"),
            (59_999, true, long, Some(false), "the episode ends"),
            (70_500, false, long, Some(true), "a second episode"),
            (
                70_500,
                false,
                soon,
                None,
                "an agent swinging its count: once a minute",
            ),
        ];
        for (mappings, warned, since, want, why) in cases {
            assert_eq!(vma_warning(mappings, 80_000, warned, since), want, "{why}");
        }
        assert_eq!(
            vma_warning(1 << 40, 0, false, None),
            None,
            "an agent that does not say"
        );
    }

    use super::*;
    use std::os::fd::{AsFd, AsRawFd};
    use std::os::unix::process::CommandExt;

    #[test]
    fn ram_is_let_go_only_once_neither_mapped_nor_held() {
        let fd = memfold_sys::memfd::create("let-go").unwrap();
        memfold_sys::memfd::set_len(fd.as_fd(), 4096).unwrap();
        let id = memfold_sys::memfd::file_id(fd.as_fd()).unwrap();
        let me = std::process::id();
        // SAFETY: a new shared mapping of a memfd this test owns, unmapped below; never
        // touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert!(!ram_let_go(me, id), "mapped and held");
        drop(fd);
        assert!(!ram_let_go(me, id), "mapped");
        // SAFETY: the mapping made above, unused.
        assert_eq!(unsafe { libc::munmap(p, 4096) }, 0);
        assert!(ram_let_go(me, id), "neither mapped nor held");
        // A process memfoldd cannot read (gone): not let go by this rule.
        assert!(!ram_let_go(u32::MAX, id));
    }

    /// A QEMU whose command name reads like a zombie's state (`a) Zz`: the kernel writes
    /// `PID (a) Zz) S ...`) is alive, and dead once it is a zombie. Seen failing without
    /// the mend: cut at the first `) `, it read as a zombie, and its detached guest would
    /// have been dropped while it still mapped pool frames.
    #[test]
    fn a_process_named_like_a_zombie_state_is_alive() {
        let dir = tempfile::tempdir().unwrap();
        // The kernel names a process after the file it executes.
        let named = dir.path().join("a) Zz");
        std::os::unix::fs::symlink("/bin/sleep", &named).unwrap();
        let mut child = std::process::Command::new(&named)
            .arg0("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        assert!(stat.starts_with(&format!("{pid} (a) Zz) ")), "{stat}");
        let alive = process_alive(pid);
        child.kill().unwrap();
        // A zombie until reaped: no longer alive.
        let until = Instant::now() + Duration::from_secs(5);
        while process_alive(pid) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let zombie = !process_alive(pid);
        child.wait().unwrap();
        assert!(alive, "a live process named \"a) Zz\" read as a zombie");
        assert!(zombie, "a zombie named \"a) Zz\" read as alive");
    }

    /// A region unplugged from a QEMU that runs on is released as a region unmapped, not
    /// as a QEMU that exited (it was logged "its QEMU has exited" either way); a guest
    /// whose QEMU is gone is released as exited; one whose RAM is still held is kept.
    #[test]
    fn a_region_unplugged_is_released_as_unmapped_and_a_qemu_gone_as_exited() {
        let me = std::process::id();
        // RAM this process (the "QEMU") let go: a memfd closed and never mapped.
        let gone_ram = {
            let fd = memfold_sys::memfd::create("unplugged").unwrap();
            memfold_sys::memfd::file_id(fd.as_fd()).unwrap()
        };
        let held = memfold_sys::memfd::create("held").unwrap();
        let held_ram = memfold_sys::memfd::file_id(held.as_fd()).unwrap();
        // A process that has exited (and was reaped).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let mut guests = Guests::default();
        guests
            .by_vm
            .insert(VmId(1), Guest::detached("g/ram1", me, 0, gone_ram));
        guests
            .by_vm
            .insert(VmId(2), Guest::detached("h", dead, 0, held_ram));
        guests
            .by_vm
            .insert(VmId(3), Guest::detached("g/ram0", me, 0, held_ram));
        assert_eq!(
            guests.released(),
            [(VmId(1), Release::Unmapped), (VmId(2), Release::Exited)]
        );
        let line = guests.release_line(VmId(1), Release::Unmapped);
        assert_eq!(
            line,
            format!(
                "region g/ram1 ({}) released (unmapped; QEMU pid {me} runs on)",
                VmId(1)
            )
        );
        assert!(!line.contains("exited"), "{line}");
        // The agent's word is named when it gave it.
        assert!(guests.region_unmapped(VmId(1)).contains("g/ram1"));
        assert!(guests
            .release_line(VmId(1), Release::Unmapped)
            .ends_with("runs on, its agent said so)"));
        assert_eq!(
            guests.release_line(VmId(2), Release::Exited),
            format!(
                "h ({}): its QEMU (pid {dead}) has exited; released",
                VmId(2)
            )
        );
    }
}
