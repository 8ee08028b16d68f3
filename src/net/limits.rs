//! Bounds on connections per listener and requests in flight. Invariant: beyond them, new
//! connections wait in the kernel's accept queue rather than growing Ferry's memory.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A TCP listener that accepts at most `limit` connections at a time.
#[derive(Debug)]
pub struct LimitedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
}

impl LimitedListener {
    pub fn new(inner: TcpListener, limit: usize) -> Self {
        LimitedListener {
            inner,
            permits: Arc::new(Semaphore::new(limit)),
        }
    }
}

impl LimitedListener {
    pub fn is_full(&self) -> bool {
        self.permits.available_permits() == 0
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = LimitedStream;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The semaphore is never closed; unlimited rather than a panic if it were.
        let permit = self.permits.clone().acquire_owned().await.ok();
        let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        let _ = stream.set_nodelay(true);
        (
            LimitedStream {
                inner: stream,
                _permit: permit,
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection holding its slot until it is closed.
#[derive(Debug)]
pub struct LimitedStream {
    inner: TcpStream,
    _permit: Option<OwnedSemaphorePermit>,
}

impl LimitedStream {
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }

    /// The socket, for `sendfile` (`registry::zero_copy`).
    pub fn tcp(&self) -> &TcpStream {
        &self.inner
    }
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for LimitedStream {
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

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Keeps a request counted (its connection busy, its slot taken) while held: a response that
/// hands its connection over (the zero-copy upgrade) holds it until the send ends.
#[derive(Clone)]
pub struct Hold {
    _held: Arc<dyn std::any::Any + Send + Sync>,
}

impl Hold {
    pub(crate) fn new(held: Arc<dyn std::any::Any + Send + Sync>) -> Hold {
        Hold { _held: held }
    }
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

/// Lets one of many like events into the log at most every `every`, with how many there were:
/// whoever sends refused requests by the thousand must not fill the disk.
#[derive(Debug)]
pub(crate) struct LogEvery {
    every: Duration,
    since: AtomicU64,
    logged_at: Mutex<Option<Instant>>,
}

impl LogEvery {
    pub(crate) const fn new(every: Duration) -> LogEvery {
        LogEvery {
            every,
            since: AtomicU64::new(0),
            logged_at: Mutex::new(None),
        }
    }

    /// `Some(count)` when this event is to be logged: the events since the last logged one,
    /// this one included.
    pub(crate) fn tick(&self) -> Option<u64> {
        self.since.fetch_add(1, Ordering::Relaxed);
        let mut at = self.logged_at.lock().unwrap_or_else(|e| e.into_inner());
        if at.is_some_and(|t| t.elapsed() < self.every) {
            return None;
        }
        *at = Some(Instant::now());
        Some(self.since.swap(0, Ordering::Relaxed))
    }
}

/// At most `chars` characters of `text`, for logs.
pub(crate) fn shortened(text: &str, chars: usize) -> &str {
    text.char_indices()
        .nth(chars)
        .map_or(text, |(i, _)| &text[..i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;

    #[tokio::test]
    async fn a_connection_beyond_the_limit_waits_until_one_closes() {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let mut listener = LimitedListener::new(tcp, 1);
        let _c1 = TcpStream::connect(addr).await.unwrap();
        let _c2 = TcpStream::connect(addr).await.unwrap();
        let (first, _) = listener.accept().await;
        let second = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        assert!(
            second.is_err(),
            "the second connection must wait for a slot"
        );
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), listener.accept()).await;
        assert!(second.is_ok(), "a closed connection frees its slot");
    }

    #[test]
    fn one_event_is_logged_then_the_rest_are_counted() {
        let log = LogEvery::new(Duration::from_secs(3600));
        assert_eq!(log.tick(), Some(1));
        for _ in 0..5 {
            assert_eq!(log.tick(), None);
        }
        let now = LogEvery::new(Duration::ZERO);
        assert_eq!(now.tick(), Some(1));
        assert_eq!(now.tick(), Some(1));
        assert_eq!(shortened("abcdef", 3), "abc");
        assert_eq!(shortened("ab", 3), "ab");
        assert_eq!(shortened("ééé", 2), "éé");
    }
}
