//! Text helpers: where in a text a byte offset falls (every config and script error names a
//! line and a column, and the parsers report byte offsets), and label values as the Prometheus
//! text exposition escapes them.
//!
//! ```
//! use stormguard_core::text::line_col;
//! assert_eq!(line_col("a = 1\nb = x\n", 10), (2, 5));
//! ```

/// The 1-based line and column (in characters) of byte `offset` in `text`. An offset inside a
/// multi-byte character counts as that character's start; one past the end as the end.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// A Prometheus / OpenMetrics label value as the text exposition writes it: `\`, `"` and
/// newline escaped (`\\`, `\"`, `\n`), everything else as it is. A value that needs no
/// escape is returned as it is, without a copy.
///
/// ```
/// use stormguard_core::text::label_value;
/// assert_eq!(label_value("web-1"), "web-1");
/// assert_eq!(label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
/// ```
pub fn label_value(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(all(test, not(stormguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn counts_characters() {
        let t = "ab\nµx = 1\n";
        assert_eq!(line_col(t, 0), (1, 1));
        assert_eq!(line_col(t, 3), (2, 1));
        assert_eq!(line_col(t, 5), (2, 2)); // after the two-byte µ
        assert_eq!(line_col(t, 4), (2, 1)); // inside µ: rounds down to its start
        assert_eq!(line_col(t, 999), (3, 1));
    }
}
