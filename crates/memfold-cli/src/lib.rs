//! The command lines of `memfold` and `memfoldd`: what both share.

#![deny(missing_docs)]

pub mod engine_args;
