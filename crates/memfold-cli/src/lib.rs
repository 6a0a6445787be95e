//! The command lines of `memfold` and `memfoldd`: what both share.

#![deny(missing_docs)]

pub mod config_file;
pub mod engine_args;
pub mod install;
pub mod libvirt_xml;
pub mod logging;
