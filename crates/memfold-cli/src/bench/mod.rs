//! Benchmark subcommands.

pub mod fault_path;
pub mod micro;
pub mod scale;
pub mod side_channel;
