//! Criterion benchmarks of the engine's operations, through the engine memfoldd runs, on
//! in-memory backings with an in-memory agent carrying out its commands (so the costs are
//! the engine's own plus the agent's byte checks, without userfaultfd or syscalls).
//! Beside Difference Engine Table 2; results in docs/benchmarks.md.
//!
//! `cargo bench -p memfold-core --bench ops` (or `make bench`).

// criterion_group!/criterion_main! generate undocumented public functions.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use memfold_core::ids::Gfn;
use memfold_core::sim::Rig;
use memfold_core::{page_hash, CompressCodec, EngineConfig, PatchCodec, Policy, PAGE_SIZE};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Content of page `g`.
type PageFn = fn(u32) -> Vec<u8>;

/// Pages per timed batch.
const PAGES: u32 = 512;

/// The engine over one guest of [`PAGES`] pages, with helpers for the benchmarks.
struct Bench(Rig);

impl Bench {
    fn new(cfg: EngineConfig) -> Bench {
        Bench(Rig::new(cfg, PAGES).unwrap())
    }

    fn fill(&mut self, page: impl Fn(u32) -> Vec<u8>) {
        for g in 0..PAGES {
            self.0.agent.write(Gfn(g), 0, &page(g)).unwrap();
        }
    }

    /// `ms` of memfoldd in 10 ms steps.
    fn run_ms(&mut self, ms: u64) {
        for _ in 0..ms / 10 {
            self.0.step(10_000).unwrap();
        }
    }

    fn stored(&self) -> u64 {
        let b = &self.0.engine.books().vms[0].books;
        b.patched_pages + b.compressed_pages
    }
}

fn config(policy: Policy) -> EngineConfig {
    EngineConfig {
        policy,
        rate: 0,
        min_scan_interval_us: 50_000,
        max_scan_interval_us: 50_000,
        clock_interval_us: Some(100_000),
        ..EngineConfig::default()
    }
}

fn random_page(seed: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    SmallRng::seed_from_u64(seed).fill(&mut p[..]);
    p
}

fn text_page(seed: u64) -> Vec<u8> {
    let words: [&[u8]; 6] = [
        b"memory ", b"page ", b"guest ", b"frame ", b"share ", b"0x1f ",
    ];
    let mut r = SmallRng::seed_from_u64(seed);
    let mut p = Vec::with_capacity(PAGE_SIZE + 8);
    while p.len() < PAGE_SIZE {
        p.extend_from_slice(words[r.gen_range(0..words.len())]);
    }
    p.truncate(PAGE_SIZE);
    p
}

fn similar_page(seed: u64) -> Vec<u8> {
    let mut p = random_page(7);
    let mut r = SmallRng::seed_from_u64(seed);
    for _ in 0..8 {
        let at = r.gen_range(0..PAGE_SIZE - 8);
        r.fill(&mut p[at..at + 8]);
    }
    p
}

fn hash(c: &mut Criterion) {
    let page: [u8; PAGE_SIZE] = random_page(1).try_into().unwrap();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
    g.bench_function("xxh3_page", |b| {
        b.iter(|| page_hash(std::hint::black_box(&page)))
    });
    g.finish();
}

/// The sharing scan over guest pages until every command is answered: per page, the
/// read, hash, lookup, byte check, frame write and share bookkeeping.
fn scan(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(PAGES as u64));
    let kinds: [(&str, PageFn); 3] = [
        ("identical", |_| random_page(3)),
        ("unique", |g| random_page(100 + g as u64)),
        ("zero", |_| vec![0u8; PAGE_SIZE]),
    ];
    for (name, page) in kinds {
        g.bench_function(format!("scan_share/{name}"), |b| {
            b.iter_batched(
                || {
                    let mut x = Bench::new(config(Policy::sharing_only()));
                    x.fill(page);
                    x
                },
                |mut x| x.run_ms(10),
                BatchSize::PerIteration,
            )
        });
    }
    g.bench_function("cow_break", |b| {
        b.iter_batched(
            || {
                let mut x = Bench::new(config(Policy::sharing_only()));
                x.fill(|_| random_page(3));
                x.run_ms(10);
                assert_eq!(x.0.engine.books().vms[0].books.shared_pages, PAGES as u64);
                x
            },
            |mut x| {
                for p in 0..PAGES {
                    x.0.agent.write(Gfn(p), 8, &[1]).unwrap();
                }
                x.0.report();
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

/// Stored pages: the clock slices and the Difference Engine until every page is stored
/// (per page: its share of the scans and clock slices that found it cold, the encode,
/// the blob write and the agent's decode check), then every page decoded back on a read.
fn store_and_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    g.throughput(Throughput::Elements(PAGES as u64));
    g.sample_size(10);
    let runs: [(String, EngineConfig, PageFn); 3] = [
        (
            "compress/zstd".into(),
            config(Policy::single("compress").unwrap()),
            |g| text_page(g as u64),
        ),
        (
            "compress/lz4".into(),
            EngineConfig {
                compress_codec: CompressCodec::Lz4,
                ..config(Policy::single("compress").unwrap())
            },
            |g| text_page(g as u64),
        ),
        (
            format!("patch/{}", PatchCodec::RunDiff.name()),
            // Patching alone: under the DE policy a page that found no candidate yet and
            // does not compress is given up on (docs/bench-micro.md).
            config(Policy::single("patch").unwrap()),
            |g| similar_page(g as u64),
        ),
    ];
    for (name, cfg, page) in runs {
        let setup = || {
            let mut x = Bench::new(cfg.clone());
            x.fill(page);
            x
        };
        g.bench_function(format!("store_cycle/{name}"), |b| {
            b.iter_batched(
                setup,
                |mut x| {
                    let mut ms = 0;
                    while x.stored() < PAGES as u64 * 9 / 10 && ms < 60_000 {
                        x.run_ms(100);
                        ms += 100;
                    }
                    x
                },
                BatchSize::PerIteration,
            )
        });
        g.bench_function(format!("decode/{name}"), |b| {
            b.iter_batched(
                || {
                    let mut x = setup();
                    let mut ms = 0;
                    while x.stored() < PAGES as u64 * 9 / 10 && ms < 60_000 {
                        x.run_ms(100);
                        ms += 100;
                    }
                    x
                },
                |mut x| {
                    for p in 0..PAGES {
                        x.0.agent.read(Gfn(p)).unwrap();
                    }
                    x.0.report();
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, hash, scan, store_and_decode);
criterion_main!(benches);
