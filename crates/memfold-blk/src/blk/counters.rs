//! What the device counts of its requests.

/// Counters of requests (logged at exit and kept for tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Reads completed OK.
    pub reads: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Writes completed OK.
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Discards.
    pub discards: u64,
    /// Write-zeroes completed OK.
    pub write_zeroes: u64,
    /// Requests answered `VIRTIO_BLK_S_IOERR`.
    pub io_errors: u64,
    /// Requests answered `VIRTIO_BLK_S_UNSUPP`.
    pub unsupported: u64,
    /// Requests that broke their queue (no status byte known or writable): not
    /// completed, and the queue served no more until the driver resets the device.
    pub dropped: u64,
    /// Pages reported landed from a base image.
    pub landed_base: u64,
    /// Pages reported landed from the overlay.
    pub landed_overlay: u64,
    /// Pages reported landed as zeros.
    pub landed_zero: u64,
    /// Pages of reads asked of memfoldd to be filled from frames (Satori §5.2).
    pub fill_asked: u64,
    /// Of those, pages filled: not read from the disk, not written.
    pub filled: u64,
    /// Reads served wholly from frames: no disk read at all.
    pub reads_from_frames: u64,
    /// Bytes read from the disk for reads: `read_bytes` less what frames filled, plus
    /// every byte read ahead (`ahead.rs`), used, dropped, or filled from frames after all.
    pub disk_read_bytes: u64,
    /// Reads served from bytes read ahead (`ahead.rs`): the next waiting request's,
    /// read while the one before it was copied, or a sequential stream's next range,
    /// read while the guest took the last.
    pub read_ahead: u64,
    /// Reads ahead dropped unused (disk reads wasted): the next read was not inside
    /// them, a request of another kind came first, or the base changed since.
    pub read_ahead_dropped: u64,
    /// Reads of QEMU's memory for the rings and descriptors (each a `process_vm_readv`).
    pub ring_reads: u64,
}

impl Counters {
    /// One line, `key=value` pairs (the binary's `--stats` file and its exit log).
    pub fn line(&self) -> String {
        format!(
            "reads={} read_bytes={} writes={} flushes={} discards={} io_errors={} unsupported={} dropped={} landed_base={} landed_overlay={} landed_zero={} fill_asked={} filled={} reads_from_frames={} disk_read_bytes={} read_ahead={} read_ahead_dropped={} ring_reads={} write_zeroes={}",
            self.reads,
            self.read_bytes,
            self.writes,
            self.flushes,
            self.discards,
            self.io_errors,
            self.unsupported,
            self.dropped,
            self.landed_base,
            self.landed_overlay,
            self.landed_zero,
            self.fill_asked,
            self.filled,
            self.reads_from_frames,
            self.disk_read_bytes,
            self.read_ahead,
            self.read_ahead_dropped,
            self.ring_reads,
            self.write_zeroes
        )
    }
}
