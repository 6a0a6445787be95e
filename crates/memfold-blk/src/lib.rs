//! memfold's sharing-aware block device (Satori §4.1, §5.2; issue 16): a vhost-user-blk
//! backend, one process per VM disk, that serves copy-on-write disks (a read-only base
//! image shared by a profile's guests, a qcow2 overlay per guest) and tells memfold which
//! guest page each read filled and from where ([`landed`]).
//!
//! # One process per disk
//!
//! Each disk of each guest is served by a `memfold-blk` process of its own, beside
//! memfoldd rather than inside it: a crash of the backend, or a malicious QEMU feeding
//! its vhost-user socket crafted messages, takes down that one disk and nothing else —
//! not memfoldd, not another VM's disk (Xen's tapdisk makes the same choice, Satori
//! §5.2); and memfoldd can restart without stalling any guest's I/O, since no request
//! waits on it.
//!
//! # The invariant
//!
//! The device never reads or writes guest RAM through its own mapping of the guest
//! memfd: every access goes through QEMU's page tables ([`mem`] says why and how).
//!
//! # Layers
//!
//! A mechanism crate (it touches the OS): no engine logic. [`remote`] reaches QEMU,
//! [`mem`] is guest RAM over it, [`disk`] the disk images, [`landed`] the report of what
//! reads put where, [`blk`] the virtio-blk device on vhost-user-backend.

mod aligned;
pub mod blk;
pub mod disk;
pub mod landed;
pub mod mem;
pub mod remote;
pub mod vring;
