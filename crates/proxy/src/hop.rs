//! Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, so a proxy removes them
//! — the fixed list and every header the `Connection` header names — before forwarding a
//! request or a response.

use http::HeaderMap;
use http::header::{CONNECTION, HeaderName, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};

/// The headers that are always hop-by-hop.
const ALWAYS: [&str; 4] =
    ["keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization"];

/// Whether `name` is hop-by-hop whatever `Connection` says.
fn always(name: &HeaderName) -> bool {
    [CONNECTION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE].contains(name)
        || ALWAYS.contains(&name.as_str())
}

/// Removes the hop-by-hop headers from `headers`, including those `Connection` names. One pass
/// over the names finds them (most messages carry none, or only `Connection`); only those are
/// removed, where asking for each of the nine by name would hash every one on every message.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut found: Vec<HeaderName> = headers.keys().filter(|n| always(n)).cloned().collect();
    found.extend(
        headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok()),
    );
    for name in found {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
