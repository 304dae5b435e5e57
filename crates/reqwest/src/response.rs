//! A `reqwest::Response` with another body: the attempt's slot moved into it, or a failed
//! response kept in memory while its retry is tried.
//!
//! reqwest converts its responses to and from `http::Response`; only the URL (which
//! `Response::url` reads from an extension that only reqwest's builder can set) needs carrying
//! across.

use bytes::Bytes;
use reqwest::{ResponseBuilderExt, Url};
use stormguard_core::limiter::Permit;
use stormguard_tower::{BoxError, Dependency, PermitBody};

/// Takes a response apart: its URL and the `http::Response` reqwest makes of it (extensions,
/// and the body with its read timeouts, included).
fn into_http(resp: reqwest::Response) -> (Url, http::Response<reqwest::Body>) {
    let url = resp.url().clone();
    (url, resp.into())
}

/// Puts a response back together with `body`.
fn from_http<B>(url: Url, resp: http::Response<B>) -> reqwest::Response
where
    B: http_body::Body + Send + Sync + 'static,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    let (mut parts, body) = resp.into_parts();
    // The builder is the one place that can set the URL reqwest reports.
    if let Ok(with_url) = http::Response::builder().url(url).body(()) {
        parts.extensions.extend(with_url.into_parts().0.extensions);
    }
    reqwest::Response::from(http::Response::from_parts(parts, reqwest::Body::wrap(body)))
}

/// The response of an admitted attempt, holding its slots until its body ends, fails or is
/// dropped: a caller slowly reading a large body is still load on the dependency. Its booking
/// in the provider's window, under rate admission, is settled from the `usage` the body states.
pub(crate) fn holding(
    resp: reqwest::Response,
    (permit, total): (Option<Permit>, Option<Permit>),
    rate: Option<stormguard_tower::rate::RateReservation>,
    dep: &Dependency,
) -> reqwest::Response {
    let (url, resp) = into_http(resp);
    from_http(
        url,
        resp.map(|body| PermitBody::new(body, permit, total, dep.clone()).with_rate(rate)),
    )
}

/// Reads a failed response to the end if it fits `limit` (which frees its slot) and keeps it
/// for the caller in case the retry is refused; past the limit, `Err` with the response as it
/// was (what was read, then the rest).
pub(crate) async fn keep(
    resp: reqwest::Response,
    limit: usize,
) -> Result<reqwest::Response, reqwest::Response> {
    let (url, resp) = into_http(resp);
    match stormguard_tower::retry::keep(resp, limit).await {
        Ok(kept) => Ok(from_http(url, kept)),
        Err(partial) => Err(from_http(url, partial)),
    }
}
