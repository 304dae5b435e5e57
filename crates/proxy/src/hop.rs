//! Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection, so a proxy removes them
//! — the fixed list and every header the `Connection` header names — before forwarding a
//! request or a response.

use http::HeaderMap;
use http::header::{CONNECTION, HeaderName, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};

/// The headers that are always hop-by-hop.
const ALWAYS: [&str; 4] =
    ["keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization"];

/// Removes the hop-by-hop headers from `headers`, including those `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [CONNECTION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE] {
        headers.remove(name);
    }
    for name in ALWAYS {
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
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["x-kept", "content-type"]);
    }
}
