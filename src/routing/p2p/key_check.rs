//! Tells a dialler with another cluster secret apart at once, on the listening side: every
//! libp2p dialler sends the negotiation header first, so anything else after the
//! private-network handshake is another key, and the connection is closed (`libp2p-pnet` never
//! checks the key itself, and such a dial would hang until the connection timeout).
//!
//! Invariant: the bytes read are handed back to the negotiation unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncReadExt, AsyncWrite};

/// The first bytes every libp2p dialler sends: multistream-select's header,
/// `/multistream/1.0.0\n` behind its length (19, one varint byte).
const NEGOTIATION_HEADER: &[u8; 20] = b"\x13/multistream/1.0.0\n";

/// What [`expect_same_key`] says when the first bytes are wrong.
const KEY_MISMATCH: &str = "cluster secrets differ";

/// Whether a dial's error (its text, which lists its causes: libp2p keeps no other trace of
/// them) is a
/// node that answered and could not agree with this one: noise failing after the
/// negotiation, which is how a listener's check (or an older node's garbled negotiation)
/// ends a dial with another key. A refused or unreachable address is a node not up yet, a
/// timeout one that is down or hung; a private-network handshake cut before the other's
/// nonce is a node going away as often as a node without a secret (which says so itself,
/// on its incoming side), so it is not counted either.
pub(super) fn dial_failed_handshake(causes: &str) -> bool {
    causes.contains("Handshake failed")
}

/// Whether an incoming connection's error is a dialler with another key (or none when this
/// node has one, or the reverse): only the check above can say so. A dialler that went away
/// mid-handshake (a dial it won elsewhere, its own timeout), closed or stayed quiet before
/// sending anything (a port scan, a TCP health check) is not counted.
pub(super) fn incoming_failed_handshake(causes: &str) -> bool {
    causes.contains(KEY_MISMATCH)
}

/// An error and its causes, `: `-separated, as libp2p prints a dial's: a listen error prints
/// none of them.
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

/// Reads the dialler's first bytes on `stream` (after the private-network handshake): the
/// stream to negotiate on when they are the negotiation's header, an error naming a
/// different cluster secret otherwise.
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
    /// How much of `head` was handed out.
    read: usize,
    inner: S,
}

impl<S> Replay<S> {
    /// `inner` with nothing to read again: the dialling side, which reads nothing first.
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
        // Small reads cross the boundary between the replayed bytes and the stream's own.
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
        // What a dialler with another key's header decrypts to: anything but the header.
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
