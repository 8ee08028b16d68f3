//! Serving a router on a listener with hyper directly. `axum::serve` gives hyper no timer, so
//! hyper's header read timeout never fires: a client that sends header bytes slowly (or opens
//! a connection and says nothing) would hold one of the listener's connection slots forever.
//! Here every connection must deliver a request's headers within [`HEADER_READ_TIMEOUT`].

use std::time::Duration;

use axum::serve::Listener;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio_util::sync::CancellationToken;

use crate::limits::LimitedListener;

/// containerd and peers send a request's headers at once; 10 s is generous for a loaded node.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts until `stop`, then lets every open connection finish its request in flight (idle
/// keep-alive connections close at once) and returns when all are closed.
pub async fn serve(mut listener: LimitedListener, router: axum::Router, stop: CancellationToken) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let service = TowerToHyperService::new(router.clone());
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                // Timeouts, resets, malformed requests: the client's problem, not ours.
                tracing::trace!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
