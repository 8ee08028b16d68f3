//! The operations listener: `/metrics`, `/healthz`, `/readyz`, `/status` (what `ferry status`
//! prints, as JSON).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::metrics::Metrics;
use crate::problems::Problems;
use crate::registry::recent::RecentPulls;
use crate::routing::Router as PeerRouter;
use crate::status::{self, Condition, PeerView, Status};

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

    /// Each condition, by name, and whether it holds.
    pub fn conditions(&self) -> Vec<(&'static str, bool)> {
        let holds = |b: &AtomicBool| b.load(Ordering::Relaxed);
        vec![
            ("hosts config written", holds(&self.hosts_written)),
            ("mirror listening", holds(&self.listening)),
            ("containerd reachable", holds(&self.containerd_up)),
            (
                "peers found (or not expected)",
                !holds(&self.waiting_for_peers),
            ),
        ]
    }

    fn report(&self) -> String {
        self.conditions()
            .into_iter()
            .map(|(name, ok)| format!("{name}: {}\n", if ok { "yes" } else { "no" }))
            .collect()
    }
}

/// Everything the ops listener reports on, each owned elsewhere and only read here.
#[derive(Clone)]
pub struct Sources {
    pub readiness: Arc<Readiness>,
    pub metrics: Arc<Metrics>,
    pub problems: Arc<Problems>,
    pub recent: Arc<RecentPulls>,
    /// `None` when peer-to-peer is off.
    pub peers: Option<Arc<dyn PeerRouter>>,
    /// The Kubernetes node name, when known.
    pub node: Option<String>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

pub fn router(sources: Sources) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/status", get(status_json))
        .with_state(sources)
}

type OpsState = Sources;

/// The state behind `ferry status`, now.
pub fn status(s: &Sources) -> Status {
    let view = |p: &crate::routing::Peer| PeerView {
        id: p.id.clone(),
        addr: p.addr.to_string(),
    };
    Status {
        version: env!("CARGO_PKG_VERSION").to_string(),
        node: s.node.clone(),
        ready: s.readiness.is_ready(),
        conditions: s
            .readiness
            .conditions()
            .into_iter()
            .map(|(name, ok)| Condition {
                name: name.to_string(),
                ok,
            })
            .collect(),
        problems: s
            .problems
            .current()
            .into_iter()
            .map(|(problem, detail)| status::Problem {
                problem: problem.to_string(),
                detail,
            })
            .collect(),
        this_node: s.peers.as_ref().map(|r| view(&r.local())),
        peers: s
            .peers
            .as_ref()
            .map(|r| r.members().iter().map(view).collect())
            .unwrap_or_default(),
        advertised_keys: s.metrics.keys_advertised.get(),
        served: status::served(&s.metrics),
        corrupt_blobs: s.metrics.corrupt_blobs.get(),
        recent: s.recent.list(),
    }
}

/// `/status` names images and peers: it answers this host only (`ferry status` runs on the
/// node, or in the pod through `kubectl exec`), never the network the metrics address is on.
async fn status_json(State(s): State<OpsState>, request: axum::extract::Request) -> Response {
    let local = request
        .extensions()
        .get::<crate::server::ConnAddrs>()
        .is_some_and(crate::server::ConnAddrs::same_host);
    if !local {
        return (
            StatusCode::FORBIDDEN,
            "/status names this node's images and peers and answers only on the node itself: run `ferry status` there\n",
        )
            .into_response();
    }
    axum::Json(status(&s)).into_response()
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
