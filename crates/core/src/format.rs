//! Numbers and percents for people: one shape for every report, table and message, so the
//! proxy's dashboard, `plan`, `simulate`, `demo` and `audit` print the same quantity the same
//! way.
//!
//! A percent is written as the project's docs write it, with a space before the sign (`20 %`).
//! Two rules, chosen by the caller:
//!
//! - **fixed** ([`percent`]): always `decimals` digits, for columns of measured values that
//!   should line up (`19.2 %`, `20.0 %`);
//! - **trimmed** ([`percent_trimmed`], [`number`]): at most `decimals` digits and no trailing
//!   zeros, for values in a sentence (`25 %`, `33.33 %`, `7.2`).
//!
//! Rounding is Rust's `{:.N}` (to nearest); a value that rounds to zero never prints a minus
//! sign. Non-finite values print as Rust prints them (`NaN`, `inf`); callers that can meet them
//! say what they mean first (audit prints an infinite factor as `unbounded`).
//!
//! ```
//! use stormguard_core::format::{number, percent, percent_trimmed};
//!
//! assert_eq!(percent(0.2, 1), "20.0 %");
//! assert_eq!(percent_trimmed(0.25, 2), "25 %");
//! assert_eq!(percent_trimmed(1.0 / 3.0, 2), "33.33 %");
//! assert_eq!(number(1.0 + 1.0 / 1.5, 3), "1.667");
//! ```

/// A fraction as a percent with exactly `decimals` digits after the point: `percent(0.192, 1)`
/// is `19.2 %`, `percent(0.2, 2)` is `20.00 %`.
///
/// ```
/// use stormguard_core::format::percent;
/// assert_eq!(percent(0.95099, 2), "95.10 %");
/// assert_eq!(percent(1.0, 0), "100 %");
/// assert_eq!(percent(-0.00001, 1), "0.0 %");
/// ```
pub fn percent(fraction: f64, decimals: usize) -> String {
    format!("{} %", fixed(fraction * 100.0, decimals))
}

/// A fraction as a percent with at most `decimals` digits after the point and no trailing
/// zeros: `percent_trimmed(0.2, 2)` is `20 %`, `percent_trimmed(0.951, 2)` is `95.1 %`.
///
/// ```
/// use stormguard_core::format::percent_trimmed;
/// assert_eq!(percent_trimmed(0.2, 2), "20 %");
/// assert_eq!(percent_trimmed(0.95099, 2), "95.1 %");
/// assert_eq!(percent_trimmed(3.0, 2), "300 %");
/// ```
pub fn percent_trimmed(fraction: f64, decimals: usize) -> String {
    format!("{} %", number(fraction * 100.0, decimals))
}

/// A number with at most `decimals` digits after the point and no trailing zeros (`7.2`, `18`,
/// `1.667`); `-0` is `0`.
///
/// ```
/// use stormguard_core::format::number;
/// assert_eq!(number(18.0, 2), "18");
/// assert_eq!(number(7.2000001, 3), "7.2");
/// assert_eq!(number(-0.0001, 3), "0");
/// assert_eq!(number(2.4, 0), "2");
/// ```
pub fn number(x: f64, decimals: usize) -> String {
    let s = fixed(x, decimals);
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

/// `{x:.decimals}`, without the minus sign of a value that rounds to zero.
fn fixed(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    match s.strip_prefix('-') {
        Some(digits) if digits.bytes().all(|b| b == b'0' || b == b'.') => digits.to_string(),
        _ => s,
    }
}

/// How a column of a [`table`] is aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Padded on the right.
    Left,
    /// Padded on the left (numbers).
    Right,
}

/// Rows laid out as text columns: each padded to its widest cell (counted in characters),
/// two spaces between columns, and each line's trailing spaces trimmed. `align(c)` says how
/// column `c` is aligned. Returns the lines, without newlines, for the caller to indent.
///
/// ```
/// use stormguard_core::format::{Align, table};
/// let rows = vec![
///     vec!["policy".to_string(), "p99".to_string()],
///     vec!["naive".to_string(), "1250".to_string()],
///     vec!["stormguard".to_string(), "90".to_string()],
/// ];
/// let lines = table(&rows, |c| if c == 0 { Align::Left } else { Align::Right });
/// assert_eq!(lines, ["policy       p99", "naive       1250", "stormguard    90"]);
/// ```
pub fn table(rows: &[Vec<String>], align: impl Fn(usize) -> Align) -> Vec<String> {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|row| {
            let mut line = String::new();
            for (c, cell) in row.iter().enumerate() {
                if c > 0 {
                    line.push_str("  ");
                }
                let pad = " ".repeat(widths[c] - cell.chars().count());
                match align(c) {
                    Align::Left => {
                        line.push_str(cell);
                        line.push_str(&pad);
                    }
                    Align::Right => {
                        line.push_str(&pad);
                        line.push_str(cell);
                    }
                }
            }
            line.trim_end().to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_keeps_its_digits() {
        assert_eq!(percent(0.2, 1), "20.0 %");
        assert_eq!(percent(0.0, 2), "0.00 %");
        assert_eq!(percent(0.12346, 2), "12.35 %");
        assert_eq!(percent(-0.5, 1), "-50.0 %");
    }

    #[test]
    fn trimmed_drops_zeros_but_not_integer_digits() {
        assert_eq!(percent_trimmed(1.0, 2), "100 %");
        assert_eq!(percent_trimmed(10.0, 0), "1000 %");
        assert_eq!(number(100.0, 0), "100");
        assert_eq!(number(0.0, 3), "0");
        assert_eq!(number(-1.26, 1), "-1.3");
    }

    #[test]
    fn non_finite_as_rust_prints_them() {
        assert_eq!(number(f64::INFINITY, 3), "inf");
        assert_eq!(percent(f64::NAN, 1), "NaN %");
    }
}
