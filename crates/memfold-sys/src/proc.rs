//! CPU time and resident memory of processes and threads, from `/proc` (what memfold
//! costs: memfoldd's own CPU and memory, the agent threads' CPU inside each QEMU, the
//! kernel's savers).

/// Name prefix of the agent's threads inside QEMU (`/proc/PID/task/TID/comm`).
pub const AGENT_THREADS: &str = "memfold-";

/// `CLOCK_MONOTONIC` now, ns: one clock for every process on the host (a block device
/// stamps a report with it, memfoldd ages it).
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CPU seconds the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`): work done in a
/// measuring thread that belongs to a side's cost (the KSM side's census).
pub fn thread_cpu_seconds() -> f64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID) as f64 / 1e9
}

/// Clock `id` now, ns (both clocks read here always exist on Linux).
fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    let r = unsafe { libc::clock_gettime(id, &mut ts) };
    debug_assert_eq!(r, 0, "clock {id} exists");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU seconds (user + system) of process `pid`, or only of its threads whose name starts
/// with `thread_prefix`.
pub fn cpu_seconds(pid: u32, thread_prefix: Option<&str>) -> f64 {
    let tck = 100.0; // USER_HZ on Linux x86_64
    let ticks = |stat: &str| -> f64 {
        let rest = stat.rsplit_once(") ").map_or("", |r| r.1);
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after "pid (comm) ".
        f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
            + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
    };
    match thread_prefix {
        None => {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(0.0, |s| ticks(&s) / tck)
        }
        Some(prefix) => std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|d| {
                d.flatten()
                    .filter(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .is_ok_and(|c| c.starts_with(prefix))
                    })
                    .map(|t| {
                        std::fs::read_to_string(t.path().join("stat")).map_or(0.0, |s| ticks(&s))
                    })
                    .sum::<f64>()
                    / tck
            })
            .unwrap_or(0.0),
    }
}

/// Has this process's heap allocations of `bytes` or more each mapped on their own, so
/// that each is given back to the kernel when freed (glibc's `M_MMAP_THRESHOLD`; setting
/// it also ends glibc's raise of the threshold to the largest block freed so far).
/// Without it, a daemon that rebuilds an 8 MiB table every few seconds (memfoldd's
/// similarity index for an 8 GiB guest, DE §4.3) has every later allocation under 8 MiB
/// served from the main heap, where freed tables stay resident (issue 19: memfoldd's RSS
/// against its metadata). Call it once at start, before threads allocate. Returns false
/// where the C library has no such knob (not glibc) or refused the value.
pub fn map_large_allocations_from(bytes: usize) -> bool {
    #[cfg(target_env = "gnu")]
    {
        let Ok(v) = libc::c_int::try_from(bytes) else {
            return false;
        };
        // SAFETY: mallopt only sets an allocator parameter; glibc documents it as safe to
        // call at any time, and no allocation is in progress in this call.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, v) == 1 }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        let _ = bytes;
        false
    }
}

/// The host's RAM (`MemTotal` of `/proc/meminfo`), bytes; 0 if `/proc` does not say.
pub fn host_ram_bytes() -> u64 {
    host_meminfo("MemTotal:").unwrap_or(0)
}

/// Memory the host can give without swapping (`MemAvailable` of `/proc/meminfo`), bytes;
/// `None` if `/proc` does not say.
pub fn host_available_bytes() -> Option<u64> {
    host_meminfo("MemAvailable:")
}

/// Field `key` (with its colon) of `/proc/meminfo`, bytes; `None` if absent.
fn host_meminfo(key: &str) -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| crate::reclaim::meminfo_bytes(&s, key))
}

/// Resident set of process `pid` (`VmRSS` of `/proc/PID/status`), bytes; 0 if `/proc`
/// does not say (the process is gone, or a kernel thread).
pub fn rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

/// Anonymous resident memory of process `pid` (`RssAnon` of `/proc/PID/status`), bytes:
/// its heap and stacks, not its binary and libraries (file pages, shared with every
/// process that maps them) nor the shared memory it maps; 0 if `/proc` does not say.
pub fn rss_anon_bytes(pid: u32) -> u64 {
    status_bytes(pid, "RssAnon:")
}

/// Field `key` (with its colon, e.g. `VmSize:`) of `/proc/PID/status`, a size the
/// kernel gives in KiB, in bytes; 0 if absent.
pub fn status_bytes(pid: u32, key: &str) -> u64 {
    status_kib(pid, key) * 1024
}

/// The KiB of field `key` of `/proc/PID/status`; 0 if absent.
fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    #[test]
    fn the_thread_clock_counts_this_threads_work_only() {
        let t0 = thread_cpu_seconds();
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_seconds() - t0;
        let t1 = thread_cpu_seconds();
        let mut x = 0u64;
        while thread_cpu_seconds() - t1 < 0.05 {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(slept < 0.02, "sleeping used {slept} s");
        assert!(thread_cpu_seconds() - t1 >= 0.05);
    }

    /// Held by the tests that read this process's resident set around their own
    /// allocations: run side by side (3 or more test threads), one's 30 MiB freed between
    /// the other's two reads would hide the other's 64 MiB.
    static RSS_READERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn touching_memory_raises_the_resident_set_and_its_peak() {
        let _alone = RSS_READERS.lock().unwrap_or_else(|e| e.into_inner());
        let me = std::process::id();
        let before = rss_bytes(me);
        let anon_before = rss_anon_bytes(me);
        assert!(before > 0, "this process has a resident set");
        // A shared memfd mapped and touched: resident, but not anonymous (as memfoldd's
        // pool and store, counted as files).
        let len = 128usize << 20;
        let fd = crate::memfd::create("not-anonymous").unwrap();
        crate::memfd::set_len(std::os::fd::AsFd::as_fd(&fd), len as u64).unwrap();
        // SAFETY: a new shared mapping of a memfd this test owns, at an address the kernel
        // picks, written only through `shared` below and unmapped at the test's end.
        let shared = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                0,
            )
        };
        assert_ne!(shared, libc::MAP_FAILED);
        for i in (0..len).step_by(4096) {
            // SAFETY: within the mapping made above.
            unsafe { *(shared as *mut u8).add(i) = 1 };
        }
        let mut v = vec![0u8; 64 << 20];
        for p in v.chunks_mut(4096) {
            p[0] = 1;
        }
        let during = rss_bytes(me);
        let anon_during = rss_anon_bytes(me);
        assert!(
            during >= before + (48 << 20),
            "64 MiB touched: rss {before} -> {during}"
        );
        assert!(
            // The upper bound leaves other tests' allocations 64 MiB.
            (anon_before + (48 << 20)..anon_before + (128 << 20)).contains(&anon_during),
            "64 MiB of heap touched, 128 MiB of a memfd mapped: RssAnon {anon_before} -> {anon_during}"
        );
        drop(std::hint::black_box(v));
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(shared, len) };
        assert_eq!(rss_bytes(u32::MAX), 0, "no such process");
        assert_eq!(rss_anon_bytes(u32::MAX), 0, "no such process");
    }

    #[test]
    fn a_busy_thread_counts_in_its_process_and_under_its_name() {
        let me = std::process::id();
        let before = cpu_seconds(me, None);
        let (done, wait) = mpsc::channel();
        let (read, until_read) = mpsc::channel::<()>();
        let busy = std::thread::Builder::new()
            .name("cputest-busy".into())
            .spawn(move || {
                // 0.3 s of CPU by the kernel's count, however busy the host is.
                let t = Instant::now();
                let mut x = 0u64;
                while thread_cpu_seconds() < 0.3 && t.elapsed() < Duration::from_secs(30) {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    }
                }
                done.send(thread_cpu_seconds()).unwrap();
                // Stay alive (and listed in /proc) until read, however late that is.
                let _ = until_read.recv();
            })
            .unwrap();
        let used = wait.recv().unwrap();
        assert!(used >= 0.3, "{used}");
        let named = cpu_seconds(me, Some("cputest-"));
        drop(read);
        busy.join().unwrap();
        // /proc counts in 10 ms ticks.
        assert!(
            (named - used).abs() <= 0.05,
            "{named} s named, {used} s used"
        );
        assert!(cpu_seconds(me, None) - before >= used - 0.05);
        assert_eq!(cpu_seconds(me, Some("no-such-thread")), 0.0);
        assert_eq!(cpu_seconds(u32::MAX, None), 0.0);
    }

    /// With the knob, a large table freed goes back to the kernel even after a larger one
    /// was freed before (which, without it, raises glibc's threshold past the table and
    /// keeps it in the heap, resident).
    #[cfg(target_env = "gnu")]
    #[test]
    fn freed_large_tables_leave_the_resident_set() {
        const MIB: usize = 1 << 20;
        let _alone = RSS_READERS.lock().unwrap_or_else(|e| e.into_inner());
        assert!(map_large_allocations_from(256 * 1024));
        assert!(
            !map_large_allocations_from(usize::MAX),
            "does not fit the C int"
        );
        let me = std::process::id();
        // Freed, a 30 MiB block would raise glibc's threshold to 30 MiB (its cap is 32).
        drop(std::hint::black_box(vec![1u8; 30 * MIB]));
        let table = std::hint::black_box(vec![1u8; 24 * MIB]);
        let with = rss_bytes(me);
        drop(table);
        let without = rss_bytes(me);
        assert!(
            with.saturating_sub(without) >= 16 * MIB as u64,
            "RSS {with} with the table, {without} after it was freed"
        );
    }

    /// The host's RAM as the kernel says it (`MemTotal`, in KiB there): more than a GiB
    /// here, a whole number of KiB.
    #[test]
    fn host_ram_is_memtotal_in_bytes() {
        let b = host_ram_bytes();
        assert!(b > 1 << 30 && b % 1024 == 0, "{b}");
    }
}
