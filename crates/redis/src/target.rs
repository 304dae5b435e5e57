//! Where the fleet's Redis is ([`RedisTarget`]), read from its URL: plain settings, no
//! connection (the client is [`resp`](crate::resp), behind the default feature `client`).

use std::fmt;

/// Where the fleet's Redis is: `redis://[[user]:password@]host[:port][/db]`, or over TLS
/// `rediss://…[?ca_file=PATH&client_cert=PATH&client_key=PATH]` (managed Redis services mostly
/// require TLS; without `ca_file`, the system's roots).
///
/// The password never appears in `Debug` or `Display` output.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTarget {
    /// Host name or address.
    pub host: String,
    /// TCP port. Default 6379.
    pub port: u16,
    /// The ACL user, if any.
    pub user: Option<String>,
    /// The password, if any.
    pub password: Option<String>,
    /// The database index (`SELECT`). Default 0.
    pub db: u32,
    /// TLS (`rediss://`), with its files; `None`: plain TCP.
    pub tls: Option<stormguard_tls::TlsFiles>,
}

impl RedisTarget {
    /// A plain-TCP target on `host:port`, database 0, no credentials.
    pub fn plain(host: impl Into<String>, port: u16) -> RedisTarget {
        RedisTarget { host: host.into(), port, user: None, password: None, db: 0, tls: None }
    }
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisTarget({self})")
    }
}

impl fmt::Display for RedisTarget {
    /// `redis://host:port/db`, with `[redacted]@` when credentials are set.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let creds = if self.user.is_some() || self.password.is_some() { "[redacted]@" } else { "" };
        let scheme = if self.tls.is_some() { "rediss" } else { "redis" };
        write!(f, "{scheme}://{creds}{}:{}/{}", self.host, self.port, self.db)
    }
}

/// Why a text is not a Redis URL. The reason never repeats the text: it may hold a password.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRedisUrl(pub &'static str);

impl std::str::FromStr for RedisTarget {
    type Err = BadRedisUrl;

    /// Parses `redis://[[user]:password@]host[:port][/db]`; user and password may be
    /// percent-encoded. Errors never repeat the text (it may hold a password).
    fn from_str(text: &str) -> Result<RedisTarget, BadRedisUrl> {
        let (rest, tls) = match (text.strip_prefix("redis://"), text.strip_prefix("rediss://")) {
            (Some(r), _) => (r, None),
            (None, Some(r)) => (r, Some(stormguard_tls::TlsFiles::default())),
            _ => {
                return Err(BadRedisUrl(
                    "a Redis URL starts with redis:// or rediss:// (unix sockets are not supported)",
                ));
            }
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let tls = match (tls, query) {
            (None, Some(_)) => {
                return Err(BadRedisUrl(
                    "only a rediss:// URL takes parameters (ca_file, client_cert, client_key)",
                ));
            }
            (Some(mut files), Some(q)) => {
                for pair in q.split('&').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    let path = Some(std::path::PathBuf::from(decode(v)?));
                    match k {
                        "ca_file" => files.ca_file = path,
                        "client_cert" => files.client_cert = path,
                        "client_key" => files.client_key = path,
                        _ => {
                            return Err(BadRedisUrl(
                                "a rediss:// URL's parameters are ca_file, client_cert and client_key",
                            ));
                        }
                    }
                }
                Some(files)
            }
            (tls, None) => tls,
        };
        let (creds, rest) = match rest.rsplit_once('@') {
            Some((c, r)) => (Some(c), r),
            None => (None, rest),
        };
        let (authority, db) = match rest.split_once('/') {
            Some((a, "")) => (a, 0),
            Some((a, d)) => (
                a,
                d.parse::<u32>()
                    .map_err(|_| BadRedisUrl("the database after '/' must be a number"))?,
            ),
            None => (rest, 0),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h,
                p.parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or(BadRedisUrl("the port must be a number from 1 to 65535"))?,
            ),
            _ => (authority, 6379),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(BadRedisUrl("the Redis URL has no host"));
        }
        let (user, password) = match creds {
            None => (None, None),
            Some(c) => {
                let (u, p) = match c.split_once(':') {
                    Some((u, p)) => (u, Some(p)),
                    None => (c, None),
                };
                let user = Some(decode(u)?).filter(|u| !u.is_empty());
                let password = p.map(decode).transpose()?.filter(|p| !p.is_empty());
                (user, password)
            }
        };
        Ok(RedisTarget { host: host.to_string(), port, user, password, db, tls })
    }
}

fn decode(s: &str) -> Result<String, BadRedisUrl> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .ok_or(BadRedisUrl("a '%' in the URL's credentials is not %XX"))?;
            out.push(
                u8::from_str_radix(hex, 16)
                    .map_err(|_| BadRedisUrl("a '%' in the URL's credentials is not %XX"))?,
            );
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| BadRedisUrl("the URL's credentials are not UTF-8"))
}
