//! memfoldd's logs: `tracing` events on stderr, in a form for where stderr goes.
//!
//! Under systemd (`JOURNAL_STREAM` names stderr's file) or to any other non-terminal
//! (a pipe, a file, a supervisor), each event is one line with the sd-daemon priority
//! prefix (`<3>` error, `<4>` warning, `<6>` info, `<7>` debug and trace) and neither
//! colours nor a timestamp: journald reads the prefix as the entry's priority (its
//! default `SyslogLevelPrefix=yes`) and stamps the entry itself, so `journalctl -p
//! warning -u memfoldd` works. On a terminal: the usual coloured, timestamped lines.
//!
//! (Why not the `tracing-journald` crate: it writes to journald's own socket, which is
//! missing wherever journald does not run — a chroot, a container, a test — while the
//! prefix on stderr is understood by systemd and harmless elsewhere.)
//!
//! The level: the `log` setting (memfoldd's `--log` or the config file's `log` key) if
//! given, else `RUST_LOG`, else `info`; any `tracing-subscriber` `EnvFilter` directive
//! (`debug`, `info,memfold_live=debug`).

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// One line per event with the sd-daemon priority prefix, no colour, no timestamp.
    Journal,
    /// Timestamped, coloured lines for a person at a terminal.
    Terminal,
}

impl Style {
    /// The style for stderr as it is now: [`Style::Journal`] under systemd (the
    /// `JOURNAL_STREAM` variable names stderr's device and inode, as systemd sets it) or
    /// when stderr is not a terminal.
    pub fn detect() -> Style {
        let journal = std::env::var("JOURNAL_STREAM")
            .ok()
            .zip(rustix::fs::fstat(std::io::stderr()).ok())
            .is_some_and(|(v, st)| is_stream(&v, st.st_dev, st.st_ino));
        if journal || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            Style::Journal
        } else {
            Style::Terminal
        }
    }
}

/// Whether `JOURNAL_STREAM`'s value (`DEVICE:INODE`, decimal) names the file of device
/// `dev` and inode `ino`.
pub fn is_stream(value: &str, dev: u64, ino: u64) -> bool {
    value
        .split_once(':')
        .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)))
        == Some((dev, ino))
}

/// The sd-daemon priority of a level (syslog's: 3 error, 4 warning, 6 info, 7 debug).
pub fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// Formats an event as `<N>message key=value ...` (the [`Style::Journal`] line).
pub struct JournalFormat;

impl<S, N> FormatEvent<S, N> for JournalFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "<{}>", priority(event.metadata().level()))?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// The filter for `level` (a directive, if given) or else `RUST_LOG`, else `info`.
///
/// Errors: `level` is not a valid directive (the message says why).
pub fn filter(level: Option<&str>) -> Result<EnvFilter, String> {
    match level {
        Some(l) => EnvFilter::try_new(l).map_err(|e| format!("log level `{l}`: {e}")),
        None => Ok(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))),
    }
}

/// Installs the global subscriber: events at `filter`'s levels to stderr in `style`.
pub fn init(style: Style, filter: EnvFilter) {
    let b = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_target(false);
    match style {
        Style::Journal => b.with_ansi(false).event_format(JournalFormat).init(),
        Style::Terminal => b.with_ansi(true).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn journal_lines_carry_the_priority_and_nothing_journald_adds() {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_env_filter(filter(Some("info")).unwrap())
            .with_ansi(false)
            .event_format(JournalFormat)
            .finish();
        tracing::subscriber::with_default(sub, || {
            tracing::error!("socket {}: gone", "/run/x");
            tracing::warn!(vm = 3, "refused");
            tracing::info!("listening");
            tracing::debug!("filtered out at info");
        });
        let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            out, "<3>socket /run/x: gone\n<4>refused vm=3\n<6>listening\n",
            "one line each, the priority first, no timestamp or colour"
        );
    }

    #[test]
    fn journal_stream_must_name_stderrs_file() {
        assert!(is_stream("8:12345", 8, 12345));
        assert!(!is_stream("8:12345", 8, 12346));
        assert!(!is_stream("8", 8, 12345));
        assert!(!is_stream("x:1", 0, 1));
    }

    #[test]
    fn levels_map_to_syslog_priorities_and_bad_levels_are_refused() {
        assert_eq!(
            [
                Level::ERROR,
                Level::WARN,
                Level::INFO,
                Level::DEBUG,
                Level::TRACE
            ]
            .map(|l| priority(&l)),
            [3, 4, 6, 7, 7]
        );
        assert!(filter(Some("info,memfold_live=debug")).is_ok());
        let e = filter(Some("info,=[")).unwrap_err();
        assert!(e.starts_with("log level `info,=[`"), "{e}");
    }
}
