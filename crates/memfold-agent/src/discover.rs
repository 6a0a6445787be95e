//! Finding guest RAM at start ([`crate::run`]): QEMU's command line, read to know whether
//! this process is a QEMU and how many memory backends it defines, and the wait for its
//! shared `memory-backend-memfd` mappings (`regions` reads and opens them).

use std::io;
use std::time::{Duration, Instant};

use crate::config::AgentConfig;
use crate::{qemu_args, regions};

/// How long the set of guest RAM regions must stay unchanged before the agent takes it,
/// when QEMU's command line does not say how many there are.
pub(crate) const SETTLE: Duration = Duration::from_secs(1);

/// QEMU's command line, read from `/proc/self/cmdline` when this process is a QEMU
/// ([`is_qemu`]); `None` for another program (a test or host program running the agent).
///
/// Errors (in a QEMU, the agent then does not start): the command line cannot be read or
/// does not parse.
pub(crate) fn qemu_plan() -> Result<Option<qemu_args::RamPlan>, String> {
    let raw =
        std::fs::read("/proc/self/cmdline").map_err(|e| format!("/proc/self/cmdline: {e}"))?;
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    let exe = std::fs::read_link("/proc/self/exe").unwrap_or_default();
    if !is_qemu(words.first().map(String::as_str), &exe) {
        return Ok(None);
    }
    qemu_args::RamPlan::parse(&words[1..])
        .map(Some)
        .map_err(|e| e.to_string())
}

/// Whether the process whose program is `exe` (`/proc/self/exe`), run as `argv0`, is a
/// QEMU: either's name starts with `qemu` (`qemu-system-*`, RHEL's `qemu-kvm`). The
/// executable decides too: libvirt runs its `<emulator>` as named, and a `kvm` symlink
/// or a wrapper's name took a QEMU for another program, skipping every check of its
/// command line (devices writing guest RAM outside its page tables, `aio=native`).
fn is_qemu(argv0: Option<&str>, exe: &std::path::Path) -> bool {
    let qemu_named = |p: &std::path::Path| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("qemu"))
    };
    argv0.is_some_and(|a| qemu_named(std::path::Path::new(a))) || qemu_named(exe)
}

/// Finds guest RAM ([`run`]). Returns the regions, in address order, and whether they are
/// QEMU's memory backends (found by name, so more may be plugged later).
///
/// Errors: none found in 120 s, or only regions of huge pages (the message says what was
/// found); `/proc/self/maps` or `/proc/self/fd` cannot be read.
pub(crate) fn discover(
    cfg: &AgentConfig,
    expected: Option<usize>,
) -> io::Result<(Vec<regions::Region>, bool)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last: Vec<regions::Candidate> = Vec::new();
    let mut since = Instant::now();
    // The set whose hugetlb regions were last warned of: once per set, not every pass.
    let mut warned: Option<Vec<regions::Candidate>> = None;
    loop {
        let maps = regions::parse_maps(&std::fs::read_to_string("/proc/self/maps")?);
        let named = regions::candidates(&maps, Some(regions::QEMU_MEMFD_NAME));
        let total: u64 = named.iter().map(|c| c.bytes).sum();
        if named != last {
            last = named.clone();
            since = Instant::now();
        }
        let ready = if cfg.ram_bytes != 0 {
            total == cfg.ram_bytes
        } else {
            !named.is_empty()
                && (expected.is_some_and(|n| named.len() >= n) || since.elapsed() >= SETTLE)
        };
        if ready {
            let (found, huge) = regions::open(&named)?;
            if !huge.is_empty() && warned.as_ref() != Some(&named) {
                warned = Some(named.clone());
                tracing::warn!("not shareable, left alone: {}", huge.join("; "));
            }
            if !found.is_empty() && (cfg.ram_bytes == 0 || found.len() == named.len()) {
                return Ok((found, true));
            }
            // Whatever its size: waiting would not change it (the host's THP setting,
            // hugetlb), and 120 s of looks every 2 ms would end in an error naming neither.
            if found.is_empty() && !huge.is_empty() {
                return Err(not_shareable(&huge));
            }
        }
        if cfg.ram_bytes != 0 {
            // A host program's own memfd (tests): one mapping of exactly that size.
            let exact: Vec<_> = regions::candidates(&maps, None)
                .into_iter()
                .filter(|c| c.bytes == cfg.ram_bytes)
                .collect();
            if let Some(c) = exact.first() {
                let (mut found, huge) = regions::open(std::slice::from_ref(c))?;
                if let Some(r) = found.pop() {
                    return Ok((vec![r], false));
                }
                if !huge.is_empty() {
                    return Err(not_shareable(&huge));
                }
            }
        }
        if Instant::now() > deadline {
            let shared: Vec<String> = named
                .iter()
                .map(|c| format!("{} MiB at {:#x}", c.bytes >> 20, c.base))
                .collect();
            let what = if cfg.ram_bytes != 0 {
                format!(
                    "MEMFOLD_RAM_BYTES={} but the shared memory-backend-memfd mappings are [{}] ({total} bytes)",
                    cfg.ram_bytes,
                    shared.join(", ")
                )
            } else {
                format!(
                    "no shared memory-backend-memfd mapping (guest RAM) appeared in 120 s; found {}",
                    regions::describe_unshareable(&maps)
                )
            };
            return Err(io::Error::other(format!(
                "{what}; QEMU needs `-object memory-backend-memfd,id=ram0,size=SIZE,share=on -machine memory-backend=ram0` (the guest runs unmanaged)"
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The error of guest RAM found but not shareable, from QEMU's command line or from its
/// mappings: each of `why` says what and why (joined with "; ", as a reason may hold a
/// comma).
pub(crate) fn not_shareable(why: &[String]) -> io::Error {
    io::Error::other(format!(
        "guest RAM is not shareable, memfold leaves this guest alone: {}",
        why.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// A QEMU is known by its executable as well as by the name it was run as: a `kvm`
    /// symlink, a wrapper's name or a libvirt `<emulator>` of another name skipped every
    /// check of its command line.
    #[test]
    fn a_qemu_run_under_another_name_is_a_qemu() {
        let exe = Path::new("/usr/bin/qemu-system-x86_64");
        assert!(super::is_qemu(Some("/usr/bin/kvm"), exe));
        assert!(super::is_qemu(Some("/usr/libexec/qemu-kvm"), Path::new("")));
        assert!(super::is_qemu(None, exe));
        assert!(!super::is_qemu(
            Some("/work/target/release/deps/regions-1234"),
            Path::new("/work/target/release/deps/regions-1234")
        ));
    }
}
