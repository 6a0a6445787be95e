//! The classic Prometheus text format (0.0.4), for clients that do not accept OpenMetrics
//! (`curl`, `promtool check metrics`): the same samples as [`Stats::exposition`]
//! writes, with the classic format's names for counters.

#[cfg(doc)]
use crate::stats::Stats;

/// The HTTP `Content-Type` of [`prometheus_text`] (the classic text format, for clients
/// that do not accept OpenMetrics: `curl`, `promtool check metrics`).
pub const CONTENT_TYPE_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// An OpenMetrics exposition (as [`Stats::exposition`] writes it) in the classic
/// Prometheus text format 0.0.4: the `# HELP` and `# TYPE` lines of a counter name its
/// samples (`_total`), `# UNIT` and `# EOF` go, an empty label set `{}` is left out.
/// Samples and values are the same.
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                if counters.contains(name) {
                    out.push_str(&format!("{p}{name}_total {tail}"));
                } else {
                    out.push_str(line);
                }
            }
            None => {
                // `{}` only right after the name: a label value may hold `{} ` too.
                let name = &line[..line.find(['{', ' ']).unwrap_or(line.len())];
                match line[name.len()..].strip_prefix("{} ") {
                    Some(value) => out.push_str(&format!("{name} {value}")),
                    None => out.push_str(line),
                }
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::tests::sample;

    #[test]
    fn the_classic_text_names_counters_by_their_samples() {
        let om = sample().exposition();
        let text = prometheus_text(&om);
        assert!(
            text.contains("# HELP memfold_cow_breaks_total Copy-on-write"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE memfold_cow_breaks_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("memfold_cow_breaks_total{vm=\"web\",pid=\"4242\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE memfold_host_memory_bytes gauge\n"),
            "{text}"
        );
        assert!(
            text.contains("memfold_host_budget_bytes 4096000.0\n"),
            "{text}"
        );
        assert!(
            !text.contains("# UNIT") && !text.contains("# EOF"),
            "{text}"
        );
        // Same samples, same values.
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| l.replace("{} ", " "))
                .collect()
        };
        assert_eq!(samples(&om), samples(&text));
    }

    /// A guest named `a{} b` (check_name lets it) keeps its name in the classic text,
    /// distinct from a guest named `a b`. Fails with `{} ` stripped anywhere in a line
    /// (both were written `vm="a b"`).
    #[test]
    fn an_empty_label_set_is_left_out_only_after_the_name() {
        let mut s = sample();
        s.vms[0].name = "a{} b".into();
        s.vms[1].name = "a b".into();
        s.vms[1].pid = s.vms[0].pid;
        let text = prometheus_text(&s.exposition());
        let pid = s.vms[0].pid;
        let line = |name: &str| format!("memfold_cow_breaks_total{{vm=\"{name}\",pid=\"{pid}\"}}");
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("memfold_cow_breaks_total{"))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].starts_with(&line("a{} b")), "{lines:?}");
        assert!(lines[1].starts_with(&line("a b")), "{lines:?}");
        // Unlabelled samples still lose their `{}`.
        assert!(
            text.contains("\nmemfold_host_budget_bytes 4096000.0\n"),
            "{text}"
        );
    }
}
