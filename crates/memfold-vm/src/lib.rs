//! # memfold-vm
//!
//! memfold's QEMU layer, used by every command that runs real guests:
//! - [`images`]: the guest image profiles (built by `images/build.sh` from Debian packages).
//! - [`launcher`]: starts guests under QEMU (KVM when it works, TCG otherwise), with RAM as
//!   a shared memfd (for memfold) or anonymous memory (for KSM), a QMP socket and a serial
//!   log each; waits for their readiness marker; stops them cleanly and never leaves a
//!   QEMU process behind.
//! - [`qmp`]: a small QMP client.
//! - [`capture`]: snapshots of guest RAM and of which pages are host-resident.
//! - [`hostmem`]: how much host memory guest RAM uses, one definition for memfold and KSM.

#![deny(missing_docs)]

pub mod capture;
pub mod census;
pub mod hostmem;
pub mod images;
pub mod launcher;
pub mod qmp;
