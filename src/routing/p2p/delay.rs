//! A fixed one-way delay on every byte a peer connection receives, for the scale simulation
//! (`benches/scale.rs`, docs/benchmarks.md): `netem` is not in every kernel, and tokio's
//! millisecond timers are too coarse for a datacenter hop, so one thread (`DelayLine`) wakes
//! readers with the kernel's sub-millisecond sleep. Invariant: never used in Ferry itself.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::{Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures::{AsyncRead, AsyncWrite};

/// Beyond this the reader stops reading, so TCP flow control slows the sender.
const MAX_HELD: usize = 1 << 20;
const CHUNK: usize = 64 * 1024;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; CHUNK]);
}

/// A stream whose received bytes become readable `delay` after they arrived.
#[derive(Debug)]
pub(super) struct Delayed<S> {
    inner: S,
    delay: Duration,
    held: VecDeque<(Instant, Vec<u8>)>,
    held_bytes: usize,
    /// Bytes of the front chunk already read.
    offset: usize,
    /// The socket ended (or failed): delivered after the held bytes.
    end: Option<io::Result<()>>,
}

impl<S> Delayed<S> {
    pub(super) fn new(inner: S, delay: Duration) -> Self {
        Delayed {
            inner,
            delay,
            held: VecDeque::new(),
            held_bytes: 0,
            offset: 0,
            end: None,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Delayed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        // Take everything the socket has now, stamped with when it may be read.
        while this.end.is_none() && this.held_bytes < MAX_HELD {
            // Reused: a zeroed 64 KiB buffer per read cost more CPU than the nodes' own work.
            let read = SCRATCH.with_borrow_mut(|scratch| {
                Pin::new(&mut this.inner)
                    .poll_read(cx, scratch)
                    .map_ok(|n| scratch[..n].to_vec())
            });
            match read {
                Poll::Ready(Ok(chunk)) if chunk.is_empty() => this.end = Some(Ok(())),
                Poll::Ready(Ok(chunk)) => {
                    this.held_bytes += chunk.len();
                    this.held.push_back((Instant::now() + this.delay, chunk));
                }
                Poll::Ready(Err(e)) => this.end = Some(Err(e)),
                Poll::Pending => break,
            }
        }
        if let Some((due, chunk)) = this.held.front() {
            if *due > Instant::now() {
                delay_line().wake_at(*due, cx.waker().clone());
                return Poll::Pending;
            }
            let len = chunk.len();
            let n = (len - this.offset).min(buf.len());
            buf[..n].copy_from_slice(&chunk[this.offset..this.offset + n]);
            this.offset += n;
            if this.offset == len {
                this.held.pop_front();
                this.held_bytes -= len;
                this.offset = 0;
            }
            return Poll::Ready(Ok(n));
        }
        match this.end.take() {
            Some(Ok(())) => {
                this.end = Some(Ok(()));
                Poll::Ready(Ok(0))
            }
            Some(Err(e)) => Poll::Ready(Err(e)),
            // The socket registered the waker when it said Pending.
            None => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Delayed<S> {
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

/// Wakers by the time they are due, and the thread that wakes them.
struct DelayLine {
    queue: Mutex<BinaryHeap<Reverse<Due>>>,
    thread: std::thread::Thread,
}

struct Due(Instant, Waker);

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.cmp(&other.0)
    }
}

impl DelayLine {
    fn wake_at(&self, at: Instant, waker: Waker) {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let earliest = queue.peek().is_none_or(|Reverse(d)| at < d.0);
        queue.push(Reverse(Due(at, waker)));
        drop(queue);
        if earliest {
            self.thread.unpark();
        }
    }
}

fn delay_line() -> &'static DelayLine {
    static LINE: OnceLock<DelayLine> = OnceLock::new();
    LINE.get_or_init(|| {
        let thread = std::thread::Builder::new()
            .name("ferry-delay-line".into())
            .spawn(|| {
                loop {
                    let line = delay_line();
                    let mut due = Vec::new();
                    let next = {
                        let mut queue = line.queue.lock().unwrap_or_else(|e| e.into_inner());
                        let now = Instant::now();
                        while let Some(Reverse(d)) = queue.peek()
                            && d.0 <= now
                        {
                            if let Some(Reverse(d)) = queue.pop() {
                                due.push(d.1);
                            }
                        }
                        queue.peek().map(|Reverse(d)| d.0)
                    };
                    due.into_iter().for_each(Waker::wake);
                    match next {
                        Some(at) => {
                            std::thread::park_timeout(at.saturating_duration_since(Instant::now()))
                        }
                        None => std::thread::park(),
                    }
                }
            })
            .unwrap_or_else(|e| panic!("cannot start the delay line thread: {e}"));
        DelayLine {
            queue: Mutex::new(BinaryHeap::new()),
            thread: thread.thread().clone(),
        }
    })
}

#[cfg(test)]
mod tests {
    use futures::AsyncReadExt;

    use super::*;

    #[test]
    fn bytes_arrive_whole_and_in_order_after_the_delay() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let delay = Duration::from_micros(2_500);
        let mut stream = Delayed::new(futures::io::Cursor::new(data.clone()), delay);
        let started = Instant::now();
        let mut got = Vec::new();
        futures::executor::block_on(stream.read_to_end(&mut got)).unwrap();
        assert_eq!(got, data);
        assert!(started.elapsed() >= delay, "{:?}", started.elapsed());
    }
}
