//! Serving a router with hyper directly, HTTP/1 only, with the bounds of docs/security.md: a
//! deadline to each request head (hyper's starts only at the first byte), eviction of the
//! longest-idle at the limit, requests counted until their body is sent, a short wait for a
//! slot, and a cut for a response that stops moving. Invariant: a connection is closed while
//! one of its requests is answered only when that response made no progress for its deadline.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::StatusCode;
use axum::serve::Listener;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::net::limits::{Hold, LimitedListener, LogEvery};

/// containerd and peers send a request's head at once; 10 s is generous for a loaded node.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// A request that finds every slot taken waits this long, then gets the listener's busy
/// answer: containerd goes to its next host rather than wait behind whoever holds the slots.
pub const SLOT_WAIT: Duration = Duration::from_millis(250);
/// A response that sends nothing for this long is cut (a reader that stopped, or a source that
/// did): containerd resumes a cut blob with a Range, elsewhere if need be.
pub const PROGRESS_DEADLINE: Duration = Duration::from_secs(60);
/// Refused requests are logged at most this often, with their count.
const REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

/// Connections closed at once when the listener is full (see `evict_longest_idle`).
const EVICT_BATCH: usize = 64;
/// While the listener stays full, how often idle connections are evicted again.
const EVICT_AGAIN: Duration = Duration::from_millis(100);
/// hyper's write queue per connection (default about 400 KiB): a reader that stops reading
/// holds at most one more body chunk in memory, not two.
const WRITE_QUEUE_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub head_deadline: Duration,
    /// Requests answered at once, bodies included; more wait for a slot.
    pub in_flight: usize,
    pub slot_wait: Duration,
    pub progress_deadline: Duration,
    /// The answer to a request that got no slot in time.
    pub busy: StatusCode,
}

/// Accepts until `stop`, then returns once open connections have finished their requests.
pub async fn serve(
    mut listener: LimitedListener,
    name: &'static str,
    router: axum::Router,
    bounds: Bounds,
    stop: CancellationToken,
) {
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.head_deadline)
        .max_buf_size(WRITE_QUEUE_BYTES);
    let tasks = TaskTracker::new();
    let table = Arc::new(Connections::default());
    let slots = Arc::new(Slots {
        free: Arc::new(Semaphore::new(bounds.in_flight)),
        bounds,
        refused: Refused::new(name),
    });
    loop {
        // At the limit, evict again while waiting: connections busy at one eviction (waiting
        // for a slot, say) are idle a moment later.
        let accepted = loop {
            if listener.is_full() {
                table.evict_longest_idle();
            }
            tokio::select! {
                _ = stop.cancelled() => break None,
                accepted = listener.accept() => break Some(accepted),
                () = tokio::time::sleep(EVICT_AGAIN), if listener.is_full() => {}
            }
        };
        let Some((stream, remote)) = accepted else {
            break;
        };
        let conn_state = table.register();
        let addrs = ConnAddrs {
            remote,
            local: stream.local_addr().ok(),
        };
        let service = {
            let (router, conn, slots) = (router.clone(), conn_state.clone(), slots.clone());
            TowerToHyperService::new(tower::service_fn(move |mut req: hyper::Request<_>| {
                // Who asks, for handlers that answer this host only (`/status`).
                req.extensions_mut().insert(addrs);
                answer(req, router.clone(), conn.clone(), slots.clone())
            }))
        };
        let conn = http1
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        let (table, stop) = (table.clone(), stop.clone());
        tasks.spawn(async move {
            let mut conn = std::pin::pin!(conn);
            let watch = conn_state.watch(bounds.head_deadline, bounds.progress_deadline);
            let ended = tokio::select! {
                ended = conn.as_mut() => Some(ended),
                // Dropping the connection closes its socket.
                reason = watch => {
                    tracing::trace!(reason, "closed a connection");
                    None
                }
                () = stop.cancelled() => {
                    // Idle keep-alive connections close now; a request in flight finishes.
                    conn.as_mut().graceful_shutdown();
                    let watch = conn_state.watch(bounds.head_deadline, bounds.progress_deadline);
                    tokio::select! {
                        ended = conn.as_mut() => Some(ended),
                        _ = watch => None,
                    }
                }
            };
            if let Some(Err(e)) = ended {
                tracing::trace!(error = %e, "connection ended with an error");
            }
            table.remove(&conn_state);
        });
    }
    drop(listener);
    tasks.close();
    tasks.wait().await;
}

/// A listener's request slots, and what happens without one.
struct Slots {
    free: Arc<Semaphore>,
    bounds: Bounds,
    refused: Refused,
}

/// Requests refused for want of a slot, logged now and then with their count.
struct Refused {
    listener: &'static str,
    log: LogEvery,
}

impl Refused {
    fn new(listener: &'static str) -> Refused {
        Refused {
            listener,
            log: LogEvery::new(REFUSED_LOG_EVERY),
        }
    }

    fn note(&self) {
        if let Some(refused) = self.log.tick() {
            tracing::warn!(
                listener = self.listener,
                refused,
                "every request slot is taken: requests answered at once so that clients go elsewhere"
            );
        }
    }
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
            moved_at: Mutex::new(Instant::now()),
            evict: Notify::new(),
            began: Notify::new(),
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
    /// When a response of this connection last sent a frame (or a request began).
    moved_at: Mutex<Instant>,
    evict: Notify,
    /// A request began: the watch changes from the head deadline to the progress one.
    began: Notify,
}

impl ConnState {
    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_idle_since(&self, at: Instant) {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = at;
    }

    fn moved(&self) {
        *self.moved_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    fn moved_at(&self) -> Instant {
        *self.moved_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns why the connection should close: idle for `head`, evicted while idle, or
    /// answering without progress for `progress`.
    async fn watch(&self, head: Duration, progress: Duration) -> &'static str {
        loop {
            let busy = self.busy.load(Ordering::Acquire) > 0;
            let (since, deadline) = if busy {
                (self.moved_at(), progress)
            } else {
                (self.idle_since(), head)
            };
            let Some(wait) = deadline
                .checked_sub(since.elapsed())
                .filter(|w| !w.is_zero())
            else {
                return if busy {
                    "a response made no progress"
                } else {
                    "no request in time"
                };
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.began.notified() => {}
                () = self.evict.notified() => {
                    if self.busy.load(Ordering::Acquire) == 0 {
                        return "evicted at the connection limit";
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
    mut req: hyper::Request<hyper::body::Incoming>,
    router: axum::Router,
    conn: Arc<ConnState>,
    slots: Arc<Slots>,
) -> Result<axum::response::Response, std::convert::Infallible> {
    if !host_fits(&req) {
        let mut refused = axum::response::Response::new(Body::empty());
        *refused.status_mut() = StatusCode::MISDIRECTED_REQUEST;
        return Ok(refused);
    }
    conn.busy.fetch_add(1, Ordering::AcqRel);
    conn.moved();
    conn.began.notify_waiters();
    let mut busy = Busy { conn, _slot: None };
    let wait = slots.bounds.slot_wait;
    // The semaphore is never closed; without a slot the request is answered anyway.
    match tokio::time::timeout(wait, slots.free.clone().acquire_owned()).await {
        Ok(slot) => busy._slot = slot.ok(),
        Err(_) => {
            slots.refused.note();
            drop(busy);
            let mut refused = axum::response::Response::new(Body::empty());
            *refused.status_mut() = slots.bounds.busy;
            return Ok(refused);
        }
    }
    let busy = Arc::new(busy);
    req.extensions_mut().insert(Hold::new(busy.clone()));
    let response = router.oneshot(req).await?;
    Ok(response.map(|body| Body::new(Tracked { body, _busy: busy })))
}

/// A request that reached a loopback address names a loopback host (an IP address or
/// `localhost`): a web page whose name was rebound to 127.0.0.1 (DNS rebinding) sends its own
/// name, and must not read the mirror or `/status`.
fn host_fits<B>(req: &hyper::Request<B>) -> bool {
    let to_loopback = req
        .extensions()
        .get::<ConnAddrs>()
        .and_then(|a| a.local)
        .is_some_and(|l| l.ip().to_canonical().is_loopback());
    let Some(host) = req.headers().get(axum::http::header::HOST) else {
        return true;
    };
    if !to_loopback {
        return true;
    }
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
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

/// A response body that keeps its request counted until it ends (and any [`Hold`] too).
struct Tracked {
    body: Body,
    _busy: Arc<Busy>,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            self._busy.conn.moved();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests;
