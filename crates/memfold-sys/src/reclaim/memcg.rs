//! A memory cgroup on either hierarchy: cgroup v1 (`memory.limit_in_bytes`,
//! `memory.usage_in_bytes`, `memory.stat`'s `swap`, `memory.oom_control`) or cgroup v2
//! (`memory.max`, `memory.current`, `memory.swap.current`, `memory.reclaim`,
//! `memory.events`, `memory.pressure`), whichever carries the memory controller on the
//! host. The hierarchy's root is a value ([`MemCgroupRoot`]), so that both flavours are
//! tested against a directory tree standing in for cgroupfs.

use std::path::{Path, PathBuf};

use super::{io, psi_some_total_us, read, write, ReclaimError};

/// The cgroup v1 memory controller's usual mount.
pub const MEMCG_V1: &str = "/sys/fs/cgroup/memory";

/// Which cgroup hierarchy carries the memory controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    /// cgroup v1: a hard limit (`memory.limit_in_bytes`) and an OOM-killer switch.
    V1,
    /// cgroup v2: `memory.max`, proactive reclaim (`memory.reclaim`), per-group PSI.
    V2,
}

impl CgroupVersion {
    /// "v1" or "v2".
    pub fn name(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

/// Where the memory controller's hierarchy is mounted, and which version it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemCgroupRoot {
    /// The hierarchy's root folder (`/sys/fs/cgroup/memory` on v1, the cgroup2 mount on v2).
    pub dir: PathBuf,
    /// Its version.
    pub version: CgroupVersion,
}

impl MemCgroupRoot {
    /// A root at `dir` (a real mount, or a directory tree standing in for one in tests).
    pub fn at(dir: impl Into<PathBuf>, version: CgroupVersion) -> MemCgroupRoot {
        MemCgroupRoot {
            dir: dir.into(),
            version,
        }
    }

    /// The host's: found in `/proc/self/mounts` ([`MemCgroupRoot::from_mounts`]).
    ///
    /// Errors: the mount table cannot be read, or no hierarchy carries the memory
    /// controller.
    pub fn detect() -> Result<MemCgroupRoot, ReclaimError> {
        MemCgroupRoot::from_mounts(&read(Path::new("/proc/self/mounts"))?)
    }

    /// The hierarchy with the memory controller, from the text of a mount table: a `cgroup`
    /// mount with the `memory` option (v1), else a `cgroup2` mount whose
    /// `cgroup.controllers` lists `memory` (v2; read from the mount point). The controller
    /// is bound to one hierarchy at a time, so a hybrid host has it on v1 or on v2, not both.
    ///
    /// Errors: [`ReclaimError::Unavailable`] when neither is there.
    pub fn from_mounts(mounts: &str) -> Result<MemCgroupRoot, ReclaimError> {
        let mut v2 = None;
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [_, mount_point, fstype, options, ..] = f[..] else {
                continue;
            };
            // The kernel writes a space in a path as \040.
            let dir = PathBuf::from(mount_point.replace("\\040", " "));
            match fstype {
                "cgroup" if options.split(',').any(|o| o == "memory") => {
                    return Ok(MemCgroupRoot::at(dir, CgroupVersion::V1));
                }
                "cgroup2" if v2.is_none() => {
                    let has_memory = std::fs::read_to_string(dir.join("cgroup.controllers"))
                        .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"));
                    if has_memory {
                        v2 = Some(MemCgroupRoot::at(dir, CgroupVersion::V2));
                    }
                }
                _ => {}
            }
        }
        v2.ok_or_else(|| {
            ReclaimError::Unavailable(
                "no memory cgroup controller is mounted here: no cgroup (v1) mount with the memory option and no cgroup2 mount with memory in its cgroup.controllers (/proc/self/mounts)".into(),
            )
        })
    }
}

/// The OOM state of a group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OomState {
    /// v1: some task of the group waits for memory now (the group is at its limit, reclaim
    /// failed, and the OOM killer is off for it: `under_oom 1`). Always false on v2.
    pub under_oom: bool,
    /// v1: the OOM killer is off for the group (`oom_kill_disable 1`). Always false on v2,
    /// which has no such switch.
    pub killer_off: bool,
    /// v2: times the group reached its `memory.max` with reclaim failing (`oom` of
    /// memory.events), since the group was made. `None` on v1, which keeps no such count.
    pub ooms: Option<u64>,
    /// Processes of the group the OOM killer killed since the group was made (`oom_kill` of
    /// memory.oom_control on v1, of memory.events on v2).
    pub oom_kills: u64,
}

/// The value of `key` in a flat-keyed cgroup file (`key value` lines).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// A memory cgroup of its own, removed when dropped (its processes must be gone by then;
/// they are moved to the root group first otherwise).
pub struct MemCgroup {
    root: MemCgroupRoot,
    dir: PathBuf,
}

impl MemCgroup {
    /// Creates memory cgroup `name` under the host's memory hierarchy
    /// ([`MemCgroupRoot::detect`]), with no limit yet.
    ///
    /// Errors: no memory controller mounted, or the group cannot be made (not root).
    pub fn create(name: &str) -> Result<MemCgroup, ReclaimError> {
        MemCgroup::create_in(&MemCgroupRoot::detect()?, name)
    }

    /// Creates memory cgroup `name` under `root`. On v2 the memory controller is first
    /// enabled for the root's children (`+memory` into its `cgroup.subtree_control`) unless
    /// it already is.
    ///
    /// Errors: the controller cannot be enabled, or the group cannot be made.
    pub fn create_in(root: &MemCgroupRoot, name: &str) -> Result<MemCgroup, ReclaimError> {
        if root.version == CgroupVersion::V2 {
            let control = root.dir.join("cgroup.subtree_control");
            let enabled = read(&control)?;
            if !enabled.split_whitespace().any(|c| c == "memory") {
                write(&control, "+memory")?;
            }
        }
        let dir = root.dir.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(&dir)(e)),
        }
        Ok(MemCgroup {
            root: root.clone(),
            dir,
        })
    }

    /// The hierarchy's version.
    pub fn version(&self) -> CgroupVersion {
        self.root.version
    }

    /// The group's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file a process writes `0` to, to join the group (before it allocates: "from
    /// birth", so that everything it uses is charged here). The same name on both versions.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn file(&self, v1: &str, v2: &str) -> PathBuf {
        self.dir.join(match self.root.version {
            CgroupVersion::V1 => v1,
            CgroupVersion::V2 => v2,
        })
    }

    /// A file holding one number of bytes (`max`: [`u64::MAX`]).
    fn number(&self, path: &Path) -> Result<u64, ReclaimError> {
        let text = read(path)?;
        if text == "max" {
            return Ok(u64::MAX);
        }
        text.parse().map_err(|e| io(path)(std::io::Error::other(e)))
    }

    /// Memory charged to the group now, bytes (v1 `memory.usage_in_bytes`, v2
    /// `memory.current`).
    ///
    /// Errors: the file cannot be read.
    pub fn usage(&self) -> Result<u64, ReclaimError> {
        self.number(&self.file("memory.usage_in_bytes", "memory.current"))
    }

    /// The hard limit now, bytes (v1 `memory.limit_in_bytes`, where "none" reads as a
    /// number near 2^63; v2 `memory.max`, where "none" reads as [`u64::MAX`]).
    ///
    /// Errors: the file cannot be read.
    pub fn limit(&self) -> Result<u64, ReclaimError> {
        self.number(&self.file("memory.limit_in_bytes", "memory.max"))
    }

    /// Sets the hard limit, bytes: the kernel reclaims down to it in this thread (zswap
    /// compresses what it swaps out here). On v1 it returns false if it could not reclaim
    /// that far (`EBUSY`) or was interrupted ([`super::interrupt`], `EINTR`); the limit is
    /// then unchanged. On v2 (`memory.max`) the kernel
    /// OOM-kills in the group when it cannot reclaim that far: the peer's controller uses
    /// [`MemCgroup::reclaim`] there instead and leaves `memory.max` unset.
    ///
    /// Errors: any other failure to write it.
    pub fn set_limit(&self, bytes: u64) -> Result<bool, ReclaimError> {
        let p = self.file("memory.limit_in_bytes", "memory.max");
        match write(&p, &bytes.to_string()) {
            Ok(()) => Ok(true),
            Err(ReclaimError::Io { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EBUSY | libc::EINTR)) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Lifts the hard limit (v1 `-1`, v2 `max`), so that nothing more is reclaimed from the
    /// group for it.
    ///
    /// Errors: the file cannot be written.
    pub fn unlimit(&self) -> Result<(), ReclaimError> {
        match self.root.version {
            CgroupVersion::V1 => write(&self.dir.join("memory.limit_in_bytes"), "-1"),
            CgroupVersion::V2 => write(&self.dir.join("memory.max"), "max"),
        }
    }

    /// Proactive reclaim of `bytes` from the group, in this thread, with no limit set (v2
    /// `memory.reclaim`, as Senpai drives it: nothing is OOM-killed if the kernel cannot
    /// find that much). Returns false if the kernel reclaimed less than asked (`EAGAIN`) or
    /// was interrupted ([`super::interrupt`], `EINTR`).
    ///
    /// Errors: on v1, which has no such file ([`ReclaimError::Unavailable`]); a failure to
    /// write it.
    pub fn reclaim(&self, bytes: u64) -> Result<bool, ReclaimError> {
        if self.root.version == CgroupVersion::V1 {
            return Err(ReclaimError::Unavailable(
                "memory.reclaim is cgroup v2's; a v1 group is reclaimed by lowering memory.limit_in_bytes".into(),
            ));
        }
        match write(&self.dir.join("memory.reclaim"), &bytes.to_string()) {
            Ok(()) => Ok(true),
            Err(ReclaimError::Io { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Turns the OOM killer off for the group where the hierarchy can (v1:
    /// `memory.oom_control` ← 1; a task that hits the limit with nothing left to reclaim
    /// then waits, `under_oom` set, until the limit is raised or memory is freed). Returns
    /// whether it was turned off; false on v2, which has no such switch (there the group
    /// has no `memory.max` to hit).
    ///
    /// Errors: the file cannot be written.
    pub fn disable_oom_killer(&self) -> Result<bool, ReclaimError> {
        match self.root.version {
            CgroupVersion::V1 => {
                write(&self.dir.join("memory.oom_control"), "1")?;
                Ok(true)
            }
            CgroupVersion::V2 => Ok(false),
        }
    }

    /// The group's OOM state now (v1 `memory.oom_control`, v2 `memory.events`).
    ///
    /// Errors: the file cannot be read.
    pub fn oom(&self) -> Result<OomState, ReclaimError> {
        match self.root.version {
            CgroupVersion::V1 => {
                let text = read(&self.dir.join("memory.oom_control"))?;
                Ok(OomState {
                    under_oom: keyed(&text, "under_oom") == Some(1),
                    killer_off: keyed(&text, "oom_kill_disable") == Some(1),
                    ooms: None,
                    oom_kills: keyed(&text, "oom_kill").unwrap_or(0),
                })
            }
            CgroupVersion::V2 => {
                let text = read(&self.dir.join("memory.events"))?;
                Ok(OomState {
                    under_oom: false,
                    killer_off: false,
                    ooms: Some(keyed(&text, "oom").unwrap_or(0)),
                    oom_kills: keyed(&text, "oom_kill").unwrap_or(0),
                })
            }
        }
    }

    /// The group's own memory pressure: µs some task of it stalled on memory (v2
    /// `memory.pressure`, `some` total). `None` on v1, which keeps no per-group PSI (the
    /// host's, [`super::memory_stall_us`], stands in there).
    ///
    /// Errors: the v2 file cannot be read or has no `some` total.
    pub fn stall_us(&self) -> Result<Option<u64>, ReclaimError> {
        match self.root.version {
            CgroupVersion::V1 => Ok(None),
            CgroupVersion::V2 => {
                let p = self.dir.join("memory.pressure");
                psi_some_total_us(&read(&p)?).map(Some).ok_or_else(|| {
                    ReclaimError::Unavailable(format!("{} has no some total", p.display()))
                })
            }
        }
    }

    /// The group's pages swapped out now (in zswap or on a swap device), bytes (v1 `swap`
    /// of memory.stat, v2 `memory.swap.current`).
    ///
    /// Errors: the file cannot be read.
    pub fn swapped(&self) -> Result<u64, ReclaimError> {
        match self.root.version {
            CgroupVersion::V1 => {
                let text = read(&self.dir.join("memory.stat"))?;
                Ok(keyed(&text, "swap").unwrap_or(0))
            }
            CgroupVersion::V2 => self.number(&self.dir.join("memory.swap.current")),
        }
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        // Any process left goes back to the root group, so that the group can go.
        if let Ok(pids) = std::fs::read_to_string(self.procs_file()) {
            for pid in pids.lines() {
                let _ = write(&self.root.dir.join("cgroup.procs"), pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake cgroupfs root: a folder with the root's files.
    fn fake_root(version: CgroupVersion) -> (tempfile::TempDir, MemCgroupRoot) {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.procs"), "").unwrap();
        if version == CgroupVersion::V2 {
            std::fs::write(
                t.path().join("cgroup.controllers"),
                "cpuset cpu io memory pids",
            )
            .unwrap();
            std::fs::write(t.path().join("cgroup.subtree_control"), "cpu io").unwrap();
        }
        let root = MemCgroupRoot::at(t.path(), version);
        (t, root)
    }

    /// Fills a made group's folder with what the kernel would put there: only `files`, so
    /// a write to another file (the other version's) fails (writes never create).
    fn populate(g: &MemCgroup, files: &[(&str, &str)]) {
        for (name, text) in files {
            std::fs::write(g.dir().join(name), text).unwrap();
        }
    }

    fn content(g: &MemCgroup, name: &str) -> String {
        std::fs::read_to_string(g.dir().join(name)).unwrap()
    }

    const V1_FILES: [&str; 5] = [
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "memory.stat",
        "memory.oom_control",
        "cgroup.procs",
    ];
    const V2_FILES: [&str; 8] = [
        "memory.max",
        "memory.current",
        "memory.swap.current",
        "memory.reclaim",
        "memory.events",
        "memory.pressure",
        "cgroup.procs",
        "cgroup.subtree_control",
    ];

    #[test]
    fn the_memory_hierarchy_is_found_in_the_mount_table() {
        let (t2, _) = fake_root(CgroupVersion::V2);
        let v2 = t2.path().display().to_string();
        // This host's kind: v1 memory beside a cgroup2 without it.
        let hybrid = format!(
            "tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\ncgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\ncgroup2 {v2} cgroup2 rw 0 0\n"
        );
        assert_eq!(
            MemCgroupRoot::from_mounts(&hybrid).unwrap(),
            MemCgroupRoot::at("/sys/fs/cgroup/memory", CgroupVersion::V1)
        );
        // A unified host: memory in the cgroup2 mount's controllers.
        let unified = format!("proc /proc proc rw 0 0\ncgroup2 {v2} cgroup2 rw,nsdelegate 0 0\n");
        assert_eq!(
            MemCgroupRoot::from_mounts(&unified).unwrap(),
            MemCgroupRoot::at(t2.path(), CgroupVersion::V2)
        );
        // A cgroup2 mount without the memory controller, and no v1 memory: refused.
        std::fs::write(t2.path().join("cgroup.controllers"), "cpu io pids").unwrap();
        assert!(matches!(
            MemCgroupRoot::from_mounts(&unified),
            Err(ReclaimError::Unavailable(_))
        ));
        // `memory` must be an option of its own, not a part of one.
        assert!(MemCgroupRoot::from_mounts("cgroup /x cgroup rw,nomemory 0 0").is_err());
    }

    #[test]
    fn a_v1_group_is_driven_through_v1_files_only() {
        let (_t, root) = fake_root(CgroupVersion::V1);
        let g = MemCgroup::create_in(&root, "peer").unwrap();
        assert_eq!(g.version(), CgroupVersion::V1);
        populate(
            &g,
            &[
                ("memory.limit_in_bytes", "9223372036854771712"),
                ("memory.usage_in_bytes", "1000"),
                (
                    "memory.stat",
                    "cache 0\nrss 0\nswap 4096\ntotal_swap 8192\n",
                ),
                (
                    "memory.oom_control",
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
                ),
                ("cgroup.procs", ""),
            ],
        );
        assert_eq!(g.usage().unwrap(), 1000);
        assert_eq!(g.limit().unwrap(), 9_223_372_036_854_771_712);
        assert_eq!(g.swapped().unwrap(), 4096);
        assert!(g.set_limit(5000).unwrap());
        assert_eq!(content(&g, "memory.limit_in_bytes"), "5000");
        assert_eq!(g.limit().unwrap(), 5000);
        assert!(g.disable_oom_killer().unwrap());
        assert_eq!(content(&g, "memory.oom_control"), "1");
        populate(
            &g,
            &[(
                "memory.oom_control",
                "oom_kill_disable 1\nunder_oom 1\noom_kill 2\n",
            )],
        );
        assert_eq!(
            g.oom().unwrap(),
            OomState {
                under_oom: true,
                killer_off: true,
                ooms: None,
                oom_kills: 2
            }
        );
        assert!(matches!(g.reclaim(4096), Err(ReclaimError::Unavailable(_))));
        assert_eq!(g.stall_us().unwrap(), None);
        g.unlimit().unwrap();
        assert_eq!(content(&g, "memory.limit_in_bytes"), "-1");
        // Nothing of v2's was written (or made).
        for f in V2_FILES.iter().filter(|f| !V1_FILES.contains(f)) {
            assert!(!g.dir().join(f).exists(), "{f} was written on v1");
        }
    }

    #[test]
    fn a_v2_group_is_driven_through_v2_files_only() {
        let (_t, root) = fake_root(CgroupVersion::V2);
        let g = MemCgroup::create_in(&root, "peer").unwrap();
        assert_eq!(g.version(), CgroupVersion::V2);
        // The controller was enabled for the root's children.
        assert_eq!(
            std::fs::read_to_string(root.dir.join("cgroup.subtree_control")).unwrap(),
            "+memory"
        );
        populate(
            &g,
            &[
                ("memory.max", "max"),
                ("memory.current", "2000"),
                ("memory.swap.current", "8192"),
                ("memory.reclaim", ""),
                (
                    "memory.events",
                    "low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n",
                ),
                (
                    "memory.pressure",
                    "some avg10=0.00 avg60=0.00 avg300=0.00 total=77\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=5\n",
                ),
                ("cgroup.procs", ""),
            ],
        );
        assert_eq!(g.usage().unwrap(), 2000);
        assert_eq!(g.limit().unwrap(), u64::MAX);
        assert_eq!(g.swapped().unwrap(), 8192);
        assert!(g.reclaim(4096).unwrap());
        assert_eq!(content(&g, "memory.reclaim"), "4096");
        assert!(!g.disable_oom_killer().unwrap());
        assert_eq!(
            g.oom().unwrap(),
            OomState {
                under_oom: false,
                killer_off: false,
                ooms: Some(1),
                oom_kills: 0
            }
        );
        assert_eq!(g.stall_us().unwrap(), Some(77));
        assert!(g.set_limit(5000).unwrap());
        assert_eq!(content(&g, "memory.max"), "5000");
        g.unlimit().unwrap();
        assert_eq!(content(&g, "memory.max"), "max");
        for f in V1_FILES.iter().filter(|f| !V2_FILES.contains(f)) {
            assert!(!g.dir().join(f).exists(), "{f} was written on v2");
        }
    }

    #[test]
    fn a_v2_root_with_memory_enabled_is_left_alone_and_v1_files_are_refused() {
        let (_t, root) = fake_root(CgroupVersion::V2);
        std::fs::write(root.dir.join("cgroup.subtree_control"), "cpu memory").unwrap();
        let g = MemCgroup::create_in(&root, "peer").unwrap();
        assert_eq!(
            std::fs::read_to_string(root.dir.join("cgroup.subtree_control")).unwrap(),
            "cpu memory"
        );
        // A v2 group without v2 files (an empty folder): every accessor names the file.
        match g.usage() {
            Err(ReclaimError::Io { path, .. }) => assert!(path.ends_with("memory.current")),
            other => panic!("{other:?}"),
        }
        match g.set_limit(1) {
            Err(ReclaimError::Io { path, .. }) => assert!(path.ends_with("memory.max")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dropped_group_hands_its_processes_to_the_root() {
        let (_t, root) = fake_root(CgroupVersion::V1);
        let g = MemCgroup::create_in(&root, "peer").unwrap();
        populate(&g, &[("cgroup.procs", "4242\n")]);
        drop(g);
        assert_eq!(
            std::fs::read_to_string(root.dir.join("cgroup.procs")).unwrap(),
            "4242"
        );
    }
}
