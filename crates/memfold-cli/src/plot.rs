//! PNG line charts (plotters with an embedded DejaVu font: no system fonts needed).

use std::path::Path;
use std::sync::Once;

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// One line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart of several lines, with vertical event markers.
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
    pub markers: Vec<f64>,
}

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Draws `panels` in a grid (two columns) into a PNG at `path`.
pub fn panels(
    path: &Path,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    panels: &[Panel],
) -> Result<()> {
    register_font();
    let cols = if panels.len() > 1 { 2 } else { 1 };
    let rows = panels.len().div_ceil(cols);
    let root =
        BitMapBackend::new(path, (700 * cols as u32, 420 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| anyhow!("plot: {e}"))?;
    for (area, p) in root.split_evenly((rows, cols)).iter().zip(panels) {
        let xmax = p
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|q| q.0))
            .fold(1.0, f64::max);
        let ymax = p
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|q| q.1))
            .fold(1.0, f64::max);
        let ymin = p
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|q| q.1))
            .fold(0.0, f64::min);
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..xmax, ymin..(ymax * 1.05))
            .map_err(|e| anyhow!("plot: {e}"))?;
        chart
            .configure_mesh()
            .x_desc(xlabel)
            .y_desc(ylabel)
            .draw()
            .map_err(|e| anyhow!("plot: {e}"))?;
        for &m in &p.markers {
            chart
                .draw_series(LineSeries::new(
                    [(m, ymin), (m, ymax * 1.05)],
                    ShapeStyle::from(&BLACK.mix(0.15)).stroke_width(1),
                ))
                .map_err(|e| anyhow!("plot: {e}"))?;
        }
        for (i, s) in p.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    ShapeStyle::from(&c).stroke_width(2),
                ))
                .map_err(|e| anyhow!("plot: {e}"))?
                .label(&s.name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], ShapeStyle::from(&c).stroke_width(2))
                });
        }
        legend(&mut chart)?;
    }
    present(&root, path)
}

/// Draws grouped bars: per group (x), one bar per (label, value), into a PNG at `path`.
pub fn bars(
    path: &Path,
    title: &str,
    ylabel: &str,
    groups: &[(String, Vec<(String, f64)>)],
) -> Result<()> {
    register_font();
    let per = groups.first().map_or(1, |g| g.1.len()).max(1);
    let root =
        BitMapBackend::new(path, (260 * groups.len().max(1) as u32 + 200, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    let ymax = groups
        .iter()
        .flat_map(|g| g.1.iter().map(|v| v.1))
        .fold(1.0, f64::max)
        * 1.1;
    let n = groups.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..ymax)
        .map_err(|e| anyhow!("plot: {e}"))?;
    let names: Vec<String> = groups.iter().map(|g| g.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        // Ticks every quarter; only each group's centre gets its name.
        .x_labels(4 * n + 1)
        .x_label_formatter(&|x| {
            if (x - x.floor() - 0.5).abs() < 1e-6 {
                names.get(x.floor() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(ylabel)
        .draw()
        .map_err(|e| anyhow!("plot: {e}"))?;
    let width = 0.8 / per as f64;
    for k in 0..per {
        let c = COLORS[k % COLORS.len()];
        let label = groups.first().map(|g| g.1[k].0.clone()).unwrap_or_default();
        chart
            .draw_series(groups.iter().enumerate().map(|(i, g)| {
                let x0 = i as f64 + 0.1 + k as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, g.1[k].1)], c.filled())
            }))
            .map_err(|e| anyhow!("plot: {e}"))?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    legend(&mut chart)?;
    present(&root, path)
}

/// One point of a scatter chart: its group (one colour and one legend entry per group),
/// its own label (drawn beside it), x with a horizontal error bar, y.
pub struct Mark {
    pub group: String,
    pub label: String,
    pub x: f64,
    pub x_err: f64,
    pub y: f64,
}

/// Draws `marks` as labelled points with horizontal error bars into a PNG at `path`; the
/// y axis starts at 0.
pub fn scatter(path: &Path, title: &str, xlabel: &str, ylabel: &str, marks: &[Mark]) -> Result<()> {
    register_font();
    let root = BitMapBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    let xmin = marks.iter().map(|m| m.x - m.x_err).fold(0.0, f64::min);
    let xmax = marks.iter().map(|m| m.x + m.x_err).fold(1.0, f64::max);
    let ymax = marks.iter().map(|m| m.y).fold(1.0, f64::max);
    let pad = (xmax - xmin) * 0.08;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin - pad)..(xmax + pad * 3.0), 0.0..(ymax * 1.15))
        .map_err(|e| anyhow!("plot: {e}"))?;
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .draw()
        .map_err(|e| anyhow!("plot: {e}"))?;
    let mut groups: Vec<&str> = marks.iter().map(|m| m.group.as_str()).collect();
    groups.sort_unstable();
    groups.dedup();
    for (i, g) in groups.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mine: Vec<&Mark> = marks.iter().filter(|m| m.group == *g).collect();
        for m in &mine {
            chart
                .draw_series(LineSeries::new(
                    [(m.x - m.x_err, m.y), (m.x + m.x_err, m.y)],
                    ShapeStyle::from(&c).stroke_width(2),
                ))
                .map_err(|e| anyhow!("plot: {e}"))?;
            chart
                .draw_series([Text::new(
                    m.label.clone(),
                    (m.x, m.y * 1.02),
                    ("sans-serif", 12).into_font().color(&BLACK),
                )])
                .map_err(|e| anyhow!("plot: {e}"))?;
        }
        chart
            .draw_series(mine.iter().map(|m| Circle::new((m.x, m.y), 6, c.filled())))
            .map_err(|e| anyhow!("plot: {e}"))?
            .label(*g)
            .legend(move |(x, y)| Circle::new((x + 6, y), 5, c.filled()));
    }
    legend(&mut chart)?;
    present(&root, path)
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// The series legend, top right.
fn legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| anyhow!("plot: {e}"))
}

/// Writes the PNG.
fn present<S>(root: &DrawingArea<BitMapBackend, S>, path: &Path) -> Result<()>
where
    S: plotters::coord::CoordTranslate,
{
    root.present()
        .map_err(|e| anyhow!("plot {}: {e}", path.display()))
}
