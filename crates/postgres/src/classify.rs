//! What a transaction's failure is, read from its SQLSTATE and from where it happened.

use stormguard_tower::call::{Failure, Outcome};
use tokio_postgres::error::SqlState;

/// How a transaction's attempt failed, and where: what a retry may assume differs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No connection could be had: nothing ran.
    #[error("could not connect to PostgreSQL: {0}")]
    Connect(#[source] tokio_postgres::Error),
    /// A statement of the transaction (or its `BEGIN`) failed before `COMMIT`: whatever it did
    /// is rolled back.
    #[error("{0}")]
    Query(#[source] tokio_postgres::Error),
    /// `COMMIT` failed: unless PostgreSQL said why (a serialization failure at commit), the
    /// transaction may have been committed.
    #[error("commit failed: {0}")]
    Commit(#[source] tokio_postgres::Error),
}

impl Error {
    /// The underlying error.
    pub fn source_error(&self) -> &tokio_postgres::Error {
        match self {
            Error::Connect(e) | Error::Query(e) | Error::Commit(e) => e,
        }
    }

    /// The SQLSTATE, when PostgreSQL sent one.
    pub fn code(&self) -> Option<&SqlState> {
        self.source_error().code()
    }

    /// Whether the session is gone: the connection closed or failed below SQL (an I/O error in
    /// the error's chain), or PostgreSQL ended it (`08…`, `57P01`, `57P02`, `57P03`, `53300`).
    /// An error without a SQLSTATE that is neither — a row count that was not one, a value that
    /// did not convert — is the caller's, and the session is intact.
    pub fn session_lost(&self) -> bool {
        let e = self.source_error();
        match e.code().map(SqlState::code) {
            Some(code) => {
                code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300")
            }
            None => e.is_closed() || io_below(e),
        }
    }
}

/// Whether an I/O error is in `e`'s chain of sources.
fn io_below(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = e.source();
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The pool's classifier: what each SQLSTATE means for a retry.
///
/// | failure | outcome |
/// | --- | --- |
/// | `40001` serialization failure, `40P01` deadlock, `55P03` lock not available | contention: took no effect (rolled back), retried even when not idempotent; the breaker does not count it |
/// | no connection: `08…`, `53300` too many connections, `57P03` cannot connect now, an I/O error | a connect failure: nothing ran |
/// | `28…` authentication, `3D000` no such database (while connecting) | final: a retry cannot help |
/// | before `COMMIT`: `57P01` admin shutdown, `57P02` crash shutdown, `08…`, a lost connection | transient, took no effect (nothing was committed) |
/// | before `COMMIT`: `57014` statement timeout or cancel | a timeout that took no effect |
/// | at `COMMIT`: a lost connection or shutdown | transient: it may have committed — retried only when idempotent |
/// | anything else (a constraint, a syntax error, bad data; without a SQLSTATE, a row count or a conversion the caller asked for) | final: the caller's answer |
pub fn classify<T>(result: &Result<T, Error>) -> Outcome {
    let error = match result {
        Ok(_) => return Outcome::Success,
        Err(e) => e,
    };
    let code = error.code().map(SqlState::code);
    let contention = matches!(code, Some("40001" | "40P01" | "55P03"));
    if contention {
        return Outcome::Failure(Failure::contention());
    }
    let class = code.map(|c| &c[..2]);
    let lost = error.session_lost();
    match error {
        Error::Connect(_) if matches!(class, Some("28")) || code == Some("3D000") => Outcome::Final,
        // No connection: nothing ran, whatever the reason.
        Error::Connect(_) => Outcome::Failure(Failure::connect()),
        Error::Query(_) if code == Some("57014") => {
            Outcome::Failure(Failure::timeout().took_no_effect())
        }
        Error::Query(_) if lost => Outcome::Failure(Failure::transient().took_no_effect()),
        Error::Commit(_) if lost => Outcome::Failure(Failure::transient()),
        Error::Query(_) | Error::Commit(_) => Outcome::Final,
    }
}
