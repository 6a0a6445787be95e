//! A share onto a frame past the end of the pool is refused: the agent compared the
//! page with the frame's bytes read by a `pread` that gave zeros past the end, so a zero
//! page "equalled" any frame past the pool and was mapped onto it, and the guest's next
//! access to it was a SIGBUS (the mapping past the file's end): QEMU killed. memfoldd
//! writes a frame before it names it, so only a bug or another peer on its socket names
//! one past the end; the agent checks what it maps either way.
//!
//! Seen failing with the zero-filling read: the page was shared.
//!
//! One test only: the agent, run in this process, takes every QEMU-named memfd of it.

mod common;

use common::{agent_with_pool, page_of, region, share, text, write};
use memfold_codecs::PAGE_SIZE;
use memfold_wire::{BatchId, FrameId, Gfn};

const PAGES: usize = 4;

#[test]
fn a_share_onto_a_frame_past_the_pool_is_refused() {
    let (_fd, ptr) = region(PAGES);
    // Page 2 stays zero (never written): a zero page, as a frame past the end reads.
    for g in [0, 1, 3] {
        write(ptr, g, &text(g));
    }
    let dir = tempfile::tempdir().unwrap();
    let (c, _pool, _store) = agent_with_pool(&dir.path().join("memfoldd.sock"), &[text(0)]);
    let (shared, _, _) = share(
        &c,
        BatchId(1),
        vec![(Gfn(2), FrameId(5)), (Gfn(0), FrameId(0))],
    );
    assert_eq!(shared, [Gfn(0)], "only the page onto a frame in the pool");
    assert!(
        page_of(ptr, 2) == vec![0u8; PAGE_SIZE],
        "page 2 reads its zeros"
    );
    assert!(page_of(ptr, 0) == text(0));
}
