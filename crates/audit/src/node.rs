//! A document tree that remembers lines.
//!
//! Findings must point at a file and a line, and neither `serde_yaml`'s successors nor
//! `serde_json` keep positions on values. So YAML goes through `saphyr-parser`'s event stream
//! (which carries a span per event) into this small tree, and JSON is first checked with
//! `serde_json` (whose errors carry line and column) and then read the same way: valid JSON is
//! YAML 1.2 once its insignificant tabs are spaces (JSON forbids raw tabs inside strings).
//!
//! Scalars keep their text; typing happens on demand (`as_u64`, `as_f64`, `as_bool`), because
//! configs write `"2"`, `2` and `2.0` for the same thing.
//!
//! **Aliases are bounded.** An alias (`*name`) is read as a copy of its anchor, so nine
//! aliases to nine aliases to ... ("billion laughs": 600 bytes that expand to gigabytes) would
//! build an enormous tree. What aliases copy is counted — one per value plus the bytes of its
//! text — and a stream whose aliases copy more than [`MAX_ALIAS_COPY`] in all, or nest values
//! deeper than [`MAX_DEPTH`], is refused as a syntax error at the alias that passed the bound.

use std::borrow::Cow;
use std::collections::HashMap;

use saphyr_parser::{Event, Parser, ScalarStyle};

/// A value and the 1-based line it starts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// 1-based line of the value's first character.
    pub line: u32,
    /// The value.
    pub value: Value,
}

/// A YAML or JSON value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar's text; `quoted` is true when it was quoted (so `"2"` is still a string to YAML,
    /// though we read it as a number where a number is expected, like most tools do).
    Scalar {
        /// The text.
        text: String,
        /// Whether the source quoted it.
        quoted: bool,
    },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping, in source order; keys are kept as text.
    Map(Vec<(String, Node)>),
}

/// Where parsing failed: a 1-based line and column and a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    /// 1-based line.
    pub line: u32,
    /// 1-based column.
    pub column: u32,
    /// The parser's reason.
    pub reason: String,
}

/// What the aliases of one YAML stream may copy in all, counting one per value plus the bytes of
/// its text: 1 000 000 (an anchored block of 50 settings reused a hundred times copies about
/// 15 000).
pub const MAX_ALIAS_COPY: u64 = 1_000_000;

/// The deepest a value may be nested, aliases expanded: 512.
pub const MAX_DEPTH: usize = 512;

static NULL: Node = Node { line: 0, value: Value::Seq(Vec::new()) };

impl Node {
    /// The value at `key` when this is a mapping.
    pub fn get(&self, key: &str) -> Option<&Node> {
        match &self.value {
            Value::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Follows a path of keys.
    pub fn at(&self, path: &[&str]) -> Option<&Node> {
        path.iter().try_fold(self, |n, k| n.get(k))
    }

    /// The text of a plain or quoted scalar (`null`/`~` read as absent).
    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar { text, quoted: false } if text == "null" || text == "~" => None,
            Value::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }

    /// A non-negative integer (`3`, `"3"`, `3.0`).
    pub fn as_u64(&self) -> Option<u64> {
        let t = self.as_str()?.trim();
        t.parse::<u64>().ok().or_else(|| {
            let f: f64 = t.parse().ok()?;
            (f >= 0.0 && f.fract() == 0.0 && f < 1e18).then_some(f as u64)
        })
    }

    /// A number.
    pub fn as_f64(&self) -> Option<f64> {
        self.as_str()?.trim().parse::<f64>().ok().filter(|f| f.is_finite())
    }

    /// A boolean (`true`/`false`, any case).
    pub fn as_bool(&self) -> Option<bool> {
        match self.as_str()?.trim().to_ascii_lowercase().as_str() {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        }
    }

    /// The items of a sequence (empty for anything else).
    pub fn items(&self) -> &[Node] {
        match &self.value {
            Value::Seq(items) => items,
            _ => &[],
        }
    }

    /// The entries of a mapping (empty for anything else).
    pub fn entries(&self) -> &[(String, Node)] {
        match &self.value {
            Value::Map(entries) => entries,
            _ => &[],
        }
    }

    /// An empty node, for `unwrap_or`.
    pub fn empty() -> &'static Node {
        &NULL
    }
}

/// Parses every document of a YAML stream.
pub fn parse_yaml(text: &str) -> Result<Vec<Node>, SyntaxError> {
    let mut builder = Builder::default();
    for event in Parser::new_from_str(text) {
        let (event, span) = event.map_err(|e| SyntaxError {
            line: e.marker().line() as u32,
            column: e.marker().col() as u32 + 1,
            reason: e.info().to_string(),
        })?;
        builder.event(event, span.start.line() as u32)?;
    }
    Ok(builder.docs)
}

/// Parses one JSON document: `serde_json` decides validity (and names the line of a mistake),
/// the YAML reader supplies the lines of a valid one.
pub fn parse_json(text: &str) -> Result<Node, SyntaxError> {
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
        return Err(SyntaxError {
            line: e.line() as u32,
            column: e.column() as u32,
            reason: strip_position(&e.to_string()),
        });
    }
    let text: Cow<'_, str> =
        if text.contains('\t') { Cow::Owned(text.replace('\t', " ")) } else { Cow::Borrowed(text) };
    let mut docs = parse_yaml(&text)?;
    Ok(if docs.is_empty() {
        Node { line: 1, value: Value::Map(Vec::new()) }
    } else {
        docs.swap_remove(0)
    })
}

fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// What a value weighs for the alias bound (one, plus its text's bytes, plus its children's
/// weights) and how deep it nests (1 for a scalar).
#[derive(Debug, Clone, Copy, Default)]
struct Size {
    weight: u64,
    depth: usize,
}

impl Size {
    fn add_child(&mut self, child: Size) {
        self.weight = self.weight.saturating_add(child.weight);
        self.depth = self.depth.max(child.depth + 1);
    }
}

enum Frame {
    Seq { line: u32, anchor: usize, items: Vec<Node>, size: Size },
    Map { line: u32, anchor: usize, entries: Vec<(String, Node)>, key: Option<String>, size: Size },
}

#[derive(Default)]
struct Builder {
    stack: Vec<Frame>,
    anchors: HashMap<usize, (Node, Size)>,
    docs: Vec<Node>,
    /// What aliases have copied so far.
    copied: u64,
}

impl Builder {
    fn event(&mut self, event: Event<'_>, line: u32) -> Result<(), SyntaxError> {
        let container = Size { weight: 1, depth: 1 };
        match event {
            Event::Scalar(text, style, anchor, _tag) => {
                let size = Size { weight: 1 + text.len() as u64, depth: 1 };
                let node = Node {
                    line,
                    value: Value::Scalar {
                        text: text.into_owned(),
                        quoted: !matches!(style, ScalarStyle::Plain),
                    },
                };
                self.finish(node, size, anchor);
            }
            Event::Alias(id) => {
                let refuse = |reason: String| SyntaxError { line, column: 1, reason };
                // An alias to an unknown anchor is refused by the parser; be safe anyway.
                let (node, size) = self
                    .anchors
                    .get(&id)
                    .ok_or_else(|| refuse("alias to an unknown anchor".into()))?;
                self.copied = self.copied.saturating_add(size.weight);
                if self.copied > MAX_ALIAS_COPY {
                    return Err(refuse(format!(
                        "YAML aliases expand to more than {MAX_ALIAS_COPY} values and text bytes \
                         (an alias bomb?): refused"
                    )));
                }
                if self.stack.len() + size.depth > MAX_DEPTH {
                    return Err(refuse(format!(
                        "values nest deeper than {MAX_DEPTH} levels once aliases are expanded: refused"
                    )));
                }
                let (node, size) = (node.clone(), *size);
                self.finish(node, size, 0);
            }
            Event::SequenceStart(anchor, _) => {
                self.stack.push(Frame::Seq { line, anchor, items: Vec::new(), size: container });
            }
            Event::MappingStart(anchor, _) => {
                self.stack.push(Frame::Map {
                    line,
                    anchor,
                    entries: Vec::new(),
                    key: None,
                    size: container,
                });
            }
            Event::SequenceEnd | Event::MappingEnd => match self.stack.pop() {
                Some(Frame::Seq { line, anchor, items, size }) => {
                    self.finish(Node { line, value: Value::Seq(items) }, size, anchor);
                }
                Some(Frame::Map { line, anchor, mut entries, size, .. }) => {
                    // Merged entries are copies of an alias already counted; they replace the
                    // `<<` entry, so the weight stays about the same.
                    merge_keys(&mut entries);
                    self.finish(Node { line, value: Value::Map(entries) }, size, anchor);
                }
                None => {}
            },
            _ => {}
        }
        Ok(())
    }

    fn finish(&mut self, node: Node, size: Size, anchor: usize) {
        if anchor != 0 {
            self.anchors.insert(anchor, (node.clone(), size));
        }
        match self.stack.last_mut() {
            None => self.docs.push(node),
            Some(Frame::Seq { items, size: parent, .. }) => {
                parent.add_child(size);
                items.push(node);
            }
            Some(Frame::Map { entries, key, size: parent, .. }) => {
                parent.add_child(size);
                match key.take() {
                    None => *key = Some(key_text(&node)),
                    Some(k) => entries.push((k, node)),
                }
            }
        }
    }
}

fn key_text(node: &Node) -> String {
    match &node.value {
        Value::Scalar { text, .. } => text.clone(),
        _ => String::new(),
    }
}

/// YAML merge keys (`<<: *defaults`), common in templated manifests: the merged entries come
/// first and explicit keys override them.
fn merge_keys(entries: &mut Vec<(String, Node)>) {
    if !entries.iter().any(|(k, _)| k == "<<") {
        return;
    }
    let mut merged: Vec<(String, Node)> = Vec::new();
    for (k, v) in entries.iter() {
        if k == "<<" {
            let sources: Vec<&Node> = match &v.value {
                Value::Seq(items) => items.iter().collect(),
                _ => vec![v],
            };
            for s in sources {
                for (mk, mv) in s.entries() {
                    if !entries.iter().any(|(ek, _)| ek == mk)
                        && !merged.iter().any(|(x, _)| x == mk)
                    {
                        merged.push((mk.clone(), mv.clone()));
                    }
                }
            }
        }
    }
    entries.retain(|(k, _)| k != "<<");
    merged.append(entries);
    *entries = merged;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_lines_and_documents() {
        let docs = parse_yaml("a: 1\n---\nb:\n  c: x\n  d: [1, 2]\n").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0].get("a").unwrap().as_u64(), Some(1));
        let c = docs[1].at(&["b", "c"]).unwrap();
        assert_eq!((c.as_str(), c.line), (Some("x"), 4));
        assert_eq!(docs[1].at(&["b", "d"]).unwrap().items().len(), 2);
    }

    #[test]
    fn yaml_anchors_and_merge_keys() {
        let docs =
            parse_yaml("base: &b\n  attempts: 3\n  x: 1\nroute:\n  <<: *b\n  x: 2\n").unwrap();
        let r = docs[0].get("route").unwrap();
        assert_eq!(r.get("attempts").unwrap().as_u64(), Some(3));
        assert_eq!(r.get("x").unwrap().as_u64(), Some(2));
    }

    #[test]
    fn yaml_error_has_a_line() {
        let e = parse_yaml("a: 1\nb: [1, 2\nc: 3\n").unwrap_err();
        assert!(e.line >= 2, "{e:?}");
    }

    #[test]
    fn json_with_tabs_and_lines() {
        let n = parse_json("{\n\t\"a\": {\n\t\t\"b\": 5\n\t}\n}\n").unwrap();
        let b = n.at(&["a", "b"]).unwrap();
        assert_eq!((b.as_u64(), b.line), (Some(5), 3));
    }

    #[test]
    fn json_error_names_line() {
        let e = parse_json("{\n  \"a\": 1,\n  \"b\": \n}\n").unwrap_err();
        assert_eq!(e.line, 4);
    }
}
