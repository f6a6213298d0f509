//! The bench report people look at: SVG charts drawn with `plotters` (throughput over
//! time of each tool in a phase, ratio bars against the targets, peak memory) and one
//! HTML page that shows them with the table. Shared by every bench.

use anyhow::{Context, Result};
use plotters::prelude::*;
use std::{fmt::Write as _, fs, path::Path};

/// One tool's line on a throughput chart.
pub struct Series {
    pub label: String,
    /// (seconds since the tool started, MB/s).
    pub points: Vec<(f64, f64)>,
}

/// One bar: a measured figure and the target it is judged by.
pub struct Bar {
    pub label: String,
    pub value: f64,
    /// The limit; bars are green when `pass`, red otherwise.
    pub target: Option<f64>,
    pub pass: bool,
}

/// A chart on the page: its file in the report directory and a caption.
pub struct Figure {
    pub file: String,
    pub caption: String,
}

const WIDTH: u32 = 900;
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];
const PASS: RGBColor = RGBColor(60, 160, 90);
const MISS: RGBColor = RGBColor(214, 69, 65);

/// MB/s between successive samples of cumulative bytes (`(seconds, bytes)`), plotted at
/// the end of each interval.
pub fn rates(samples: &[(f64, u64)]) -> Vec<(f64, f64)> {
    let mut out = vec![(0.0, 0.0)];
    for w in samples.windows(2) {
        let ((t0, b0), (t1, b1)) = (w[0], w[1]);
        if t1 > t0 {
            out.push((t1, b1.saturating_sub(b0) as f64 / 1e6 / (t1 - t0)));
        }
    }
    out
}

/// A line chart of each series' MB/s over time, written as SVG to `path`.
pub fn throughput_chart(
    path: &Path,
    title: &str,
    series: &[Series],
    floor_seconds: Option<f64>,
) -> Result<()> {
    let t_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .chain(floor_seconds)
        .fold(1.0_f64, f64::max);
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0_f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (WIDTH, 360)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_max * 1.02, 0.0..y_max)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .x_desc("seconds since start")
        .y_desc("MB/s read + written")
        .draw()
        .map_err(draw_err)?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(draw_err)?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    if let Some(floor) = floor_seconds {
        // The floor: the least time the job's bytes take on this disk, or its CPU work on
        // this machine, measured in the same run; a line ending far right of it is time
        // the job spent on its own.
        let dashed = BLACK.stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(
                [(floor, 0.0), (floor, y_max)],
                6,
                4,
                dashed,
            ))
            .map_err(draw_err)?
            .label(format!("floor ({floor:.1} s)"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], dashed));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(draw_err)?;
    root.present().map_err(draw_err)?;
    Ok(())
}

/// Horizontal bars, one per figure, each with its target as a black tick, written as SVG.
pub fn bar_chart(path: &Path, title: &str, x_desc: &str, bars: &[Bar]) -> Result<()> {
    let x_max = bars
        .iter()
        .flat_map(|b| [b.value, b.target.unwrap_or(0.0)])
        .fold(0.1_f64, f64::max)
        * 1.15;
    let n = bars.len().max(1);
    let height = 80 + 34 * n as u32;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let label_width = bars
        .iter()
        .map(|b| b.label.chars().count())
        .max()
        .unwrap_or(10) as u32
        * 7
        + 10;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(label_width.min(WIDTH / 2))
        .build_cartesian_2d(0.0..x_max, 0.0..n as f64)
        .map_err(draw_err)?;
    let labels: Vec<String> = bars.iter().map(|b| b.label.clone()).collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n * 2 + 1)
        .y_label_formatter(&|y| {
            // Labels at the middle of each bar only.
            let i = (n as f64 - y - 0.5).round();
            if (n as f64 - y - 0.5 - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .x_desc(x_desc)
        .draw()
        .map_err(draw_err)?;
    for (i, b) in bars.iter().enumerate() {
        let top = n as f64 - i as f64 - 0.15;
        let bottom = n as f64 - i as f64 - 0.85;
        let color = if b.pass { PASS } else { MISS };
        chart
            .draw_series([Rectangle::new(
                [(0.0, bottom), (b.value, top)],
                color.filled(),
            )])
            .map_err(draw_err)?;
        chart
            .draw_series([Text::new(
                format!("{:.2}", b.value),
                (b.value + x_max * 0.01, (top + bottom) / 2.0 + 0.1),
                ("sans-serif", 13),
            )])
            .map_err(draw_err)?;
        if let Some(t) = b.target {
            chart
                .draw_series([PathElement::new(
                    [(t, bottom - 0.08), (t, top + 0.08)],
                    BLACK.stroke_width(3),
                )])
                .map_err(draw_err)?;
        }
    }
    root.present().map_err(draw_err)?;
    Ok(())
}

fn draw_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("cannot draw a chart: {e:?}")
}

/// Writes `DIR/index.html`: the title, a table (preformatted text) and the figures.
pub fn write_page(dir: &Path, title: &str, table: &str, figures: &[Figure]) -> Result<()> {
    let mut html = String::new();
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    write!(
        html,
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title>\
         <style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}\
         pre{{background:#f6f6f6;padding:1em;overflow-x:auto}}\
         figure{{margin:2em 0}}</style></head><body>\n<h1>{t}</h1>\n<pre>{table}</pre>\n",
        t = esc(title),
        table = esc(table)
    )?;
    for f in figures {
        writeln!(
            html,
            "<figure><img src=\"{}\" alt=\"{c}\"><figcaption>{c}</figcaption></figure>",
            esc(&f.file),
            c = esc(&f.caption)
        )?;
    }
    html.push_str("</body></html>\n");
    let page = dir.join("index.html");
    fs::write(&page, html).with_context(|| format!("cannot write {}", page.display()))
}

/// A file name from a phase name: `agent full` -> `agent-full`.
pub fn slug(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_mb_per_second_between_samples() {
        let r = rates(&[
            (0.0, 0),
            (0.5, 50_000_000),
            (1.5, 150_000_000),
            (2.0, 150_000_000),
        ]);
        assert_eq!(r, vec![(0.0, 0.0), (0.5, 100.0), (1.5, 100.0), (2.0, 0.0)]);
    }

    #[test]
    fn charts_and_page_are_written_with_their_labels() {
        let dir = std::env::temp_dir().join(format!("mover-charts-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let series = [Series {
            label: "tool-a".into(),
            points: vec![(0.0, 0.0), (1.0, 250.0), (2.0, 10.0)],
        }];
        throughput_chart(&dir.join("t.svg"), "phase one", &series, Some(2.0)).unwrap();
        let bars = [Bar {
            label: "speed-up of x".into(),
            value: 1.7,
            target: Some(2.0),
            pass: false,
        }];
        bar_chart(&dir.join("b.svg"), "ratios", "x", &bars).unwrap();
        let figures = [Figure {
            file: "t.svg".into(),
            caption: "a <caption>".into(),
        }];
        write_page(&dir, "title & more", "a | table", &figures).unwrap();
        let t = fs::read_to_string(dir.join("t.svg")).unwrap();
        assert!(t.starts_with("<svg") && t.contains("phase one") && t.contains("tool-a"));
        assert!(t.contains("<polyline"), "no line drawn");
        let b = fs::read_to_string(dir.join("b.svg")).unwrap();
        assert!(b.contains("speed-up of x") && b.contains("1.70"));
        assert!(b.contains("<rect"), "no bar drawn");
        let page = fs::read_to_string(dir.join("index.html")).unwrap();
        assert!(page.contains("<img src=\"t.svg\""));
        assert!(page.contains("title &amp; more") && page.contains("a &lt;caption&gt;"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn slugs_are_file_names() {
        assert_eq!(slug("agent full"), "agent-full");
        assert_eq!(slug("hash N=2"), "hash-n-2");
    }
}
