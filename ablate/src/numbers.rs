//! How the report aggregates and prints numbers: means and maxima that
//! skip what is missing, values with their change against the baseline.

/// Bytes in a MiB.
pub(crate) const MIB: f64 = 1024.0 * 1024.0;

pub(crate) fn mean(v: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = v
        .into_iter()
        .filter(|x| x.is_finite())
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

pub(crate) fn max(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter()
        .filter(|x| x.is_finite())
        .fold(f64::NAN, |m, x| if m.is_nan() || x > m { x } else { m })
}

pub(crate) fn num(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "–".into()
    }
}

/// `x` and its change against `base` in percent.
pub(crate) fn with_change(x: f64, base: f64, digits: usize) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    if !base.is_finite() || base == 0.0 {
        return num(x, digits);
    }
    format!("{} ({:+.1}%)", num(x, digits), (x / base - 1.0) * 100.0)
}

/// A fraction in percent and its change in points against `base`.
pub(crate) fn with_points(x: f64, base: f64) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    if !base.is_finite() {
        return format!("{:.0}%", x * 100.0);
    }
    format!("{:.0}% ({:+.0} pt)", x * 100.0, (x - base) * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::median;

    #[test]
    fn medians_means_and_changes_skip_what_is_missing() {
        assert_eq!(median(vec![3.0, 1.0, f64::NAN, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert!(median(vec![]).is_nan());
        assert_eq!(mean([1.0, f64::NAN, 3.0]), 2.0);
        assert_eq!(max([1.0, f64::NAN, 3.0]), 3.0);
        assert_eq!(with_change(110.0, 100.0, 1), "110.0 (+10.0%)");
        assert_eq!(with_points(0.5, 0.75), "50% (-25 pt)");
        assert_eq!(with_change(f64::NAN, 1.0, 1), "–");
    }
}
