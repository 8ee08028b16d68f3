//! Tells a dialler with another cluster secret apart at once, on the listening side: every
//! libp2p dialler sends the negotiation header first, so anything else after the
//! private-network handshake is another key (`libp2p-pnet` never checks it).
//!
//! Invariant: the bytes read are handed back to the negotiation unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncReadExt, AsyncWrite};

/// The first bytes every libp2p dialler sends: multistream-select's length-prefixed header.
const NEGOTIATION_HEADER: &[u8; 20] = b"\x13/multistream/1.0.0\n";

const KEY_MISMATCH: &str = "cluster secrets differ";

/// Whether a dial's error text is a node that answered and could not agree (noise failing);
/// refused, timed-out or cut-short dials are not (docs/design/private-network.md).
pub(super) fn dial_failed_handshake(causes: &str) -> bool {
    causes.contains("Handshake failed")
}

/// Whether an incoming connection's error is [`expect_same_key`]'s: a dialler with another key
/// (a dialler gone or silent, like a port scan, is not).
pub(super) fn incoming_failed_handshake(causes: &str) -> bool {
    causes.contains(KEY_MISMATCH)
}

/// An error and its causes, as libp2p prints a dial's; a listen error prints none.
pub(super) fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

/// The stream to negotiate on if the dialler's first bytes are the header, else an error
/// naming a different cluster secret.
pub(super) async fn expect_same_key<S: AsyncRead + Unpin>(mut stream: S) -> io::Result<Replay<S>> {
    let mut first = [0u8; NEGOTIATION_HEADER.len()];
    stream.read_exact(&mut first).await?;
    if &first != NEGOTIATION_HEADER {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the dialler's first bytes are not a libp2p handshake once decrypted: the {KEY_MISMATCH} (one side may have none), or it is not a Ferry"
            ),
        ));
    }
    Ok(Replay {
        head: first,
        read: 0,
        inner: stream,
    })
}

/// `inner`, whose first bytes (already read from it) are read again first.
#[derive(Debug)]
pub(super) struct Replay<S> {
    head: [u8; NEGOTIATION_HEADER.len()],
    read: usize,
    inner: S,
}

impl<S> Replay<S> {
    /// `inner` with nothing to read again (the dialling side).
    pub(super) fn unread(inner: S) -> Self {
        Replay {
            head: *NEGOTIATION_HEADER,
            read: NEGOTIATION_HEADER.len(),
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.read < this.head.len() {
            let n = buf.len().min(this.head.len() - this.read);
            buf[..n].copy_from_slice(&this.head[this.read..this.read + n]);
            this.read += n;
            return Poll::Ready(Ok(n));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::io::Cursor;

    #[tokio::test]
    async fn the_header_is_read_again_then_the_rest() {
        let mut sent = NEGOTIATION_HEADER.to_vec();
        sent.extend_from_slice(b"\x07/noise\n and the rest");
        let mut stream = expect_same_key(Cursor::new(sent.clone())).await.unwrap();
        // Small reads cross from the replayed bytes to the stream's own.
        let mut got = Vec::new();
        let mut chunk = [0u8; 7];
        loop {
            let n = stream.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(got, sent);
    }

    #[tokio::test]
    async fn other_bytes_are_another_key() {
        let mut garbage = NEGOTIATION_HEADER.to_vec();
        garbage[5] ^= 0x40;
        garbage.extend_from_slice(b"more");
        let err = expect_same_key(Cursor::new(garbage)).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("cluster secrets differ"), "{err}");
    }

    #[test]
    fn dial_errors_that_are_a_node_with_another_key() {
        // As libp2p prints them (the dial's error chain).
        for (error, failed_handshake) in [
            (
                "Failed to negotiate transport protocol(s): [(/ip4/10.0.0.2/tcp/5482: : Handshake failed: An I/O error occurred)]",
                true,
            ),
            (
                "Failed to negotiate transport protocol(s): [(/ip4/10.0.0.2/tcp/5482: : private-network handshake failed: Handshake error: early eof)]",
                false,
            ),
            (
                "Failed to negotiate transport protocol(s): [(/ip4/10.0.0.2/tcp/5482: : Connection refused (os error 111))]",
                false,
            ),
            (
                "Failed to negotiate transport protocol(s): [(/ip4/10.0.0.2/tcp/5482: : Timeout has been reached)]",
                false,
            ),
        ] {
            assert_eq!(dial_failed_handshake(error), failed_handshake, "{error}");
        }
    }

    #[tokio::test]
    async fn incoming_errors_that_are_a_node_with_another_key() {
        let mismatch = expect_same_key(Cursor::new(vec![0x55; 40]))
            .await
            .unwrap_err();
        let wrapped = io::Error::other(mismatch);
        assert!(
            incoming_failed_handshake(&causes(&wrapped)),
            "{}",
            causes(&wrapped)
        );
        let probe = expect_same_key(Cursor::new(Vec::new())).await.unwrap_err();
        assert!(!incoming_failed_handshake(&causes(&probe)), "a TCP probe");
        let quiet = io::Error::new(io::ErrorKind::TimedOut, "Timeout has been reached");
        assert!(!incoming_failed_handshake(&causes(&quiet)), "a hung client");
        let gone = io::Error::other("Handshake failed: Connection reset by peer");
        assert!(
            !incoming_failed_handshake(&causes(&gone)),
            "a dialler gone mid-noise"
        );
    }

    #[tokio::test]
    async fn a_dialler_that_hangs_up_early_is_an_error_not_a_connection() {
        let err = expect_same_key(Cursor::new(b"\x13/multi".to_vec()))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
