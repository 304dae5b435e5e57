//! The path a route is chosen by: `/checkout/../admin` is `/admin`.
//!
//! A route's budget and dependency are chosen by path prefix, and an upstream resolves dot
//! segments before it acts: matched on the raw path, `/checkout/../admin` would be sent to the
//! `/checkout` route (its dependency, its budget) and served as `/admin`. So the path is
//! normalized before matching, as Envoy's `normalize_path` and `merge_slashes` do: dot segments
//! removed (RFC 3986 §5.2.4; `%2e` is a dot, as RFC 3986 §6.2.2.2 decodes unreserved
//! characters), repeated slashes merged. Nothing else is decoded: `%2F` stays a byte of its
//! segment (Envoy's default, `KEEP_UNCHANGED`), and `..;` (a servlet container's path
//! parameter) is not a dot segment here.
//!
//! The upstream gets the path as the caller sent it, not the normalized one (Envoy rewrites it):
//! an upstream that resolves dots acts on the path the route was chosen by anyway, and one for
//! which `//` is part of a name (an object store's keys, a signed path) gets the name it was
//! asked for. The route decides the dependency and the budget, not access.

use std::borrow::Cow;

/// `path` normalized (see the module docs); borrowed when it is already.
pub(crate) fn normalize(path: &str) -> Cow<'_, str> {
    let b = path.as_bytes();
    let suspicious = b.windows(2).any(|w| w == b"//" || w == b"/." || w[0] == b'%');
    if !suspicious {
        return Cow::Borrowed(path);
    }
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').collect();
    let last = segments.len().saturating_sub(1);
    // Whether the path ends in a directory (a trailing slash, or a last segment of dots).
    let mut trailing = false;
    for (i, seg) in segments.iter().enumerate() {
        trailing = false;
        match dots(seg) {
            Some(1) => trailing = true,
            Some(2) => {
                out.pop();
                trailing = true;
            }
            _ if seg.is_empty() => trailing = i == last && i > 0,
            _ => out.push(seg),
        }
    }
    let mut s = String::with_capacity(path.len());
    for seg in &out {
        s.push('/');
        s.push_str(seg);
    }
    if trailing || s.is_empty() {
        s.push('/');
    }
    if s == path { Cow::Borrowed(path) } else { Cow::Owned(s) }
}

/// How many dots a segment is, when it is only dots (`.`, `..`, `%2e`, `.%2E`): 1 or 2.
fn dots(seg: &str) -> Option<usize> {
    let mut n = 0;
    let mut rest = seg.as_bytes();
    while !rest.is_empty() {
        if rest[0] == b'.' {
            rest = &rest[1..];
        } else if rest.len() >= 3 && rest[0] == b'%' && rest[1] == b'2' && rest[2] | 0x20 == b'e' {
            rest = &rest[3..];
        } else {
            return None;
        }
        n += 1;
    }
    (n == 1 || n == 2).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn dot_segments_and_repeated_slashes_are_resolved() {
        for (raw, want) in [
            ("/checkout/pay", "/checkout/pay"),
            ("/", "/"),
            ("/checkout/../admin", "/admin"),
            ("/checkout/%2e%2E/admin", "/admin"),
            ("/checkout/.%2e/admin", "/admin"),
            ("/a/./b", "/a/b"),
            ("//checkout///pay", "/checkout/pay"),
            ("/a/b/", "/a/b/"),
            ("/a/b/..", "/a/"),
            ("/a/.", "/a/"),
            ("/../../etc", "/etc"),
            ("/a/...", "/a/..."),
            ("/a/%2fb", "/a/%2fb"),
            ("/a/.hidden", "/a/.hidden"),
        ] {
            assert_eq!(normalize(raw), want, "{raw}");
        }
    }
}
