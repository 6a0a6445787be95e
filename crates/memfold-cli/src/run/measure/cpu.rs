//! CPU time of processes a supervisor may restart (memfold-blk), where no single process
//! holds it.

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
}
