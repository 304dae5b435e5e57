//! The TLS client configuration stormguard's connections share — the proxy's `https://`
//! upstreams and the fleet's `rediss://` Redis: rustls with the `ring` provider, the operating
//! system's roots (rustls-native-certs) or only those of a CA file, and an optional client
//! certificate (mutual TLS). Files are PEM, read with a bound (a FIFO or `/dev/zero` is refused,
//! not read forever); every problem is a typed [`TlsError`] that names the setting at fault.
//!
//! The settings and their errors ([`TlsFiles`], [`TlsError`]) need nothing else; reading and
//! building them ([`client_config`]) is the default feature `rustls`. A crate that only reads
//! a configuration (`stormguard audit`) goes without it.

use std::io;
use std::path::PathBuf;

use serde::Deserialize;

/// An error from rustls (or its PEM reader), kept as the source of a [`TlsError`].
pub type RustlsError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Which TLS files to use. Relative paths are from the current directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsFiles {
    /// The CA certificates the server's chain must lead to, instead of the operating
    /// system's roots. Default none: the system roots.
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain to present (with `client_key`). Default none.
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PKCS#8, PKCS#1 or SEC1). Default none.
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    /// Whether anything is configured.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }
}

/// Why TLS settings cannot be used: a file that cannot be read or holds no usable PEM, or keys
/// that do not fit. [`TlsError::key`] names the setting (`tls.ca_file`, …).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        /// The key that names the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file is not PEM, or holds nothing of the kind needed.
    #[error("{}: {reason}", path.display())]
    Pem {
        /// The key that names the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What the PEM reader said.
        reason: PemProblem,
    },
    /// A CA certificate rustls refuses.
    #[error("{}: {source}", path.display())]
    Certificate {
        /// The file.
        path: PathBuf,
        /// Why (a `rustls::Error`).
        source: RustlsError,
    },
    /// `client_cert` without `client_key`.
    #[error("client_cert needs client_key")]
    CertWithoutKey,
    /// `client_key` without `client_cert`.
    #[error("client_key needs client_cert")]
    KeyWithoutCert,
    /// The key is not the certificate's.
    #[error("does not fit client_cert: {0}")]
    KeyMismatch(RustlsError),
    /// rustls refused the protocol versions.
    #[error("{0}")]
    Protocol(RustlsError),
}

/// What was wrong with a PEM file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PemProblem {
    /// No certificate in it.
    #[error("no certificate in it (PEM expected)")]
    NoCertificate,
    /// No private key in it.
    #[error("no private key read: {0}")]
    NoKey(Box<PemProblem>),
    /// Nothing of the kind needed.
    #[error("nothing of that kind in it (PEM expected)")]
    NothingOfThatKind,
    /// Not PEM.
    #[error("not valid PEM: {0}")]
    Invalid(RustlsError),
    /// Reading failed.
    #[error("{0}")]
    Io(io::Error),
}

impl TlsError {
    /// The setting at fault: `tls.ca_file`, `tls.client_cert`,
    /// `tls.client_key` or `tls`.
    pub fn key(&self) -> &'static str {
        match self {
            TlsError::Read { key, .. } | TlsError::Pem { key, .. } => key,
            TlsError::Certificate { .. } => "tls.ca_file",
            TlsError::CertWithoutKey => "tls.client_cert",
            TlsError::KeyWithoutCert | TlsError::KeyMismatch(_) => "tls.client_key",
            TlsError::Protocol(_) => "tls",
        }
    }
}

/// The rustls client config for `tls`: its roots (the CA file's, or the system's) and its
/// client certificate, if any; ALPN is left to the connector. `needs_roots` names who will use
/// it: with no `ca_file` and no system root, one warning is logged for it (every handshake will
/// fail); `None` logs nothing (a config check).
#[cfg(feature = "rustls")]
pub fn client_config(
    tls: &TlsFiles,
    needs_roots: Option<&str>,
) -> Result<rustls::ClientConfig, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca_file {
        Some(path) => {
            for c in read_certs("tls.ca_file", path)? {
                roots
                    .add(c)
                    .map_err(|e| TlsError::Certificate { path: path.clone(), source: e.into() })?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0
                && let Some(dependency) = needs_roots
            {
                // Not an error here: every handshake will fail, and say so.
                tracing::warn!(
                    user = dependency,
                    error = native.errors.first().map(tracing::field::display),
                    "no system root certificates found; TLS to it needs a CA file (tls.ca_file, or ca_file in a rediss:// URL)"
                );
            }
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Protocol(e.into()))?
        .with_root_certificates(roots);
    match (&tls.client_cert, &tls.client_key) {
        (None, None) => Ok(builder.with_no_client_auth()),
        (Some(_), None) => Err(TlsError::CertWithoutKey),
        (None, Some(_)) => Err(TlsError::KeyWithoutCert),
        (Some(cert), Some(key_path)) => {
            let chain = read_certs("tls.client_cert", cert)?;
            let pem_text = read_pem("tls.client_key", key_path)?;
            let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(&pem_text).map_err(|e| {
                TlsError::Pem {
                    key: "tls.client_key",
                    path: key_path.clone(),
                    reason: PemProblem::NoKey(Box::new(pem(e))),
                }
            })?;
            builder.with_client_auth_cert(chain, key).map_err(|e| TlsError::KeyMismatch(e.into()))
        }
    }
}

/// Every certificate in a PEM file; at least one.
#[cfg(feature = "rustls")]
fn read_certs(
    key: &'static str,
    path: &std::path::Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, TlsError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let text = read_pem(key, path)?;
    let bad = |reason| TlsError::Pem { key, path: path.to_path_buf(), reason };
    let certs = CertificateDer::pem_slice_iter(&text)
        .map(|c| c.map(|c| c.into_owned()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(pem(e)))?;
    if certs.is_empty() {
        return Err(bad(PemProblem::NoCertificate));
    }
    Ok(certs)
}

/// A PEM file's bytes: a regular file of at most 16 MiB (`/dev/zero` or a FIFO is refused, not
/// read forever).
#[cfg(feature = "rustls")]
fn read_pem(key: &'static str, path: &std::path::Path) -> Result<Vec<u8>, TlsError> {
    stormguard_input::read(path, stormguard_input::MAX_FILE).map_err(|source| TlsError::Read {
        key,
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(feature = "rustls")]
fn pem(e: rustls::pki_types::pem::Error) -> PemProblem {
    match e {
        rustls::pki_types::pem::Error::Io(e) => PemProblem::Io(e),
        rustls::pki_types::pem::Error::NoItemsFound => PemProblem::NothingOfThatKind,
        other => PemProblem::Invalid(other.into()),
    }
}
