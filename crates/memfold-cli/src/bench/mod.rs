//! Benchmark subcommands.

pub mod micro;
