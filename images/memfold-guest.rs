//! memfold-guest: the agent inside an enlightened guest (issue 17; PV §3.1,
//! "meta-data dependent sharing"; docs/enlightened.md). It tells memfoldd what the guest's
//! pages are, from the guest kernel's own book-keeping, over the virtio-serial port
//! `org.memfold.guest.0` (memfold_wire::guest is the protocol's definition on the host
//! side; this file speaks it without crates, so that it builds statically into any guest).
//!
//! - `memfold-guest [serve]`: answers memfoldd's requests on
//!   `/dev/virtio-ports/org.memfold.guest.0` (or, without udev, the `/dev/vportNpM` of
//!   that name) until killed (waits for the port to appear).
//!   To `{"req":"categories","v":1,"seq":N}` it answers with one `ram` line (its System
//!   RAM ranges from `/proc/iomem`, some `/proc/meminfo` values), `runs` lines (every
//!   System RAM frame's category as `[code, pages]` runs, from `/proc/kpageflags` and
//!   `/proc/kpagecount`) and an `end` line. Needs root (both files, and `/proc/iomem`'s
//!   addresses).
//! - `memfold-guest categories`: prints the same counts once, by category, beside
//!   `/proc/meminfo` (a check of an install).
//! - `memfold-guest never-share --pid P | --path F | --list | --clear`: marks a process's
//!   pages (all it maps now) or a file's page-cache pages never to be shared (Satori
//!   §4.3, the write-latency side channel). The marks are kept in [`MARKS`]; `serve`
//!   resolves them to frames for each answer and sets their never-share bit (6), and
//!   memfoldd never shares, patches or takes as reference those pages, and takes back
//!   those already shared (docs/side-channel.md). A process's mark ends with it.
//! - `memfold-guest marker TEXT`: fills a page of its own memory with TEXT, prints
//!   `MEMFOLD-MARKER pfn=0x… text=TEXT` (its frame by `/proc/self/pagemap`), and keeps
//!   the page, printing its frame again if the kernel moves it (the host's check that it
//!   maps frames to memfold's gfns right: it finds TEXT at the gfn of that frame).
//!
//! Built by memfold-vm's build script (statically linked, no crates) and put in every
//! image's initramfs by images/build.sh; tiny-init, or in the Debian images guest-init,
//! starts `memfold-guest serve` at boot.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::time::Duration;

// The never-share marks (`never-share`), resolved to frames for each answer.
#[path = "memfold-guest-marks.rs"]
pub mod marks;
use marks::{never_share, resolve_marks, NEVER_SHARE};

/// The port's device.
const PORT: &str = "/dev/virtio-ports/org.memfold.guest.0";
/// The guest channel's protocol version (memfold_wire::guest::GUEST_PROTOCOL_VERSION).
const VERSION: u32 = 1;
/// Runs a `runs` line carries at most (memfold_wire::guest::MAX_RUNS is 65 536; a line
/// stays well under its 1 MiB).
const CHUNK_RUNS: usize = 16_384;
/// Longest request line read, bytes; a longer one is skipped.
const MAX_REQUEST: usize = 4096;
const PAGE: u64 = 4096;

// /proc/kpageflags bits (Documentation/admin-guide/mm/pagemap.rst).
const KPF_REFERENCED: u64 = 1 << 2;
const KPF_LRU: u64 = 1 << 5;
const KPF_ACTIVE: u64 = 1 << 6;
const KPF_SLAB: u64 = 1 << 7;
const KPF_BUDDY: u64 = 1 << 10;
const KPF_ANON: u64 = 1 << 12;
const KPF_COMPOUND_HEAD: u64 = 1 << 15;
const KPF_COMPOUND_TAIL: u64 = 1 << 16;
const KPF_NOPAGE: u64 = 1 << 20;
const KPF_OFFLINE: u64 = 1 << 23;
const KPF_PGTABLE: u64 = 1 << 26;
const KPF_RESERVED: u64 = 1 << 32;

// Category codes (memfold_core::categories::Category).
const UNKNOWN: u8 = 0;
const FREE: u8 = 1;
const CACHE: u8 = 2;
const ANON: u8 = 3;
const SLAB: u8 = 4;
const KERNEL: u8 = 5;
const NAMES: [&str; 6] = ["unknown", "free", "cache", "anon", "slab", "kernel"];

/// A frame's code (category in bits 0–2, active bit 3, referenced bit 4, buddy bit 5)
/// from its `/proc/kpageflags` flags and `/proc/kpagecount` count; `head`: the code of
/// the compound page's head when this frame is a tail (its flags are mostly the head's
/// to have). Free: in the buddy allocator (`BUDDY`, on every frame of a free block since
/// Linux 4.19; on the first only before) or with no user (count 0: per-CPU free lists).
/// The count is a *map* count, 0 for pages only the kernel uses too (stacks, DMA
/// buffers, a virtqueue's ring), so "free" by it is an estimate for the books; the buddy
/// bit marks the frames that are surely free, the only ones the host may discard
/// (issue 17).
pub fn classify(flags: u64, count: u64, head: Option<u8>) -> u8 {
    if flags & KPF_NOPAGE != 0 {
        return UNKNOWN;
    }
    if flags & KPF_COMPOUND_TAIL != 0 {
        if let Some(h) = head {
            return h;
        }
    }
    let cat = if flags & KPF_BUDDY != 0 {
        FREE
    } else if flags & KPF_SLAB != 0 {
        SLAB
    } else if flags & KPF_ANON != 0 {
        ANON
    } else if flags & KPF_LRU != 0 {
        CACHE
    } else if flags & (KPF_OFFLINE | KPF_RESERVED | KPF_PGTABLE) != 0 {
        KERNEL
    } else if count == 0 && flags & KPF_COMPOUND_TAIL == 0 {
        FREE
    } else {
        KERNEL
    };
    cat | ((flags & KPF_ACTIVE != 0) as u8) << 3
        | ((flags & KPF_REFERENCED != 0) as u8) << 4
        | ((flags & KPF_BUDDY != 0 && cat == FREE) as u8) << 5
}

/// The "System RAM" ranges of `/proc/iomem`'s text, as whole frames `[start, end)`.
pub fn ram_ranges(iomem: &str) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for line in iomem.lines() {
        // Top-level entries only (nested ones are indented).
        if line.starts_with(' ') || !line.ends_with(": System RAM") {
            continue;
        }
        let Some((range, _)) = line.split_once(" : ") else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let (s, e) = (a.div_ceil(PAGE), (b + 1) / PAGE);
        if s < e {
            out.push((s, e));
        }
    }
    out
}

/// Run-length lists of codes, cut into chunks of at most [`CHUNK_RUNS`] runs.
pub struct Runs {
    /// Finished chunks: first frame and `[code, pages]`.
    pub chunks: Vec<(u64, Vec<[u32; 2]>)>,
    first: u64,
    next: u64,
    cur: Vec<[u32; 2]>,
}

impl Runs {
    /// No runs.
    pub fn new() -> Self {
        Runs {
            chunks: Vec::new(),
            first: 0,
            next: 0,
            cur: Vec::new(),
        }
    }

    /// Frame `pfn` has `code` (frames pushed in increasing order; a gap, or a chunk
    /// full, starts a new chunk).
    pub fn push(&mut self, pfn: u64, code: u8) {
        let code = code as u32;
        if pfn == self.next && !self.cur.is_empty() {
            let last = self.cur.last_mut().expect("not empty");
            if last[0] == code && last[1] < u32::MAX {
                last[1] += 1;
                self.next += 1;
                return;
            }
            if self.cur.len() < CHUNK_RUNS {
                self.cur.push([code, 1]);
                self.next += 1;
                return;
            }
        }
        self.finish();
        self.first = pfn;
        self.cur.push([code, 1]);
        self.next = pfn + 1;
    }

    /// Ends the chunk under way.
    pub fn finish(&mut self) {
        if !self.cur.is_empty() {
            self.chunks
                .push((self.first, std::mem::take(&mut self.cur)));
        }
    }
}

impl Default for Runs {
    fn default() -> Self {
        Runs::new()
    }
}

/// Flags that decide a frame's category before its map count is looked at (the arms of
/// [`classify`] above its last two), or make its code its head's (a tail).
const DECIDING: u64 = KPF_NOPAGE
    | KPF_COMPOUND_TAIL
    | KPF_BUDDY
    | KPF_SLAB
    | KPF_ANON
    | KPF_LRU
    | KPF_OFFLINE
    | KPF_RESERVED
    | KPF_PGTABLE;

/// Whether [`classify`] needs a frame's `/proc/kpagecount` word: only when none of its
/// flags decides its category. The kernel walks its memmap for each of the two files
/// (on a 24 GiB host about half the walk each; in the guests measured the counts were
/// less: skipping them saved ~12% of a report, docs/enlightened.md), and in a guest in
/// use most frames are on an LRU, anonymous, slab or in the buddy allocator, so most
/// counts need not be read.
pub fn needs_count(flags: u64) -> bool {
    flags & DECIDING == 0
}

/// Frames of `/proc/kpagecount` read at a time at most (4 KiB of it; a chunk's last
/// block may be shorter): a block is read only if one of its frames [`needs_count`].
pub const COUNT_BLOCK: usize = 512;

/// The blocks of a chunk of frames (by their flags) whose counts must be read: index
/// ranges of at most [`COUNT_BLOCK`] frames, in order, covering every frame that
/// [`needs_count`] and no block without one.
pub fn count_blocks(flags: &[u64]) -> Vec<std::ops::Range<usize>> {
    (0..flags.len())
        .step_by(COUNT_BLOCK)
        .map(|b| b..(b + COUNT_BLOCK).min(flags.len()))
        .filter(|r| flags[r.clone()].iter().any(|&f| needs_count(f)))
        .collect()
}

/// Every System RAM frame's code, and frames by category; frames of `marked` (sorted)
/// get the never-share bit.
fn read_categories(ranges: &[(u64, u64)], marked: &[u64]) -> Result<(Runs, [u64; 6]), String> {
    let flags = File::open("/proc/kpageflags").map_err(|e| format!("/proc/kpageflags: {e}"))?;
    let counts = File::open("/proc/kpagecount").map_err(|e| format!("/proc/kpagecount: {e}"))?;
    let mut runs = Runs::new();
    let mut by = [0u64; 6];
    const N: u64 = 8192;
    let mut fb = vec![0u8; (N * 8) as usize];
    let mut cb = vec![0u8; (N * 8) as usize];
    let mut fl = vec![0u64; N as usize];
    for &(start, end) in ranges {
        let mut head: Option<u8> = None;
        let mut pfn = start;
        while pfn < end {
            let n = N.min(end - pfn);
            let bytes = (n * 8) as usize;
            read_full(&flags, &mut fb[..bytes], pfn * 8)
                .map_err(|e| format!("/proc/kpageflags at frame {pfn:#x}: {e}"))?;
            let fl = &mut fl[..n as usize];
            for (k, f) in fl.iter_mut().enumerate() {
                *f = u64::from_le_bytes(fb[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
            }
            // Counts only where a frame's flags leave its category open; the others'
            // count words are left as they were, and classify does not read them.
            for r in count_blocks(fl) {
                let at = pfn + r.start as u64;
                read_full(&counts, &mut cb[r.start * 8..r.end * 8], at * 8)
                    .map_err(|e| format!("/proc/kpagecount at frame {at:#x}: {e}"))?;
            }
            for k in 0..n as usize {
                let f = fl[k];
                let c = u64::from_le_bytes(cb[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
                let tail = f & KPF_COMPOUND_TAIL != 0;
                let code = classify(f, c, if tail { head } else { None });
                if f & KPF_COMPOUND_HEAD != 0 {
                    head = Some(code);
                } else if !tail {
                    head = None;
                }
                by[(code & 7) as usize] += 1;
                let here = pfn + k as u64;
                let mark = marked.binary_search(&here).is_ok();
                runs.push(here, if mark { code | NEVER_SHARE } else { code });
            }
            pfn += n;
        }
    }
    runs.finish();
    Ok((runs, by))
}

fn read_full(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = f.read_at(&mut buf[done..], off + done as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "short read",
            ));
        }
        done += n;
    }
    Ok(())
}

/// `/proc/meminfo`'s value of `key`, KiB (0 if absent).
fn meminfo(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or(0)
}

fn meminfo_json(text: &str) -> String {
    let keys = [
        ("mem_total", "MemTotal"),
        ("mem_free", "MemFree"),
        ("buffers", "Buffers"),
        ("cached", "Cached"),
        ("anon_pages", "AnonPages"),
        ("shmem", "Shmem"),
        ("slab", "Slab"),
    ];
    let fields: Vec<String> = keys
        .iter()
        .map(|(j, k)| format!("\"{j}\":{}", meminfo(text, k)))
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// A JSON string of `s` (quotes, backslashes and control characters escaped).
fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Whether the host may discard this guest's free pages (reading as zeros afterwards):
/// not with page poisoning on (`page_poison=` on the kernel command line `cmdline`, true
/// as the kernel's `kstrtobool` reads it: a value starting with y, t or 1, or "on", in
/// any case; a bare `page_poison` counts too), whose allocator checks a free page's old
/// poison bytes when it hands it out.
pub fn free_pages_discardable(cmdline: &str) -> bool {
    !cmdline.split_whitespace().any(|a| {
        let Some(v) = a.strip_prefix("page_poison") else {
            return false;
        };
        let Some(v) = v.strip_prefix('=') else {
            return v.is_empty();
        };
        v.starts_with(['y', 'Y', 't', 'T', '1']) || v.to_ascii_lowercase().starts_with("on")
    })
}

/// The lines answering request `seq`.
pub fn answer(seq: u64) -> Vec<String> {
    let iomem = std::fs::read_to_string("/proc/iomem").unwrap_or_default();
    let ranges = ram_ranges(&iomem);
    if ranges.is_empty() {
        return vec![error_line(seq, "no System RAM in /proc/iomem (not root?)")];
    }
    let (marked, problems) = resolve_marks();
    // Said once, not every report.
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    if let Ok(mut said) = SAID.lock() {
        if *said != problems {
            for p in &problems {
                eprintln!("memfold-guest: never-share: {p}");
            }
            *said = problems;
        }
    }
    let walk = std::time::Instant::now();
    let (runs, _) = match read_categories(&ranges, &marked) {
        Ok(r) => r,
        Err(e) => return vec![error_line(seq, &e)],
    };
    let walk_us = walk.elapsed().as_micros().max(1);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mi = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let rs: Vec<String> = ranges.iter().map(|(s, e)| format!("[{s},{e}]")).collect();
    let mut out = vec![format!(
        "{{\"msg\":\"ram\",\"v\":{VERSION},\"seq\":{seq},\"agent\":{},\"kernel\":{},\"ranges\":[{}],\"meminfo\":{},\"discard\":{}}}",
        json_str(concat!("memfold-guest ", "1")),
        json_str(kernel.trim()),
        rs.join(","),
        meminfo_json(&mi),
        free_pages_discardable(&cmdline)
    )];
    let mut frames = 0u64;
    for (first, chunk) in &runs.chunks {
        let items: Vec<String> = chunk.iter().map(|[c, n]| format!("[{c},{n}]")).collect();
        frames += chunk.iter().map(|r| r[1] as u64).sum::<u64>();
        out.push(format!(
            "{{\"msg\":\"runs\",\"v\":{VERSION},\"seq\":{seq},\"first\":{first},\"runs\":[{}]}}",
            items.join(",")
        ));
    }
    out.push(format!(
        "{{\"msg\":\"end\",\"v\":{VERSION},\"seq\":{seq},\"chunks\":{},\"frames\":{frames},\"walk_us\":{walk_us}}}",
        runs.chunks.len()
    ));
    out
}

fn error_line(seq: u64, what: &str) -> String {
    format!(
        "{{\"msg\":\"error\",\"v\":{VERSION},\"seq\":{seq},\"what\":{}}}",
        json_str(what)
    )
}

/// The `seq` of a categories request of this protocol version, `None` for anything else.
pub fn parse_request(line: &str) -> Option<u64> {
    let compact: String = line.chars().filter(|c| !c.is_whitespace()).collect();
    if !compact.contains("\"req\":\"categories\"")
        || !compact.contains(&format!("\"v\":{VERSION},"))
            && !compact.contains(&format!("\"v\":{VERSION}}}"))
    {
        return None;
    }
    let rest = &compact[compact.find("\"seq\":")? + 6..];
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// The port's device: udev's `/dev/virtio-ports/NAME` link, or without udev (an
/// initramfs) the `/dev/vportNpM` whose `/sys/class/virtio-ports/vportNpM/name` is the
/// port's name.
fn find_port() -> Option<String> {
    if std::path::Path::new(PORT).exists() {
        return Some(PORT.into());
    }
    let name = PORT.rsplit('/').next().expect("a name");
    std::fs::read_dir("/sys/class/virtio-ports")
        .ok()?
        .flatten()
        .find(|e| std::fs::read_to_string(e.path().join("name")).is_ok_and(|n| n.trim() == name))
        .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
}

fn serve() -> ! {
    loop {
        let (port, path) = loop {
            if let Some(p) = find_port() {
                if let Ok(f) = File::options().read(true).write(true).open(&p) {
                    break (f, p);
                }
            }
            std::thread::sleep(Duration::from_secs(1));
        };
        eprintln!("memfold-guest: serving {path}");
        let mut out = match port.try_clone() {
            Ok(f) => f,
            Err(e) => {
                eprintln!("memfold-guest: {path}: {e}");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let mut r = BufReader::new(port);
        let mut line = Vec::new();
        loop {
            line.clear();
            // A bounded line: a longer one is skipped to its newline.
            let mut too_long = false;
            let ok = loop {
                let buf = match r.fill_buf() {
                    Ok(b) => b,
                    Err(_) => break false,
                };
                if buf.is_empty() {
                    // Nobody on the host side: wait for them.
                    std::thread::sleep(Duration::from_millis(500));
                    continue;
                }
                let (take, done) = match buf.iter().position(|&b| b == b'\n') {
                    Some(i) => (i, true),
                    None => (buf.len(), false),
                };
                if line.len() + take <= MAX_REQUEST {
                    line.extend_from_slice(&buf[..take]);
                } else {
                    too_long = true;
                }
                r.consume(take + done as usize);
                if done {
                    break true;
                }
            };
            if !ok {
                break;
            }
            if too_long {
                continue;
            }
            let Some(seq) = std::str::from_utf8(&line).ok().and_then(parse_request) else {
                continue;
            };
            let mut all = answer(seq).join("\n");
            all.push('\n');
            if out.write_all(all.as_bytes()).is_err() {
                break;
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn categories() -> Result<(), String> {
    let iomem = std::fs::read_to_string("/proc/iomem").map_err(|e| format!("/proc/iomem: {e}"))?;
    let ranges = ram_ranges(&iomem);
    let (marked, problems) = resolve_marks();
    let (_, by) = read_categories(&ranges, &marked)?;
    let mi = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total: u64 = ranges.iter().map(|(s, e)| e - s).sum();
    println!("MEMFOLD-GUEST-RAM ranges={} frames={total}", ranges.len());
    for (i, n) in by.iter().enumerate() {
        println!("MEMFOLD-GUEST-CATEGORY {} {} KiB", NAMES[i], n * 4);
    }
    println!("MEMFOLD-GUEST-NEVER-SHARE {} KiB", marked.len() * 4);
    for p in problems {
        println!("MEMFOLD-GUEST-NEVER-SHARE-PROBLEM {p}");
    }
    for k in [
        "MemTotal",
        "MemFree",
        "Buffers",
        "Cached",
        "AnonPages",
        "Shmem",
        "Slab",
    ] {
        println!("MEMFOLD-GUEST-MEMINFO {k} {} KiB", meminfo(&mi, k));
    }
    Ok(())
}

/// One page, page-aligned.
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// The frame of the page at `addr` of this process, by `/proc/self/pagemap` (bit 63:
/// present, bits 0–54: frame; root sees frames).
fn pfn_of(addr: usize) -> Result<u64, String> {
    let f = File::open("/proc/self/pagemap").map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    let mut b = [0u8; 8];
    read_full(&f, &mut b, (addr as u64 / PAGE) * 8).map_err(|e| format!("pagemap: {e}"))?;
    let e = u64::from_le_bytes(b);
    if e >> 63 == 0 {
        return Err("marker page not present".into());
    }
    let pfn = e & ((1 << 55) - 1);
    if pfn == 0 {
        return Err("pagemap shows no frame (not root?)".into());
    }
    Ok(pfn)
}

fn marker(text: &str) -> Result<(), String> {
    let mut page = Box::new(Page([0; 4096]));
    let t = text.as_bytes();
    if t.is_empty() || t.len() > 4096 {
        return Err("marker text of 1 to 4096 bytes".into());
    }
    for (i, b) in page.0.iter_mut().enumerate() {
        *b = t[i % t.len()];
    }
    let addr = page.0.as_ptr() as usize;
    let mut last = 0;
    loop {
        // Read through the page so that it stays as written and resident.
        let sum: u64 = page.0.iter().map(|&b| b as u64).sum();
        std::hint::black_box(sum);
        let pfn = pfn_of(addr)?;
        if pfn != last {
            println!("MEMFOLD-MARKER pfn={pfn:#x} text={text}");
            println!("MEMFOLD-MARKER-PID pid={} pfn={pfn:#x}", std::process::id());
            let _ = std::io::stdout().flush();
            last = pfn;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        None | Some("serve") => serve(),
        Some("categories") => categories(),
        Some("marker") if args.len() == 3 => marker(&args[2]),
        Some("never-share") => never_share(&args[2..]),
        _ => Err("usage: memfold-guest [serve] | categories | marker TEXT \
             | never-share --pid P | --path F | --list | --clear"
            .into()),
    };
    if let Err(e) = r {
        eprintln!("memfold-guest: {e}");
        let _ = std::io::stderr().flush();
        std::process::exit(1);
    }
}
