//! SVG charts of a suite's runs: latency distribution, throughput over time, and CDC against
//! polling side by side.

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

use crate::BenchMode;
use crate::report::{Report, pairs};

const SIZE: (u32, u32) = (960, 540);

/// One number of a run, for a bar.
type Measure = fn(&Report) -> f64;

/// Latency CDF of every run that measured latency (backlog drains do not).
pub(super) fn latency(runs: &[Report], path: &Path) -> anyhow::Result<()> {
    let runs: Vec<&Report> = runs.iter().filter(|r| r.latency_quantiles_ms.len() > 1).collect();
    let max_ms = runs.iter().map(|r| r.latency_p99_ms).fold(1.0, f64::max) * 1.2;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("End-to-end latency (commit returned → record consumed)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..max_ms, 0f64..100f64)
        .map_err(chart_error)?;
    chart.configure_mesh().x_desc("latency, ms").y_desc("% of records at or below").draw().map_err(chart_error)?;
    for (i, r) in runs.iter().enumerate() {
        let q = &r.latency_quantiles_ms;
        let points = q.iter().enumerate().map(|(k, ms)| (ms.min(max_ms), k as f64 * 100.0 / (q.len() - 1) as f64));
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(chart_error)?
            .label(r.scenario.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    legend(&mut chart)?;
    root.present().map_err(chart_error)
}

/// Records consumed per second over each run.
pub(super) fn throughput(runs: &[Report], path: &Path) -> anyhow::Result<()> {
    let seconds = runs.iter().map(|r| r.throughput_per_second.len()).max().unwrap_or(1).max(1) as f64;
    let peak = runs.iter().flat_map(|r| r.throughput_per_second.iter().copied()).max().unwrap_or(1).max(1) as f64;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Records consumed per second", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..seconds, 0f64..peak * 1.1)
        .map_err(chart_error)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the checker started")
        .y_desc("records/s")
        .draw()
        .map_err(chart_error)?;
    for (i, r) in runs.iter().enumerate() {
        let points = r.throughput_per_second.iter().enumerate().map(|(s, n)| (s as f64, *n as f64));
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(chart_error)?
            .label(r.scenario.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    legend(&mut chart)?;
    root.present().map_err(chart_error)
}

/// CDC and polling bars per load: sustained rate, p99 latency, database CPU per 1,000.
pub(super) fn comparison(runs: &[Report], path: &Path) -> anyhow::Result<()> {
    let pairs = pairs(runs);
    let root = SVGBackend::new(path, (SIZE.0, SIZE.1 * 3 / 2)).into_drawing_area();
    root.fill(&WHITE).map_err(chart_error)?;
    let panels = root.split_evenly((3, 1));
    let metrics: [(&str, Measure); 3] = [
        ("sustained msgs/s", |r| r.throughput_msgs_per_s),
        ("p99 latency, ms", |r| r.latency_p99_ms),
        ("database CPU s per 1,000 msgs", |r| r.db_cpu_s_per_1k.unwrap_or(0.0)),
    ];
    for (panel, (title, value)) in panels.iter().zip(metrics) {
        let top = pairs.iter().flat_map(|(_, c, p)| [value(c), value(p)]).fold(0.0, f64::max).max(1e-9) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("CDC (blue) vs polling (red): {title}"), ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..pairs.len().max(1) as f64, 0f64..top)
            .map_err(chart_error)?;
        let labels: Vec<String> = pairs.iter().map(|(load, _, _)| load.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(pairs.len().max(1) * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - i as f64 - 0.5).abs() < 0.26 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(chart_error)?;
        for (i, (_, cdc, polling)) in pairs.iter().enumerate() {
            let x = i as f64;
            for (offset, report, color) in [(0.1, cdc, BLUE), (0.5, polling, RED)] {
                let bar = Rectangle::new([(x + offset, 0.0), (x + offset + 0.38, value(report))], color.filled());
                chart.draw_series(std::iter::once(bar)).map_err(chart_error)?;
            }
        }
    }
    root.present().map_err(chart_error)
}

type Plane = Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>;

fn legend<'a, DB: DrawingBackend + 'a>(chart: &mut ChartContext<'a, DB, Plane>) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("drawing the legend: {e}"))
}

fn chart_error<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e}")
}

/// Whether a run belongs to the CDC side of a comparison.
pub(super) fn is_cdc(r: &Report) -> bool {
    r.mode == BenchMode::Cdc
}
