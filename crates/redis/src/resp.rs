//! A minimal RESP2 client: one connection, one command at a time, every reply bounded, over
//! TCP or TLS (`rediss://`, rustls: the system roots or a CA file, an optional client
//! certificate; see [`stormguard_tls`]).
//!
//! The fleet needs five commands (`AUTH`, `SELECT`, `SCRIPT LOAD`, `EVALSHA`, `EVAL`) on one
//! connection that a background worker owns, so a full client (pooling, pub/sub, cluster
//! topology) would be mostly weight. Replies are read with limits (line length, bulk size,
//! array length, nesting), so a malformed or hostile peer is an error, never a panic or an
//! unbounded allocation. After any error or timeout the caller drops the connection: a late
//! reply must never be read as the answer to the next command.

use std::fmt;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub use crate::target::{BadRedisUrl, RedisTarget};

/// The longest status or error line accepted, in bytes.
const MAX_LINE: usize = 64 * 1024;
/// The largest bulk string accepted, in bytes.
const MAX_BULK: usize = 1024 * 1024;
/// The most elements an array may have.
const MAX_ARRAY: usize = 64 * 1024;
/// The deepest nesting of arrays.
const MAX_DEPTH: usize = 4;

/// A reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `$-1` or `*-1`.
    Nil,
    /// `:n`.
    Int(i64),
    /// `+text`.
    Status(String),
    /// `$n` bytes.
    Bulk(Vec<u8>),
    /// `*n` values.
    Array(Vec<Value>),
}

/// What went wrong talking to Redis.
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// The connection failed or closed.
    #[error("redis i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Redis answered with an error (`-ERR ...`).
    #[error("redis said: {0}")]
    Server(String),
    /// The reply was not valid RESP, or broke a limit.
    #[error("malformed redis reply: {0}")]
    Protocol(&'static str),
    /// No answer in time.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// The TLS files of a `rediss://` URL cannot be used.
    #[error("rediss:// {0}")]
    Tls(#[from] stormguard_tls::TlsError),
    /// The host of a `rediss://` URL is not a name a certificate can be checked against.
    #[error("rediss:// host is not a DNS name or an IP address")]
    ServerName,
}

/// A byte stream to Redis: TCP, or TLS over TCP.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// One connection.
pub struct Connection {
    stream: BufReader<Box<dyn Io>>,
    line: Vec<u8>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Connection")
    }
}

impl Connection {
    /// Connects, authenticates and selects the database.
    pub async fn connect(target: &RedisTarget) -> Result<Connection, RedisError> {
        let tcp = TcpStream::connect((target.host.as_str(), target.port)).await?;
        let _ = tcp.set_nodelay(true);
        let io: Box<dyn Io> = match &target.tls {
            None => Box::new(tcp),
            Some(files) => {
                let config = stormguard_tls::client_config(files, Some("the fleet's Redis"))?;
                let name = rustls::pki_types::ServerName::try_from(target.host.clone())
                    .map_err(|_| RedisError::ServerName)?;
                let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
                Box::new(tls.connect(name, tcp).await?)
            }
        };
        let mut c = Connection { stream: BufReader::new(io), line: Vec::new() };
        match (&target.user, &target.password) {
            (Some(u), Some(p)) => {
                c.command(&[b"AUTH", u.as_bytes(), p.as_bytes()]).await?;
            }
            (None, Some(p)) => {
                c.command(&[b"AUTH", p.as_bytes()]).await?;
            }
            _ => {}
        }
        if target.db != 0 {
            c.command(&[b"SELECT", target.db.to_string().as_bytes()]).await?;
        }
        Ok(c)
    }

    /// Sends one command and reads its reply; an error reply is [`RedisError::Server`].
    pub async fn command(&mut self, args: &[&[u8]]) -> Result<Value, RedisError> {
        let mut out = Vec::with_capacity(64 + args.iter().map(|a| a.len() + 16).sum::<usize>());
        out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.stream.get_mut().write_all(&out).await?;
        self.read_value(0).await
    }

    async fn read_line(&mut self) -> Result<Vec<u8>, RedisError> {
        self.line.clear();
        let n =
            (&mut self.stream).take(MAX_LINE as u64 + 2).read_until(b'\n', &mut self.line).await?;
        if n == 0 {
            return Err(RedisError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        if !self.line.ends_with(b"\r\n") {
            return Err(RedisError::Protocol("a line without CRLF, or too long"));
        }
        self.line.truncate(self.line.len() - 2);
        Ok(std::mem::take(&mut self.line))
    }

    fn read_value(
        &mut self,
        depth: usize,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Value, RedisError>> + Send + '_>> {
        Box::pin(async move {
            let line = self.read_line().await?;
            let (&kind, rest) = line.split_first().ok_or(RedisError::Protocol("an empty line"))?;
            let text = || String::from_utf8_lossy(rest).into_owned();
            let number = || -> Result<i64, RedisError> {
                std::str::from_utf8(rest)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or(RedisError::Protocol("a length or integer that is not a number"))
            };
            match kind {
                b'+' => Ok(Value::Status(text())),
                b'-' => Err(RedisError::Server(text())),
                b':' => Ok(Value::Int(number()?)),
                b'$' => {
                    let n = number()?;
                    if n < 0 {
                        return Ok(Value::Nil);
                    }
                    let n = usize::try_from(n).unwrap_or(usize::MAX);
                    if n > MAX_BULK {
                        return Err(RedisError::Protocol("a bulk string above 1 MiB"));
                    }
                    let mut buf = vec![0; n + 2];
                    self.stream.read_exact(&mut buf).await?;
                    if !buf.ends_with(b"\r\n") {
                        return Err(RedisError::Protocol("a bulk string without CRLF"));
                    }
                    buf.truncate(n);
                    Ok(Value::Bulk(buf))
                }
                b'*' => {
                    let n = number()?;
                    if n < 0 {
                        return Ok(Value::Nil);
                    }
                    let n = usize::try_from(n).unwrap_or(usize::MAX);
                    if n > MAX_ARRAY || depth >= MAX_DEPTH {
                        return Err(RedisError::Protocol("an array too long or too deep"));
                    }
                    let mut items = Vec::with_capacity(n.min(64));
                    for _ in 0..n {
                        items.push(self.read_value(depth + 1).await?);
                    }
                    Ok(Value::Array(items))
                }
                _ => Err(RedisError::Protocol("an unknown reply type")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    #[test]
    fn parses_urls_and_never_shows_the_password() {
        let t: RedisTarget = "redis://app:s%40cret@cache.internal:6380/2".parse().unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.user.as_deref(), t.password.as_deref(), t.db),
            ("cache.internal", 6380, Some("app"), Some("s@cret"), 2)
        );
        assert_eq!(t.to_string(), "redis://[redacted]@cache.internal:6380/2");
        assert!(!format!("{t:?}").contains("cret"));
        let t: RedisTarget = "redis://:pw@127.0.0.1".parse().unwrap();
        assert_eq!((t.user, t.password.as_deref(), t.port), (None, Some("pw"), 6379));
        let t: RedisTarget = "redis://[::1]:7000/".parse().unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 7000));
        let t: RedisTarget =
            "rediss://:pw@cache:6380/0?ca_file=/etc/ca%20dir/ca.pem".parse().unwrap();
        let files = t.tls.clone().unwrap();
        assert_eq!(files.ca_file.as_deref(), Some(std::path::Path::new("/etc/ca dir/ca.pem")));
        assert_eq!(t.to_string(), "rediss://[redacted]@cache:6380/0");
        assert!("rediss://cache".parse::<RedisTarget>().unwrap().tls.is_some());
        for bad in [
            "http://x",
            "redis://",
            "redis://h:99999",
            "redis://h/x",
            "redis://:%zz@h",
            "redis://h?ca_file=x",
            "rediss://h?cafile=x",
        ] {
            let e = bad.parse::<RedisTarget>().unwrap_err();
            assert!(!e.to_string().contains("zz"), "{e}");
        }
    }

    /// A peer that answers `reply` to whatever it is sent.
    async fn peer(reply: &'static [u8]) -> Connection {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(reply).await;
            let _ = s.shutdown().await;
        });
        let t = RedisTarget::plain("127.0.0.1", addr.port());
        Connection::connect(&t).await.unwrap()
    }

    #[tokio::test]
    async fn reads_nested_replies() {
        let mut c = peer(b"*3\r\n$2\r\nab\r\n:-7\r\n*2\r\n+OK\r\n$-1\r\n").await;
        let v = c.command(&[b"EVAL"]).await.unwrap();
        assert_eq!(
            v,
            Value::Array(vec![
                Value::Bulk(b"ab".to_vec()),
                Value::Int(-7),
                Value::Array(vec![Value::Status("OK".into()), Value::Nil]),
            ])
        );
    }

    #[tokio::test]
    async fn malformed_replies_are_errors_not_panics() {
        for reply in [
            &b"?what\r\n"[..],
            b":12x\r\n",
            b"$5\r\nab\r\n",
            b"$99999999999\r\n",
            b"*99999999\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
            b"+no crlf",
            b"",
            b"\r\n",
        ] {
            let mut c = peer(reply).await;
            assert!(c.command(&[b"PING"]).await.is_err(), "{:?}", String::from_utf8_lossy(reply));
        }
        let mut c = peer(b"-NOSCRIPT no such script\r\n").await;
        assert!(
            matches!(c.command(&[b"EVALSHA"]).await, Err(RedisError::Server(m)) if m.starts_with("NOSCRIPT"))
        );
    }
}
