//! The write half of a connection wrapper that only watches reads (the listener's
//! `Watched` for caller connections, tokio's `AsyncWrite`; the upstream
//! client's `SettingsStream`, hyper's `rt::Write`): every write method forwarded to one field.
//! The two traits have the same methods, so one macro writes both.

/// Inside an `impl AsyncWrite` or `impl hyper::rt::Write` block: forwards every method to
/// `self.$field`.
macro_rules! forward_writes {
    ($field:ident) => {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.get_mut().$field).poll_write(cx, buf)
        }

        fn poll_write_vectored(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.get_mut().$field).poll_write_vectored(cx, bufs)
        }

        fn is_write_vectored(&self) -> bool {
            self.$field.is_write_vectored()
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.get_mut().$field).poll_flush(cx)
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.get_mut().$field).poll_shutdown(cx)
        }
    };
}

pub(crate) use forward_writes;
