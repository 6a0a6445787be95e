//! The page table's tests: packing, records, compaction, and a plain model of it.

use super::*;
use memfold_codecs::PatchCodec;

#[test]
fn a_page_record_stays_small() {
    // One per guest page: 4 bytes, 0.1% of guest RAM, and 4 bits (R, M, watch,
    // zapped); a stashed page's 20 more (none for an identical one).
    assert_eq!(std::mem::size_of::<Packed>(), 4);
    assert_eq!(std::mem::size_of::<Record>(), 20);
    let mut p = Pages::new(1024);
    assert_eq!(p.state_bytes(), 1024 * 4 + 4 * 16 * 8, "no page stashed");
    p.set(Gfn(3), PageHome::Stashed(stash(3)));
    assert!(p.state_bytes() > 1024 * 4 + 4 * 16 * 8);
    p.set(Gfn(3), PageHome::Private);
    assert_eq!(p.state_bytes(), 1024 * 4 + 4 * 16 * 8, "given back");
}

/// A record gives back every stash the decode lets through: each blob kind and codec,
/// both homes, lengths 0..=4096, offsets up to the last they keep, checksums of 64 bits.
#[test]
fn a_record_gives_back_the_stash_it_keeps() {
    let mut blobs = vec![Blob::Raw];
    blobs.extend(memfold_codecs::CompressCodec::ALL.map(Blob::Compressed));
    for codec in PatchCodec::ALL {
        for f in [0, 1, MAX_FRAME - 1, u32::MAX - 1] {
            blobs.push(Blob::Patch {
                codec,
                reference: FrameId(f),
            });
        }
    }
    for blob in blobs {
        for home in [BlobHome::Store, BlobHome::Swap] {
            for (offset, len) in [
                (0, 0),
                (8, 1),
                (1 << 32, 4096),
                (1 << 35, 17),
                (MAX_BLOB_OFFSET - BLOB_ALIGN, 4095),
            ] {
                for checksum in [0, u64::MAX, 0x8000_0001_7fff_fffe] {
                    let s = Stash {
                        blob,
                        home,
                        offset,
                        len,
                        checksum: Some(checksum),
                    };
                    assert_eq!(Record::new(s).stash(), s);
                }
            }
        }
    }
}

/// The rule both the decode and the record follow: 8-byte multiples below 2^48, and no
/// other offset (each the record would pack into a different one).
#[test]
fn only_offsets_a_record_packs_are_kept() {
    for o in [0, 8, 1 << 32, MAX_BLOB_OFFSET - BLOB_ALIGN] {
        assert!(keeps_offset(o), "{o}");
    }
    for o in [1, 7, 4095, MAX_BLOB_OFFSET, MAX_BLOB_OFFSET + 8, u64::MAX] {
        assert!(!keeps_offset(o), "{o}");
    }
}

fn stash(k: u64) -> Stash {
    Stash {
        blob: Blob::Compressed(memfold_codecs::CompressCodec::Zstd),
        home: if k % 3 == 0 {
            BlobHome::Swap
        } else {
            BlobHome::Store
        },
        offset: 64 * k,
        len: 100 + (k % 3000) as u32,
        checksum: Some(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
    }
}

/// Frame `f`'s identical patch as a stash request brings it: with a checksum, at
/// some offset in the store.
fn requested_identical(f: u32, k: u64) -> Stash {
    Stash {
        offset: 4096 * k,
        checksum: Some(k ^ 0x5555),
        ..Stash::identical(FrameId(f))
    }
}

/// The packed table reads back exactly what a plain one would, through any sequence
/// of homes (stash entries reused, moved, freed and given back).
#[test]
fn the_packed_table_agrees_with_a_plain_one() {
    let mut p = Pages::new(64);
    let mut plain = vec![PageHome::Private; 64];
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for step in 0..20_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let g = (x % 64) as usize;
        let f = (x >> 16) as u32 % MAX_FRAME;
        let (home, reads) = match (x >> 8) % 5 {
            0 => (PageHome::Private, PageHome::Private),
            1 => (PageHome::Zero, PageHome::Zero),
            // Frames up to the largest that packs.
            2 => (PageHome::Frame(FrameId(f)), PageHome::Frame(FrameId(f))),
            3 => (
                PageHome::Stashed(stash(step)),
                PageHome::Stashed(stash(step)),
            ),
            // Read back without its offset and checksum.
            _ => (
                PageHome::Stashed(requested_identical(f, step)),
                PageHome::Stashed(Stash::identical(FrameId(f))),
            ),
        };
        p.set(Gfn(g as u32), home);
        plain[g] = reads;
        if step % 97 == 0 {
            for (k, h) in plain.iter().enumerate() {
                assert_eq!(p.home(Gfn(k as u32)), *h, "page {k} at step {step}");
            }
            let frames = plain
                .iter()
                .filter(|h| matches!(h, PageHome::Frame(_)))
                .count();
            assert_eq!(p.on_frames(), frames);
            let stashed: Vec<(Gfn, Stash)> = plain
                .iter()
                .enumerate()
                .filter_map(|(k, h)| match h {
                    PageHome::Stashed(s) => Some((Gfn(k as u32), *s)),
                    _ => None,
                })
                .collect();
            assert_eq!(p.stashed(), stashed);
            let recorded = stashed.iter().filter(|(_, s)| s.checksum.is_some());
            assert_eq!(
                p.stashes.len() - p.free.len(),
                recorded.count(),
                "no entry leaks"
            );
        }
    }
}

/// A burst of stores taken back leaves the table at what is still stashed, not at its
/// peak, and every page reads back its own record (without the compaction, 20 000
/// records stay).
#[test]
fn records_freed_in_bulk_are_given_back_and_the_rest_renumbered() {
    let n = 20_000u32;
    let mut p = Pages::new(n as usize);
    for g in 0..n {
        p.set(Gfn(g), PageHome::Stashed(stash(g as u64)));
    }
    for g in (0..n).filter(|g| g % 10 != 0) {
        p.set(Gfn(g), PageHome::Private);
    }
    // At most COMPACT_MIN free records beyond those in use (or a third as many).
    let used = n as usize / 10;
    assert!(
        p.stashes.len() <= used + COMPACT_MIN.max(used / 3),
        "{} records",
        p.stashes.len()
    );
    assert_eq!(p.stashes.len() - p.free.len(), used);
    for g in 0..n {
        let want = if g % 10 == 0 {
            PageHome::Stashed(stash(g as u64))
        } else {
            PageHome::Private
        };
        assert_eq!(p.home(Gfn(g)), want, "page {g}");
    }
    // Reused after the compaction: still each page's own.
    p.set(Gfn(1), PageHome::Stashed(stash(7)));
    p.set(Gfn(10), PageHome::Zero);
    assert_eq!(p.home(Gfn(1)), PageHome::Stashed(stash(7)));
    assert_eq!(p.home(Gfn(20)), PageHome::Stashed(stash(20)));
}

/// A page stashed as the identical patch takes no record: 512 of them leave the
/// table and `state_bytes` as they were (a record each would be 16 KiB), each reads
/// back as its frame's identical patch (no checksum, offset 0), and a record taken
/// for another blob is given back when the page becomes identical again. The same
/// patch in the swap file, or not empty, or of another codec, is no identical one.
#[test]
fn an_identical_stash_takes_no_record_and_reads_back_as_its_frame() {
    let mut p = Pages::new(1024);
    let empty = p.state_bytes();
    for g in 0..512u32 {
        p.set(
            Gfn(g),
            PageHome::Stashed(requested_identical(g * 3, g as u64)),
        );
    }
    assert_eq!(p.state_bytes(), empty, "no record an identical page");
    assert!(p.stashes.is_empty() && p.free.is_empty());
    for g in 0..512u32 {
        let want = Stash::identical(FrameId(g * 3));
        assert_eq!(p.home(Gfn(g)), PageHome::Stashed(want), "page {g}");
        assert_eq!(p.get(Gfn(g)), Some(PageHome::Stashed(want)));
        // Read back, set again: the same home.
        p.set(Gfn(g), p.home(Gfn(g)));
        assert_eq!(p.home(Gfn(g)), PageHome::Stashed(want));
    }
    assert_eq!(p.stashed().len(), 512, "identical pages are stashed pages");
    assert_eq!(p.stashed()[7], (Gfn(7), Stash::identical(FrameId(21))));
    // Moved to a blob with a record, and back: the record is given back.
    p.set(Gfn(5), PageHome::Stashed(stash(5)));
    assert_eq!(p.home(Gfn(5)), PageHome::Stashed(stash(5)));
    assert_eq!(p.stashes.len() - p.free.len(), 1);
    p.set(Gfn(5), PageHome::Stashed(requested_identical(9, 1)));
    assert_eq!(
        p.home(Gfn(5)),
        PageHome::Stashed(Stash::identical(FrameId(9)))
    );
    assert!(p.stashes.is_empty(), "given back");
    assert_eq!(p.state_bytes(), empty);
    p.set(Gfn(6), PageHome::Private);
    assert_eq!(p.home(Gfn(6)), PageHome::Private);
    // Not the identical form: each keeps a record and its checksum.
    let near = [
        Stash {
            home: BlobHome::Swap,
            ..requested_identical(4, 1)
        },
        Stash {
            len: 1,
            ..requested_identical(4, 2)
        },
        Stash {
            blob: Blob::Patch {
                codec: PatchCodec::XorLz4,
                reference: FrameId(4),
            },
            ..requested_identical(4, 3)
        },
    ];
    for (k, s) in near.into_iter().enumerate() {
        p.set(Gfn(600 + k as u32), PageHome::Stashed(s));
        assert_eq!(p.home(Gfn(600 + k as u32)), PageHome::Stashed(s));
    }
    assert_eq!(p.stashes.len() - p.free.len(), 3);
}

/// Slots hold frames and indexes below 2^29: 2^29 − 1 packs and reads back in every
/// kind, 2^29 does not pack; an identical stash against a frame past it keeps a
/// record (with its checksum) rather than fail.
#[test]
fn a_frame_of_2_pow_29_minus_1_packs_and_2_pow_29_does_not() {
    assert_eq!(MAX_FRAME, 1 << 29);
    let top = (1 << 29) - 1;
    for s in [
        Slot::Private,
        Slot::Zero,
        Slot::Frame(FrameId(top)),
        Slot::Stashed(top),
        Slot::Identical(FrameId(top)),
        Slot::Frame(FrameId(0)),
        Slot::Stashed(0),
        Slot::Identical(FrameId(0)),
    ] {
        assert_eq!(Packed::new(s).get(), s);
    }
    for s in [
        Slot::Frame(FrameId(1 << 29)),
        Slot::Stashed(1 << 29),
        Slot::Identical(FrameId(1 << 29)),
    ] {
        assert!(
            std::panic::catch_unwind(|| Packed::new(s)).is_err(),
            "{s:?} packed"
        );
    }
    let mut p = Pages::new(4);
    p.set(Gfn(0), PageHome::Stashed(requested_identical(top, 1)));
    assert_eq!(
        p.home(Gfn(0)),
        PageHome::Stashed(Stash::identical(FrameId(top)))
    );
    let past = requested_identical(1 << 29, 2);
    p.set(Gfn(1), PageHome::Stashed(past));
    assert_eq!(p.home(Gfn(1)), PageHome::Stashed(past), "kept as a record");
    assert_eq!(p.stashes.len(), 1);
}

/// Compaction renumbers the records of stashed pages and leaves identical ones (no
/// index) alone: with the two interleaved, every page keeps its home through it.
#[test]
fn compaction_keeps_every_home_with_identical_stashes_interleaved() {
    let n = 20_000u32;
    let mut p = Pages::new(n as usize);
    // Page g: identical against frame 7g + 1 when g % 3 == 0, else a record.
    let want = |g: u32, freed: bool| {
        if g % 3 == 0 {
            PageHome::Stashed(Stash::identical(FrameId(7 * g + 1)))
        } else if freed && g % 10 != 1 {
            PageHome::Private
        } else {
            PageHome::Stashed(stash(g as u64))
        }
    };
    for g in 0..n {
        let s = if g % 3 == 0 {
            requested_identical(7 * g + 1, g as u64)
        } else {
            stash(g as u64)
        };
        p.set(Gfn(g), PageHome::Stashed(s));
    }
    let records = p.stashes.len();
    assert_eq!(records as u32, n - n.div_ceil(3));
    for g in (0..n).filter(|g| g % 3 != 0 && g % 10 != 1) {
        p.set(Gfn(g), PageHome::Private);
    }
    let kept = (0..n).filter(|g| g % 3 != 0 && g % 10 == 1).count();
    assert_eq!(p.stashes.len() - p.free.len(), kept);
    assert!(
        p.stashes.len() < records / 2,
        "compacted: {}",
        p.stashes.len()
    );
    for g in 0..n {
        assert_eq!(p.home(Gfn(g)), want(g, true), "page {g}");
    }
    // Records reused after it: still each page's own.
    p.set(Gfn(2), PageHome::Stashed(stash(99)));
    p.set(Gfn(3), PageHome::Stashed(stash(98)));
    assert_eq!(p.home(Gfn(2)), PageHome::Stashed(stash(99)));
    assert_eq!(p.home(Gfn(3)), PageHome::Stashed(stash(98)));
    assert_eq!(p.home(Gfn(6)), want(6, true));
    assert_eq!(p.home(Gfn(11)), want(11, true));
}

/// The stash table grows by an eighth (at least GROW_MIN records), not by doubling:
/// 300 000 records take at most ~340 000 slots (a doubled Vec: 524 288).
#[test]
fn the_stash_table_grows_by_an_eighth() {
    let n = 300_000u32;
    let mut p = Pages::new(n as usize);
    for g in 0..n {
        p.set(Gfn(g), PageHome::Stashed(stash(g as u64)));
        let (len, cap) = (p.stashes.len(), p.stashes.capacity());
        assert!(
            cap <= len + (len / 8).max(GROW_MIN),
            "{len} records in {cap} slots"
        );
    }
    assert_eq!(p.home(Gfn(n - 1)), PageHome::Stashed(stash(n as u64 - 1)));
}

#[test]
fn pages_start_private_and_fresh_and_bits_are_taken_once() {
    let mut p = Pages::new(130);
    assert_eq!(p.len(), 130);
    assert!(p.is_private(Gfn(129)));
    assert!(!p.is_private(Gfn(130)), "beyond RAM");
    assert_eq!(p.get(Gfn(130)), None);
    // Never armed: R and M set.
    let (r, m) = p.take_bits(Gfn(60), 70);
    assert_eq!((r.len(), m.len()), (2, 2));
    assert_eq!((r[0], r[1]), (u64::MAX, (1 << 6) - 1));
    assert_eq!(m, r);
    assert_eq!(p.take_bits(Gfn(60), 70), (vec![0, 0], vec![0, 0]));
    p.mark(Gfn(61), false);
    p.mark(Gfn(129), true);
    let (r, m) = p.take_bits(Gfn(60), 70);
    assert_eq!(r, vec![0b10, 1 << 5]);
    assert_eq!(m, vec![0, 1 << 5]);
}

#[test]
fn a_watch_ends_at_a_write_a_new_home_or_lifted_protection_and_a_read_keeps_it() {
    let mut p = Pages::new(200);
    for g in [3, 64, 130, 131, 199] {
        p.watch(Gfn(g));
    }
    p.mark(Gfn(3), false);
    assert!(p.watched(Gfn(3)), "a read is no write");
    p.mark(Gfn(3), true);
    assert!(!p.watched(Gfn(3)), "a write ends it");
    p.set(Gfn(64), PageHome::Zero);
    p.set(Gfn(64), PageHome::Private);
    assert!(!p.watched(Gfn(64)), "a new home ends it");
    p.unwatch(Gfn(130), 1);
    assert!(!p.watched(Gfn(130)) && p.watched(Gfn(131)));
    p.unwatch(Gfn(190), 50); // clamped to RAM
    assert!(!p.watched(Gfn(199)));
    assert!((0..200).all(|g| !p.watched(Gfn(g)) || g == 131));
}

#[test]
fn the_reattach_list_names_frames_and_zero_pages() {
    let mut p = Pages::new(8);
    p.set(Gfn(1), PageHome::Frame(FrameId(4)));
    p.set(Gfn(1), PageHome::Frame(FrameId(4)));
    p.set(Gfn(2), PageHome::Frame(FrameId(5)));
    p.set(Gfn(2), PageHome::Private);
    assert_eq!(p.on_frames(), 1);
    p.set(Gfn(3), PageHome::Zero);
    let stash = Stash {
        blob: Blob::Patch {
            codec: PatchCodec::XorLz4,
            reference: FrameId(4),
        },
        home: BlobHome::Store,
        offset: 64,
        len: 100,
        checksum: Some(7),
    };
    p.set(Gfn(5), PageHome::Stashed(stash));
    assert_eq!(p.stashed(), vec![(Gfn(5), stash)]);
    p.set(Gfn(5), PageHome::Private);
    assert_eq!(
        p.reattach_list(),
        vec![
            (Gfn(1), Mapped::Frame(FrameId(4))),
            (Gfn(3), Mapped::ReclaimedZero)
        ]
    );
    assert_eq!(plus(Gfn(3), 2), Gfn(5));
}

/// The spans `paged_in` reads residency over hold every paged-out page of the range and
/// nothing outside it, begin and end on paged-out pages, and split only at gaps wider
/// than asked — against a plain walk, over pseudo-random marks of every density. Seen
/// failing with an unmarked word skipped from mid-word (the next word's first pages were
/// missed) and with a gap of exactly `gap` splitting; `any_paged_out` against the same
/// walk, seen failing with the last page of a word left out of its mask.
#[test]
fn paged_out_spans_cover_every_paged_out_page_and_split_only_at_wide_gaps() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..300 {
        let pages = 1 + (rand() % 700) as usize;
        let mut p = Pages::new(pages);
        let density = rand() % 100;
        let mut out = vec![false; pages];
        for (g, o) in out.iter_mut().enumerate() {
            if rand() % 100 < density {
                p.set(Gfn(g as u32), PageHome::Private);
                p.paged_out(Gfn(g as u32));
                *o = true;
            }
        }
        let first = (rand() % pages as u64) as u32;
        let n = (rand() % (pages as u64 + 80)) as u32;
        let gap = (rand() % 40) as u32;
        let spans = p.paged_out_spans(Gfn(first), n, gap);
        // The plain walk: paged-out pages of the range, split where the gap is wider.
        let end = (first as usize + n as usize).min(pages);
        let mut want: Vec<(Gfn, u32)> = Vec::new();
        for g in (first as usize..end).filter(|&g| out[g]) {
            match want.last_mut() {
                Some((s, len)) if g as u32 - (s.0 + *len) <= gap => *len = g as u32 - s.0 + 1,
                _ => want.push((Gfn(g as u32), 1)),
            }
        }
        assert_eq!(
            spans, want,
            "round {round}: {pages} pages, [{first}, +{n}), gap {gap}"
        );
        assert_eq!(
            p.any_paged_out(Gfn(first), n),
            !spans.is_empty(),
            "round {round}"
        );
    }
}
