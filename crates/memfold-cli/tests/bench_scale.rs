//! `memfold bench scale`, small (issue 19's "a smaller version in CI"): one and three
//! `tiny` guests of 192 MiB under memfold for 30 s each (no KSM side), through the
//! binary. Every guest's self-checks must pass (the run fails on a mismatch), and each
//! point must carry what the sweep is for: a saving, the engine's and the agents'
//! metadata, memfoldd's resident set, the QEMUs' mappings, pages scanned, a slope. About
//! two minutes under TCG; run it alone with other guest-booting tests
//! (`flock /tmp/measure.lock cargo test --release -p memfold-cli --test bench_scale`).

use std::process::Command;

#[test]
fn a_small_sweep_measures_every_cost_of_each_point() {
    let out = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_memfold"))
        .args([
            "bench", "scale", "--vms", "1,3", "--sizes", "192", "--secs", "30", "--settle", "10",
            "--no-ksm", "--json", "--out",
        ])
        .arg(out.path())
        .output()
        .expect("memfold runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "memfold bench scale failed:\n{stderr}");
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    assert_eq!(j["x"], "guests");
    let points = j["points"].as_array().expect("points");
    assert_eq!(points.len(), 2, "{j:#}");
    let ram_pages = |p: &serde_json::Value| p["guests"].as_u64().unwrap() * 192 * 256;
    for p in points {
        let f = |k: &str| {
            p[k].as_f64()
                .unwrap_or_else(|| panic!("{k} missing: {p:#}"))
        };
        assert!(
            f("memfold_saved_pct") > 10.0,
            "tiny guests share and compress: {p:#}"
        );
        assert!(f("scanned_gib") > 0.0, "{p:#}");
        assert!(f("engine_metadata_bytes") > 0.0, "{p:#}");
        // The agents' record is at least a byte per guest page and at most 1 KiB.
        let per_page = f("agent_state_bytes") / ram_pages(p) as f64;
        assert!(
            (1.0..1024.0).contains(&per_page),
            "{per_page} bytes a page: {p:#}"
        );
        assert!(f("metadata_pct") > 0.0 && f("metadata_pct") < 10.0, "{p:#}");
        assert!(f("memfoldd_rss_bytes") > 1e6, "{p:#}");
        assert!(
            f("max_qemu_mappings") > 50.0,
            "a QEMU has more than 50 mappings: {p:#}"
        );
        assert!(p["ksm_saved_pct"].is_null(), "--no-ksm: {p:#}");
    }
    assert_eq!(points[1]["guests"], 3);
    assert!(
        j["slopes_per_x"]["memfold_used_before_mib"]
            .as_f64()
            .unwrap()
            > 10.0,
        "each guest adds its memory: {j:#}"
    );
    for f in ["scale.json", "scale.csv", "scale.png"] {
        assert!(out.path().join(f).exists(), "{f} written");
    }
}
