//! CPU time of processes and threads, from `/proc` (what memfold costs: memfoldd's own
//! CPU, the agent threads' inside each QEMU, the kernel's savers).

/// Name prefix of the agent's threads inside QEMU (`/proc/PID/task/TID/comm`).
pub const AGENT_THREADS: &str = "memfold-";

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn burn(d: Duration) -> u64 {
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < d {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        x
    }

    #[test]
    fn a_busy_thread_counts_in_its_process_and_under_its_name() {
        let me = std::process::id();
        let before = cpu_seconds(me, None);
        std::thread::Builder::new()
            .name("cputest-busy".into())
            .spawn(|| {
                burn(Duration::from_millis(400));
                // Stay alive (and listed in /proc) until read.
                std::thread::sleep(Duration::from_millis(600));
            })
            .unwrap();
        std::thread::sleep(Duration::from_millis(450));
        let named = cpu_seconds(me, Some("cputest-"));
        assert!(named >= 0.25 && named <= 0.6, "{named} s");
        assert!(cpu_seconds(me, None) - before >= 0.25);
        assert_eq!(cpu_seconds(me, Some("no-such-thread")), 0.0);
        assert_eq!(cpu_seconds(u32::MAX, None), 0.0);
    }
}
