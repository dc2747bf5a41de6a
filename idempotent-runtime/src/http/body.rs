//! Reading a response body up to the size the route stores, without losing what comes after.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum_core::body::Body;
use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

/// A response body, read as far as needed to store it.
pub(crate) enum Buffered {
    /// The whole body, at most the limit long (its trailers, if any, are dropped).
    Whole(Bytes),
    /// The body is longer than the limit (or says so up front): what was read of it, and the rest.
    Longer(Body),
    /// The body failed before its end.
    Failed(axum_core::Error),
}

/// Reads `body` until its end or until it passes `limit` bytes.
pub(crate) async fn buffer(mut body: Body, limit: usize) -> Buffered {
    if usize::try_from(http_body::Body::size_hint(&body).lower()).map_or(true, |len| len > limit) {
        return Buffered::Longer(body);
    }
    let mut read = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Buffered::Whole(read.freeze()),
            Some(Err(error)) => return Buffered::Failed(error),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers
                };
                read.extend_from_slice(&data);
                if read.len() > limit {
                    return Buffered::Longer(Body::new(Prefixed {
                        prefix: Some(read.freeze()),
                        rest: body,
                    }));
                }
            }
        }
    }
}

/// A body that yields `prefix`, then `rest`.
struct Prefixed {
    prefix: Option<Bytes>,
    rest: Body,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = axum_core::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(prefix));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(prefix));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn all(body: Body) -> Bytes {
        body.collect().await.unwrap().to_bytes()
    }

    /// A body of data frames that gives no size hint, as a stream does.
    fn chunked(chunks: &'static [&'static [u8]]) -> Body {
        struct Chunks(std::slice::Iter<'static, &'static [u8]>);
        impl http_body::Body for Chunks {
            type Data = Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
                Poll::Ready(
                    self.0
                        .next()
                        .map(|c| Ok(Frame::data(Bytes::from_static(c)))),
                )
            }
        }
        Body::new(Chunks(chunks.iter()))
    }

    #[tokio::test]
    async fn a_body_within_the_limit_is_read_whole() {
        match buffer(chunked(&[b"ab", b"cd"]), 4).await {
            Buffered::Whole(bytes) => assert_eq!(&bytes[..], b"abcd"),
            _ => panic!("not whole"),
        }
    }

    #[tokio::test]
    async fn a_longer_body_is_passed_on_whole() {
        match buffer(chunked(&[b"ab", b"cd", b"ef"]), 3).await {
            Buffered::Longer(body) => assert_eq!(&all(body).await[..], b"abcdef"),
            _ => panic!("not longer"),
        }
        // A body that says up front it is longer is not read at all.
        match buffer(Body::from("abcdef"), 3).await {
            Buffered::Longer(body) => assert_eq!(&all(body).await[..], b"abcdef"),
            _ => panic!("not longer"),
        }
    }
}
