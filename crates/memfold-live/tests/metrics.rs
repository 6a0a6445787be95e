//! memfoldd's Prometheus endpoint over real HTTP: a memfoldd in this process, two guests
//! served by the real agent with pages for every mechanism, the endpoint on
//! 127.0.0.1:0. The scrape must name both guests with their counters, pass
//! `promtool check metrics` (when promtool is there: `scripts/setup.sh` extracts it into
//! ~/.cache/memfold/promtool), and carry every metric the Grafana dashboard in
//! packaging/grafana/memfold.json queries.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{
    every_mechanism, fast_engine, fill_every_mechanism, start_agent, start_memfoldd, vm_named,
    wait_for, GuestRam, PAGE,
};
use memfold_live::metrics::{MetricsError, MetricsServer};

/// A GET of `path` with `accept`: (status line, headers, body).
fn get(addr: SocketAddr, path: &str, accept: &str) -> (String, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").expect("an HTTP answer");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.into(), headers.to_lowercase(), body.into())
}

/// The sample value of the line that starts with `prefix` (name and labels).
fn value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no sample {prefix} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// promtool from ~/.cache/memfold/promtool (setup.sh) or PATH.
fn promtool() -> Option<PathBuf> {
    let cached = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/memfold/promtool/promtool"))
        .filter(|p| p.exists());
    cached.or_else(|| {
        Command::new("promtool")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|_| PathBuf::from("promtool"))
    })
}

/// Every `memfold_*` name in the Grafana dashboard's queries (panels' targets and the
/// variables').
fn dashboard_metrics() -> BTreeSet<String> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../packaging/grafana/memfold.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let d: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            exprs.push(t["expr"].as_str().expect("an expr").to_string());
        }
    }
    for v in d["templating"]["list"].as_array().unwrap() {
        exprs.push(v["definition"].as_str().unwrap_or("").to_string());
    }
    let mut names = BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("memfold_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    assert!(names.len() >= 6, "the dashboard queries {names:?}");
    names
}

#[test]
fn the_endpoint_serves_every_guest_passes_promtool_and_feeds_the_dashboard() {
    let dir = tempfile::tempdir().unwrap();
    let socket = start_memfoldd(dir.path(), fast_engine());
    // Sizes no other test in this process uses (the agent finds guest RAM by its size).
    let web = GuestRam::new("metrics-web", 1210);
    let db = GuestRam::new("metrics-db", 1230);
    fill_every_mechanism(&web, 11);
    fill_every_mechanism(&db, 12);
    start_agent(&socket, "web-m", &web);
    start_agent(&socket, "db-m", &db);
    wait_for(&socket, Duration::from_secs(60), "every mechanism", |s| {
        s.vms.len() == 2 && s.vms.iter().all(every_mechanism)
    });
    // A write to a shared page (g % 5 == 1) breaks copy-on-write; the agent reports the
    // write-protect fault it served in its next report.
    let s = wait_for(&socket, Duration::from_secs(30), "a CoW break", |s| {
        web.write(1, 100, &[0xee; 8]);
        let v = vm_named(s, "web-m");
        v.cow_breaks > 0 && v.wp_faults > 0
    });
    assert!(vm_named(&s, "web-m").host_bytes >= PAGE as u64);

    assert!(matches!(
        MetricsServer::start("0.0.0.0:0".parse().unwrap(), false, socket.clone()),
        Err(MetricsError::NotLoopback { .. })
    ));
    let m = MetricsServer::start("127.0.0.1:0".parse().unwrap(), false, socket.clone()).unwrap();
    let addr = m.addr();
    assert!(addr.ip().is_loopback() && addr.port() != 0);

    // Whoever reaches the address may ask: GETs within a second get the same answer (its
    // uptime too), memfoldd's books read once. Tried a few times: a pair may straddle the
    // second's end on a loaded machine. Fails with every GET answered afresh.
    let uptime = || value(&get(addr, "/metrics", "*/*").2, "memfold_uptime_seconds ");
    assert!(
        (0..5).any(|_| uptime() == uptime()),
        "two GETs in a row read memfoldd's books twice"
    );

    // What curl and promtool get: the classic text format.
    let (status, headers, text) = get(addr, "/metrics", "*/*");
    assert!(status.contains(" 200 "), "{status}");
    assert!(
        headers.contains("content-type: text/plain; version=0.0.4"),
        "{headers}"
    );
    // A guest's series are labelled by its name and its QEMU's pid (this process).
    let pid = std::process::id();
    for vm in ["web-m", "db-m"] {
        let labels = format!("vm=\"{vm}\",pid=\"{pid}\"");
        assert!(
            value(&text, &format!("memfold_host_memory_bytes{{{labels}}}")) >= PAGE as f64,
            "{text}"
        );
        assert_eq!(
            value(&text, &format!("memfold_guest_memory_bytes{{{labels}}}")),
            if vm == "web-m" { 1210.0 } else { 1230.0 } * PAGE as f64
        );
        assert!(
            value(
                &text,
                &format!("memfold_pages{{{labels},state=\"patched\"}}")
            ) > 0.0
        );
    }
    let web = format!("vm=\"web-m\",pid=\"{pid}\"");
    assert!(value(&text, &format!("memfold_cow_breaks_total{{{web}}}")) >= 1.0);
    assert!(
        value(
            &text,
            &format!("memfold_faults_total{{{web},kind=\"write_protect\"}}")
        ) >= 1.0
    );
    for mech in ["share", "zero", "patch", "compress"] {
        assert!(
            value(
                &text,
                &format!("memfold_saved_bytes{{mechanism=\"{mech}\"}}")
            ) > 0.0,
            "{mech}: {text}"
        );
    }
    assert!(
        value(
            &text,
            "memfold_operation_latency_seconds_count{op=\"share\"}"
        ) > 0.0
    );
    // memfoldd runs in this process, which has done the work above.
    assert!(value(&text, "memfold_cpu_seconds_total{process=\"memfoldd\"}") > 0.0);
    assert!(
        value(
            &text,
            &format!("memfold_agent_cpu_seconds_total{{vm=\"db-m\",pid=\"{pid}\"}}")
        ) >= 0.0
    );
    assert!(
        value(
            &text,
            "memfold_operation_latency_seconds_bucket{le=\"+Inf\",op=\"share\"}"
        ) > 0.0
    );

    match promtool() {
        Some(p) => {
            let mut child = Command::new(&p)
                .args(["check", "metrics"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
            let o = child.wait_with_output().unwrap();
            assert!(
                o.status.success(),
                "promtool check metrics failed:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            eprintln!("promtool check metrics ({}): ok", p.display());
        }
        None => memfold_sys::testing::skipped(
            "the_endpoint_serves_every_guest_passes_promtool_and_feeds_the_dashboard",
            "promtool not found (scripts/setup.sh puts it in ~/.cache/memfold/promtool): \
             promtool check metrics not run",
        ),
    }

    // Every metric the dashboard queries is in the scrape.
    let samples: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    for name in dashboard_metrics() {
        assert!(
            samples.contains(name.as_str()),
            "the dashboard queries {name}, which the exposition does not have: {samples:?}"
        );
    }

    // What Prometheus gets: OpenMetrics.
    let (status, headers, om) = get(
        addr,
        "/metrics",
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    );
    assert!(status.contains(" 200 "), "{status}");
    assert!(
        headers.contains("content-type: application/openmetrics-text"),
        "{headers}"
    );
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("# TYPE memfold_cow_breaks counter\n"));

    let (status, _, _) = get(addr, "/other", "*/*");
    assert!(status.contains(" 404 "), "{status}");
    m.stop();
}
