//! The command lines of `memfold` and `memfoldd`: what both share.

#![deny(missing_docs)]

/// memfoldd's socket when none is given: where the service listens
/// (`packaging/memfoldd.service`), the default of every command that talks to it (`memfoldd`,
/// `memfold qemu`, `status`, `top`, `merge`, `unmerge`).
pub const DEFAULT_SOCKET: &str = "/run/memfold/memfoldd.sock";

pub mod config_file;
pub mod engine_args;
pub mod install;
pub mod libvirt_xml;
pub mod logging;
pub mod side_channel;
