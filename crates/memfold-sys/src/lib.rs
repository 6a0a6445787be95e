//! # memfold-sys
//!
//! The system layer: memfold's thin, typed wrappers over the Linux calls it needs, so
//! that the rest of memfold (the live daemon, the agent, the wire, the command line)
//! reads as plain Rust. The engine core (`memfold-core`) decides; this crate carries out
//! what needs the OS. Every `unsafe` call is here or says why it is elsewhere.
//!
//! | module | what |
//! |---|---|
//! | [`max_map_count`] | the kernel's `vm.max_map_count` (the VMA wall): read, and raised only when the operator asks |
//! | [`memfd`] | memfds: create, positional I/O over a borrowed descriptor, punch holes, count allocated bytes, find data runs (SEEK_DATA/SEEK_HOLE) |
//! | [`socket`] | a `SOCK_SEQPACKET` Unix socket that carries packets of bytes and file descriptors (SCM_RIGHTS) |
//! | [`uffd`] | userfaultfd on shmem: register, write-protect, copy, zero-page, continue, events |
//! | [`fence`] | the write fence: writers of guest RAM in other processes (block devices) tell the agent which pages they are copying into, so it never takes one away mid-copy |
//! | [`files`] | what a file that is not a regular one is, in words (for errors that refuse it) |
//! | [`ksm`] | Linux KSM's sysfs settings and counters (the peer memfold is measured against) |
//! | [`pidfd`] | a process held by a descriptor: a socket peer's (`SO_PEERPIDFD`), whether it still runs, so a pid looked at stays its own |
//! | [`proc`] | CPU seconds of a process or its threads, from `/proc` |
//! | [`pageout`] | a read-only window onto a memfd to send its pages to the kernel's swap (zswap) with `MADV_PAGEOUT` |
//! | [`reclaim`] | the kernel's other memory savers: zswap, a swap file, a v1 memory cgroup's limit, memory PSI |
//! | [`testing`] | for memfold's tests: a skip made visible (stderr and the `MEMFOLD_SKIP_LOG` file CI lists) |

#![deny(missing_docs)]

pub mod deadline;
pub mod fence;
pub mod files;
pub mod ksm;
pub mod max_map_count;
pub mod memfd;
pub mod pagemap;
pub mod pageout;
pub mod pidfd;
pub mod proc;
pub mod reclaim;
pub mod socket;
pub mod testing;
pub mod uffd;
