//! The books' export: the engine's books and the agents' reports, as the wire's
//! statistics (JSON to clients; `memfold_wire::metrics` makes them a Prometheus
//! exposition).

use memfold_core::engine::{Books, VmReport};
use memfold_core::Engine;
use memfold_sys::proc::{cpu_seconds, AGENT_THREADS};
use memfold_wire::{
    HeldBytes, KernelSwapStats, LifetimeCdf, OpLatencies, OpLatency, SavedBy, Stats, SwapStats,
    VmStats, AGENT_OPS,
};

use super::balloon::Claims;
use super::guests::Guests;

/// `agent_cpu_s`: the CPU seconds of the agent threads of `v`'s QEMU.
fn vm_stats(v: &VmReport, guests: &Guests, claims: &Claims, agent_cpu_s: f64) -> VmStats {
    let b = &v.books;
    let g = guests.by_vm.get(&v.id);
    let balloon = claims.state(v.pid).unwrap_or_default();
    VmStats {
        name: v.name.clone(),
        pid: v.pid,
        pages: v.pages,
        host_bytes: v.host_bytes,
        agent_state_bytes: g.map_or(0, |g| g.agent_state_bytes),
        qemu_mappings: g.map_or(0, |g| g.qemu_mappings),
        qemu_vma_budget: g.map_or(0, |g| g.vma_budget),
        run_breaks: g.map_or(0, |g| g.run_breaks),
        ahead_breaks: g.map_or(0, |g| g.ahead_breaks),
        nocopy_breaks: g.map_or(0, |g| g.nocopy_breaks),
        clock_zaps: g.map_or(0, |g| g.clock_zaps.0),
        clock_zaps_skipped: g.map_or(0, |g| g.clock_zaps.1),
        shared_pages: b.shared_pages,
        zero_shared_pages: b.zero_shared_pages,
        zero_reclaimed_pages: b.zero_reclaimed_pages,
        scanned_pages: b.scanned_pages,
        skipped_pages: b.skipped_pages,
        shares: b.shares,
        read_landed: b.read_landed,
        read_shares: b.read_shares,
        read_fills: b.read_fills,
        read_backoffs: b.read_backoffs,
        cow_breaks: b.cow_breaks,
        reclaims: b.reclaims,
        refills: b.refills,
        discards: b.discards,
        free_watches: b.free_watches,
        free_discards: b.free_discards,
        free_discards_shared: b.free_discards_shared,
        free_discards_stored: b.free_discards_stored,
        free_reclaimed_pages: b.free_reclaimed_pages,
        cow_copies_avoided: b.cow_copies_avoided,
        store_floor: b.store_floor,
        wait_share_pct: b.wait_share_bp.map(|bp| bp as f64 / 100.0),
        store_floor_raised: b.store_floor_raised,
        wp_faults: g.map_or(0, |g| g.wp_faults),
        missing_faults: g.map_or(0, |g| g.missing_faults),
        minor_faults: g.map_or(0, |g| g.minor_faults),
        nru_pages: b.nru_pages,
        clock_passes: b.clock_passes,
        latency: guests.latencies(v.id),
        share_changed: b.share_changed,
        hot_skipped: b.hot_skipped,
        share_refused: b.share_refused,
        unmapped_pages: b.unmapped_pages,
        unmapped_shares: b.unmapped_shares,
        unmaps: b.unmaps,
        patched_pages: b.patched_pages,
        compressed_pages: b.compressed_pages,
        paged_out_pages: b.paged_out_pages,
        page_outs: b.page_outs,
        paged_ins: b.paged_ins,
        patches: b.patches,
        compressions: b.compressions,
        unstashes: b.unstashes,
        stash_changed: b.stash_changed,
        stash_refused: b.stash_refused,
        swapped_pages: b.swapped_pages,
        swap_outs: b.swap_outs,
        swap_ins: b.swap_ins,
        swap_moves: b.swap_moves,
        detached: !v.attached,
        opted_out: b.opted_out,
        agent_cpu_s,
        sharing_ranks: v.sharing_ranks.0.clone(),
        entitlement_pages: v.sharing_ranks.entitlement_pages(),
        balloon_target_bytes: balloon.target,
        balloon_actual_bytes: balloon.actual,
        balloon_problem: balloon.problem,
        guest_available_bytes: balloon.available,
        guest_short: balloon.short,
        guest_pages: b.categories.map(|c| {
            use memfold_core::categories::Category;
            memfold_wire::GuestPages {
                free: c.of(Category::Free),
                cache: c.of(Category::Cache),
                anon: c.of(Category::Anon),
                slab: c.of(Category::Slab),
                kernel: c.of(Category::Kernel),
                unknown: c.of(Category::Unknown),
                active: c.active,
                referenced: c.referenced,
                never_share: c.never_share,
                never_share_takebacks: b.never_share_takebacks,
                reports: b.category_reports,
                refused: b.category_refused,
                scan_skipped: b.category_skipped,
                ..Default::default()
            }
        }),
    }
}

/// memfoldd's statistics now: an operator's (`tenant` `None`), or tenant `uid`'s (only
/// the guests whose QEMUs run as `uid`, and no host-wide figure: [`Stats::tenant_uid`]).
pub(crate) fn stats(
    engine: &Engine,
    guests: &Guests,
    claims: &Claims,
    tenant: Option<u32>,
) -> Stats {
    let b: Books = engine.books();
    // One read of /proc per QEMU: a guest of several RAM regions is several engine guests.
    let mut cpu: std::collections::BTreeMap<u32, f64> = Default::default();
    let mut vms: Vec<VmStats> = b
        .vms
        .iter()
        .filter(|v| tenant.is_none_or(|uid| guests.by_vm.get(&v.id).is_some_and(|g| g.uid == uid)))
        .map(|v| {
            let agent_cpu_s = *cpu
                .entry(v.pid)
                .or_insert_with(|| cpu_seconds(v.pid, Some(AGENT_THREADS)));
            vm_stats(v, guests, claims, agent_cpu_s)
        })
        .collect();
    vms.sort_by(|a, b| a.name.cmp(&b.name));
    if tenant.is_some() {
        return Stats {
            uptime_s: b.uptime_s,
            rate_pages_per_s: engine.config().rate,
            policy: b.policy.clone(),
            tenant_uid: tenant,
            vms,
            ..Stats::default()
        };
    }
    let mut all: [OpLatency; AGENT_OPS] = Default::default();
    for g in guests.by_vm.values() {
        for (a, h) in all.iter_mut().zip(&g.latency) {
            a.merge(h);
        }
    }
    let mut latency = OpLatencies::from_histograms(&all);
    let own = [
        OpLatency::from_pairs(&b.encode_ns[0]),
        OpLatency::from_pairs(&b.encode_ns[1]),
        OpLatency::from_pairs(
            &b.read_share_us
                .iter()
                .map(|&(us, n)| (us * 1000, n))
                .collect::<Vec<_>>(),
        ),
    ];
    latency.patch_encode = own[0].summary();
    latency.compress = own[1].summary();
    latency.share_at_read = own[2].summary();
    // The agents' seven, then memfoldd's three, in the order of OpLatencies::OPS.
    let latency_buckets = all
        .iter()
        .chain(&own)
        .zip(OpLatencies::OPS)
        .map(|(h, op)| h.buckets(op))
        .collect();
    let s = &b.saved_by;
    let kernel_swap = kernel_swap(&b);
    let zswap_saved = zswap_saved_pages(&kernel_swap);
    Stats {
        uptime_s: b.uptime_s,
        cpu_s: cpu_seconds(std::process::id(), None),
        rate_pages_per_s: engine.config().rate,
        full_scans: b.full_scans,
        frames: b.frames,
        mapped_pages: b.mapped_pages,
        zero_reclaimed_pages: b.zero_reclaimed_pages,
        saved_pages: b.saved_pages + zswap_saved,
        saved_by: SavedBy {
            sharing: s.sharing,
            zero: s.zero,
            free: s.free,
            patching: s.patching,
            compression: s.compression,
            swap: s.swap,
            store_waste: s.store_waste,
            zswap: zswap_saved,
        },
        patched_pages: b.patched_pages,
        unmapped_pages: b.unmapped_pages,
        compressed_pages: b.compressed_pages,
        store_pages: b.store_pages,
        reference_frames: b.reference_frames,
        swap: SwapStats {
            budget_pages: b.swap.budget_pages,
            host_used_pages: b.swap.host_used_pages,
            swapped_pages: b.swap.swapped_pages,
            slot_bytes: b.swap.slot_bytes,
            file_pages: b.swap.file_pages,
            capacity_pages: b.swap.capacity_pages,
            full: b.swap.full,
            wanted_pages: b.swap.wanted_pages,
        },
        lifetime: LifetimeCdf {
            restored: b.lifetime.restored,
            stashed_now: b.lifetime.stored_now,
            restored_before: b.lifetime.restored_before.clone(),
            lived_10s: b.lifetime.lived_10s,
        },
        policy: b.policy.clone(),
        domains: b.domains,
        blob_write_errors: b.blob_write_errors,
        held: HeldBytes {
            pool: b.held[0].0,
            pool_booked: b.held[0].1,
            store: b.held[1].0,
            store_booked: b.held[1].1,
            swap: b.held[2].0,
            swap_booked: b.held[2].1,
        },
        table_entries: b.table_entries,
        adopted_pool: b.adopted_pool,
        latency,
        latency_buckets,
        metadata_bytes: b.metadata_bytes,
        metadata_by: memfold_wire::MetadataBy {
            pages: b.metadata_by.pages,
            frames: b.metadata_by.frames,
            share_table: b.metadata_by.share_table,
            similarity: b.metadata_by.similarity,
            blobs: b.metadata_by.blobs,
        },
        blocks_indexed: b.blocks_indexed,
        blocks_held: b.blocks_held,
        rss_bytes: memfold_sys::proc::rss_bytes(std::process::id()),
        kernel_swap,
        vms,
        // Set by the reader thread if it sends them in parts (`stats_messages`).
        vms_following: 0,
        tenant_uid: None,
    }
}

/// The guests' pages and the pools' frames in the kernel's swap, and the host's zswap pool
/// (zeros where /proc/meminfo does not say: a kernel without zswap).
fn kernel_swap(b: &Books) -> KernelSwapStats {
    let mut k = KernelSwapStats::default();
    for v in &b.vms {
        k.paged_out_pages += v.books.paged_out_pages;
        k.page_outs += v.books.page_outs;
        k.paged_ins += v.books.paged_ins;
        k.page_outs_kept += v.books.page_outs_kept;
    }
    k.frames_paged_out = b.frames_paged_out;
    k.frame_page_outs = b.frame_page_outs;
    if k.paged_out_pages + k.frames_paged_out > 0 {
        if let Ok((pool, zswapped)) = memfold_sys::reclaim::zswap_pool() {
            (k.zswap_pool_bytes, k.zswapped_bytes) = (pool, zswapped);
        }
    }
    k
}

/// Pages the kernel's swap saves: pages and frames paged out less the zswap pool's share
/// of them at the host's ratio (the kernel keeps no per-page figure; on a host where only
/// memfold's guests use zswap, as in `memfold run`, the ratio is theirs). Pages zswap does
/// not hold went to the swap file on disk and count whole.
fn zswap_saved_pages(k: &KernelSwapStats) -> i64 {
    let paged = (k.paged_out_pages + k.frames_paged_out) as f64;
    let held = if k.zswapped_bytes > 0 {
        let in_zswap = paged.min(k.zswapped_bytes as f64 / 4096.0);
        in_zswap * k.zswap_pool_bytes as f64 / k.zswapped_bytes as f64
    } else {
        0.0
    };
    (paged - held).round() as i64
}
