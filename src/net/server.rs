//! Serving a router with hyper directly, with the bounds of docs/security.md: a deadline to each
//! request head (hyper's starts only at the first byte; HTTP/2's preface has none), eviction of
//! the longest-idle at the limit, requests counted until their body is sent. Invariant: a
//! connection is closed only while none of its requests is being answered.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::serve::Listener;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::net::limits::LimitedListener;

/// containerd and peers send a request's head at once; 10 s is generous for a loaded node.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);

/// Connections closed at once when the listener is full (see `evict_longest_idle`).
const EVICT_BATCH: usize = 64;
/// hyper's write queue per connection (default about 400 KiB): a reader that stops reading
/// holds at most one more body chunk in memory, not two.
const WRITE_QUEUE_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub head_deadline: Duration,
    /// Requests answered at once, bodies included; more wait for a slot.
    pub in_flight: usize,
}

/// Accepts until `stop`, then returns once open connections have finished their requests.
pub async fn serve(
    mut listener: LimitedListener,
    router: axum::Router,
    bounds: Bounds,
    stop: CancellationToken,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.head_deadline)
        .max_buf_size(WRITE_QUEUE_BYTES);
    let graceful = GracefulShutdown::new();
    let table = Arc::new(Connections::default());
    let in_flight = Arc::new(Semaphore::new(bounds.in_flight));
    loop {
        if listener.is_full() {
            table.evict_longest_idle();
        }
        let (stream, remote) = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let conn_state = table.register();
        let addrs = ConnAddrs {
            remote,
            local: stream.local_addr().ok(),
        };
        let service = {
            let (router, conn, in_flight) = (router.clone(), conn_state.clone(), in_flight.clone());
            TowerToHyperService::new(tower::service_fn(move |mut req: hyper::Request<_>| {
                // Who asks, for handlers that answer this host only (`/status`).
                req.extensions_mut().insert(addrs);
                answer(req, router.clone(), conn.clone(), in_flight.clone())
            }))
        };
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        let (table, deadline) = (table.clone(), bounds.head_deadline);
        tokio::spawn(async move {
            tokio::select! {
                ended = conn => if let Err(e) = ended {
                    tracing::trace!(error = %e, "connection ended with an error");
                },
                // Dropping the connection closes its socket.
                () = conn_state.idle_too_long(deadline) => {
                    tracing::trace!("closed a connection that sent no request in time");
                }
            }
            table.remove(&conn_state);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// The listener's open connections, for eviction at the limit.
#[derive(Default)]
struct Connections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
}

impl Connections {
    fn register(&self) -> Arc<ConnState> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState {
            id,
            busy: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            evict: Notify::new(),
        });
        self.lock().insert(id, state.clone());
        state
    }

    fn remove(&self, state: &ConnState) {
        self.lock().remove(&state.id);
    }

    /// Closes the [`EVICT_BATCH`] connections idle longest: a batch, because one eviction per
    /// accept drains a burst in the kernel's queue too slowly.
    fn evict_longest_idle(&self) {
        let open = self.lock();
        let mut idle: Vec<&Arc<ConnState>> = open
            .values()
            .filter(|c| c.busy.load(Ordering::Acquire) == 0)
            .collect();
        idle.sort_by_key(|c| c.idle_since());
        idle.truncate(EVICT_BATCH);
        tracing::debug!(
            open = open.len(),
            closing = idle.len(),
            "at the connection limit: closing the connections idle longest"
        );
        for victim in idle {
            victim.evict.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnState>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct ConnState {
    id: u64,
    busy: AtomicUsize,
    idle_since: Mutex<Instant>,
    evict: Notify,
}

impl ConnState {
    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_idle_since(&self, at: Instant) {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    /// Returns once the connection has been idle for `deadline`, or is evicted while idle.
    async fn idle_too_long(&self, deadline: Duration) {
        loop {
            let busy = self.busy.load(Ordering::Acquire) > 0;
            let wait = if busy {
                deadline
            } else {
                let idle = self.idle_since().elapsed();
                if idle >= deadline {
                    return;
                }
                deadline - idle
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.evict.notified() => {
                    if self.busy.load(Ordering::Acquire) == 0 {
                        return;
                    }
                }
            }
        }
    }
}

/// A request being answered, until its response body is sent or dropped.
struct Busy {
    conn: Arc<ConnState>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn.set_idle_since(Instant::now());
        self.conn.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
    router: axum::Router,
    conn: Arc<ConnState>,
    in_flight: Arc<Semaphore>,
) -> Result<axum::response::Response, std::convert::Infallible> {
    conn.busy.fetch_add(1, Ordering::AcqRel);
    let mut busy = Busy { conn, _slot: None };
    // The semaphore is never closed; without a slot the request is answered anyway.
    busy._slot = in_flight.acquire_owned().await.ok();
    let response = router.oneshot(req).await?;
    Ok(response.map(|body| Body::new(Tracked { body, _busy: busy })))
}

/// Both ends of a request's connection, in its extensions.
#[derive(Debug, Clone, Copy)]
pub struct ConnAddrs {
    pub remote: std::net::SocketAddr,
    pub local: Option<std::net::SocketAddr>,
}

impl ConnAddrs {
    /// The client came from loopback (IPv4-mapped included) or from the address it connected to.
    pub fn same_host(&self) -> bool {
        let ip = self.remote.ip();
        let mapped = match ip {
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
            std::net::IpAddr::V4(_) => false,
        };
        ip.is_loopback() || mapped || self.local.is_some_and(|l| l.ip() == ip)
    }
}

/// A response body that keeps its request counted until it ends.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_clients_on_this_host_are_the_same_host() {
        let addrs = |remote: &str, local: &str| ConnAddrs {
            remote: remote.parse().unwrap(),
            local: Some(local.parse().unwrap()),
        };
        assert!(addrs("127.0.0.1:4000", "127.0.0.1:5483").same_host());
        assert!(addrs("[::1]:4000", "[::1]:5483").same_host());
        assert!(addrs("[::ffff:127.0.0.1]:4000", "[::ffff:127.0.0.1]:5483").same_host());
        assert!(
            addrs("10.0.0.5:4000", "10.0.0.5:5483").same_host(),
            "to its own address"
        );
        assert!(!addrs("10.0.0.6:4000", "10.0.0.5:5483").same_host());
        assert!(!addrs("[fd00::6]:4000", "[fd00::5]:5483").same_host());
    }
}
