//! Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, so a proxy removes them
//! — the fixed list and every header the `Connection` header names — before forwarding a
//! request or a response.

use http::HeaderMap;
use http::header::{
    CONNECTION, HeaderName, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};

/// The names that are hop-by-hop whatever `Connection` says: `Connection`, `TE`, `Trailer`,
/// `Transfer-Encoding`, `Upgrade`, and four that only ever name one connection — as names the
/// map finds without parsing text (the standard ones by their index, the other two by a hash of
/// their bytes).
static FIXED: [HeaderName; 9] = [
    CONNECTION,
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    PROXY_AUTHENTICATE,
    PROXY_AUTHORIZATION,
];

/// `name` if it is one of [`FIXED`]: by its length first (most names have a length none of
/// the nine has), then against the one or two of that length.
fn always(name: &HeaderName) -> Option<&'static HeaderName> {
    let of_length: &[usize] = match name.as_str().len() {
        2 => &[1],
        7 => &[2, 4],
        10 => &[0, 5],
        16 => &[6],
        17 => &[3],
        18 => &[7],
        19 => &[8],
        _ => return None,
    };
    of_length.iter().map(|&i| &FIXED[i]).find(|f| *f == name)
}

/// Removes the hop-by-hop headers from `headers`, including those `Connection` names. One pass
/// over the names finds them (most messages carry none, or only `Connection`); only those are
/// removed, where asking for each of the nine by name would hash every one on every message.
/// Nothing is allocated, and the usual `Connection: keep-alive` or `close` parses no name: a
/// token that is a fixed hop-by-hop name goes with the fixed list, and `close` names no header.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if !headers.keys().any(|n| always(n).is_some()) {
        return;
    }
    // What each `Connection` value names goes first, while `Connection` is still there to be
    // read (a value is a shared view of the message's bytes: cloning it copies nothing).
    let mut i = 0;
    while let Some(v) = headers.get_all(&CONNECTION).iter().nth(i).cloned() {
        for name in v.to_str().unwrap_or("").split(',').map(str::trim) {
            // A fixed name (`Connection` itself among them) goes below, once every value of
            // `Connection` has been read. A name that is not a valid header name is in no map:
            // nothing to remove.
            let fixed = name.eq_ignore_ascii_case("close")
                || FIXED.iter().any(|f| name.eq_ignore_ascii_case(f.as_str()));
            if !fixed {
                headers.remove(name);
            }
        }
        i += 1;
    }
    while let Some(name) = headers.keys().find_map(always) {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_fixed_name_is_found_by_its_length_and_no_other() {
        for f in &FIXED {
            assert_eq!(always(f), Some(f), "{f}");
            let upper = HeaderName::from_bytes(f.as_str().to_ascii_uppercase().as_bytes()).unwrap();
            assert_eq!(always(&upper), Some(f), "{f} in upper case");
        }
        for other in ["tk", "warning", "user-agent", "accept-encoding", "x-forwarded-proto"] {
            assert_eq!(always(&HeaderName::from_static(other)), None, "{other}");
        }
    }

    #[test]
    fn removes_the_list_and_what_connection_names() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "close, x-secret"),
            ("connection", "keep-alive"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "basic x"),
            ("x-kept", "yes"),
            ("content-type", "text/plain"),
        ] {
            h.append(k, v.parse().unwrap());
        }
        strip_hop_by_hop(&mut h);
        // What is left (field order across names carries no meaning, RFC 9110 §5.3).
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "x-kept"]);
        // Upper case in the list, and a message with nothing to remove.
        let mut h = HeaderMap::new();
        h.append("connection", "X-Trace, Keep-Alive".parse().unwrap());
        h.append("x-trace", "1".parse().unwrap());
        h.append("keep-alive", "timeout=5".parse().unwrap());
        h.append("proxy-connection", "keep-alive".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        let mut h = HeaderMap::new();
        h.append("content-length", "3".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        // Names that are no header name (empty, spaces, bytes a name cannot hold) remove
        // nothing, and the rest of the list is still followed.
        let mut h = HeaderMap::new();
        h.append("connection", ", ,bad name,x-a,x(y),,x-b".parse().unwrap());
        h.append("x-a", "1".parse().unwrap());
        h.append("x-b", "1".parse().unwrap());
        h.append("x-c", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-c"]);
        // A value naming `Connection` itself does not stop the values after it being read.
        let mut h = HeaderMap::new();
        h.append("connection", "x-a, Connection".parse().unwrap());
        h.append("connection", "x-b".parse().unwrap());
        h.append("x-a", "1".parse().unwrap());
        h.append("x-b", "1".parse().unwrap());
        h.append("x-c", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-c"]);
    }
}
