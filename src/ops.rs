//! The operations listener: `/metrics`, `/healthz`, `/readyz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;
use crate::problems::Problems;

/// The conditions of readiness. Each is set by the one task that owns that condition.
#[derive(Debug, Default)]
pub struct Readiness {
    pub hosts_written: AtomicBool,
    pub listening: AtomicBool,
    pub containerd_up: AtomicBool,
    /// A bootstrap source names other nodes and none is connected yet (for at most
    /// `app::FIRST_PEER_WAIT`): a node of a new pool is not ready until it can ask its peers,
    /// so the kubelet's first pulls (held back by the ready taint) do not all go upstream.
    pub waiting_for_peers: AtomicBool,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.hosts_written.load(Ordering::Relaxed)
            && self.listening.load(Ordering::Relaxed)
            && self.containerd_up.load(Ordering::Relaxed)
            && !self.waiting_for_peers.load(Ordering::Relaxed)
    }

    fn report(&self) -> String {
        let yes_no = |b: &AtomicBool| {
            if b.load(Ordering::Relaxed) {
                "yes"
            } else {
                "no"
            }
        };
        let peers = if self.waiting_for_peers.load(Ordering::Relaxed) {
            "waiting for the first"
        } else {
            "yes"
        };
        format!(
            "hosts config written: {}\nmirror listening: {}\ncontainerd reachable: {}\npeers found (or not expected): {peers}\n",
            yes_no(&self.hosts_written),
            yes_no(&self.listening),
            yes_no(&self.containerd_up)
        )
    }
}

#[derive(Debug, Clone)]
struct OpsState {
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    problems: Arc<Problems>,
}

pub fn router(readiness: Arc<Readiness>, metrics: Arc<Metrics>, problems: Arc<Problems>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(OpsState {
            readiness,
            metrics,
            problems,
        })
}

async fn readyz(State(s): State<OpsState>) -> impl IntoResponse {
    let status = if s.readiness.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = s.readiness.report();
    let problems = s.problems.current();
    if !problems.is_empty() {
        body.push_str("problems (they do not change readiness):\n");
        for (name, detail) in problems {
            body.push_str(&format!("  {name}: {detail}\n"));
        }
    }
    (status, body)
}

async fn metrics_text(State(s): State<OpsState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        {
            // Problems that lapsed since the last look drop to 0 before they are exported.
            s.problems.current();
            s.metrics.encode()
        },
    )
}
