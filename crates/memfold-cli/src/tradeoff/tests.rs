//! The tradeoff table and verdict, from compare.json files written by the tests.

use super::*;

fn pair(ratio: f64, e: Option<f64>) -> Pair {
    Pair {
        metric: "m".into(),
        guest: "g".into(),
        ratio,
        change_2se: e,
        managed_rounds: None,
        plain_rounds: None,
    }
}

#[test]
fn slowdown_is_one_minus_the_geometric_mean_with_its_error() {
    let (s, e) = slowdown(&[pair(0.81, Some(0.02)), pair(1.0, Some(0.02))]);
    // √(0.81·1) = 0.9: a 10% slowdown.
    assert!((s.unwrap() - 10.0).abs() < 1e-9, "{s:?}");
    // se(log) = √((0.01/0.81)² + 0.01²)/2; 2 s.e. of g = 2·se·g.
    let want = 2.0 * (((0.01f64 / 0.81).powi(2) + 0.0001).sqrt() / 2.0) * 0.9 * 100.0;
    assert!((e.unwrap() - want).abs() < 1e-9);
    // One round on a side: a slowdown, but no error bar.
    assert!(slowdown(&[pair(0.5, None)]).1.is_none());
    assert_eq!(slowdown(&[]), (None, None));
}

fn write(dir: &Path, name: &str, v: serde_json::Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, v.to_string()).unwrap();
    p
}

/// The points of a compare.json written with `v` under `dir`.
fn written(dir: &Path, name: &str, v: serde_json::Value) -> Vec<Point> {
    points(&write(dir, name, v)).unwrap()
}

fn run_json(
    memfold_left: f64,
    peer_left: f64,
    m_ratio: f64,
    p_ratio: f64,
    m_cpu: f64,
) -> serde_json::Value {
    let mib = (1u64 << 20) as f64;
    serde_json::json!({
        "guests": "web,db", "secs": 240, "memfold_policy": "de",
        "memfold_used_after_bytes": memfold_left * mib, "memfold_cpu_s": m_cpu,
        "memfold_t95_s": 14.0,
        "memfold_throughput": [{"metric": "web-req/s", "ratio": m_ratio, "change_2se": 0.01}],
        "peer": "ksm+zswap", "peer_used_after_bytes": peer_left * mib, "peer_cpu_s": 30.0,
        "peer_t95_s": 100.0, "peer_guest_mismatches": 0,
        "peer_senpai": {"target": 0.001, "max_probe": 0.01, "interval_s": 6.0},
        "peer_throughput": [{"metric": "web-req/s", "ratio": p_ratio, "change_2se": 0.01}],
        "memfold_memory_stall_pct": 0.0, "memfold_guest_wait_pct": {"web-1": 1.0, "db-1": 1.5},
        "peer_memory_stall_pct": 2.5,
    })
}

#[test]
fn the_verdict_names_each_reason_the_goal_is_missed() {
    let dir = tempfile::tempdir().unwrap();
    let met = written(
        dir.path(),
        "a.json",
        run_json(140.0, 250.0, 0.95, 0.90, 20.0),
    );
    let v = verdict(&met.iter().collect::<Vec<_>>());
    assert!(v.ends_with("goal met"), "{v}");
    assert_eq!(met[1].label, "ksm+zswap target 0.1% probe 1%/6s");
    // Too much memory, slower beyond the error bars, more CPU: all three said.
    let missed = written(
        dir.path(),
        "b.json",
        run_json(200.0, 250.0, 0.80, 0.95, 40.0),
    );
    let v = verdict(&missed.iter().collect::<Vec<_>>());
    assert!(
        v.contains("memory 0.80×") && v.contains("slowdown") && v.contains("CPU"),
        "{v}"
    );
    // 10.5% against 5.0%, each ± 3.0: 5.5 points apart is past the difference's 2 s.e.
    // (√(3² + 3²) = 4.2), though under the sum of the two (6.0).
    let mut apart = run_json(140.0, 250.0, 0.895, 0.95, 20.0);
    apart["memfold_throughput"][0]["change_2se"] = serde_json::json!(0.03);
    apart["peer_throughput"][0]["change_2se"] = serde_json::json!(0.03);
    let apart = written(dir.path(), "c.json", apart);
    let v = verdict(&apart.iter().collect::<Vec<_>>());
    assert!(v.contains("slowdown 10.5% > 5.0%"), "{v}");
    // The best peer is the least memory of all peer points: a second run's.
    let both: Vec<Point> = met.into_iter().chain(missed).collect();
    let v = verdict(&both.iter().collect::<Vec<_>>());
    assert!(v.contains("= 0.56×"), "{v}");
    // A marked peer run (a guest killed) is listed, never the best.
    let mut marked = run_json(140.0, 100.0, 0.95, 0.90, 20.0);
    marked["peer_marks"] = serde_json::json!(["db-1's QEMU died"]);
    let m = written(dir.path(), "m.json", marked);
    let all: Vec<&Point> = both.iter().chain(&m).collect();
    assert!(verdict(&all).contains("= 0.56×"), "{}", verdict(&all));
    assert!(table(&m).contains("(MARKED)"));
    let t = table(&both);
    assert!(
        t.contains("| memfold de | 240 | 140.0 | 5.0 ± 1.0 |"),
        "{t}"
    );
    // PSI on both sides, and memfold's waits on its agents (2.5% over two guests).
    assert!(t.contains("| 0.00 | 2.50 | — |"), "{t}");
    assert!(t.contains("| 2.50 | — | 0 |"), "{t}");
    // CPU is compared per second of run: 40 s in 600 s (6.7% of a core) is less than
    // the peer's 30 s in 240 s (12.5%), 40 s in 240 s more.
    let mut long = run_json(140.0, 250.0, 0.95, 0.90, 40.0);
    long["secs"] = serde_json::json!(600);
    let long = written(dir.path(), "l.json", long);
    let v = verdict(&[&long[0], &both[1]]);
    assert!(v.ends_with("goal met"), "{v}");
    let v = verdict(&[&both[2], &both[1]]);
    assert!(v.contains("CPU 16.7% of a core > 12.5%"), "{v}");
    // No CPU figure for the peer: not met, not passed by a NaN.
    let mut no_cpu = run_json(140.0, 250.0, 0.95, 0.90, 20.0);
    no_cpu.as_object_mut().unwrap().remove("peer_cpu_s");
    let v = verdict(
        &written(dir.path(), "n.json", no_cpu)
            .iter()
            .collect::<Vec<_>>(),
    );
    assert!(
        !v.ends_with("goal met") && v.contains("CPU not measured"),
        "{v}"
    );
}

#[test]
fn a_ksm_compare_and_the_recorded_runs_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let mib = (1u64 << 20) as f64;
    let p = write(
        dir.path(),
        "k.json",
        serde_json::json!({
            "guests": "web", "secs": 90, "memfold_policy": "sharing",
            "memfold_used_after_bytes": 100.0 * mib, "memfold_cpu_s": 10.0,
            "memfold_t95_s": null, "ksm_used_after_bytes": 120.0 * mib, "ksm_cpu_s": 9.0,
            "ksm_t95_s": 12.0, "ksm_guest_mismatches": 0, "peer": "ksm+fpr",
        }),
    );
    let ps = points(&p).unwrap();
    assert_eq!((ps[1].kind, ps[1].label.as_str()), (Kind::Ksm, "ksm+fpr"));
    assert!(ps[1].slowdown_pct.is_none());
    assert!(verdict(&ps.iter().collect::<Vec<_>>()).contains("--plain-twins"));
    // Every compare.json kept in docs/peer-runs parses.
    let runs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/peer-runs");
    let mut n = 0;
    for e in std::fs::read_dir(runs).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "json") {
            points(&path).unwrap_or_else(|e| panic!("{e:#}"));
            n += 1;
        }
    }
    assert!(n >= 5, "{n} runs");
    let bad = write(dir.path(), "bad.json", serde_json::json!({"guests": "web"}));
    let e = format!("{:#}", points(&bad).unwrap_err());
    assert!(e.contains("bad.json"), "{e}");
}

/// A side with a self-check mismatch or a paused guest is marked, listed and never the
/// best, whether the run recorded marks (new) or only a mismatch count (older runs).
#[test]
fn a_side_with_mismatches_or_a_paused_guest_is_never_the_best() {
    let dir = tempfile::tempdir().unwrap();
    let clean = written(
        dir.path(),
        "a.json",
        run_json(140.0, 250.0, 0.95, 0.90, 20.0),
    );
    let mut paused = run_json(100.0, 200.0, 0.95, 0.90, 20.0);
    paused["memfold_marks"] = serde_json::json!(["guest web-1 paused (fail closed) from 40 s"]);
    paused["peer_marks"] = serde_json::json!(["self-check mismatch: db-1: MEMFOLD-MISMATCH x"]);
    let paused = written(dir.path(), "p.json", paused);
    assert!(paused[0].marked() && paused[1].marked());
    // An older run: no marks recorded, a mismatch count on the kit's side.
    let mut old = run_json(120.0, 220.0, 0.95, 0.90, 20.0);
    old["peer_guest_mismatches"] = serde_json::json!(2);
    let old = written(dir.path(), "o.json", old);
    assert!(!old[0].marked());
    assert_eq!(old[1].marks, ["2 self-check mismatch(es)"]);
    let all: Vec<&Point> = clean.iter().chain(&paused).chain(&old).collect();
    // memfold 120 (o.json) against the clean peer, 250: not p.json's 100 nor 200.
    let v = verdict(&all);
    assert!(
        v.contains("(memfold de, 120.0 MiB)") && v.contains("250.0 MiB"),
        "{v}"
    );
    let t = table(&paused);
    assert!(
        t.contains("memfold de (MARKED)") && t.contains("paused (fail closed)"),
        "{t}"
    );
    // A KSM compare with mismatches on the KSM side (`ksm_*` keys).
    let k = written(
        dir.path(),
        "k.json",
        serde_json::json!({
            "guests": "web", "secs": 90, "memfold_policy": "de", "memfold_marks": [],
            "memfold_used_after_bytes": 1e8, "memfold_cpu_s": 10.0, "memfold_t95_s": null,
            "ksm_used_after_bytes": 2e8, "ksm_cpu_s": 9.0, "ksm_t95_s": 12.0,
            "ksm_guest_mismatches": 1, "ksm_marks": ["self-check mismatch: web-1: x"],
        }),
    );
    assert!(!k[0].marked() && k[1].marked());
    assert!(verdict(&k.iter().collect::<Vec<_>>()).starts_with("needs an unmarked"));
}

/// A workload with no rounds on a side (a managed db too slow for a pgbench round)
/// leaves that side marked without a slowdown, and sides over different workloads
/// are not compared.
#[test]
fn an_unmeasured_workload_marks_the_side_and_different_workloads_are_not_compared() {
    let dir = tempfile::tempdir().unwrap();
    let pair = |metric: &str, guest: &str, ratio: f64, m: usize| {
        serde_json::json!({"metric": metric, "guest": guest, "ratio": ratio,
            "change_2se": 0.01, "managed_rounds": m, "plain_rounds": 12})
    };
    let mut j = run_json(140.0, 250.0, 0.95, 0.90, 20.0);
    j["memfold_throughput"] = serde_json::json!([
        pair("web-req/s", "web-1", 0.95, 30),
        pair("pgbench-tps", "db-1", 0.0, 0)
    ]);
    j["peer_throughput"] = serde_json::json!([
        pair("web-req/s", "web-1", 0.9, 30),
        pair("pgbench-tps", "db-1", 0.8, 11)
    ]);
    let ps = written(dir.path(), "u.json", j.clone());
    assert_eq!(ps[0].slowdown_pct, None);
    assert!(ps[0].marks[0].contains("db-1 pgbench-tps: not measured (0 rounds managed"));
    assert!(!ps[1].marked() && ps[1].slowdown_pct.is_some());
    // An older run that dropped the pair: the workloads differ, no verdict.
    j["memfold_throughput"] = serde_json::json!([pair("web-req/s", "web-1", 0.95, 30)]);
    let ps = written(dir.path(), "d.json", j);
    assert!(!ps[0].marked());
    let v = verdict(&ps.iter().collect::<Vec<_>>());
    assert!(v.contains("not compared: their workloads differ"), "{v}");
}

#[test]
fn the_chart_is_written_with_the_points_that_have_a_slowdown() {
    let dir = tempfile::tempdir().unwrap();
    let ps = written(
        dir.path(),
        "a.json",
        run_json(140.0, 250.0, 0.95, 0.90, 20.0),
    );
    let png = dir.path().join("t.png");
    assert_eq!(chart(&png, &ps).unwrap(), 2);
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);
}
