//! Where in a text a byte offset falls: every config and script error names a line and a
//! column, and the parsers report byte offsets.
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

/// The key a TOML error at byte `offset` points at, for messages that name file, line and key:
/// named in the message (unknown or missing fields), or the bare key before `=` on the error's
/// line, prefixed by the table it is in (`dependency[1].`, `phase[0].`,
/// `dependency[0].breaker.`). Empty for a syntax error with no key.
pub fn toml_key_at(text: &str, offset: usize, message: &str) -> String {
    let offset = offset.min(text.len());
    let named = ["unknown field `", "missing field `"].iter().find_map(|p| {
        message.strip_prefix(p).and_then(|rest| rest.split_once('`')).map(|(k, _)| k.to_string())
    });
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("");
    let on_line = line
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| !k.is_empty() && !k.starts_with('[') && !k.starts_with('#'))
        .map(str::to_string);
    let Some(key) = named.or(on_line) else { return String::new() };
    // The table the offset is in: the last header before the error's line.
    let mut counts: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    let mut table = String::new();
    let upto =
        if line.trim_start().starts_with('[') { line_start + line.len() } else { line_start };
    for l in text[..upto.min(text.len())].lines() {
        let t = l.trim();
        if let Some(name) =
            t.strip_prefix("[[").and_then(|r| r.split_once("]]")).map(|(n, _)| n.trim())
        {
            let n = counts.entry(name.to_string()).or_insert(0);
            table = format!("{name}[{}]", *n);
            *n += 1;
        } else if let Some(name) =
            t.strip_prefix('[').and_then(|r| r.split_once(']')).map(|(n, _)| n.trim())
        {
            // `[dependency.breaker]` belongs to the last `[[dependency]]`.
            table = match name.split_once('.') {
                Some((parent, child)) => match counts.get(parent) {
                    Some(n) => format!("{parent}[{}].{child}", n - 1),
                    None => name.to_string(),
                },
                None => name.to_string(),
            };
        }
    }
    if table.is_empty() { key } else { format!("{table}.{key}") }
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

    #[test]
    fn keys_carry_their_table() {
        let t = "seed = 1\n[[phase]]\na = 1\n[[phase]]\nb = x\n[[dep]]\n[dep.breaker]\nc = 2\n";
        let at = |needle: &str| t.find(needle).unwrap();
        assert_eq!(toml_key_at(t, at("seed"), "invalid"), "seed");
        assert_eq!(toml_key_at(t, at("b = x"), "invalid"), "phase[1].b");
        assert_eq!(toml_key_at(t, at("c = 2"), "invalid"), "dep[0].breaker.c");
        assert_eq!(toml_key_at(t, at("a = 1"), "unknown field `z`, expected"), "phase[0].z");
        assert_eq!(toml_key_at(t, at("[[phase]]"), "expected `]`"), "");
    }
}
