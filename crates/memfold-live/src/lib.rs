//! memfold's live layer: memfoldd, which runs the one engine (`memfold-core`) over
//! running QEMU guests, with the engine's backings on memfds and files.
//!
//! - [`daemon`]: memfoldd — connections, the executor that turns the engine's commands
//!   into requests to the agents and their answers into outcomes, the backings, the
//!   books' export.
//! - [`guest_channel`]: enlightened guests' channels: page categories from
//!   `memfold-guest` inside the guest, over virtio-serial (issue 17, PV §3.1).
//! - [`monitor`]: memfoldd's own QEMU monitor of each guest, and the RAM layout asked
//!   there.
//! - [`metrics`]: memfoldd's Prometheus endpoint (`GET /metrics`, `--metrics-listen`).
//! - [`reused`]: answers to untrusted askers (a tenant's statistics, a scrape) reused
//!   for a second, so asking cannot keep memfoldd's main loop busy.
//! - [`query_stats`], [`opt_out`]: a client's requests: memfoldd's statistics, the
//!   operator's opt-out of a guest.
//!
//! The agent inside each QEMU (crate `memfold-agent`: owns the userfaultfd on guest RAM,
//! maps shared pool frames over guest pages and breaks copy-on-write on every write)
//! carries out memfoldd's requests. They talk over `memfold-wire`'s versioned protocol
//! (as do clients) and reach the OS through `memfold-sys` (memfd, userfaultfd, the
//! socket).
//!
//! Data flows one way: guest memory (memfd, read with pread) → detection and decision
//! (the engine) → mechanism (agent: mapping changes, userfaultfd) → outcome → books.

#![deny(missing_docs)]

pub mod daemon;
pub mod guest_channel;
pub mod metrics;
pub mod monitor;
pub mod reused;

use std::path::Path;

use memfold_wire::{Conn, Stats, ToClient, ToDaemon, PROTOCOL_VERSION};

/// Sends one client request to the memfoldd at `socket`; returns the connection and its
/// answer's first message.
fn request_on(socket: &Path, req: &ToDaemon) -> std::io::Result<(Conn, ToClient)> {
    let c = Conn::connect(socket)?;
    c.send(
        &ToDaemon::ClientHello {
            version: PROTOCOL_VERSION,
        },
        &[],
    )?;
    c.send(req, &[])?;
    match c.recv::<ToClient>()? {
        Some((ToClient::Error { message }, _)) => {
            Err(std::io::Error::other(format!("memfoldd: {message}")))
        }
        Some((reply, _)) => Ok((c, reply)),
        None => Err(std::io::Error::other("memfoldd closed the connection")),
    }
}

/// Sends one client request to the memfoldd at `socket` and reads its answer (one
/// message).
fn request(socket: &Path, req: &ToDaemon) -> std::io::Result<ToClient> {
    request_on(socket, req).map(|(_, reply)| reply)
}

/// Asks the memfoldd at `socket` for its statistics: every guest's, when they come in
/// parts (past ~40 guests; `memfold_wire::stats_parts`), put together.
///
/// Errors: no daemon there, it answered with an error, or the parts did not add up
/// or the connection ended before they all came
/// ([`memfold_wire::StatsPartsError`], as `InvalidData` or `UnexpectedEof`).
pub fn query_stats(socket: &Path) -> std::io::Result<Stats> {
    match request_on(socket, &ToDaemon::Stats)? {
        (c, ToClient::Stats(head)) => Ok(memfold_wire::assemble_stats(*head, || {
            Ok(c.recv::<ToClient>()?.map(|(m, _)| m))
        })?),
        (_, other) => Err(std::io::Error::other(format!(
            "memfoldd answered {other:?} to a request for statistics"
        ))),
    }
}

/// Asks the memfoldd at `socket` for a census of its guests' pages by content (Satori
/// §6.1's sharing potential; O(guest memory) in memfoldd).
///
/// Errors: no daemon there, or an answer of another kind.
pub fn query_census(socket: &Path) -> std::io::Result<memfold_wire::CensusStats> {
    match request(socket, &ToDaemon::Census)? {
        ToClient::Census(c) => Ok(c),
        other => Err(std::io::Error::other(format!(
            "memfoldd answered {other:?} to a request for a census"
        ))),
    }
}

/// Asks the memfoldd at `socket` to take the guests named `name` out of memfold (`out`:
/// every page it holds taken back into guest RAM, nothing shared or stored again) or back
/// in. Returns the pages being taken back.
///
/// Errors: no daemon there, or no such guest.
pub fn opt_out(socket: &Path, name: &str, out: bool) -> std::io::Result<u32> {
    let req = ToDaemon::OptOut {
        name: name.into(),
        out,
    };
    match request(socket, &req)? {
        ToClient::OptedOut { pages } => Ok(pages),
        other => Err(std::io::Error::other(format!(
            "memfoldd answered {other:?} to an opt-out"
        ))),
    }
}
