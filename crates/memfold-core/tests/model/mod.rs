//! A plain reference model of guest memory and an executor that drives the engine and the
//! model with the same operations, checking them against each other after every step.

#![allow(dead_code)]

use std::sync::atomic::Ordering;

use memfold_core::swap::SwapFaults;
use memfold_core::{
    CompressCodec, Engine, EngineConfig, EngineError, Page, PatchCodec, Policy, VmId, ZeroPolicy,
    PAGE_SIZE,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Page content the generator picks from: few distinct pages so that sharing and
/// similarity happen often.
#[derive(Clone, Copy, Debug)]
pub enum Content {
    Zero,
    /// One of 6 base pages.
    Base(u8),
    /// A base page with a few 8-byte runs changed (seeded).
    Similar(u8, u8),
    /// Text-like, compressible.
    Text(u8),
    /// Random bytes.
    Random(u64),
}

impl Content {
    pub fn render(self) -> Box<Page> {
        let mut p = Box::new([0u8; PAGE_SIZE]);
        match self {
            Content::Zero => {}
            Content::Base(b) => SmallRng::seed_from_u64(1000 + (b % 6) as u64).fill(&mut p[..]),
            Content::Similar(b, seed) => {
                SmallRng::seed_from_u64(1000 + (b % 6) as u64).fill(&mut p[..]);
                let mut r = SmallRng::seed_from_u64(seed as u64);
                for _ in 0..r.gen_range(1..12) {
                    let at = r.gen_range(0..PAGE_SIZE - 8);
                    r.fill(&mut p[at..at + 8]);
                }
            }
            Content::Text(seed) => {
                let words: [&[u8]; 4] = [b"guest ", b"frame ", b"share ", b"page\n"];
                let mut r = SmallRng::seed_from_u64(seed as u64);
                let mut i = 0;
                while i < PAGE_SIZE {
                    for &c in words[r.gen_range(0..4)] {
                        if i < PAGE_SIZE {
                            p[i] = c;
                            i += 1;
                        }
                    }
                }
            }
            Content::Random(s) => SmallRng::seed_from_u64(s).fill(&mut p[..]),
        }
        p
    }
}

/// One step. VM and gfn numbers are reduced modulo what exists when the step runs.
#[derive(Clone, Debug)]
pub enum Op {
    CreateVm {
        pages: u32,
    },
    DestroyVm {
        vm: u32,
    },
    WritePage {
        vm: u32,
        gfn: u32,
        content: Content,
    },
    WritePartial {
        vm: u32,
        gfn: u32,
        offset: u16,
        len: u16,
        byte: u8,
    },
    Read {
        vm: u32,
        gfn: u32,
        offset: u16,
        len: u16,
    },
    Discard {
        vm: u32,
        gfn: u32,
    },
    Tick {
        budget: u16,
        advance_ms: u32,
    },
    Share {
        vm: u32,
        gfn: u32,
    },
    IndexReference {
        vm: u32,
        gfn: u32,
    },
    Patch {
        vm: u32,
        gfn: u32,
    },
    Compress {
        vm: u32,
        gfn: u32,
    },
    SwapOut {
        vm: u32,
        gfn: u32,
    },
    SwapHint {
        pages: u8,
    },
    SetPolicy(u8),
    FailSwapWrites(bool),
    FailSwapReads(bool),
}

/// Engine parameters a run uses.
#[derive(Clone, Debug)]
pub struct Setup {
    pub zero: u8,
    pub passes: u32,
    pub patch_codec: u8,
    pub compress_codec: u8,
    pub host_limit: Option<u32>,
    pub swap_slots: u32,
    pub collide_hashes: bool,
    pub min_rescan_ms: u32,
}

fn collide(_: &Page) -> u64 {
    0x0123_4567_89ab_cdef
}

pub struct Harness {
    pub engine: Engine,
    faults: SwapFaults,
    /// The reference model: per live VM, its pages' bytes.
    model: Vec<(VmId, Vec<Box<Page>>)>,
    now_us: u64,
    pub steps: u64,
    pub tolerated_errors: u64,
}

impl Harness {
    pub fn new(s: &Setup) -> Self {
        let mut cfg = EngineConfig {
            zero_pages: [
                ZeroPolicy::Reclaim,
                ZeroPolicy::AsContent,
                ZeroPolicy::Never,
            ][s.zero as usize % 3],
            share_passes: s.passes,
            patch_codec: PatchCodec::ALL[s.patch_codec as usize % 3],
            compress_codec: CompressCodec::ALL[s.compress_codec as usize % 4],
            host_frames_limit: s.host_limit,
            min_rescan_us: s.min_rescan_ms as u64 * 1000,
            ..EngineConfig::default()
        };
        if s.collide_hashes {
            cfg.page_hash = collide;
        }
        let dev = memfold_core::MemSwapDevice::new(s.swap_slots);
        let faults = dev.faults();
        Harness {
            engine: Engine::new(cfg, Box::new(dev)).unwrap(),
            faults,
            model: Vec::new(),
            now_us: 0,
            steps: 0,
            tolerated_errors: 0,
        }
    }

    fn pick(&self, vm: u32, gfn: u32) -> Option<(usize, VmId, u32)> {
        if self.model.is_empty() {
            return None;
        }
        let i = vm as usize % self.model.len();
        let (id, pages) = &self.model[i];
        Some((i, *id, gfn % pages.len() as u32))
    }

    /// Errors the engine may legitimately return in this harness: the host budget with a
    /// full swap file, and injected swap I/O failures. Anything else fails the test.
    fn tolerate(&mut self, r: Result<(), EngineError>, what: &Op) -> Result<(), String> {
        match r {
            Ok(()) => Ok(()),
            Err(EngineError::OutOfHostMemory { .. }) | Err(EngineError::SwapIo(_)) => {
                self.tolerated_errors += 1;
                Ok(())
            }
            Err(e) => Err(format!("{what:?}: unexpected error {e}")),
        }
    }

    /// Runs one op on engine and model; returns the (vm index, gfn) touched, if any.
    pub fn step(&mut self, op: &Op) -> Result<Option<(usize, u32)>, String> {
        self.steps += 1;
        let mut touched = None;
        match *op {
            Op::CreateVm { pages } => {
                if self.model.len() < 5 {
                    let id = self.engine.create_vm(pages).map_err(|e| e.to_string())?;
                    self.model
                        .push((id, (0..pages).map(|_| Box::new([0u8; PAGE_SIZE])).collect()));
                }
            }
            Op::DestroyVm { vm } => {
                if let Some((i, id, _)) = self.pick(vm, 0) {
                    self.engine.destroy_vm(id).map_err(|e| e.to_string())?;
                    self.model.remove(i);
                }
            }
            Op::WritePage { vm, gfn, content } => {
                if let Some((i, id, g)) = self.pick(vm, gfn) {
                    let page = content.render();
                    let r = self.engine.write(id, g, 0, &page[..]).map(|_| ());
                    if r.is_ok() {
                        self.model[i].1[g as usize] = page;
                    }
                    self.tolerate(r, op)?;
                    touched = Some((i, g));
                }
            }
            Op::WritePartial {
                vm,
                gfn,
                offset,
                len,
                byte,
            } => {
                if let Some((i, id, g)) = self.pick(vm, gfn) {
                    let off = offset as usize % PAGE_SIZE;
                    let len = (len as usize % 64 + 1).min(PAGE_SIZE - off);
                    let data = vec![byte; len];
                    let r = self.engine.write(id, g, off, &data).map(|_| ());
                    if r.is_ok() {
                        self.model[i].1[g as usize][off..off + len].copy_from_slice(&data);
                    }
                    self.tolerate(r, op)?;
                    touched = Some((i, g));
                }
            }
            Op::Read {
                vm,
                gfn,
                offset,
                len,
            } => {
                if let Some((i, id, g)) = self.pick(vm, gfn) {
                    let off = offset as usize % PAGE_SIZE;
                    let len = (len as usize % PAGE_SIZE + 1).min(PAGE_SIZE - off);
                    let mut buf = vec![0xEEu8; len];
                    let r = self.engine.read(id, g, off, &mut buf).map(|_| ());
                    if r.is_ok() && buf[..] != self.model[i].1[g as usize][off..off + len] {
                        return Err(format!(
                            "{op:?}: read of {id} gfn {g} returned bytes the guest did not write"
                        ));
                    }
                    self.tolerate(r, op)?;
                    touched = Some((i, g));
                }
            }
            Op::Discard { vm, gfn } => {
                if let Some((i, id, g)) = self.pick(vm, gfn) {
                    self.engine.discard(id, g).map_err(|e| e.to_string())?;
                    self.model[i].1[g as usize].fill(0);
                    touched = Some((i, g));
                }
            }
            Op::Tick { budget, advance_ms } => {
                self.now_us += advance_ms as u64 * 1000;
                let r = self.engine.tick(self.now_us, budget as u32).map(|_| ());
                self.tolerate(r, op)?;
            }
            Op::Share { vm, gfn }
            | Op::IndexReference { vm, gfn }
            | Op::Patch { vm, gfn }
            | Op::Compress { vm, gfn }
            | Op::SwapOut { vm, gfn } => {
                if let Some((i, id, g)) = self.pick(vm, gfn) {
                    let r = match op {
                        Op::Share { .. } => self.engine.try_share(id, g).map(|_| ()),
                        Op::IndexReference { .. } => self.engine.index_reference(id, g).map(|_| ()),
                        Op::Patch { .. } => self.engine.try_patch(id, g).map(|_| ()),
                        Op::Compress { .. } => self.engine.try_compress(id, g).map(|_| ()),
                        _ => self.engine.swap_out(id, g).map(|_| ()),
                    };
                    self.tolerate(r, op)?;
                    touched = Some((i, g));
                }
            }
            Op::SwapHint { pages } => {
                let r = self.engine.swap_out_hint(pages as u32).map(|_| ());
                self.tolerate(r, op)?;
            }
            Op::SetPolicy(p) => {
                let names = Policy::NAMES;
                self.engine
                    .set_policy(Policy::by_name(names[p as usize % names.len()]).unwrap());
            }
            Op::FailSwapWrites(on) => self.faults.writes.store(on, Ordering::Relaxed),
            Op::FailSwapReads(on) => self.faults.reads.store(on, Ordering::Relaxed),
        }
        Ok(touched)
    }

    /// Checks one page's content against the model without disturbing the engine.
    pub fn verify_page(&self, i: usize, gfn: u32) -> Result<(), String> {
        let (id, pages) = &self.model[i];
        let reads = self.faults.reads.swap(false, Ordering::Relaxed);
        let mut out = [0u8; PAGE_SIZE];
        let r = self.engine.peek(*id, gfn, &mut out);
        self.faults.reads.store(reads, Ordering::Relaxed);
        r.map_err(|e| format!("peek {id} gfn {gfn}: {e}"))?;
        if out[..] != pages[gfn as usize][..] {
            let state = self.engine.page_state(*id, gfn).unwrap();
            return Err(format!("{id} gfn {gfn} ({state:?}) differs from the model"));
        }
        Ok(())
    }

    /// Every page, every invariant, the books.
    pub fn verify_all(&self) -> Result<(), String> {
        for (i, (_, pages)) in self.model.iter().enumerate() {
            for g in 0..pages.len() as u32 {
                self.verify_page(i, g)?;
            }
        }
        self.engine.check_invariants()?;
        let acc = self.engine.accounting();
        if (acc.saved.total() - acc.saved_bytes as f64).abs() > 0.5 {
            return Err(format!(
                "savings by mechanism {:?} do not add up to {}",
                acc.saved, acc.saved_bytes
            ));
        }
        let f = acc.frames;
        if f.private + f.shared + f.reference_only + f.blob != f.in_use {
            return Err(format!("frame breakdown {f:?} does not add up"));
        }
        let per_vm: f64 = acc.per_vm.iter().map(|v| v.saved.total()).sum();
        if (per_vm - acc.saved_bytes as f64).abs() > 1.0 + acc.saved_bytes.abs() as f64 * 1e-9 {
            return Err(format!(
                "per-VM savings {per_vm} do not add up to {}",
                acc.saved_bytes
            ));
        }
        Ok(())
    }

    /// Destroys every VM and checks nothing leaked.
    pub fn teardown(&mut self) -> Result<(), String> {
        for (id, _) in std::mem::take(&mut self.model) {
            self.engine.destroy_vm(id).map_err(|e| e.to_string())?;
        }
        self.engine.check_invariants()?;
        let acc = self.engine.accounting();
        if acc.frames.in_use != 0 || acc.swap.in_use != 0 || acc.blobs.blobs != 0 {
            return Err(format!(
                "leak after all VMs are gone: {:?}, swap {:?}, blobs {:?}",
                acc.frames, acc.swap, acc.blobs
            ));
        }
        Ok(())
    }
}

/// A random op for the long run (the proptest run has its own strategy with the same mix).
pub fn random_op(r: &mut SmallRng) -> Op {
    let vm = r.gen();
    let gfn = r.gen();
    let content = match r.gen_range(0..10) {
        0..=1 => Content::Zero,
        2..=4 => Content::Base(r.gen()),
        5..=7 => Content::Similar(r.gen(), r.gen()),
        8 => Content::Text(r.gen()),
        _ => Content::Random(r.gen()),
    };
    match r.gen_range(0..100) {
        0 => Op::CreateVm {
            pages: r.gen_range(1..48),
        },
        1 => Op::DestroyVm { vm },
        2..=21 => Op::WritePage { vm, gfn, content },
        22..=31 => Op::WritePartial {
            vm,
            gfn,
            offset: r.gen(),
            len: r.gen(),
            byte: r.gen(),
        },
        32..=46 => Op::Read {
            vm,
            gfn,
            offset: r.gen(),
            len: r.gen(),
        },
        47..=49 => Op::Discard { vm, gfn },
        50..=61 => Op::Tick {
            budget: r.gen_range(1..64),
            advance_ms: r.gen_range(0..3000),
        },
        62..=69 => Op::Share { vm, gfn },
        70..=73 => Op::IndexReference { vm, gfn },
        74..=80 => Op::Patch { vm, gfn },
        81..=86 => Op::Compress { vm, gfn },
        87..=91 => Op::SwapOut { vm, gfn },
        92..=93 => Op::SwapHint {
            pages: r.gen_range(1..8),
        },
        94 => Op::SetPolicy(r.gen()),
        95..=96 => Op::FailSwapWrites(r.gen_bool(0.3)),
        97..=98 => Op::FailSwapReads(r.gen_bool(0.3)),
        _ => Op::CreateVm {
            pages: r.gen_range(1..16),
        },
    }
}

pub fn random_setup(r: &mut SmallRng) -> Setup {
    Setup {
        zero: r.gen(),
        passes: if r.gen_bool(0.3) { 5 } else { 1 },
        patch_codec: r.gen(),
        compress_codec: r.gen(),
        host_limit: if r.gen_bool(0.4) {
            Some(r.gen_range(8..80))
        } else {
            None
        },
        swap_slots: r.gen_range(0..96),
        collide_hashes: r.gen_bool(0.15),
        min_rescan_ms: if r.gen_bool(0.5) { 0 } else { 4000 },
    }
}
