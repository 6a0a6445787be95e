//! Reads served from frames (Satori §5.2; issue 16), memfoldd's side, with real agents
//! (in this process, on memfds) and a block device played by the test through the
//! wire's [`LandedReporter`]: reads of a base's blocks that two guests landed and shared
//! teach memfoldd — from the base file's own bytes — which frames hold which blocks; the
//! device is told; a later read of those blocks is filled from the frames, no disk
//! bytes written. What must not be believed is not: a block whose landed bytes differ
//! from the base's (a guest that wrote its buffer before the share) is never indexed,
//! a base descriptor that is not the file its id names is not taken, and a fill of a
//! page the device wrote after its nonce maps nothing.

mod common;

use std::time::{Duration, Instant};

use memfold_ids::{BaseBlock, Gfn};
use memfold_wire::LandedReporter;
use rand::{rngs::SmallRng, SeedableRng};

use common::{eventually, ram_file, GuestRam, PAGE};

const PAGES: usize = 2048;
const PAGES_B: usize = 2560;
/// Blocks of the base file.
const BLOCKS: usize = 16;

fn nonce_bytes(n: [u64; 2]) -> Vec<u8> {
    [n[0].to_ne_bytes(), n[1].to_ne_bytes()].concat()
}

#[test]
fn held_blocks_are_learnt_from_the_base_and_reads_of_them_filled_from_frames() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(dir.path(), common::read_fill_engine());
    let mut rng = SmallRng::seed_from_u64(52);
    let (a, b) = common::two_random_guests(&socket, &mut rng, PAGES, PAGES_B);
    // The base image: 16 random blocks.
    let (base_path, base, disk) = common::random_base(dir.path(), &mut rng, BLOCKS);
    let block = |k: usize| BaseBlock {
        disk,
        block: k as u64,
    };
    let dev = LandedReporter::spawn_with_bases(
        &socket,
        vec![(disk, std::fs::File::open(&base_path).unwrap().into())],
    )
    .unwrap();

    // Both guests read blocks 0..8 into pages of their own; block 9 is "read" too, but
    // each guest overwrote its buffer with the same other bytes before memfoldd looked:
    // those pages share, and block 9 must still not be taken as their frame's.
    let forged = vec![0x42u8; PAGE];
    let (in_a, in_b) = (|k: usize| 1500 + 3 * k, |k: usize| 1000 + 5 * k);
    for (k, block) in base.iter().enumerate().take(8) {
        a.write(in_a(k), 0, block);
        b.write(in_b(k), 0, block);
    }
    a.write(in_a(9), 0, &forged);
    b.write(in_b(9), 0, &forged);
    let report = |ram: &GuestRam, at: &dyn Fn(usize) -> usize| {
        let ks: Vec<usize> = (0..8).chain([9]).collect();
        let gfns = ks.iter().map(|&k| Gfn(at(k) as u32)).collect();
        let bases = ks
            .iter()
            .enumerate()
            .map(|(i, &k)| (i as u32, block(k)))
            .collect();
        assert!(dev.report_from(ram_file(ram), gfns, bases));
    };
    report(&a, &in_a);
    report(&b, &in_b);
    eventually("blocks 0..8 held", || (0..8).all(|k| dev.held(block(k))));
    // The forged pair's share may land after the held blocks' news (its agent's answer
    // is its own round trip): wait for it, then ask memfoldd what it learnt.
    eventually("the forged pages share", || {
        a.on_pool(in_a(9)) && b.on_pool(in_b(9))
    });
    let s = memfold_live::query_stats(&socket).unwrap();
    assert!(
        !dev.held(block(9)),
        "a block is learnt from the base, not a guest page"
    );
    assert_eq!(s.blocks_held, 8, "{s:#?}");

    // b reads blocks 0..8 again into other pages: the device writes its nonce and asks.
    let nonce = [0x1234_5678, 99];
    let fresh = |k: usize| 2000 + k;
    for k in 0..8 {
        b.write(fresh(k), 0, &nonce_bytes(nonce));
    }
    let asked: Vec<(Gfn, BaseBlock)> = (0..8).map(|k| (Gfn(fresh(k) as u32), block(k))).collect();
    let t = Instant::now();
    let filled = dev.fill(ram_file(&b), &asked, nonce, Duration::from_secs(5));
    let took = t.elapsed();
    let want: Vec<Gfn> = (0..8).map(|k| Gfn(fresh(k) as u32)).collect();
    assert_eq!(filled, want, "every held block filled");
    let mut got = vec![0u8; PAGE];
    for (k, block) in base.iter().enumerate().take(8) {
        assert!(b.on_pool(fresh(k)));
        b.read(fresh(k), &mut got);
        assert_eq!(&got, block, "block {k} as the base holds it");
    }
    eprintln!("8 pages filled from frames in {took:?}");

    // A page the device wrote after its nonce (it gave up and read the disk), then the
    // guest wrote: a fill finds no nonce and maps nothing.
    let late = 2100;
    b.write(late, 0, &nonce_bytes([5, 6]));
    b.write(late, 0, &base[1]);
    b.write(late, 0, b"guest bytes");
    let filled = dev.fill(
        ram_file(&b),
        &[(Gfn(late as u32), block(1))],
        [5, 6],
        Duration::from_secs(5),
    );
    assert!(filled.is_empty());
    b.read(late, &mut got);
    assert_eq!(&got[..11], b"guest bytes");
    assert_eq!(&got[11..], &base[1][11..]);

    // A device whose descriptor is not the file its id names: its bases are not
    // taken, its fills fill nothing.
    let liar = LandedReporter::spawn_with_bases(
        &socket,
        vec![(disk, std::fs::File::open("/proc/self/exe").unwrap().into())],
    )
    .unwrap();
    assert!(liar.report(ram_file(&a), vec![Gfn(3)]));
    eventually("the liar connected", || {
        liar.fill(
            ram_file(&a),
            &[(Gfn(10), block(0))],
            [7, 8],
            Duration::from_millis(200),
        )
        .is_empty()
            && liar.sent() > 0
    });
    a.write(11, 0, &nonce_bytes([7, 9]));
    let filled = liar.fill(
        ram_file(&a),
        &[(Gfn(11), block(0))],
        [7, 9],
        Duration::from_secs(2),
    );
    assert!(filled.is_empty(), "a base not shown is not served");
    assert!(!a.on_pool(11));

    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        s.vms.iter().map(|v| v.read_fills).sum::<u64>(),
        8,
        "{:#?}",
        s.vms
    );

    // The base rewritten in place (same file, new bytes), as a rebuild of an image cache
    // would. A device opened over it names another disk: its reads of blocks 0..8 are
    // not filled with the frames that hold the old bytes.
    std::thread::sleep(Duration::from_millis(50)); // past the file system's mtime tick
    let ino =
        |p: &std::path::Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    let old_ino = ino(&base_path);
    // `random_base` writes over the file at its path (`std::fs::write`): same inode.
    let (_, new_base, new_disk) = common::random_base(dir.path(), &mut rng, BLOCKS);
    assert_eq!(
        ino(&base_path),
        old_ino,
        "the base was not rewritten in place"
    );
    assert_ne!(new_disk, disk, "a base rewritten in place keeps its id");
    let new_block = |k: usize| BaseBlock {
        disk: new_disk,
        block: k as u64,
    };
    let dev2 = LandedReporter::spawn_with_bases(
        &socket,
        vec![(new_disk, std::fs::File::open(&base_path).unwrap().into())],
    )
    .unwrap();
    // Connected (a fill asked before is not sent) and naming b (a read of no base block).
    assert!(dev2.report(ram_file(&b), vec![Gfn(5)]));
    eventually("the new device connected", || dev2.sent() == 1);
    let nonce = [0xabcd, 7];
    let again = |k: usize| 2200 + k;
    for k in 0..8 {
        b.write(again(k), 0, &nonce_bytes(nonce));
    }
    let asked: Vec<(Gfn, BaseBlock)> = (0..8)
        .map(|k| (Gfn(again(k) as u32), new_block(k)))
        .collect();
    let filled = dev2.fill(ram_file(&b), &asked, nonce, Duration::from_secs(2));
    assert!(
        filled.is_empty(),
        "reads of a base rewritten in place filled with its old bytes: {filled:?}"
    );
    for k in 0..8 {
        b.read(again(k), &mut got);
        assert_eq!(&got[..16], &nonce_bytes(nonce)[..], "block {k}'s page");
    }

    // The old device reports pages holding the new bytes of blocks 8..12 as its (old)
    // disk's: their share makes candidates whose check reads the new bytes through the
    // same file, equal to the frame's, but not the bytes the old id names: not learnt.
    // Then blocks 12..14, new bytes under the new id, are learnt (checked after those).
    let land = |dev: &LandedReporter,
                ram: &GuestRam,
                at: usize,
                ks: &[usize],
                b: &dyn Fn(usize) -> BaseBlock| {
        let gfns = ks.iter().map(|&k| Gfn((at + k) as u32)).collect();
        let bases = ks
            .iter()
            .enumerate()
            .map(|(i, &k)| (i as u32, b(k)))
            .collect();
        for &k in ks {
            ram.write(at + k, 0, &new_base[k]);
        }
        assert!(dev.report_from(ram_file(ram), gfns, bases));
    };
    let old: Vec<usize> = (8..12).collect();
    land(&dev, &a, 1700, &old, &block);
    land(&dev, &b, 1200, &old, &block);
    eventually("the new bytes reported under the old id share", || {
        old.iter()
            .all(|&k| a.on_pool(1700 + k) && b.on_pool(1200 + k))
    });
    let new: Vec<usize> = (12..14).collect();
    land(&dev2, &a, 1700, &new, &new_block);
    land(&dev2, &b, 1200, &new, &new_block);
    eventually("blocks 12..14 of the new bytes held", || {
        new.iter().all(|&k| dev2.held(new_block(k)))
    });
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        s.blocks_held,
        8 + 2,
        "blocks learnt of bytes their id does not name"
    );
    assert!(old.iter().all(|&k| !dev.held(block(k))));
}
