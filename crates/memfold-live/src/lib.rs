//! memfold's live layer: memfoldd, which runs the one engine (`memfold-core`) over
//! running QEMU guests, with the engine's backings on memfds and files.
//!
//! - [`daemon`]: memfoldd — connections, the executor that turns the engine's commands
//!   into requests to the agents and their answers into outcomes, the backings, the
//!   books' export.
//! - [`query_stats`]: a client's request for memfoldd's statistics.
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

use std::path::Path;

use memfold_wire::{Conn, Stats, ToClient, ToDaemon, PROTOCOL_VERSION};

/// Asks the memfoldd at `socket` for its statistics.
///
/// Errors: no daemon there, or it answered with an error.
pub fn query_stats(socket: &Path) -> std::io::Result<Stats> {
    let c = Conn::connect(socket)?;
    c.send(
        &ToDaemon::ClientHello {
            version: PROTOCOL_VERSION,
        },
        &[],
    )?;
    c.send(&ToDaemon::Stats, &[])?;
    match c.recv::<ToClient>()? {
        Some((ToClient::Stats(s), _)) => Ok(*s),
        Some((ToClient::Error { message }, _)) => {
            Err(std::io::Error::other(format!("memfoldd: {message}")))
        }
        None => Err(std::io::Error::other("memfoldd closed the connection")),
    }
}
