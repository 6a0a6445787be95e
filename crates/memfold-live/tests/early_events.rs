//! A QEMU that reports a CoW break before its answer to the share it broke (the real
//! agent answers first; a buggy or compromised one may not): memfoldd must book the page
//! private, not shared with a frame no one maps (`memfold_core`'s engine/early.rs).
//!
//! This test process plays the QEMU, speaking the wire itself: its RAM holds one page
//! eight times, and to every share it sends the breaks of all its pages first, then the
//! answer that they were shared. Seen failing with the engine's parking of early events
//! removed: the pages stayed booked shared.

mod common;

use std::time::Duration;

use memfold_core::{EngineConfig, Policy};
use memfold_live::query_stats;
use memfold_wire::{Gfn, ToAgent, ToDaemon};

const PAGE: usize = 4096;
const PAGES: usize = 32;

#[test]
fn a_break_reported_before_its_share_answer_leaves_the_pages_private() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(
        dir.path(),
        EngineConfig {
            policy: Policy::sharing_only(),
            clock_interval_us: None,
            ..common::fast_engine()
        },
    );
    let mut ram = vec![0u8; PAGES * PAGE];
    for (g, page) in ram.chunks_mut(PAGE).enumerate() {
        let text = if g < 8 {
            "the page shared".to_string()
        } else {
            format!("page {g}")
        };
        for (i, b) in page.iter_mut().enumerate() {
            *b = text.as_bytes()[i % text.len()];
        }
    }
    let (qemu, _fds, _ram) = common::attach_fake_qemu(&socket, "early", &ram);
    qemu.set_recv_timeout(Duration::from_millis(50)).unwrap();
    let t = std::time::Instant::now();
    let mut answered = 0;
    loop {
        while let Ok(Some((m, _))) = qemu.recv::<ToAgent>() {
            if let ToAgent::Share { batch, pages } = m {
                let shared: Vec<Gfn> = pages.iter().map(|p| p.0).collect();
                qemu.send(&ToDaemon::CowBroken { breaks: pages }, &[])
                    .unwrap();
                let done = ToDaemon::ShareDone {
                    batch,
                    shared,
                    changed: Vec::new(),
                    refused: Vec::new(),
                };
                qemu.send(&done, &[]).unwrap();
                answered += 1;
            }
        }
        let s = query_stats(&socket).unwrap();
        let v = common::vm_named(&s, "early");
        if v.shares >= 8 {
            assert_eq!(
                (v.shared_pages, v.cow_breaks),
                (0, v.shares),
                "every page shared was broken, so none is shared: {v:?}"
            );
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{answered} shares answered, memfoldd booked {} pages shared",
            v.shares
        );
    }
}
