//! The loss-curve PNG: training and validation loss against the step, drawn with plotters.
//!
//! Text needs a TrueType font, which plotters' `ab_glyph` backend takes as bytes. The first
//! readable file of [`FONT_CANDIDATES`] (or `$RTX_PLOT_FONT`, read by the binary and passed in)
//! is registered once per process; when none is found the curve is drawn without any text
//! (no caption, tick labels or legend) rather than failing.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::metrics::MetricRecord;

/// Font files tried, in order, when no font is named explicitly.
pub const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

const FAMILY: &str = "sans-serif";

/// Errors of drawing the plot.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// plotters failed to draw or encode.
    #[error("cannot draw loss curve {path}: {reason}", path = .path.display())]
    Draw {
        /// The PNG being written.
        path: PathBuf,
        /// plotters' message.
        reason: String,
    },
}

/// What [`plot_loss_curve`] drew.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlotOutcome {
    /// Whether text (caption, labels, legend) was drawn, i.e. a font was found.
    pub with_text: bool,
    /// Training points drawn.
    pub train_points: usize,
    /// Validation points drawn.
    pub val_points: usize,
}

/// Registers the first usable font (the `preferred` file, then [`FONT_CANDIDATES`]) once per
/// process; returns whether one is registered.
pub fn ensure_font(preferred: Option<&Path>) -> bool {
    static REGISTERED: OnceLock<Option<PathBuf>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let candidates = preferred.map(Path::to_path_buf).into_iter().chain(FONT_CANDIDATES.iter().map(PathBuf::from));
            for path in candidates {
                let Ok(bytes) = std::fs::read(&path) else { continue };
                // plotters keeps fonts for the life of the process; leak one file's bytes once.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).is_ok() {
                    tracing::debug!(font = %path.display(), "registered plot font");
                    return Some(path);
                }
            }
            tracing::warn!("no TrueType font found; the loss curve is drawn without text");
            None
        })
        .is_some()
}

/// Draws training loss (`loss`), validation loss (`val_loss`) and, when present, the I-JEPA probe
/// accuracies (`probe_acc`, `knn_acc`) of `records` against the step
/// into a 900×560 PNG at `path`, with an optional horizontal `baseline` (e.g. the unigram
/// entropy a language model must beat). `with_text` false draws no text at all.
pub fn plot_loss_curve(records: &[MetricRecord], path: &Path, title: &str, baseline: Option<(f64, &str)>, with_text: bool) -> Result<PlotOutcome, PlotError> {
    let train: Vec<(f64, f64)> = records.iter().filter_map(|r| Some((r.step as f64, finite(r.loss?)?))).collect();
    let val: Vec<(f64, f64)> = records.iter().filter_map(|r| Some((r.step as f64, finite(r.val_loss?)?))).collect();
    let probe: Vec<(f64, f64)> = records.iter().filter_map(|r| Some((r.step as f64, finite(r.probe_acc?)?))).collect();
    let knn: Vec<(f64, f64)> = records.iter().filter_map(|r| Some((r.step as f64, finite(r.knn_acc?)?))).collect();
    let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw { path: path.to_path_buf(), reason: e.to_string() };

    let all = train.iter().chain(&val).chain(&probe).chain(&knn);
    let x_max = all.clone().map(|p| p.0).fold(1.0, f64::max);
    let base = baseline.and_then(|(y, _)| finite(y));
    let y_max = all.clone().map(|p| p.1).chain(base).fold(f64::MIN, f64::max);
    let y_min = all.map(|p| p.1).chain(base).fold(f64::MAX, f64::min);
    let (y_min, y_max) = if y_min <= y_max { (y_min, y_max) } else { (0.0, 1.0) };
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let y_range = (y_min - pad).max(0.0)..(y_max + pad);

    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if with_text {
        builder.caption(title, (FAMILY, 24)).x_label_area_size(40).y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(0.0..x_max, y_range).map_err(|e| draw_err(&e))?;
    if with_text {
        chart.configure_mesh().x_desc("step").y_desc("loss").x_label_formatter(&|x| format!("{x:.0}")).label_style((FAMILY, 14)).draw().map_err(|e| draw_err(&e))?;
    } else {
        chart.configure_mesh().x_labels(0).y_labels(0).draw().map_err(|e| draw_err(&e))?;
    }
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(255, 127, 14);
    let series = chart.draw_series(LineSeries::new(train.iter().copied(), blue.stroke_width(2))).map_err(|e| draw_err(&e))?;
    if with_text {
        series.label("train loss").legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
    }
    // Validation loss, then the frozen-feature accuracies (I-JEPA) on the same axis: fractions in [0, 1].
    for (points, colour, label) in [(&val, orange, "validation loss"), (&probe, RGBColor(44, 160, 44), "linear probe test accuracy"), (&knn, RGBColor(214, 39, 40), "k-NN test accuracy")] {
        draw_marked_line(&mut chart, points, colour, with_text.then_some(label)).map_err(|e| draw_err(&e))?;
    }
    if let (Some(y), Some((_, label))) = (base, baseline) {
        let grey = RGBColor(120, 120, 120);
        let dashes = (0..40).map(|i| vec![(x_max * f64::from(2 * i) / 80.0, y), (x_max * f64::from(2 * i + 1) / 80.0, y)]);
        let series = chart.draw_series(dashes.map(|pts| PathElement::new(pts, grey.stroke_width(2)))).map_err(|e| draw_err(&e))?;
        if with_text {
            let label = label.to_string();
            series.label(label).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(2)));
        }
    }
    if with_text {
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).label_font((FAMILY, 14)).position(SeriesLabelPosition::UpperRight).draw().map_err(|e| draw_err(&e))?;
    }
    root.present().map_err(|e| draw_err(&e))?;
    Ok(PlotOutcome { with_text, train_points: train.len(), val_points: val.len() })
}

/// Draws test accuracy against the round into a 900×560 PNG at `path` (`rtx fed run`).
pub fn plot_accuracy_curve(points: &[(f64, f64)], path: &Path, title: &str, with_text: bool) -> Result<(), PlotError> {
    let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw { path: path.to_path_buf(), reason: e.to_string() };
    let points: Vec<(f64, f64)> = points.iter().filter_map(|&(x, y)| Some((x, finite(y)?))).collect();
    let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if with_text {
        builder.caption(title, (FAMILY, 24)).x_label_area_size(40).y_label_area_size(60);
    }
    let mut chart = builder.build_cartesian_2d(0.0..x_max, 0.0..1.0).map_err(|e| draw_err(&e))?;
    if with_text {
        chart.configure_mesh().x_desc("round").y_desc("test accuracy").x_label_formatter(&|x| format!("{x:.0}")).label_style((FAMILY, 14)).draw().map_err(|e| draw_err(&e))?;
    } else {
        chart.configure_mesh().x_labels(0).y_labels(0).draw().map_err(|e| draw_err(&e))?;
    }
    draw_marked_line(&mut chart, &points, RGBColor(31, 119, 180), None).map_err(|e| draw_err(&e))?;
    root.present().map_err(|e| draw_err(&e))?;
    Ok(())
}

type Chart<'a, 'b> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>>;

/// Draws `points` as a line with a dot at each point, with a legend entry when `label` is given;
/// nothing when there are no points.
fn draw_marked_line(chart: &mut Chart<'_, '_>, points: &[(f64, f64)], colour: RGBColor, label: Option<&str>) -> Result<(), String> {
    if points.is_empty() {
        return Ok(());
    }
    chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(|e| e.to_string())?;
    let series = chart.draw_series(LineSeries::new(points.iter().copied(), colour.stroke_width(2))).map_err(|e| e.to_string())?;
    if let Some(label) = label {
        series.label(label).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    Ok(())
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records() -> Vec<MetricRecord> {
        (1..=20)
            .map(|i| MetricRecord {
                step: i * 10,
                loss: Some(2.0 / i as f64),
                val_loss: (i % 5 == 0).then_some(2.2 / i as f64),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn draws_png_with_and_without_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain.png");
        let outcome = plot_loss_curve(&records(), &plain, "t", Some((1.5, "baseline")), false).expect("plot without text");
        assert_eq!((outcome.train_points, outcome.val_points), (20, 4));
        let bytes = std::fs::read(&plain).expect("png");
        assert_eq!(&bytes[1..4], b"PNG");

        if ensure_font(None) {
            let text = dir.path().join("text.png");
            plot_loss_curve(&records(), &text, "loss", Some((1.5, "baseline")), true).expect("plot with text");
            assert_eq!(&std::fs::read(&text).expect("png")[1..4], b"PNG");
        }
        // No points at all still gives a (blank) chart.
        plot_loss_curve(&[], &dir.path().join("empty.png"), "t", None, false).expect("empty plot");
    }
}
