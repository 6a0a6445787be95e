//! How much host memory a guest's RAM uses: one definition for memfold and KSM.
//!
//! **Host memory used by guest RAM** = the proportional set size (Pss) of the QEMU
//! mappings that hold guest RAM, plus what of them is swapped out, summed over guests.
//! Pss splits a page shared by n mappings into n parts, so a KSM-merged page or a memfold
//! pool page counts once in the sum over guests; pages never touched, holes punched in a
//! memfd and pages mapped to the host zero page (KSM's `use_zero_pages`, zero-filled pieces
//! of split huge pages) count nothing. The same figure therefore measures KSM (anonymous
//! RAM) and memfold (memfd RAM with pool pages mapped over it) identically.

use serde::Serialize;

/// One guest's RAM mappings as the kernel reports them, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RamUsage {
    /// Resident bytes mapped (shared pages counted in full).
    pub rss: u64,
    /// Proportional set size: shared pages split among their mappers.
    pub pss: u64,
    /// Bytes swapped out.
    pub swap: u64,
}

impl RamUsage {
    /// Host memory used by this guest's RAM per the module's definition, bytes.
    pub fn used(&self) -> u64 {
        self.pss + self.swap
    }
}

/// Sums Rss, Pss and Swap over QEMU process `pid`'s guest-RAM mappings: memfd mappings
/// (memfold) and anonymous read-write mappings of at least `min_bytes` (KSM runs; the RAM
/// is one such mapping, QEMU's other anonymous mappings are smaller).
///
/// Errors: the smaps file cannot be read, or is empty (the process is gone or a zombie,
/// e.g. QEMU after a guest kernel panic).
pub fn guest_ram_usage(pid: u32, min_bytes: u64) -> std::io::Result<RamUsage> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    if smaps.is_empty() {
        return Err(std::io::Error::other(format!(
            "process {pid} has no memory map: it has exited"
        )));
    }
    let mut total = RamUsage::default();
    let mut counting = false;
    for line in smaps.lines() {
        let mut parts = line.split_whitespace();
        let first = parts.next().unwrap_or("");
        if first.contains('-')
            && first.chars().next().is_some_and(|c| c.is_ascii_hexdigit())
            && !first.ends_with(':')
        {
            // A mapping header: "start-end perms offset dev inode [path]".
            let (s, e) = first.split_once('-').unwrap_or(("0", "0"));
            let size = u64::from_str_radix(e, 16)
                .unwrap_or(0)
                .saturating_sub(u64::from_str_radix(s, 16).unwrap_or(0));
            let perms = parts.next().unwrap_or("");
            let path: Vec<&str> = parts.skip(3).collect();
            let path = path.join(" ");
            counting = if path.contains("memfd:") {
                true
            } else {
                path.is_empty() && perms.starts_with("rw") && size >= min_bytes
            };
            continue;
        }
        if !counting {
            continue;
        }
        let mut kb = || {
            parts
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        match first {
            "Rss:" => total.rss += kb(),
            "Pss:" => total.pss += kb(),
            "Swap:" => total.swap += kb(),
            _ => {}
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_large_anonymous_mapping_of_this_process() {
        let len = 64 << 20;
        let v = std::hint::black_box(vec![1u8; len]); // touched: resident
        let u = guest_ram_usage(std::process::id(), len as u64).unwrap();
        assert!(u.rss >= len as u64 / 2, "{u:?}");
        assert!(u.pss >= len as u64 / 2 && u.pss <= u.rss, "{u:?}");
        drop(v);
    }
}
