//! `memfold top`: a full-screen view of a running memfoldd (ratatui on crossterm), one
//! row per guest and the total, refreshed every `--interval` seconds; `q`, Esc or Ctrl-C
//! quits. The terminal is put back (raw mode off, the main screen back) on every way out:
//! quitting, an error (a guard's drop) and a panic (ratatui's panic hook).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row as TableRow, Table};
use ratatui::Frame;

use super::{cells, cpu_line, sample, saved_line, view, OpsError, View, COLUMNS, DEFAULT_SOCKET};

/// `memfold top`'s flags.
#[derive(clap::Args, Debug)]
pub struct TopArgs {
    /// memfoldd's socket.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Seconds between refreshes (and between the samples the rates come from).
    #[arg(long, default_value_t = 1.0, value_parser = positive)]
    pub interval: f64,
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x >= 0.1 && x.is_finite() => Ok(x),
        _ => Err(format!("{s:?}: seconds, at least 0.1")),
    }
}

/// Puts the terminal back when dropped.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// Runs the view until the operator quits.
///
/// Errors: no memfoldd at the socket when it starts (later losses are shown on screen
/// and retried); the terminal cannot be set up or drawn.
pub fn run(a: &TopArgs) -> Result<(), OpsError> {
    // Before the screen is taken: a missing memfoldd is a plain error on the terminal.
    let mut now = sample(&a.socket)?;
    let mut prev = None;
    let every = Duration::from_secs_f64(a.interval);
    let mut terminal = ratatui::try_init()?;
    let _restore = Restore;
    let mut lost: Option<String> = None;
    let mut next = Instant::now() + every;
    loop {
        if Instant::now() >= next {
            match sample(&a.socket) {
                // The same answer again (a tenant's statistics are reused for a second):
                // kept as it is, so the rates still span two samples.
                Ok(s) if s.uptime_s == now.uptime_s => lost = None,
                Ok(s) => {
                    prev = Some(std::mem::replace(&mut now, s));
                    lost = None;
                }
                Err(e) => lost = Some(e.to_string()),
            }
            next = Instant::now() + every;
        }
        let v = view(prev.as_ref(), &now);
        terminal.draw(|f| draw(f, &v, &a.socket, a.interval, lost.as_deref()))?;
        if event::poll(next.saturating_duration_since(Instant::now()))? {
            if let Event::Key(k) = event::read()? {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                let quit = matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c;
                if k.kind == KeyEventKind::Press && quit {
                    return Ok(());
                }
            }
        }
    }
}

/// One frame: a header, the table (every guest, the total), savings and latencies.
fn draw(f: &mut Frame, v: &View, socket: &Path, interval: f64, lost: Option<&str>) {
    let [head, body, foot] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(3),
        Constraint::Length(3),
    ])
    .areas(f.area());
    let mut header = vec![Line::from(format!(
        "memfold top  memfoldd at {}  up {:.0} s  policy {}  {} guests  every {interval} s  (q quits)",
        socket.display(),
        v.uptime_s,
        v.policy,
        v.vms.len()
    ))];
    header.push(match lost {
        Some(e) => Line::styled(
            format!("{e} (showing the last sample; retrying)"),
            Style::default().fg(Color::Red),
        ),
        None => Line::from(match v.interval_s {
            Some(d) => format!("rates over the last {d:.1} s  {}", cpu_line(v)),
            None => "rates from the next sample on".into(),
        }),
    });
    f.render_widget(Paragraph::new(header), head);

    let bold = Style::default().add_modifier(Modifier::BOLD);
    let name_width = v
        .vms
        .iter()
        .map(|r| r.name.chars().count())
        .chain([COLUMNS[0].len(), "total".len()])
        .max()
        .unwrap_or(5) as u16;
    let widths = [
        Constraint::Length(name_width),
        Constraint::Length(9),
        Constraint::Length(9),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(12),
        Constraint::Length(11),
        Constraint::Length(7),
        Constraint::Length(9),
        Constraint::Length(10),
    ];
    // Names and the state left, numbers right, as in `memfold status`.
    let row = |cells: [String; 13]| {
        TableRow::new(cells.into_iter().enumerate().map(|(i, c)| {
            if i == 0 || i == COLUMNS.len() - 1 {
                Cell::from(Line::from(c))
            } else {
                Cell::from(Line::from(c).right_aligned())
            }
        }))
    };
    let rows = v
        .vms
        .iter()
        .map(|r| row(cells(r)))
        .chain(std::iter::once(row(cells(&v.total)).style(bold)));
    let table = Table::new(rows, widths)
        .column_spacing(2)
        .header(row(COLUMNS.map(String::from)).style(bold.fg(Color::Cyan)))
        .block(Block::default().borders(Borders::TOP | Borders::BOTTOM));
    f.render_widget(table, body);

    let lat: Vec<String> = v
        .latency
        .iter()
        .filter(|l| l.count > 0)
        .map(|l| format!("{} {:.0}/{:.0}", l.op, l.p50_us, l.p99_us))
        .collect();
    let footer = vec![
        Line::from(saved_line(&v.saved)),
        Line::from(format!(
            "latency p50/p99 µs: {}",
            if lat.is_empty() {
                "none yet".into()
            } else {
                lat.join(", ")
            }
        )),
    ];
    f.render_widget(Paragraph::new(footer), foot);
}
