//! The call tree's context on the wire: a member of W3C `baggage`.
//!
//! ```text
//! baggage: stormguard-tree=1.2;spent=1;id=8f3a09c1d2e4b5a6, userId=alice
//! ```
//!
//! **Why `baggage`.** A service between two hops must pass the context from the request it
//! received to the requests it makes. OpenTelemetry's propagators already carry `baggage` from
//! a service's inbound request to its outbound ones (and the meshes ask services to pass
//! `traceparent` and `baggage` on), so a service that propagates its trace propagates the
//! tree too; a header of stormguard's own would need every service to learn one more name. The
//! member's value is [`TreeContext`]'s text form: the allowance, then its properties.
//!
//! **Malformed input.** A member that does not read is ignored (the request has no tree
//! context) and counted by the caller of [`read`]. Other members pass untouched.
//!
//! ```
//! use http::HeaderMap;
//! use stormguard_http::tree;
//!
//! let mut h = HeaderMap::new();
//! h.insert("baggage", "userId=alice,stormguard-tree=1.2".parse().unwrap());
//! let ctx = tree::read(&h).unwrap().unwrap();
//! tree::write(&mut h, &ctx.below(true));
//! assert_eq!(h["baggage"], "userId=alice,stormguard-tree=1.2;spent=1");
//! ```

use http::header::{HeaderMap, HeaderName, HeaderValue};
use stormguard_core::tree::{BadTreeContext, TreeContext};

/// W3C `baggage`.
pub static BAGGAGE: HeaderName = HeaderName::from_static("baggage");
/// The member's key.
pub const MEMBER: &str = "stormguard-tree";

/// The members of every `baggage` header, in order (a list may come in several headers), as
/// bytes: a value with bytes past ASCII (which HTTP allows) is still split, so a member in it
/// can be read, and taken off, like any other.
fn members(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(&BAGGAGE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|m| !m.is_empty())
}

/// The value (with its properties) of a `stormguard-tree` member, if `m` is one.
fn ours(m: &[u8]) -> Option<&[u8]> {
    let eq = m.iter().position(|&b| b == b'=')?;
    (m[..eq].trim_ascii() == MEMBER.as_bytes()).then(|| m[eq + 1..].trim_ascii())
}

/// The request's tree context: `None` without one, `Some(Err)` when its member does not read
/// (the first member of that key is read, as W3C allows; the rest are ignored).
pub fn read(headers: &HeaderMap) -> Option<Result<TreeContext, BadTreeContext>> {
    if !headers.contains_key(&BAGGAGE) {
        return None;
    }
    members(headers).find_map(ours).map(|v| match std::str::from_utf8(v) {
        Ok(text) => text.parse(),
        Err(_) => Err(BadTreeContext(String::from_utf8_lossy(v).chars().take(80).collect())),
    })
}

/// Sets the request's `stormguard-tree` member to `ctx`, keeping the other members (in one
/// `baggage` header).
pub fn write(headers: &mut HeaderMap, ctx: &TreeContext) {
    let ours = format!("{MEMBER}={ctx}");
    set(headers, Some(ours.as_bytes()));
}

/// Sets the context an attempt carries to the hops below (its request life's word:
/// `stormguard_core::life::Admitted::tree`) on its copy of the request, when it has one.
pub fn mark(headers: &mut HeaderMap, ctx: Option<&TreeContext>) {
    if let Some(ctx) = ctx {
        write(headers, ctx);
    }
}

/// Takes every `stormguard-tree` member off the request (a context from outside the trust
/// boundary), keeping the other members.
pub fn remove(headers: &mut HeaderMap) {
    if headers.contains_key(&BAGGAGE) && members(headers).any(|m| ours(m).is_some()) {
        set(headers, None);
    }
}

fn set(headers: &mut HeaderMap, ours: Option<&[u8]>) {
    let mut list: Vec<&[u8]> = members(headers).filter(|m| self::ours(m).is_none()).collect();
    list.extend(ours);
    let joined = list.join(&b","[..]);
    // Every part came from a valid header value or from a context's text: it is one too.
    match HeaderValue::from_bytes(&joined) {
        Ok(v) if !joined.is_empty() => {
            headers.insert(BAGGAGE.clone(), v);
        }
        _ => {
            headers.remove(&BAGGAGE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(&BAGGAGE, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn read_finds_the_member_among_others_and_across_headers() {
        assert!(read(&HeaderMap::new()).is_none());
        assert!(read(&with(&["a=1"])).is_none());
        let c = read(&with(&["a=1", " stormguard-tree = 1.5;spent=2 ,b=2"])).unwrap().unwrap();
        assert_eq!((c.allowance.0, c.spent), (1500, 2));
        assert!(read(&with(&["stormguard-tree=lots"])).unwrap().is_err());
    }

    #[test]
    fn write_replaces_ours_and_keeps_the_rest() {
        let mut h = with(&["a=1", "stormguard-tree=3,b=2;p"]);
        let ctx: TreeContext = "1.2;spent=1".parse().unwrap();
        write(&mut h, &ctx);
        assert_eq!(h.get_all(&BAGGAGE).iter().count(), 1);
        assert_eq!(h[&BAGGAGE], "a=1,b=2;p,stormguard-tree=1.2;spent=1");
        remove(&mut h);
        assert_eq!(h[&BAGGAGE], "a=1,b=2;p");
        let mut only = with(&["stormguard-tree=2"]);
        remove(&mut only);
        assert!(only.get(&BAGGAGE).is_none());
        let mut none = HeaderMap::new();
        write(&mut none, &ctx);
        assert_eq!(none[&BAGGAGE], "stormguard-tree=1.2;spent=1");
    }

    /// A value with bytes past ASCII (HTTP allows them) hides no member: it is read and taken
    /// off like any other, and the other members, those bytes included, are kept.
    #[test]
    fn bytes_past_ascii_hide_nothing() {
        let mut h = HeaderMap::new();
        let v = HeaderValue::from_bytes(b"name=caf\xe9, stormguard-tree=10;spent=1").unwrap();
        h.append(&BAGGAGE, v);
        h.append(&BAGGAGE, HeaderValue::from_static("stormguard-tree=2"));
        assert_eq!(read(&h).unwrap().unwrap().allowance.0, 10_000, "the first one");
        remove(&mut h);
        assert_eq!(h[&BAGGAGE].as_bytes(), b"name=caf\xe9");
        let mut bad = HeaderMap::new();
        bad.insert(&BAGGAGE, HeaderValue::from_bytes(b"stormguard-tree=1\xe9").unwrap());
        assert!(read(&bad).unwrap().is_err(), "a member that is not text does not read");
    }
}
