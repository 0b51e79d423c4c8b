//! PNG line plots for the experiment reports (plotters, embedded font).

use std::path::Path;

use anyhow::Result;
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A white PNG canvas of `size` at `path`, the embedded DejaVu font
/// registered.
fn canvas(path: &Path, size: (u32, u32)) -> Result<DrawingArea<BitMapBackend<'_>, Shift>> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow::anyhow!("embedded font rejected"))?;
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(root)
}

/// A titled chart over `x` × `y` on `root`, axes labelled and meshed.
fn axes<'a, 'b>(
    root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    x: (f64, f64),
    y: (f64, f64),
) -> Result<Chart<'a, 'b>> {
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(chart)
}

/// Draws `series` (one line with point markers each) into a PNG at
/// `path`; registers the embedded DejaVu font first.
pub fn line_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    x: (f64, f64),
    y: (f64, f64),
    series: &[(&str, Vec<(f64, f64)>)],
) -> Result<()> {
    let root = canvas(path, (800, 480))?;
    let mut chart = axes(&root, title, x_label, y_label, x, y)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

/// A labelled scatter plot into a PNG at `path`; with `front`, the Pareto
/// front (lower x and lower y both better) joined by a line. Points with a
/// non-finite coordinate are left out; points at the same place share one
/// marker and one label (their names joined).
pub fn scatter_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    points: &[(String, f64, f64)],
    front: bool,
) -> Result<()> {
    let mut pts: Vec<(String, f64, f64)> = Vec::new();
    for p in points.iter().filter(|p| p.1.is_finite() && p.2.is_finite()) {
        match pts.iter_mut().find(|q| q.1 == p.1 && q.2 == p.2) {
            Some(q) => q.0 = format!("{}, {}", q.0, p.0),
            None => pts.push(p.clone()),
        }
    }
    let span = |f: fn(&(String, f64, f64)) -> f64| {
        let lo = pts.iter().map(f).fold(f64::INFINITY, f64::min);
        let hi = pts.iter().map(f).fold(f64::NEG_INFINITY, f64::max);
        if !lo.is_finite() {
            return (0.0, 1.0);
        }
        let pad = ((hi - lo) * 0.12).max(hi.abs() * 0.02).max(1e-6);
        (lo - pad, hi + pad)
    };
    let (x, y) = (span(|p| p.1), span(|p| p.2));
    // Room on the right for the labels of the rightmost points.
    let x = (x.0, x.1 + (x.1 - x.0) * 0.25);
    let root = canvas(path, (900, 560))?;
    let mut chart = axes(&root, title, x_label, y_label, x, y)?;
    if front {
        let mut sorted: Vec<(f64, f64)> = pts.iter().map(|p| (p.1, p.2)).collect();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut line: Vec<(f64, f64)> = Vec::new();
        for p in sorted {
            if line.last().is_none_or(|l| p.1 < l.1) {
                line.push(p);
            }
        }
        chart
            .draw_series(LineSeries::new(line, BLACK.mix(0.4).stroke_width(1)))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    for (i, p) in pts.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(std::iter::once(Circle::new((p.1, p.2), 5, color.filled())))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((p.1, p.2))
                    // Alternate above and below so neighbours do not overlap.
                    + Text::new(
                        p.0.clone(),
                        (8, if i % 2 == 0 { -16 } else { 4 }),
                        ("sans-serif", 14).into_font(),
                    ),
            ))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

/// One point of a [`panels`] plot: a value with its interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// Its label.
    pub label: String,
    /// x.
    pub x: f64,
    /// y, and its interval `[lo, hi]` (drawn as a bar).
    pub y: f64,
    /// Lower end of the interval.
    pub lo: f64,
    /// Upper end of the interval.
    pub hi: f64,
    /// A reference point (another tool's): a grey square, off the front.
    pub reference: bool,
}

/// One panel of a [`panels`] plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    /// Its title.
    pub title: String,
    /// What y is.
    pub y_label: String,
    /// Whether a higher y is better (the front runs along the top).
    pub higher_better: bool,
    /// Its points; non-finite ones are left out.
    pub points: Vec<Point>,
}

/// The Pareto front of `pts` (a smaller x is better; a larger y when
/// `higher_better`, else a smaller one): the points no other point beats
/// on both, in x order.
pub fn front(pts: &[(f64, f64)], higher_better: bool) -> Vec<(f64, f64)> {
    let better = |a: f64, b: f64| if higher_better { a > b } else { a < b };
    let mut sorted: Vec<(f64, f64)> = pts
        .iter()
        .copied()
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    sorted.sort_by(|a, b| {
        a.0.total_cmp(&b.0).then(if higher_better {
            b.1.total_cmp(&a.1)
        } else {
            a.1.total_cmp(&b.1)
        })
    });
    let mut line: Vec<(f64, f64)> = Vec::new();
    for p in sorted {
        if line.last().is_none_or(|l| better(p.1, l.1)) {
            line.push(p);
        }
    }
    line
}

/// Side-by-side panels sharing an x label, each a scatter of points with
/// vertical interval bars, kvforge's points labelled and their Pareto front
/// drawn; reference points as grey squares.
pub fn panels(path: &Path, x_label: &str, panels: &[Panel]) -> Result<()> {
    let n = panels.len().max(1);
    let root = canvas(path, (560 * n as u32, 560))?;
    let areas = root.split_evenly((1, n));
    for (area, p) in areas.iter().zip(panels) {
        let pts: Vec<&Point> = p
            .points
            .iter()
            .filter(|q| q.x.is_finite() && q.y.is_finite())
            .collect();
        let fin = |v: f64, d: f64| if v.is_finite() { v } else { d };
        let (mut x0, mut x1, mut y0, mut y1) = (0.0f64, 1.0f64, f64::INFINITY, f64::NEG_INFINITY);
        for q in &pts {
            x1 = x1.max(q.x);
            x0 = x0.min(q.x);
            y0 = y0.min(fin(q.lo, q.y)).min(q.y);
            y1 = y1.max(fin(q.hi, q.y)).max(q.y);
        }
        if !y0.is_finite() {
            (y0, y1) = (0.0, 1.0);
        }
        let pad = ((y1 - y0) * 0.08).max(1e-3);
        let mut chart = axes(
            area,
            &p.title,
            x_label,
            &p.y_label,
            (x0 - 0.02, x1 + 0.08),
            (y0 - pad, y1 + pad),
        )?;
        let err = |e: DrawingAreaErrorKind<_>| anyhow::anyhow!("{e:?}");
        let ours: Vec<(f64, f64)> = pts
            .iter()
            .filter(|q| !q.reference)
            .map(|q| (q.x, q.y))
            .collect();
        chart
            .draw_series(LineSeries::new(
                front(&ours, p.higher_better),
                BLACK.mix(0.5).stroke_width(2),
            ))
            .map_err(err)?;
        for (i, q) in pts.iter().enumerate() {
            let color = if q.reference {
                RGBColor(120, 120, 120).to_rgba()
            } else {
                Palette99::pick(i).to_rgba()
            };
            if q.lo.is_finite() && q.hi.is_finite() {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(q.x, q.lo), (q.x, q.hi)],
                        color.stroke_width(1),
                    )))
                    .map_err(err)?;
            }
            if q.reference {
                chart
                    .draw_series(std::iter::once(
                        EmptyElement::at((q.x, q.y)) + Rectangle::new([(-4, -4), (4, 4)], color),
                    ))
                    .map_err(err)?;
            } else {
                chart
                    .draw_series(std::iter::once(Circle::new((q.x, q.y), 4, color.filled())))
                    .map_err(err)?;
            }
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((q.x, q.y))
                        + Text::new(
                            q.label.clone(),
                            (6, if i % 2 == 0 { -14 } else { 3 }),
                            ("sans-serif", 11).into_font().color(&color),
                        ),
                ))
                .map_err(err)?;
        }
    }
    root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::front;

    #[test]
    fn the_front_keeps_what_nothing_beats_on_both_axes() {
        let pts = [
            (0.5, 0.9),
            (0.25, 0.8),
            (0.25, 0.5),
            (1.0, 1.0),
            (0.6, 0.7),
            (0.1, f64::NAN),
        ];
        assert_eq!(front(&pts, true), vec![(0.25, 0.8), (0.5, 0.9), (1.0, 1.0)]);
        let ppl = [(0.5, 1.0), (0.25, 3.0), (1.0, 0.0), (0.3, 4.0)];
        assert_eq!(
            front(&ppl, false),
            vec![(0.25, 3.0), (0.5, 1.0), (1.0, 0.0)]
        );
    }
}
