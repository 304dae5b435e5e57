//! What a model provider's error answer says in its body, read below the cap: with
//! `provider = "openai"`, a 429 whose error is `insufficient_quota` is the account's quota or
//! billing, not a rate. It is marked [`QuotaExhausted`], so the retry layer never retries it and
//! rate admission holds the upstream for `quota_hold` (see docs/providers.md).
//!
//! Only a 429 from an OpenAI-preset dependency is read, up to [`READ_AT_MOST`] bytes (an error
//! answer is a few hundred); what was read is sent on to the caller unchanged, followed by the
//! rest when there was more. Every other answer passes through untouched.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use stormguard_tower::BoxError;
use stormguard_tower::Provider;
use stormguard_tower::extensions::QuotaExhausted;

/// The most of a 429's body read to find its error code.
pub(crate) const READ_AT_MOST: usize = 64 * 1024;

/// An upstream's answer body, with the part read below the cap (if any) in front.
#[derive(Debug)]
pub(crate) struct ProviderBody {
    head: Option<Bytes>,
    /// Trailers read with the head (the body had ended).
    trailers: Option<http::HeaderMap>,
    rest: Option<Incoming>,
}

impl ProviderBody {
    pub(crate) fn untouched(body: Incoming) -> ProviderBody {
        ProviderBody { head: None, trailers: None, rest: Some(body) }
    }
}

impl Body for ProviderBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        match self.rest.as_mut() {
            None => Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t)))),
            Some(rest) => Pin::new(rest).poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let rest = self.rest.as_ref().map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        stormguard_http::body::hint_after(head, &rest)
    }
}

/// Whether an error body says the quota is spent: OpenAI's `"code": "insufficient_quota"` (or
/// its `type`).
fn says_quota_spent(body: &[u8]) -> bool {
    body.windows(b"\"insufficient_quota\"".len()).any(|w| w == b"\"insufficient_quota\"")
}

/// Whether an answer's body is read before it goes on: an OpenAI 429, for a spent quota.
pub(crate) fn needs_inspection<B>(provider: Option<Provider>, resp: &Response<B>) -> bool {
    provider == Some(Provider::OpenAi) && resp.status() == StatusCode::TOO_MANY_REQUESTS
}

/// The answer as the layers above see it: a 429 from an OpenAI-preset provider read and, when
/// its error is `insufficient_quota`, marked [`QuotaExhausted`].
pub(crate) async fn inspect(
    provider: Option<Provider>,
    result: Result<Response<Incoming>, BoxError>,
) -> Result<Response<ProviderBody>, BoxError> {
    let resp = result?;
    if !needs_inspection(provider, &resp) {
        return Ok(resp.map(ProviderBody::untouched));
    }
    let (mut parts, mut body) = resp.into_parts();
    let mut read = BytesMut::new();
    let mut trailers = None;
    let ended = read_some(&mut body, &mut read, &mut trailers).await?;
    if says_quota_spent(&read) {
        parts.extensions.insert(QuotaExhausted);
    }
    let head = (!read.is_empty()).then(|| read.freeze());
    let rest = (!ended).then_some(body);
    Ok(Response::from_parts(parts, ProviderBody { head, trailers, rest }))
}

/// Reads `body` into `read` up to [`READ_AT_MOST`] bytes (and its trailers, if it ends with
/// some): `true` when it ended, `false` when more is left.
async fn read_some(
    body: &mut Incoming,
    read: &mut BytesMut,
    trailers: &mut Option<http::HeaderMap>,
) -> Result<bool, BoxError> {
    use http_body_util::BodyExt;
    while read.len() < READ_AT_MOST {
        match body.frame().await {
            None => return Ok(true),
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => read.extend_from_slice(&d),
                Err(f) => {
                    *trailers = f.into_trailers().ok();
                    return Ok(true);
                }
            },
        }
    }
    Ok(body.is_end_stream())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_quota_code_is_a_spent_quota() {
        let quota = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        let rate = br#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        assert!(says_quota_spent(quota));
        assert!(!says_quota_spent(rate));
        assert!(!says_quota_spent(b"insufficient_quota")); // not a JSON string
    }
}
