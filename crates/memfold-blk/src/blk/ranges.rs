//! Discard and write-zeroes requests (`VIRTIO_BLK_T_DISCARD`, `VIRTIO_BLK_T_WRITE_ZEROES`):
//! the same 16-byte ranges, checked whole before any is applied (virtio 1.2 §5.2.6).

use super::*;

/// What a range request drops: [`BlkBackend::discard`]'s two kinds.
#[derive(Clone, Copy)]
pub(super) enum RangeOp {
    /// `VIRTIO_BLK_T_DISCARD`: the range reads as the base again (any bytes are allowed).
    Discard,
    /// `VIRTIO_BLK_T_WRITE_ZEROES`: the range reads as zeros.
    Zeroes,
}

impl RangeOp {
    fn op(self) -> &'static str {
        match self {
            RangeOp::Discard => "discard",
            RangeOp::Zeroes => "write zeroes",
        }
    }
    /// The range flags this kind knows.
    fn flags(self) -> u32 {
        match self {
            RangeOp::Discard => 0,
            RangeOp::Zeroes => vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
        }
    }
}

impl BlkBackend {
    /// A discard or write-zeroes request: `len` bytes of 16-byte ranges (`struct
    /// virtio_blk_discard_write_zeroes`: sector u64, sectors u32, flags u32), each checked
    /// before any is applied, then applied in order. A flag the request's type does not
    /// know (for a discard, any: its unmap flag is write-zeroes' alone) is UNSUPP, as the
    /// virtio spec (1.2 §5.2.6.2) has the device answer; nothing is changed.
    pub(super) fn discard(
        &mut self,
        mem: &RemoteMemory,
        c: &Chain,
        len: u64,
        kind: RangeOp,
    ) -> Result<(), ReqError> {
        if len == 0 || len % 16 != 0 || len / 16 > MAX_DISCARD_SEG as u64 {
            return Err(ReqError::Malformed(format!(
                "{} of {len} bytes of ranges (1 to {MAX_DISCARD_SEG} ranges of 16 bytes)",
                kind.op()
            )));
        }
        let buf = gather(mem, &c.readable, HEADER, len)?;
        let le = |b: &[u8]| {
            let mut w = [0u8; 8];
            w[..b.len()].copy_from_slice(b);
            u64::from_le_bytes(w)
        };
        // (sector, sectors, flags) of each range, read once.
        let asked: Vec<(u64, u64, u32)> = buf
            .chunks_exact(16)
            .map(|r| (le(&r[0..8]), le(&r[8..12]), le(&r[12..16]) as u32))
            .collect();
        // Every range's flags first: an unknown flag is UNSUPP even when another range
        // is out of bounds (the spec's MUST), and nothing is applied.
        if let Some(&(_, _, flags)) = asked.iter().find(|a| a.2 & !kind.flags() != 0) {
            return Err(ReqError::Unsupported(format!(
                "{} with flags {flags:#x} (known: {:#x})",
                kind.op(),
                kind.flags()
            )));
        }
        let mut ranges = Vec::with_capacity(asked.len());
        for (sector, n, flags) in asked {
            let unmap = flags & vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
            ranges.push((self.data_range(sector, n * SECTOR)?, n * SECTOR, unmap));
        }
        for (off, n, unmap) in ranges {
            let disk = self.disk_mut(kind.op())?;
            match kind {
                RangeOp::Discard => disk.discard(off, n)?,
                RangeOp::Zeroes => disk.write_zeroes(off, n, unmap)?,
            }
        }
        self.write_through()
    }
}
