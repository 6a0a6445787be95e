//! Static analysis of guest memory snapshots: Difference Engine Table 1 (§3.2) with the
//! engine's own detectors and codecs.
//!
//! For a set of guests and a basis (all guest pages, or only host-resident ones) it
//! counts zero, duplicate (and distinct duplicate) and unique pages, and the pages needed
//! to store them with sharing only, with sharing + patching, and with sharing + patching +
//! compression:
//! - **sharing only**: one page per distinct non-zero content, plus one zero page if any
//!   (what KSM does with `use_zero_pages=0`; memfold's default reclaims it too);
//! - **+ patching**: over the distinct contents in page order, a page with a candidate
//!   from HashSimilarityDetector whose patch is under the cut-off costs its patch's
//!   blob-store slot (header included); the others are stored whole and indexed as
//!   references (DE §3.2's procedure);
//! - **+ compression**: whole pages that no patch uses as reference cost their compressed
//!   slot if under the cut-off (DE §4.3: a compressed page cannot be a reference).
//!
//! Page counts with patching and compression are fractional (slot bytes / 4096).

use std::collections::HashMap;

use memfold_codecs::{CompressCodec, Page, PatchCodec, PAGE_SIZE};
use serde::Serialize;

use crate::ids::Gpn;
use crate::is_zero_page;
use crate::similarity::{RefPage, SimilarityConfig, SimilarityDetector, SimilarityIndex};
use crate::slab::slot_size;

/// Bytes of header counted in front of each blob (reference, length, kind), as a store
/// that keeps blobs self-describing would.
const BLOB_HEADER: usize = 8;

/// One guest's snapshot: its pages and, if known, which are host-resident.
pub struct GuestMemory<'a> {
    /// Guest name.
    pub name: String,
    /// Guest-physical memory, a multiple of 4096 bytes.
    pub ram: &'a [u8],
    /// One bit a page, LSB first; `None`: residency unknown (the resident basis is then
    /// the same as all pages).
    pub resident: Option<&'a [u8]>,
}

/// Analysis parameters.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct AnalysisConfig {
    /// HashSimilarityDetector parameters; DE's (2,1) by default.
    pub similarity: SimilarityConfig,
    /// Patch codec.
    pub patch_codec: PatchCodec,
    /// Largest patch, bytes (DE: 2048).
    pub patch_cutoff: usize,
    /// Compression codec.
    pub compress_codec: CompressCodec,
    /// Largest compressed page, bytes.
    pub compress_cutoff: usize,
    /// Worker threads.
    pub threads: usize,
}

impl Default for AnalysisConfig {
    fn default() -> Self {
        AnalysisConfig {
            similarity: SimilarityConfig::default(),
            patch_codec: PatchCodec::RunDiff,
            patch_cutoff: 2048,
            compress_codec: CompressCodec::Lz4,
            compress_cutoff: 2048,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// The analysis of one set of guests on one basis (DE Table 1's columns).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SetAnalysis {
    /// Set name: a guest's name, or `all`.
    pub name: String,
    /// `all` (every guest page) or `resident` (host-resident pages only).
    pub basis: &'static str,
    /// Guests in the set.
    pub guests: Vec<String>,
    /// Pages considered.
    pub pages: u64,
    /// All-zero pages.
    pub zero_pages: u64,
    /// Non-zero pages whose content occurs at least twice in the set.
    pub duplicate_pages: u64,
    /// Distinct contents among the duplicate pages.
    pub distinct_duplicate_pages: u64,
    /// Non-zero pages whose content occurs once.
    pub unique_pages: u64,
    /// Pages needed with sharing only.
    pub pages_sharing_only: f64,
    /// Pages needed with sharing and patching.
    pub pages_with_patching: f64,
    /// Pages needed with sharing, patching and compression.
    pub pages_with_compression: f64,
    /// Distinct contents stored as patches.
    pub patched_pages: u64,
    /// Distinct contents used as patch references.
    pub reference_pages: u64,
    /// Distinct contents stored compressed.
    pub compressed_pages: u64,
    /// Pages saved beyond sharing only if each shared frame (a distinct duplicate
    /// content) were kept compressed when under the cut-off, once for all its sharers.
    /// memfold's live DE never compresses a shared frame (DE §5.4: reads are free for
    /// shared pages, not for compressed ones), so this is the most a fold of shared
    /// frames into the store could add, were every shared frame cold.
    pub shared_frames_compressed_saving: f64,
}

/// Per distinct content: a representative page, its compressed slot size (0: over the
/// cut-off) and similarity signatures.
struct Content {
    page: (u32, u32),
    comp_slot: u32,
    sigs: [u32; 8],
}

fn page_of<'a>(guests: &'a [GuestMemory<'a>], (g, p): (u32, u32)) -> &'a Page {
    let off = p as usize * PAGE_SIZE;
    guests[g as usize].ram[off..off + PAGE_SIZE]
        .try_into()
        .expect("page-sized")
}

fn resident(gm: &GuestMemory, p: usize) -> bool {
    gm.resident
        .is_none_or(|b| b.get(p / 8).is_some_and(|x| x & (1 << (p % 8)) != 0))
}

/// Analyses every guest alone and all guests together, on both bases. Sets come out in
/// the order: each guest, then `all`; each with basis `all` then `resident`.
///
/// Panics if a snapshot's length is not a multiple of 4096 (callers validate files).
pub fn analyze(guests: &[GuestMemory], cfg: &AnalysisConfig) -> Result<Vec<SetAnalysis>, String> {
    for g in guests {
        assert!(g.ram.len() % PAGE_SIZE == 0, "{}: not whole pages", g.name);
    }
    // A blob is counted in a slab slot with its header, and no slot is past a page.
    for (which, bytes) in [
        ("patch", cfg.patch_cutoff),
        ("compression", cfg.compress_cutoff),
    ] {
        if bytes.saturating_add(BLOB_HEADER) > PAGE_SIZE {
            return Err(format!(
                "{which} cut-off of {bytes} bytes: at most {} (a blob and its {BLOB_HEADER}-byte header in one page)",
                PAGE_SIZE - BLOB_HEADER
            ));
        }
    }
    let det = SimilarityDetector::new(cfg.similarity)?;
    let threads = cfg.threads.max(1);

    // 1. Hash every page (in parallel): content id per page, u32::MAX for zero pages.
    let all_pages: Vec<(u32, u32)> = guests
        .iter()
        .enumerate()
        .flat_map(|(g, gm)| (0..(gm.ram.len() / PAGE_SIZE) as u32).map(move |p| (g as u32, p)))
        .collect();
    let hashes: Vec<u64> = parallel_map(&all_pages, threads, |&gp| {
        let page = page_of(guests, gp);
        if is_zero_page(page) {
            0
        } else {
            xxhash_rust::xxh3::xxh3_64(page) | 1 // never 0: 0 marks zero pages
        }
    });
    // 2. Group by content, confirming byte for byte.
    let mut groups: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut reps: Vec<(u32, u32)> = Vec::new();
    let mut cid_of = vec![u32::MAX; all_pages.len()];
    for (i, &h) in hashes.iter().enumerate() {
        if h == 0 {
            continue;
        }
        let page = page_of(guests, all_pages[i]);
        let bucket = groups.entry(h).or_default();
        let cid = match bucket
            .iter()
            .find(|&&c| page_of(guests, reps[c as usize]) == page)
        {
            Some(&c) => c,
            None => {
                reps.push(all_pages[i]);
                bucket.push(reps.len() as u32 - 1);
                reps.len() as u32 - 1
            }
        };
        cid_of[i] = cid;
    }
    // 3. Per content, once: compressed slot size and signatures (in parallel).
    let contents: Vec<Content> = parallel_map(&reps, threads, |&gp| {
        let page = page_of(guests, gp);
        let mut buf = Vec::with_capacity(2 * PAGE_SIZE);
        let comp_slot = match cfg.compress_codec.compress(page, &mut buf) {
            Ok(()) if buf.len() <= cfg.compress_cutoff => slot_size(buf.len() + BLOB_HEADER) as u32,
            _ => 0,
        };
        Content {
            page: gp,
            comp_slot,
            sigs: det.signatures(page),
        }
    });

    // 4. The sets: each guest, then all; each on both bases.
    let mut jobs: Vec<(String, Vec<usize>, &'static str)> = Vec::new();
    // The `all` set first: it is the largest job, so it starts while the single guests
    // share the other threads. The output order is restored below.
    let mut sets: Vec<(String, Vec<usize>)> = Vec::new();
    if guests.len() > 1 {
        sets.push(("all".into(), (0..guests.len()).collect()));
    }
    sets.extend(
        guests
            .iter()
            .enumerate()
            .map(|(i, g)| (g.name.clone(), vec![i])),
    );
    for (name, members) in sets {
        for basis in ["all", "resident"] {
            jobs.push((name.clone(), members.clone(), basis));
        }
    }
    let offsets: Vec<usize> = guests
        .iter()
        .scan(0, |acc, g| {
            let o = *acc;
            *acc += g.ram.len() / PAGE_SIZE;
            Some(o)
        })
        .collect();
    let mut results = parallel_map(&jobs, threads, |(name, members, basis)| {
        analyze_set(
            guests, cfg, &det, &contents, &cid_of, &offsets, name, members, basis,
        )
    });
    if guests.len() > 1 {
        results.rotate_left(2); // each guest, then `all`
    }
    Ok(results)
}

#[allow(clippy::too_many_arguments)]
fn analyze_set(
    guests: &[GuestMemory],
    cfg: &AnalysisConfig,
    det: &SimilarityDetector,
    contents: &[Content],
    cid_of: &[u32],
    offsets: &[usize],
    name: &str,
    members: &[usize],
    basis: &'static str,
) -> SetAnalysis {
    let mut a = SetAnalysis {
        name: name.into(),
        basis,
        guests: members.iter().map(|&g| guests[g].name.clone()).collect(),
        pages: 0,
        zero_pages: 0,
        duplicate_pages: 0,
        distinct_duplicate_pages: 0,
        unique_pages: 0,
        pages_sharing_only: 0.0,
        pages_with_patching: 0.0,
        pages_with_compression: 0.0,
        patched_pages: 0,
        reference_pages: 0,
        compressed_pages: 0,
        shared_frames_compressed_saving: 0.0,
    };
    // Occurrences of each content in this set, and contents in first-seen order.
    let mut count: HashMap<u32, u32> = HashMap::new();
    let mut order: Vec<u32> = Vec::new();
    for &g in members {
        let gm = &guests[g];
        for p in 0..gm.ram.len() / PAGE_SIZE {
            if basis == "resident" && !resident(gm, p) {
                continue;
            }
            a.pages += 1;
            let cid = cid_of[offsets[g] + p];
            if cid == u32::MAX {
                a.zero_pages += 1;
                continue;
            }
            let c = count.entry(cid).or_insert(0);
            if *c == 0 {
                order.push(cid);
            }
            *c += 1;
        }
    }
    for (&cid, &n) in &count {
        if n >= 2 {
            a.duplicate_pages += n as u64;
            a.distinct_duplicate_pages += 1;
            let slot = contents[cid as usize].comp_slot;
            if slot > 0 {
                a.shared_frames_compressed_saving += 1.0 - slot as f64 / PAGE_SIZE as f64;
            }
        } else {
            a.unique_pages += 1;
        }
    }
    let zero_cost = if a.zero_pages > 0 { 1.0 } else { 0.0 };
    a.pages_sharing_only = order.len() as f64 + zero_cost;

    // Patching over distinct contents, in first-seen order (DE §3.2).
    let mut index = SimilarityIndex::new(det.clone());
    index.clear_for(order.len() as u64);
    let mut is_reference = vec![false; order.len()];
    let mut stored_whole: Vec<usize> = Vec::new(); // positions in `order`
    let mut patch_bytes = 0usize;
    let mut cands = Vec::new();
    let mut buf = Vec::with_capacity(2 * PAGE_SIZE);
    for (pos, &cid) in order.iter().enumerate() {
        let c = &contents[cid as usize];
        let page = page_of(guests, c.page);
        index.candidates(&c.sigs, &mut cands);
        let mut best: Option<(usize, usize)> = None; // (reference position, patch length)
        for &cand in &cands {
            let RefPage::Guest(Gpn(rpos)) = cand else {
                continue;
            };
            let r = &contents[order[rpos as usize] as usize];
            let rpage = page_of(guests, r.page);
            if !index.matches(&c.sigs, rpage) {
                continue;
            }
            if cfg.patch_codec.encode(rpage, page, &mut buf).is_ok()
                && !buf.is_empty()
                && buf.len() <= cfg.patch_cutoff
                && best.is_none_or(|(_, l)| buf.len() < l)
            {
                best = Some((rpos as usize, buf.len()));
            }
        }
        match best {
            Some((rpos, len)) => {
                a.patched_pages += 1;
                is_reference[rpos] = true;
                patch_bytes += slot_size(len + BLOB_HEADER);
            }
            None => {
                stored_whole.push(pos);
                index.insert(&c.sigs, RefPage::Guest(Gpn(pos as u32)));
            }
        }
    }
    a.reference_pages = is_reference.iter().filter(|&&r| r).count() as u64;
    let page = PAGE_SIZE as f64;
    a.pages_with_patching = zero_cost + stored_whole.len() as f64 + patch_bytes as f64 / page;
    let mut whole_bytes = 0usize;
    for &pos in &stored_whole {
        let slot = contents[order[pos] as usize].comp_slot as usize;
        if !is_reference[pos] && slot > 0 {
            a.compressed_pages += 1;
            whole_bytes += slot;
        } else {
            whole_bytes += PAGE_SIZE;
        }
    }
    a.pages_with_compression = zero_cost + (whole_bytes + patch_bytes) as f64 / page;
    a
}

/// Maps `f` over `items` on `threads` threads, keeping order. Work is handed out in small
/// blocks, so items of uneven cost (the `all` set beside single guests) stay balanced.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    if threads <= 1 || items.len() < 2 {
        return items.iter().map(&f).collect();
    }
    let block = (items.len() / (threads * 64)).max(1);
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, Vec<R>)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let start = next.fetch_add(block, Ordering::Relaxed);
                if start >= items.len() {
                    break;
                }
                let out: Vec<R> = items[start..(start + block).min(items.len())]
                    .iter()
                    .map(&f)
                    .collect();
                done.lock().expect("no poisoned worker").push((start, out));
            });
        }
    });
    let mut blocks = done.into_inner().expect("no poisoned worker");
    blocks.sort_by_key(|(start, _)| *start);
    blocks.into_iter().flat_map(|(_, out)| out).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    fn random(seed: u64) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_SIZE];
        SmallRng::seed_from_u64(seed).fill(&mut p[..]);
        p
    }

    /// A cut-off past what a slab slot holds with its header is refused by name (it
    /// panicked in the slot lookup when a page compressed to just under a page).
    #[test]
    fn a_cutoff_past_a_slot_is_refused_not_a_panic() {
        let pages: Vec<u8> = (0..8).flat_map(random).collect();
        let g = [GuestMemory {
            name: "r".into(),
            ram: &pages,
            resident: None,
        }];
        let cfg = AnalysisConfig {
            compress_cutoff: 5000,
            ..AnalysisConfig::default()
        };
        let err = analyze(&g, &cfg).unwrap_err();
        assert!(
            err.contains("compression cut-off of 5000 bytes: at most 4088"),
            "{err}"
        );
        let ok = AnalysisConfig {
            compress_cutoff: 4088,
            patch_cutoff: 4088,
            ..AnalysisConfig::default()
        };
        analyze(&g, &ok).unwrap();
    }

    #[test]
    fn synthetic_snapshots_give_exact_counts() {
        // Guest a: 3 zero, base x3, r1, r2, base+8 bytes changed.
        // Guest b: 1 zero, base x1, r1, r3 (text), and an unbacked page (not resident).
        let base = random(1);
        let mut near = base.clone();
        let free_block = (0..64u8)
            .find(|b| {
                !SimilarityDetector::new(SimilarityConfig::default())
                    .unwrap()
                    .blocks()
                    .contains(b)
            })
            .unwrap();
        near[free_block as usize * 64..free_block as usize * 64 + 8].copy_from_slice(&[9; 8]);
        let text: Vec<u8> = b"memfold "
            .iter()
            .cycle()
            .take(PAGE_SIZE)
            .copied()
            .collect();
        let zero = vec![0u8; PAGE_SIZE];
        let a: Vec<u8> = [
            &zero[..],
            &zero,
            &zero,
            &base,
            &base,
            &base,
            &random(2),
            &random(3),
            &near,
        ]
        .concat();
        let b: Vec<u8> = [&zero[..], &base, &random(2), &text, &zero].concat();
        let b_res = [0b0_1111u8];
        let guests = vec![
            GuestMemory {
                name: "a".into(),
                ram: &a,
                resident: None,
            },
            GuestMemory {
                name: "b".into(),
                ram: &b,
                resident: Some(&b_res),
            },
        ];
        let r = analyze(
            &guests,
            &AnalysisConfig {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap();
        let get = |n: &str, basis: &str| {
            r.iter()
                .find(|s| s.name == n && s.basis == basis)
                .unwrap()
                .clone()
        };
        let a_all = get("a", "all");
        assert_eq!(
            (
                a_all.pages,
                a_all.zero_pages,
                a_all.duplicate_pages,
                a_all.distinct_duplicate_pages,
                a_all.unique_pages
            ),
            (9, 3, 3, 1, 3)
        );
        assert_eq!(a_all.pages_sharing_only, 1.0 + 1.0 + 3.0);
        // `near` is patched against base: 2 varint bytes + 8 = 10 bytes → one 64-byte slot.
        assert_eq!(a_all.patched_pages, 1);
        assert_eq!(a_all.pages_with_patching, 1.0 + 3.0 + 64.0 / 4096.0);
        let b_all = get("b", "all");
        let b_res = get("b", "resident");
        assert_eq!((b_all.pages, b_all.zero_pages), (5, 2));
        assert_eq!(
            (b_res.pages, b_res.zero_pages),
            (4, 1),
            "the unbacked page is not resident"
        );
        let all = get("all", "all");
        assert_eq!(
            (
                all.pages,
                all.zero_pages,
                all.duplicate_pages,
                all.distinct_duplicate_pages,
                all.unique_pages
            ),
            (14, 5, 6, 2, 3)
        );
        assert_eq!(all.pages_sharing_only, 1.0 + 5.0);
        // Text compresses: the compression column is below the patching column by at
        // least the text page's savings; random pages and the reference stay whole.
        assert_eq!(all.compressed_pages, 1);
        assert!(all.pages_with_compression < all.pages_with_patching - 0.5);
        assert_eq!(all.reference_pages, 1);
        // The duplicates (base, random(2)) are incompressible: no fold saving.
        assert_eq!(all.shared_frames_compressed_saving, 0.0);
        // Text in both guests: one shared frame, compressed to a small slot.
        let (t1, t2) = (
            [&text[..], &random(4)].concat(),
            [&random(5)[..], &text].concat(),
        );
        let pair = [
            GuestMemory {
                name: "t1".into(),
                ram: &t1,
                resident: None,
            },
            GuestMemory {
                name: "t2".into(),
                ram: &t2,
                resident: None,
            },
        ];
        let r = analyze(
            &pair,
            &AnalysisConfig {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let all = r
            .iter()
            .find(|s| s.name == "all" && s.basis == "all")
            .unwrap();
        assert_eq!(all.distinct_duplicate_pages, 1);
        assert!(
            all.shared_frames_compressed_saving > 0.9 && all.shared_frames_compressed_saving < 1.0,
            "{}",
            all.shared_frames_compressed_saving
        );
    }
}
