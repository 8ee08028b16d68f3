//! The operations listener: `/metrics`, `/healthz`, `/readyz`, `/status` and, when turned on,
//! `/debug`. Invariant: what names images and peers answers this host only.

pub(crate) mod debug_page;
pub mod problems;
pub mod status;
pub(crate) mod watch;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::coalesce::Coalescer;
use crate::keep::Keeper;
use crate::metrics::Metrics;
use crate::ops::problems::Problems;
use crate::registry::peer::PeerFetcher;
use crate::registry::recent::RecentPulls;
use crate::routing::ContentRouting;
use status::{Condition, PeerView, Status};

/// The conditions of readiness, each set by the one task that owns it.
#[derive(Debug, Default)]
pub struct Readiness {
    pub hosts_written: AtomicBool,
    pub listening: AtomicBool,
    pub containerd_up: AtomicBool,
    /// No peer yet although bootstrap names some (at most `watch::FIRST_PEER_WAIT`), so the
    /// kubelet's first pulls on a new pool do not all go upstream.
    pub waiting_for_peers: AtomicBool,
}

impl Readiness {
    pub fn is_ready(&self) -> bool {
        self.hosts_written.load(Ordering::Relaxed)
            && self.listening.load(Ordering::Relaxed)
            && self.containerd_up.load(Ordering::Relaxed)
            && !self.waiting_for_peers.load(Ordering::Relaxed)
    }

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

/// Everything the ops listener reports on, owned elsewhere and only read here.
#[derive(Clone)]
pub struct Sources {
    pub readiness: Arc<Readiness>,
    pub metrics: Arc<Metrics>,
    pub problems: Arc<Problems>,
    pub recent: Arc<RecentPulls>,
    pub peers: Option<Arc<dyn ContentRouting>>,
    /// `None` when peer-to-peer is off, as are `peers` and `exposed`.
    pub fetcher: Option<Arc<PeerFetcher>>,
    pub exposed: Option<tokio::sync::watch::Receiver<crate::routing::sync::Exposed>>,
    /// `None` when coalescing is off.
    pub coalesce: Option<Arc<Coalescer>>,
    /// `None` without a lease.
    pub keep: Option<Keeper>,
    pub debug_page: bool,
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
    let mut router = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/status", get(status_json));
    if sources.debug_page {
        router = router
            .route("/debug", get(debug_page::page))
            .route("/debug/test-pull", get(debug_page::test_pull));
    }
    router.with_state(sources)
}

type OpsState = Sources;

pub fn status(s: &Sources) -> Status {
    let now = std::time::SystemTime::now();
    let view = |p: &crate::routing::Peer| PeerView {
        id: p.id.clone(),
        addr: p.addr.to_string(),
        connected_s: s
            .peers
            .as_ref()
            .and_then(|r| r.connected_since(&p.id))
            .and_then(|t| now.duration_since(t).ok())
            .map(|d| d.as_secs()),
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
        this_node: s.peers.as_ref().map(|r| PeerView {
            connected_s: None,
            ..view(&r.local())
        }),
        passed_over: s
            .fetcher
            .as_ref()
            .map(|f| f.passed_over())
            .unwrap_or_default()
            .into_iter()
            .map(|(id, left, quarantined)| status::PassedOver {
                id,
                seconds_left: left.as_secs(),
                quarantined,
            })
            .collect(),
        peers: s
            .peers
            .as_ref()
            .map(|r| r.members().iter().map(view).collect())
            .unwrap_or_default(),
        in_flight: s
            .coalesce
            .as_ref()
            .map(|c| c.in_flight())
            .unwrap_or_default(),
        advertised_keys: s.metrics.keys_advertised.get(),
        advertised_tags: s
            .exposed
            .as_ref()
            .map(|e| {
                e.borrow()
                    .iter()
                    // A key is a digest (`routing::digest_key`) or a tag (`tag_key`).
                    .filter(|k| k.parse::<crate::oci::Digest>().is_err())
                    .cloned()
                    .collect()
            })
            .unwrap_or_default(),
        served: status::served(&s.metrics),
        keep: s.keep.as_ref().map(Keeper::status),
        lookup_wait_ms: s
            .peers
            .as_ref()
            .map(|_| (s.metrics.peer_resolve_wait.get() * 1000.0).ceil() as u64),
        lookups_found_late: s.metrics.peer_lookups_found_late.get(),
        corrupt_blobs: s.metrics.corrupt_blobs.get(),
        recent: s.recent.list(),
    }
}

/// Whether `request` came from this host (`kubectl exec` and `port-forward` do too), for the
/// pages that name images and peers.
pub fn from_this_host(request: &axum::extract::Request) -> bool {
    request
        .extensions()
        .get::<crate::net::server::ConnAddrs>()
        .is_some_and(crate::net::server::ConnAddrs::same_host)
}

pub fn refused(what: &str) -> Response {
    (
        StatusCode::FORBIDDEN,
        format!("{what} names this node's images and peers and answers only on the node itself: run `ferry status` there, or `kubectl port-forward` to the pod\n"),
    )
        .into_response()
}

async fn status_json(State(s): State<OpsState>, request: axum::extract::Request) -> Response {
    if !from_this_host(&request) {
        return refused("/status");
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
