//! CPU time a side's helpers use where no single process holds it: processes a supervisor
//! may restart (memfold-blk), and work done in the measuring thread itself (the KSM
//! side's census).

use std::collections::HashMap;

/// CPU seconds of a changing set of processes over a window: each pid counts from its
/// CPU when first seen (the window's start for those alive then, 0 for one born later,
/// e.g. restarted by its supervisor) to the most seen of it. Never negative, whatever
/// restarts happen; a process's last moments between its last sighting and its exit are
/// lost (under a sampling interval each).
#[derive(Clone, Debug, Default)]
pub struct ProcCpu {
    /// Per pid: CPU seconds when first seen, and the most seen since.
    seen: HashMap<u32, (f64, f64)>,
}

impl ProcCpu {
    /// A window starting now for `pids` (their CPU now counts as already spent).
    pub fn starting(pids: impl IntoIterator<Item = u32>) -> ProcCpu {
        let mut c = ProcCpu::default();
        for pid in pids {
            let now = super::cpu_seconds(pid, None);
            c.seen.insert(pid, (now, now));
        }
        c
    }

    /// Notes `pid` at `cpu_s` CPU seconds: a pid not seen before was born in the window.
    pub fn note(&mut self, pid: u32, cpu_s: f64) {
        let e = self.seen.entry(pid).or_insert((0.0, 0.0));
        e.1 = e.1.max(cpu_s);
    }

    /// Notes each of `pids` at its CPU now (a gone process reads 0 and changes nothing).
    pub fn observe(&mut self, pids: impl IntoIterator<Item = u32>) {
        for pid in pids {
            self.note(pid, super::cpu_seconds(pid, None));
        }
    }

    /// CPU seconds used in the window, summed over every pid seen.
    pub fn seconds(&self) -> f64 {
        self.seen.values().map(|&(a, b)| (b - a).max(0.0)).sum()
    }
}

/// CPU seconds the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`): for work done in
/// the measuring thread that belongs to a side's cost.
pub fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memfold-blk restarted mid-window (pid 10 at 5 s of CPU, then pid 11 from 0):
    /// 2 + 1 s, where the pid looked up once gave 1 − 5 = −4.
    #[test]
    fn a_restarted_process_adds_its_cpu_and_never_subtracts() {
        let mut c = ProcCpu::default();
        c.seen.insert(10, (5.0, 5.0));
        c.note(10, 7.0);
        c.note(11, 0.5);
        c.note(11, 1.0);
        // A late read of a gone pid (0) changes nothing.
        c.note(10, 0.0);
        assert!((c.seconds() - 3.0).abs() < 1e-12, "{}", c.seconds());
        assert_eq!(ProcCpu::default().seconds(), 0.0);
    }

    #[test]
    fn the_thread_clock_counts_this_threads_work_only() {
        let t0 = thread_cpu_s();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let slept = thread_cpu_s() - t0;
        let t1 = thread_cpu_s();
        let mut x = 0u64;
        while thread_cpu_s() - t1 < 0.05 {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(slept < 0.02, "sleeping used {slept} s");
        assert!(thread_cpu_s() - t1 >= 0.05);
    }
}
