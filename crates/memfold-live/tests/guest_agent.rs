//! `memfold-guest` (images/memfold-guest.rs, the agent inside an enlightened guest) against
//! memfoldd's side of the guest channel: its page classification from kpageflags bits,
//! its reading of `/proc/iomem`, its run lists, and its lines as memfoldd reads them
//! ([`memfold_live::guest_channel::read_report`]). The file is compiled here as a module
//! (it has no crates), so the test checks the very code the image carries.

#[allow(dead_code)]
#[path = "../../../images/memfold-guest.rs"]
mod guest;

use memfold_core::categories::{Category, PageInfo, RamLayout};
use memfold_live::guest_channel::read_report;
use memfold_wire::guest::LineReader;

const LRU: u64 = 1 << 5;
const ACTIVE: u64 = 1 << 6;
const REFERENCED: u64 = 1 << 2;

fn cat(flags: u64, count: u64, head: Option<u8>) -> Category {
    PageInfo::from_code(guest::classify(flags, count, head))
        .expect("a valid code")
        .category
}

#[test]
fn kpageflags_bits_give_the_categories_of_pv_3_1() {
    use Category::*;
    assert_eq!(cat(1 << 10, 0, None), Free, "buddy head");
    // Only a frame the buddy allocator marks is surely free: the bit discards go by.
    let info = |f, c| PageInfo::from_code(guest::classify(f, c, None)).unwrap();
    assert!(info(1 << 10, 0).buddy);
    assert!(
        !info(0, 0).buddy,
        "map count 0: a buddy tail, or a page only the kernel uses"
    );
    assert!(!info(1 << 7, 0).buddy && !info(0, 1).buddy);
    // Page poisoning rules a guest's free pages out of discards.
    assert!(guest::free_pages_discardable(
        "quiet console=ttyS0 init_on_free=1"
    ));
    for on in [
        "page_poison=1",
        "page_poison=ON",
        "page_poison=On",
        "page_poison=yes",
        "page_poison=true",
        "page_poison",
    ] {
        assert!(
            !guest::free_pages_discardable(&format!("quiet {on}")),
            "{on}"
        );
    }
    assert!(guest::free_pages_discardable(
        "page_poison=0 page_poison_x=1"
    ));
    assert_eq!(
        cat(0, 0, None),
        Free,
        "a buddy block's tail, or a per-CPU free page"
    );
    assert_eq!(cat(0, 1, None), Kernel, "in use, no flags: the kernel's");
    assert_eq!(cat(1 << 7, 1, None), Slab);
    assert_eq!(cat(1 << 12 | LRU | 1 << 11, 1, None), Anon);
    assert_eq!(cat(LRU, 1, None), Cache, "page cache, not mapped");
    assert_eq!(cat(LRU | 1 << 11, 2, None), Cache, "mapped page cache");
    assert_eq!(cat(1 << 32, 1, None), Kernel, "reserved");
    assert_eq!(cat(1 << 26, 1, None), Kernel, "page table");
    assert_eq!(cat(1 << 20, 0, None), Unknown, "no page");
    // A compound page's tail is its head's.
    let head = guest::classify(1 << 15 | 1 << 12 | LRU | ACTIVE, 1, None);
    assert_eq!(cat(1 << 16, 0, Some(head)), Anon);
    assert_eq!(cat(1 << 16, 0, None), Kernel, "a tail with no head seen");
    let i = PageInfo::from_code(guest::classify(LRU | ACTIVE | REFERENCED, 1, None)).unwrap();
    assert!(i.active && i.referenced && i.category == Cache);
}

/// Every combination of the flag bits classify reads, and a few it ignores.
fn flag_combinations() -> impl Iterator<Item = u64> {
    // referenced, lru, active, slab, buddy, anon, head, tail, nopage, offline, pgtable,
    // reserved; and mmap (11), dirty (4), which classify ignores.
    const BITS: [u32; 14] = [2, 5, 6, 7, 10, 12, 15, 16, 20, 23, 26, 32, 11, 4];
    (0u32..1 << BITS.len()).map(|m| {
        BITS.iter()
            .enumerate()
            .filter(|(i, _)| m >> i & 1 == 1)
            .fold(0u64, |f, (_, b)| f | 1 << b)
    })
}

#[test]
fn a_frames_map_count_is_read_only_when_its_flags_leave_its_category_open() {
    let head = guest::classify(1 << 15 | LRU | ACTIVE, 1, None);
    let (mut skipped, mut read) = (0, 0);
    for f in flag_combinations() {
        if guest::needs_count(f) {
            // Its category does turn on the count: skipping it would be wrong.
            read += 1;
            assert_ne!(
                guest::classify(f, 0, None),
                guest::classify(f, 1, None),
                "flags {f:#x}: read, but the count changes nothing"
            );
        } else {
            // The count is left unread: no count may change its code.
            skipped += 1;
            for h in [None, Some(head)] {
                let c0 = guest::classify(f, 0, h);
                for c in [1, 2, 7, u64::MAX] {
                    assert_eq!(
                        guest::classify(f, c, h),
                        c0,
                        "flags {f:#x}, head {h:?}: the count {c} changes the code, unread"
                    );
                }
            }
        }
    }
    assert!(skipped > 0 && read > 0, "{skipped} skipped, {read} read");
}

#[test]
fn counts_are_read_in_the_blocks_that_need_them_and_no_other() {
    let b = guest::COUNT_BLOCK;
    // A chunk of page-cache frames, with three whose flags decide nothing.
    let mut flags = vec![LRU; 8 * b + 100];
    for i in [0, b + 188, 8 * b + 99] {
        flags[i] = 0;
    }
    assert_eq!(
        guest::count_blocks(&flags),
        vec![0..b, b..2 * b, 8 * b..8 * b + 100]
    );
    assert!(guest::count_blocks(&[LRU, 1 << 10, 1 << 7]).is_empty());
    assert!(guest::count_blocks(&[]).is_empty());
}

/// /proc/iomem of a 3 GiB q35 guest under SeaBIOS.
const IOMEM_3G: &str = "\
00000000-00000fff : Reserved
00001000-0009fbff : System RAM
0009fc00-0009ffff : Reserved
000f0000-000fffff : Reserved
  000f0000-000fffff : System ROM
00100000-7ffdefff : System RAM
  01000000-01ffffff : Kernel code
7ffdf000-7fffffff : Reserved
b0000000-bfffffff : PCI MMCONFIG 0000 [bus 00-ff]
fffc0000-ffffffff : Reserved
100000000-13fffffff : System RAM
";

#[test]
fn system_ram_of_iomem_gives_the_q35_layout() {
    let r = guest::ram_ranges(IOMEM_3G);
    assert_eq!(r, vec![(1, 0x9f), (0x100, 0x7ffdf), (0x100000, 0x140000)]);
    let l = RamLayout::from_ranges(3 << 18, &r).unwrap();
    assert_eq!((l.low, l.high), (2 << 18, 1 << 18));
}

#[test]
fn runs_are_cut_at_gaps_and_at_the_chunk_limit() {
    let mut r = guest::Runs::new();
    for p in 1..0x9f {
        r.push(p, 1);
    }
    for p in 0x100..0x110 {
        r.push(p, if p < 0x108 { 2 } else { 3 });
    }
    r.finish();
    assert_eq!(
        r.chunks,
        vec![(1, vec![[1, 0x9e]]), (0x100, vec![[2, 8], [3, 8]])]
    );
    // 16 384 runs a chunk at most.
    let mut r = guest::Runs::new();
    for p in 0..40_000u64 {
        r.push(p, (p % 2) as u8);
    }
    r.finish();
    let sizes: Vec<usize> = r.chunks.iter().map(|c| c.1.len()).collect();
    assert_eq!(sizes, [16_384, 16_384, 7232]);
    assert_eq!(r.chunks[1].0, 16_384);
}

#[test]
fn requests_are_parsed_strictly_enough() {
    assert_eq!(
        guest::parse_request(r#"{"req":"categories","v":1,"seq":42}"#),
        Some(42)
    );
    assert_eq!(
        guest::parse_request(r#"{ "req": "categories", "seq": 7, "v": 1 }"#),
        Some(7)
    );
    assert_eq!(
        guest::parse_request(r#"{"req":"categories","v":2,"seq":1}"#),
        None
    );
    assert_eq!(
        guest::parse_request(r#"{"req":"other","v":1,"seq":1}"#),
        None
    );
    assert_eq!(guest::parse_request("garbage"), None);
}

/// The guest's answer, made on this host from its own /proc (root only: kpageflags), is
/// read by memfoldd's side without an error, and its runs cover every System RAM frame.
#[test]
fn an_answer_made_from_this_hosts_proc_reads_back_whole() {
    if let Err(e) = std::fs::File::open("/proc/kpageflags") {
        memfold_sys::testing::skipped(
            "an_answer_made_from_this_hosts_proc_reads_back_whole",
            &format!("/proc/kpageflags not readable (not root?): {e}"),
        );
        return;
    }
    let iomem = std::fs::read_to_string("/proc/iomem").unwrap();
    let ranges = guest::ram_ranges(&iomem);
    // This host's RAM, as if it were a QEMU guest's: low part up to its last low range.
    let four = memfold_core::categories::FOUR_GIB_PFN;
    let low = ranges
        .iter()
        .filter(|r| r.1 <= four)
        .map(|r| r.1)
        .max()
        .unwrap_or(0);
    let high = ranges
        .iter()
        .filter(|r| r.0 >= four)
        .map(|r| r.1 - four)
        .max()
        .unwrap_or(0);
    let lines = guest::answer(5).join("\n") + "\n";
    let mut sent = Vec::new();
    let r = read_report(
        &mut LineReader::new(lines.as_bytes()),
        &mut sent,
        5,
        low + high,
        None,
    )
    .expect("the guest's own answer reads back");
    let frames: u64 = ranges.iter().map(|(s, e)| e - s).sum();
    assert_eq!(r.frames, frames);
    assert!(r.meminfo.mem_total > 0);
    assert!(r.agent.starts_with("memfold-guest"));
    assert!(r.walk_us > 0, "the agent says how long its walk took");
}

/// `never-share` marks resolve to the frames they name (here, on the host: root reads
/// frames in pagemap as the guest's root does): a process's include the frame of a page
/// it wrote, a file's are its resident pages, and a process that is gone (or a reused
/// pid) resolves to nothing.
#[test]
fn never_share_marks_resolve_to_the_frames_of_a_process_and_a_file() {
    use std::io::Write;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        memfold_sys::testing::skipped(
            "never_share_marks_resolve_to_the_frames_of_a_process_and_a_file",
            "not root: pagemap shows no frame numbers",
        );
        return;
    }
    let pid = std::process::id();
    let start = guest::marks::start_time(pid).expect("our own start time");
    let mut page = vec![0x5au8; 3 * 4096];
    let addr = (page.as_mut_ptr() as usize).next_multiple_of(4096);
    // SAFETY: inside `page`, which lives to the end of the test.
    unsafe { std::ptr::write_volatile(addr as *mut u8, 1) };
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut mine = Vec::new();
    let mut budget = 1;
    guest::marks::present_frames(&pagemap, addr as u64 / 4096, 1, &mut budget, &mut mine);
    assert!(
        !mine.is_empty(),
        "root reads the frame of a page it wrote in its own pagemap"
    );
    let mut frames = Vec::new();
    guest::marks::frames_of_pid(pid, start, &mut frames).unwrap();
    assert!(
        frames.contains(&mine[0]),
        "the process's marks hold its written page"
    );
    let mut none = Vec::new();
    assert!(guest::marks::frames_of_pid(pid, start + 1, &mut none)
        .unwrap_err()
        .ends_with("gone"));
    assert!(none.is_empty(), "a reused pid names nothing");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![0xa5u8; 5 * 4096 + 100]).unwrap();
    f.sync_all().unwrap();
    let mut file_frames = Vec::new();
    guest::marks::frames_of_path(path.to_str().unwrap(), &mut file_frames).unwrap();
    file_frames.sort_unstable();
    file_frames.dedup();
    assert_eq!(file_frames.len(), 6, "6 resident pages: {file_frames:x?}");
    assert!(!file_frames.contains(&mine[0]));
    drop(page);
}

/// A mark's path is opened each round inside the guest, where anyone may have replaced
/// the file: a FIFO must not block `serve` (O_NONBLOCK), a symlink must not lead it
/// elsewhere (O_NOFOLLOW), a vanished file drops the mark ("gone"), and an empty file
/// names nothing. Run on a thread with a deadline, so a blocking open fails the test
/// instead of hanging it.
#[test]
fn a_marked_path_that_is_a_fifo_a_symlink_gone_or_empty_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let target = dir.path().join("target");
    std::fs::write(&target, vec![1u8; 4096]).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    let gone = dir.path().join("gone");
    let paths: Vec<String> = [&fifo, &link, &gone, &empty]
        .iter()
        .map(|p| p.to_str().unwrap().to_string())
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let results: Vec<(Result<(), String>, usize)> = paths
            .iter()
            .map(|p| {
                let mut frames = Vec::new();
                let r = guest::marks::frames_of_path(p, &mut frames);
                (r, frames.len())
            })
            .collect();
        tx.send(results).unwrap();
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("a marked path blocked the guest agent (a FIFO opened without O_NONBLOCK?)");
    let err = |i: usize| r[i].0.clone().unwrap_err();
    assert!(err(0).contains("not a regular file"), "fifo: {}", err(0));
    assert_eq!(r[0].1, 0);
    assert!(
        !err(1).ends_with("gone"),
        "a symlink is refused, not followed: {}",
        err(1)
    );
    assert_eq!(r[1].1, 0, "no frames through a symlink");
    assert!(err(2).ends_with(": gone"), "{}", err(2));
    assert_eq!(r[3], (Ok(()), 0), "an empty file names nothing");
}
