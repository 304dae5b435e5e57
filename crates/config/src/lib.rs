//! The one reader of stormguard's TOML files: the proxy's config, chaos scripts, simulator
//! scenarios and audit's call graphs are all read here, and every error they can give has one
//! shape:
//!
//! ```text
//! FILE:LINE:COLUMN: KEY.PATH: what is wrong (and the fix)
//! ```
//!
//! Lines and columns count from 1 (columns in characters), indices in key paths from 0
//! (`dependency[1].breaker.window`, `phase[0].error_rate`), as TOML's own tools say them.
//!
//! Reading is two steps. [`Document::deserialize`] fills a `serde` type: a syntax error, a value
//! of the wrong type, an unknown key (with `#[serde(deny_unknown_fields)]`) or a missing one is
//! located by the TOML parser, and its key path is tracked by `serde_path_to_error` while the
//! type is built — never read back out of a message. Then the format checks its own rules on
//! the typed value and reports a broken one as an [`Invalid`]: a [`KeyPath`] and a typed
//! reason. [`Document::error`] finds that key in the file (or, for a key the file leaves to its
//! default, the nearest table that is there) and gives the same [`FileError`].
//!
//! ```
//! use serde::Deserialize;
//! use stormguard_config::{Document, FileError, KeyPath};
//!
//! #[derive(Debug, Deserialize)]
//! #[serde(deny_unknown_fields)]
//! struct Phase {
//!     #[serde(deserialize_with = "stormguard_config::de::duration")]
//!     duration: std::time::Duration,
//! }
//! #[derive(Debug, Deserialize)]
//! #[serde(deny_unknown_fields)]
//! struct Script {
//!     phase: Vec<Phase>,
//! }
//!
//! let text = "[[phase]]\nduration = \"5s\"\n[[phase]]\nduration = \"soon\"\n";
//! let doc = Document::parse(text, "storm.toml").unwrap();
//! let err = doc.deserialize::<Script>().unwrap_err();
//! assert_eq!(err.key().unwrap().to_string(), "phase[1].duration");
//! assert_eq!(
//!     err.to_string(),
//!     "storm.toml:4:12: phase[1].duration: `soon` is not a duration (e.g. 250ms, 10s, 2m)"
//! );
//!
//! // A rule the format checks itself, reported at its key.
//! let doc = Document::parse("[[phase]]\nduration = \"0s\"\n", "storm.toml").unwrap();
//! let key = KeyPath::root().key("phase").index(0).key("duration");
//! let err = doc.error(key, "must be above zero");
//! assert_eq!(err.to_string(), "storm.toml:2:12: phase[0].duration: must be above zero");
//! assert!(matches!(err, FileError::Invalid { line: 2, .. }));
//! ```

#![warn(missing_docs)]

pub mod de;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use toml_edit::{ImDocument, Item};

/// Where a value is in a file: table keys and array indices from the top, written the way
/// TOML's tools say them, `dependency[0].breaker.window`. Indices count from 0.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct KeyPath {
    segments: Vec<Segment>,
}

/// One step of a [`KeyPath`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Segment {
    /// A table key.
    Key(String),
    /// An element of an array (or array of tables), from 0.
    Index(usize),
}

impl KeyPath {
    /// The top of the file.
    pub fn root() -> KeyPath {
        KeyPath::default()
    }

    /// This path, one table key further.
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> KeyPath {
        self.segments.push(Segment::Key(key.into()));
        self
    }

    /// This path, one array element further.
    #[must_use]
    pub fn index(mut self, index: usize) -> KeyPath {
        self.segments.push(Segment::Index(index));
        self
    }

    /// This path followed by `rest` (a path relative to it).
    #[must_use]
    pub fn join(mut self, rest: &KeyPath) -> KeyPath {
        self.segments.extend(rest.segments.iter().cloned());
        self
    }

    /// The steps, from the top.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// True for the top of the file.
    pub fn is_root(&self) -> bool {
        self.segments.is_empty()
    }

    fn from_serde(path: &serde_path_to_error::Path) -> KeyPath {
        let mut k = KeyPath::root();
        for s in path.iter() {
            match s {
                serde_path_to_error::Segment::Seq { index } => k = k.index(*index),
                serde_path_to_error::Segment::Map { key } => k = k.key(key.clone()),
                serde_path_to_error::Segment::Enum { variant } => k = k.key(variant.clone()),
                serde_path_to_error::Segment::Unknown => {}
            }
        }
        k
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.segments.iter().enumerate() {
            match s {
                Segment::Key(k) if i == 0 => f.write_str(k)?,
                Segment::Key(k) => write!(f, ".{k}")?,
                Segment::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// What a [`FileError::Invalid`] found wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// Not TOML: the parser's own message.
    #[error("{0}")]
    Syntax(String),
    /// TOML, but not the shape the format takes: a value of the wrong type or that does not
    /// read (a duration that is not one), a key the format does not have, a key it needs.
    #[error("{0}")]
    Shape(String),
    /// The shape is right and a rule of the format is broken (a cap of 0, two dependencies
    /// with one name): the format's own typed error, to match with `downcast_ref`.
    #[error("{0}")]
    Rule(Box<dyn std::error::Error + Send + Sync>),
}

/// A file that could not be read, or that is not a valid file of its format.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The file could not be read (missing, not a regular file, over 16 MiB, not UTF-8).
    #[error("{}: {source}", path.display())]
    Read {
        /// The path given.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid file of its format.
    #[error("{file}:{line}:{column}: {}{problem}", key_prefix(key))]
    Invalid {
        /// The file name as given.
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column, in characters.
        column: usize,
        /// The key at fault; the root for a syntax error with no key.
        key: KeyPath,
        /// What is wrong.
        problem: Problem,
    },
}

fn key_prefix(key: &KeyPath) -> String {
    if key.is_root() { String::new() } else { format!("{key}: ") }
}

impl FileError {
    /// The key at fault, when the file was read.
    pub fn key(&self) -> Option<&KeyPath> {
        match self {
            FileError::Invalid { key, .. } => Some(key),
            FileError::Read { .. } => None,
        }
    }

    /// The 1-based line and column, when the file was read.
    pub fn position(&self) -> Option<(usize, usize)> {
        match self {
            FileError::Invalid { line, column, .. } => Some((*line, *column)),
            FileError::Read { .. } => None,
        }
    }

    /// The format's own rule error, when that is what is wrong.
    pub fn rule<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            FileError::Invalid { problem: Problem::Rule(e), .. } => e.downcast_ref(),
            _ => None,
        }
    }
}

/// A rule of a format broken at a key: what a format's checks return, before
/// [`Document::error`] turns it into a [`FileError`] with a line and column.
#[derive(Debug, thiserror::Error)]
#[error("{}{error}", key_prefix(key))]
pub struct Invalid<E> {
    /// Where.
    pub key: KeyPath,
    /// Which rule.
    pub error: E,
}

impl<E> Invalid<E> {
    /// `error` at `key`.
    pub fn new(key: KeyPath, error: E) -> Invalid<E> {
        Invalid { key, error }
    }

    /// The same error, its key under `parent` (a dependency's rule under `dependency[2]`).
    #[must_use]
    pub fn under(self, parent: &KeyPath) -> Invalid<E> {
        Invalid { key: parent.clone().join(&self.key), error: self.error }
    }

    /// The same key with the error mapped (a crate's error into the format's own enum).
    pub fn map<F>(self, f: impl FnOnce(E) -> F) -> Invalid<F> {
        Invalid { key: self.key, error: f(self.error) }
    }
}

/// A TOML file, parsed, with the place of every key: what the format types are read from, and
/// what their rule errors are located in.
#[derive(Debug, Clone)]
pub struct Document<'t> {
    file: String,
    text: &'t str,
    doc: ImDocument<&'t str>,
}

impl<'t> Document<'t> {
    /// Parses `text`, read from `file` (the name errors give). A syntax error is a
    /// [`FileError::Invalid`] with a [`Problem::Syntax`].
    pub fn parse(text: &'t str, file: &str) -> Result<Document<'t>, FileError> {
        match ImDocument::parse(text) {
            Ok(doc) => Ok(Document { file: file.to_string(), text, doc }),
            Err(e) => {
                let at = e.span().map_or(0, |s| s.start);
                let key = key_at(text, at);
                Err(invalid(file, text, at, key, Problem::Syntax(message(e.message()))))
            }
        }
    }

    /// The file name errors give.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The text.
    pub fn text(&self) -> &'t str {
        self.text
    }

    /// The file as a `T`. A value of the wrong type, an unknown key or a missing one is a
    /// [`Problem::Shape`] at its key path.
    pub fn deserialize<T: DeserializeOwned>(&self) -> Result<T, FileError> {
        let de = toml_edit::de::Deserializer::from(self.doc.clone());
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = KeyPath::from_serde(e.path());
            let inner = e.into_inner();
            let at = inner.span().map_or_else(|| self.span(&key).start, |s| s.start);
            invalid(&self.file, self.text, at, key, Problem::Shape(message(inner.message())))
        })
    }

    /// `problem` at `key`: located at the key's value in the file, or, when the file does not
    /// set it (a default broke the rule together with a key that is set), at the nearest
    /// enclosing table that is there.
    pub fn error(&self, key: KeyPath, problem: impl Into<Problem>) -> FileError {
        let at = self.span(&key).start;
        invalid(&self.file, self.text, at, key, problem.into())
    }

    /// A format's rule error, located.
    pub fn invalid<E>(&self, e: Invalid<E>) -> FileError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        self.error(e.key, Problem::Rule(Box::new(e.error)))
    }

    /// True when the file sets `key`.
    pub fn has(&self, key: &KeyPath) -> bool {
        self.lookup(key).1 == key.segments.len()
    }

    /// Where `key`'s value is in the text, or its nearest enclosing table's (0..0 when none).
    pub fn span(&self, key: &KeyPath) -> Range<usize> {
        self.lookup(key).0
    }

    /// The span of the deepest part of `key` the file has, and how many segments that was.
    fn lookup(&self, key: &KeyPath) -> (Range<usize>, usize) {
        let mut node = Node::Table(self.doc.as_table());
        let mut best = 0..0;
        for (depth, seg) in key.segments.iter().enumerate() {
            let Some((next, span)) = node.step(seg) else { return (best, depth) };
            if let Some(s) = span {
                best = s;
            }
            node = next;
        }
        (best, key.segments.len())
    }
}

/// A place in the parsed document, while a key path is walked.
#[derive(Clone, Copy)]
enum Node<'a> {
    Table(&'a toml_edit::Table),
    Item(&'a Item),
    Value(&'a toml_edit::Value),
}

impl<'a> Node<'a> {
    /// One segment further, with the span to point at: a value's own, else its key's or the
    /// table header's.
    fn step(self, seg: &Segment) -> Option<(Node<'a>, Option<Range<usize>>)> {
        use toml_edit::Value;
        match (self, seg) {
            (Node::Table(t) | Node::Item(Item::Table(t)), Segment::Key(k)) => {
                t.get_key_value(k).map(|(key, item)| (Node::Item(item), item.span().or(key.span())))
            }
            (Node::Item(Item::Value(v)), s) => Node::Value(v).step(s),
            (Node::Value(Value::InlineTable(t)), Segment::Key(k)) => {
                t.get_key_value(k).map(|(key, v)| (Node::Item(v), v.span().or(key.span())))
            }
            (Node::Item(Item::ArrayOfTables(a)), Segment::Index(i)) => {
                a.get(*i).map(|t| (Node::Table(t), t.span()))
            }
            (Node::Value(Value::Array(a)), Segment::Index(i)) => {
                a.get(*i).map(|v| (Node::Value(v), v.span()))
            }
            _ => None,
        }
    }
}

/// The key whose value holds byte `at` of a file that did not parse (`cap =
/// 99999999999999999999999999` is TOML, but past any integer): read from the text, since there
/// is no document. The key on that line after the table header above it (`[[dependency]]`
/// counted, `[dependency.tls]` under the last one); the root when the error is not in a
/// `key = value` line's value.
fn key_at(text: &str, at: usize) -> KeyPath {
    let at = at.min(text.len());
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("");
    let bare = |k: &str| {
        !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    let Some((k, _)) = line.split_once('=') else { return KeyPath::root() };
    let parts: Vec<&str> = k.trim().split('.').map(str::trim).collect();
    if line_start + k.len() >= at || !parts.iter().all(|p| bare(p)) {
        return KeyPath::root();
    }
    let mut arrays: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut table = KeyPath::root();
    for l in text[..line_start].lines() {
        // A header may end in a comment (`[[dependency]]  # payments`).
        let l = l.split('#').next().unwrap_or("").trim();
        let (name, array) = if let Some(n) = l.strip_prefix("[[").and_then(|r| r.strip_suffix("]]"))
        {
            (n.trim(), true)
        } else if let Some(n) = l.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            (n.trim(), false)
        } else {
            continue;
        };
        if array {
            let n = arrays.entry(name).or_insert(0);
            table = KeyPath::root().key(name).index(*n);
            *n += 1;
            continue;
        }
        let mut segs = name.split('.').map(str::trim);
        let first = segs.next().unwrap_or("");
        table = KeyPath::root().key(first);
        if let Some(n) = arrays.get(first) {
            table = table.index(n.saturating_sub(1));
        }
        for seg in segs {
            table = table.key(seg);
        }
    }
    parts.into_iter().fold(table, |p, k| p.key(k))
}

/// A syntax or shape message as one line: the parser's multi-line messages joined.
fn message(m: &str) -> String {
    m.trim().lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ")
}

fn invalid(file: &str, text: &str, at: usize, key: KeyPath, problem: Problem) -> FileError {
    let (line, column) = stormguard_core::text::line_col(text, at);
    FileError::Invalid { file: file.to_string(), line, column, key, problem }
}

impl From<&str> for Problem {
    fn from(s: &str) -> Problem {
        Problem::Rule(s.to_string().into())
    }
}

/// Reads `path` (a regular file of at most 16 MiB) and parses it; `read` fills and checks the
/// format's type from the parsed document.
pub fn load<T>(
    path: &Path,
    read: impl FnOnce(&Document<'_>) -> Result<T, FileError>,
) -> Result<T, FileError> {
    let text = stormguard_input::read_to_string(path, stormguard_input::MAX_FILE)
        .map_err(|source| FileError::Read { path: path.to_path_buf(), source })?;
    let doc = Document::parse(&text, &path.display().to_string())?;
    read(&doc)
}
