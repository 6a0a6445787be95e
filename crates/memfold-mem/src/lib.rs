//! # memfold-mem
//!
//! The mechanism layer: the parts of memfold that touch real memory and files. The engine
//! core (`memfold-core`) decides; this crate carries out what needs the OS.
//!
//! Today it holds the swap file ([`FileSwapDevice`], Difference Engine §4.6: "a single flat
//! file of configurable size is used as storage for the swap space") and the control of
//! Linux KSM ([`ksm`]), the peer memfold is measured against. The live layer (userfaultfd,
//! memfd, the QEMU agent) joins it next.

pub mod ksm;
mod swapfile;

pub use swapfile::{FileSwapDevice, SwapFileError};
