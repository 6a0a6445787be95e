//! Statistics past one message, and the names that fill them. An operator's statistics
//! carry a `VmStats` per guest (~2–3 KB of JSON each); one message of them all stopped
//! fitting a `SOCK_SEQPACKET` socket's send buffer (~208 KiB by default: a larger
//! message fails with `EMSGSIZE`) at about 70 guests, and every statistics reader
//! (`memfold status`, `/metrics`, tenants) got nothing. An agent's name had no bound
//! either: one hello could put ~250 KiB into every operator's statistics.
//!
//! Seen failing: without the parts, `query_stats` with 100 guests ended in "memfoldd
//! closed the connection" (the reply's send failed); without the name check, the
//! 200 KiB name was welcomed.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use memfold_core::{EngineConfig, Policy};
use memfold_live::query_stats;
use memfold_wire::{Conn, ToAgent, MAX_MESSAGE};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Sharing alone (random pages share nothing), no clock: the fake QEMUs below answer
/// nothing, so memfoldd should ask them as little as it can.
fn quiet_engine() -> EngineConfig {
    EngineConfig {
        policy: Policy::sharing_only(),
        clock_interval_us: None,
        ..common::fast_engine()
    }
}

/// A hello for guest `name` with a RAM memfd of `pages` random pages: memfoldd's answer
/// and the connection (kept open, the guest stays attached).
fn hello(socket: &Path, name: &str, pages: usize, rng: &mut SmallRng) -> (ToAgent, Conn) {
    let mut ram = vec![0u8; pages * common::PAGE];
    rng.fill(&mut ram[..]);
    // The memfd's own name: memfd_create takes at most 249 bytes.
    let (reply, c, _fds, _ram) = common::hello_fake_qemu(socket, name, "many", &ram);
    (reply, c)
}

/// 100 guests of 1–4 pages, each named with the most bytes a name may have (255): the
/// operator's statistics list every one of them, in name order.
#[test]
fn a_hundred_guests_statistics_arrive_whole() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(dir.path(), quiet_engine());
    let mut rng = SmallRng::seed_from_u64(100);
    let names: Vec<String> = (0..100)
        .map(|i| format!("guest-{i:03}-{}", "x".repeat(245)))
        .collect();
    assert!(names.iter().all(|n| n.len() == 255));
    let mut conns = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let (reply, c) = hello(&socket, name, 1 + i % 4, &mut rng);
        assert!(
            matches!(reply, ToAgent::Welcome { .. }),
            "{name}: {reply:?}"
        );
        conns.push(c);
    }
    let t = Instant::now();
    let s = query_stats(&socket).expect("statistics of 100 guests");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let got: Vec<&str> = s.vms.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(got.len(), names.len(), "guests listed");
    assert!(got == names, "every guest once, in name order");
    // The whole answer would not have fitted one message the socket takes.
    let whole = memfold_wire::encode(&memfold_wire::ToClient::Stats(Box::new(s.clone())));
    assert!(whole.len() > 212_992, "only {} bytes: too few", whole.len());
    assert!(s.vms.iter().all(|v| v.pages >= 1 && v.pages <= 4));
    drop(conns);
}

/// A hello whose name is 200 KiB, or holds control characters, is refused with a
/// message saying why that shows the name short and escaped; the operator's statistics
/// go on working and list only the honest guest.
#[test]
fn an_overlong_or_unprintable_name_is_refused_at_the_hello() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd(dir.path(), quiet_engine());
    let mut rng = SmallRng::seed_from_u64(200);
    let (reply, _honest) = hello(&socket, "honest", 2, &mut rng);
    assert!(matches!(reply, ToAgent::Welcome { .. }), "{reply:?}");

    let long = "n".repeat(200 * 1024);
    let (reply, _c) = hello(&socket, &long, 1, &mut rng);
    let ToAgent::Refused { message } = reply else {
        panic!("a 200 KiB name was welcomed: {reply:?}")
    };
    assert!(message.contains("204800 bytes"), "{message}");
    assert!(message.len() < 1024, "the refusal is short: {message:.300}");

    let (reply, _c) = hello(&socket, "evil\n2026 WARN forged\u{1b}[2J", 1, &mut rng);
    let ToAgent::Refused { message } = reply else {
        panic!("a name with control characters was welcomed: {reply:?}")
    };
    assert!(
        message.contains("evil\\n2026 WARN forged\\u{1b}[2J"),
        "{message}"
    );
    assert!(
        !message.contains('\n') && !message.contains('\u{1b}'),
        "{message}"
    );

    let s = query_stats(&socket).expect("statistics after the refusals");
    let names: Vec<&str> = s.vms.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["honest"]);
    assert!(
        MAX_MESSAGE > long.len(),
        "the hello itself was a valid message"
    );
}
