//! Cost of each engine operation, as in Difference Engine Table 2 (share_page 6 µs,
//! cow_break 25 µs, compress_page 30 µs, uncompress 10 µs, patch_page 300 µs, unpatch 18 µs).
//! Run: `cargo bench -p memfold-core --bench ops`. Results: docs/benchmarks.md.
//!
//! Engine-level benchmarks time only the operation: pages are put back in the state the
//! operation needs between timed batches.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use memfold_core::{
    CompressCodec, Engine, EngineConfig, MemSwapDevice, PatchCodec, VmId, PAGE_SIZE,
};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const BATCH: u32 = 256;

fn text_page(seed: u64) -> Vec<u8> {
    let words: [&[u8]; 8] = [
        b"the ", b"guest ", b"memory ", b"page ", b"is ", b"shared ", b"and ", b"saved\n",
    ];
    let mut r = SmallRng::seed_from_u64(seed);
    let mut p = Vec::with_capacity(PAGE_SIZE + 8);
    while p.len() < PAGE_SIZE {
        p.extend_from_slice(words[r.gen_range(0..8)]);
    }
    p.truncate(PAGE_SIZE);
    p
}

/// A page like kernel data: zeros, small integers, pointers with common high bits.
fn kernel_like_page(seed: u64) -> Vec<u8> {
    let mut r = SmallRng::seed_from_u64(seed);
    let mut p = vec![0u8; PAGE_SIZE];
    for w in p.chunks_exact_mut(8) {
        let v: u64 = match r.gen_range(0..3) {
            0 => 0,
            1 => r.gen_range(0..1024),
            _ => 0xffff_8880_0000_0000 | (r.gen_range(0..1u64 << 20) << 6),
        };
        w.copy_from_slice(&v.to_le_bytes());
    }
    p
}

fn random_page(seed: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    SmallRng::seed_from_u64(seed).fill(&mut p[..]);
    p
}

fn similar(base: &[u8], seed: u64) -> Vec<u8> {
    let mut p = base.to_vec();
    let mut r = SmallRng::seed_from_u64(seed);
    for _ in 0..26 {
        let at = r.gen_range(0..PAGE_SIZE / 8) * 8;
        r.fill(&mut p[at..at + 8]);
    }
    p
}

fn engine(cfg: EngineConfig) -> (Engine, VmId) {
    let mut e = Engine::new(
        EngineConfig {
            share_passes: 1,
            min_rescan_us: 0,
            ..cfg
        },
        Box::new(MemSwapDevice::new(0)),
    )
    .unwrap();
    let vm = e.create_vm(BATCH + 1).unwrap();
    (e, vm)
}

/// Times `op` on pages 1..=BATCH, after `prepare` (untimed) before each batch.
fn per_page(
    iters: u64,
    e: &mut Engine,
    vm: VmId,
    mut prepare: impl FnMut(&mut Engine, VmId, u32),
    mut op: impl FnMut(&mut Engine, VmId, u32),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let n = (iters - done).min(BATCH as u64) as u32;
        for g in 1..=n {
            prepare(e, vm, g);
        }
        let t = Instant::now();
        for g in 1..=n {
            op(e, vm, g);
        }
        total += t.elapsed();
        done += n as u64;
    }
    total
}

fn bench_hash(c: &mut Criterion) {
    let page = random_page(1);
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
    g.bench_function("xxh3_page", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_64(std::hint::black_box(&page)))
    });
    g.finish();
}

fn bench_share(c: &mut Criterion) {
    let base = random_page(2);
    let mut g = c.benchmark_group("engine");
    g.bench_function("share_page", |b| {
        let (mut e, vm) = engine(EngineConfig::default());
        e.write(vm, 0, 0, &base).unwrap();
        e.try_share(vm, 0).unwrap();
        e.write(vm, 1, 0, &base).unwrap();
        e.try_share(vm, 1).unwrap(); // page 0's frame is now shared
        b.iter_custom(|iters| {
            per_page(
                iters,
                &mut e,
                vm,
                |e, vm, g| {
                    e.write(vm, g, 0, &base).unwrap();
                },
                |e, vm, g| {
                    e.try_share(vm, g).unwrap();
                },
            )
        })
    });
    g.bench_function("cow_break", |b| {
        let (mut e, vm) = engine(EngineConfig::default());
        e.write(vm, 0, 0, &base).unwrap();
        e.try_share(vm, 0).unwrap();
        b.iter_custom(|iters| {
            per_page(
                iters,
                &mut e,
                vm,
                |e, vm, g| {
                    e.write(vm, g, 0, &base).unwrap();
                    e.try_share(vm, g).unwrap();
                },
                |e, vm, g| {
                    e.write(vm, g, 8, &[1]).unwrap();
                },
            )
        })
    });
    g.finish();
}

fn bench_compress(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine");
    for codec in CompressCodec::ALL {
        let page = if codec == CompressCodec::Wkdm {
            kernel_like_page(3)
        } else {
            text_page(3)
        };
        g.bench_function(format!("compress_page/{}", codec.name()), |b| {
            let (mut e, vm) = engine(EngineConfig {
                compress_codec: codec,
                ..EngineConfig::default()
            });
            b.iter_custom(|iters| {
                per_page(
                    iters,
                    &mut e,
                    vm,
                    |e, vm, g| {
                        e.write(vm, g, 0, &page).unwrap();
                    },
                    |e, vm, g| {
                        assert!(matches!(
                            e.try_compress(vm, g).unwrap(),
                            memfold_core::CompressOutcome::Compressed(_)
                        ));
                    },
                )
            })
        });
        g.bench_function(format!("uncompress/{}", codec.name()), |b| {
            let (mut e, vm) = engine(EngineConfig {
                compress_codec: codec,
                ..EngineConfig::default()
            });
            let mut buf = [0u8; 8];
            b.iter_custom(|iters| {
                per_page(
                    iters,
                    &mut e,
                    vm,
                    |e, vm, g| {
                        e.write(vm, g, 0, &page).unwrap();
                        e.try_compress(vm, g).unwrap();
                    },
                    |e, vm, g| {
                        e.read(vm, g, 0, &mut buf).unwrap();
                    },
                )
            })
        });
    }
    g.finish();
}

fn bench_patch(c: &mut Criterion) {
    use memfold_core::similarity::{SimilarityConfig, SimilarityDetector};
    let base = random_page(4);
    // Only pages that still share a hashed block with the base: the cost of patching is
    // what is measured here, not the detector's hit rate (see bench micro for that).
    let det = SimilarityDetector::new(SimilarityConfig::default()).unwrap();
    let base_sigs = det.signatures(&base.clone().try_into().unwrap());
    let sims: Vec<Vec<u8>> = (0..)
        .map(|i| similar(&base, i))
        .filter(|p| {
            let s = det.signatures(&p.clone().try_into().unwrap());
            s[0] == base_sigs[0] || s[1] == base_sigs[1]
        })
        .take(BATCH as usize + 1)
        .collect();
    let mut g = c.benchmark_group("engine");
    for codec in PatchCodec::ALL {
        let setup = || {
            let (mut e, vm) = engine(EngineConfig {
                patch_codec: codec,
                ..EngineConfig::default()
            });
            e.write(vm, 0, 0, &base).unwrap();
            e.index_reference(vm, 0).unwrap();
            (e, vm)
        };
        g.bench_function(format!("patch_page/{}", codec.name()), |b| {
            let (mut e, vm) = setup();
            b.iter_custom(|iters| {
                per_page(
                    iters,
                    &mut e,
                    vm,
                    |e, vm, g| {
                        e.write(vm, g, 0, &sims[g as usize]).unwrap();
                    },
                    |e, vm, g| {
                        assert!(matches!(
                            e.try_patch(vm, g).unwrap(),
                            memfold_core::PatchOutcome::Patched(_)
                        ));
                    },
                )
            })
        });
        g.bench_function(format!("unpatch/{}", codec.name()), |b| {
            let (mut e, vm) = setup();
            let mut buf = [0u8; 8];
            b.iter_custom(|iters| {
                per_page(
                    iters,
                    &mut e,
                    vm,
                    |e, vm, g| {
                        e.write(vm, g, 0, &sims[g as usize]).unwrap();
                        e.try_patch(vm, g).unwrap();
                    },
                    |e, vm, g| {
                        e.read(vm, g, 0, &mut buf).unwrap();
                    },
                )
            })
        });
    }
    g.finish();
}

fn bench_similarity(c: &mut Criterion) {
    use memfold_core::similarity::{SimilarityConfig, SimilarityDetector, SimilarityIndex};
    let det = SimilarityDetector::new(SimilarityConfig::default()).unwrap();
    let mut idx = SimilarityIndex::new(det.clone());
    idx.clear_for(1 << 18);
    for i in 0..(1u32 << 17) {
        idx.insert(
            &det.signatures(&random_page(i as u64 + 100).try_into().unwrap()),
            i,
        );
    }
    let probe: [u8; PAGE_SIZE] = random_page(150).try_into().unwrap();
    let mut out = Vec::new();
    let mut g = c.benchmark_group("similarity");
    g.bench_function("lookup_2_1", |b| {
        b.iter(|| {
            let sigs = det.signatures(std::hint::black_box(&probe));
            idx.candidates(&sigs, &mut out);
            out.len()
        })
    });
    g.finish();
}

fn bench_codecs(c: &mut Criterion) {
    let pages = [("text", text_page(5)), ("kernel", kernel_like_page(5))];
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
    for (kind, p) in &pages {
        let page: [u8; PAGE_SIZE] = p.clone().try_into().unwrap();
        for codec in CompressCodec::ALL {
            let mut blob = Vec::new();
            g.bench_function(format!("compress/{}/{kind}", codec.name()), |b| {
                b.iter(|| codec.compress(&page, &mut blob).unwrap())
            });
            codec.compress(&page, &mut blob).unwrap();
            let mut out = [0u8; PAGE_SIZE];
            g.bench_function(format!("decompress/{}/{kind}", codec.name()), |b| {
                b.iter_batched_ref(
                    || (),
                    |_| codec.decompress(&blob, &mut out).unwrap(),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = ops;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = bench_hash, bench_share, bench_compress, bench_patch, bench_similarity, bench_codecs
}
criterion_main!(ops);
