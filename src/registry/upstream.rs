//! Is the upstream registry answering? Tags resolve through peers only while it is not
//! (`--resolve-tags when-upstream-fails`): a verdict per registry, refreshed in the background
//! (`docs/design/upstream-probe.md`). Invariant: a pull never waits for a probe.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use tokio_util::sync::CancellationToken;

use crate::containerd_config::dir::upstream_roots;
use crate::metrics::{Metrics, ProbeLabels, RegistryLabels};
use crate::oci::registry::Registries;

/// At most 6 probes a minute per registry in use.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// No answer within this: not answering (containerd dials for 30 s; this slow fails pulls).
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// `ns` comes from any local process: beyond this many, a registry counts as answering.
const MAX_WATCHED: usize = 256;
/// Named registries excepted, one idle this long is no longer probed.
const IDLE_AFTER: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not probed yet: treated as answering.
    Unknown,
    Answering,
    NotAnswering(Failure),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Refused,
    Timeout,
    /// Reset, TLS or protocol failure, DNS.
    Error,
    Status5xx,
    RateLimited,
}

impl Failure {
    pub fn label(self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::Timeout => "timeout",
            Failure::Error => "error",
            Failure::Status5xx => "status_5xx",
            Failure::RateLimited => "status_429",
        }
    }
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// containerd's hosts dir, listing the hosts tried after Ferry.
    pub hosts_dir: PathBuf,
    /// Ferry's own entry there, skipped.
    pub mirror_url: String,
    /// Probed from the start (`--registries`), before their first pull.
    pub watched: Vec<String>,
    pub interval: Duration,
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot build the probe's HTTP client: {0}")]
pub struct UpstreamError(#[from] reqwest::Error);

/// A cloneable handle on the verdicts.
#[derive(Clone)]
pub struct UpstreamWatch {
    inner: Arc<Inner>,
}

struct Inner {
    config: UpstreamConfig,
    client: reqwest::Client,
    metrics: Arc<Metrics>,
    token: CancellationToken,
    registries: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    verdict: Verdict,
    used: Instant,
}

impl std::fmt::Debug for UpstreamWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamWatch")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl UpstreamWatch {
    /// For `--resolve-tags when-upstream-fails`; `None` (never in practice): all answer.
    pub fn watch(
        registries: &Registries,
        hosts_dir: PathBuf,
        mirror_url: String,
        metrics: Arc<Metrics>,
        token: CancellationToken,
    ) -> Option<UpstreamWatch> {
        let watched = match registries {
            Registries::Only(list) => list.clone(),
            Registries::All => Vec::new(),
        };
        let config = UpstreamConfig {
            hosts_dir,
            mirror_url,
            watched,
            interval: PROBE_INTERVAL,
            timeout: PROBE_TIMEOUT,
        };
        match UpstreamWatch::start(config, metrics, token) {
            Ok(watch) => Some(watch),
            Err(e) => {
                tracing::error!(error = %e, "tags always resolve upstream: the registries cannot be probed");
                None
            }
        }
    }

    /// Probes stop when `token` is cancelled.
    pub fn start(
        config: UpstreamConfig,
        metrics: Arc<Metrics>,
        token: CancellationToken,
    ) -> Result<UpstreamWatch, UpstreamError> {
        let client = client(config.timeout)?;
        let watch = UpstreamWatch {
            inner: Arc::new(Inner {
                config,
                client,
                metrics,
                token,
                registries: Mutex::new(HashMap::new()),
            }),
        };
        for registry in watch.inner.config.watched.clone() {
            watch.track(&registry);
        }
        Ok(watch)
    }

    /// The last verdict on `registry`; a first use starts its probe.
    pub fn verdict(&self, registry: &str) -> Verdict {
        self.track(registry)
    }

    fn track(&self, registry: &str) -> Verdict {
        let mut registries = self.lock();
        if let Some(entry) = registries.get_mut(registry) {
            entry.used = Instant::now();
            return entry.verdict;
        }
        if registries.len() >= MAX_WATCHED {
            return Verdict::Unknown;
        }
        registries.insert(
            registry.to_string(),
            Entry {
                verdict: Verdict::Unknown,
                used: Instant::now(),
            },
        );
        drop(registries);
        let keep = self.inner.config.watched.iter().any(|r| r == registry);
        tokio::spawn(watch(self.inner.clone(), registry.to_string(), keep));
        Verdict::Unknown
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.inner
            .registries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// Probes one registry until it is idle (unless `keep`) or Ferry shuts down.
async fn watch(inner: Arc<Inner>, registry: String, keep: bool) {
    let labels = RegistryLabels {
        registry: registry.clone(),
    };
    let mut last = Verdict::Unknown;
    loop {
        let (hosts_dir, mirror_url) = (
            inner.config.hosts_dir.clone(),
            inner.config.mirror_url.clone(),
        );
        let name = registry.clone();
        let roots =
            tokio::task::spawn_blocking(move || upstream_roots(&hosts_dir, &name, &mirror_url))
                .await
                .unwrap_or_default();
        let verdict = tokio::select! {
            _ = inner.token.cancelled() => return,
            v = probe(&inner.client, &roots) => v,
        };
        let result = match verdict {
            Verdict::NotAnswering(f) => f.label(),
            _ => "answering",
        };
        inner
            .metrics
            .upstream_probes
            .get_or_create(&ProbeLabels { result })
            .inc();
        inner
            .metrics
            .upstream_up
            .get_or_create(&labels)
            .set(i64::from(verdict == Verdict::Answering));
        match (last, verdict) {
            (Verdict::NotAnswering(_), Verdict::Answering) => {
                tracing::info!(%registry, "registry answers again: tags resolve upstream")
            }
            (Verdict::Answering | Verdict::Unknown, Verdict::NotAnswering(f)) => tracing::warn!(
                %registry,
                hosts = ?roots,
                reason = f.label(),
                "registry is not answering: tags resolve through peers until it does"
            ),
            _ => {}
        }
        last = verdict;
        {
            let mut registries = inner.registries.lock().unwrap_or_else(|e| e.into_inner());
            let Some(entry) = registries.get_mut(&registry) else {
                return;
            };
            entry.verdict = verdict;
        }
        tokio::select! {
            _ = inner.token.cancelled() => return,
            _ = tokio::time::sleep(inner.config.interval) => {}
        }
        let mut registries = inner.registries.lock().unwrap_or_else(|e| e.into_inner());
        let idle = registries
            .get(&registry)
            .is_none_or(|e| e.used.elapsed() > IDLE_AFTER);
        if idle && !keep {
            registries.remove(&registry);
            inner.metrics.upstream_up.remove(&labels);
            tracing::debug!(%registry, "registry idle: no longer probed");
            return;
        }
    }
}

/// Proxies from the environment (as containerd's), no redirects, and no certificate checks:
/// the probe sends nothing and reads only whether a server answered.
fn client(timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .tls_danger_accept_invalid_certs(true)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!(
            "ferry/",
            env!("CARGO_PKG_VERSION"),
            " (reachability probe)"
        ))
        .build()
}

/// The first root that answers decides; if none does, the first failure is the reason.
pub(crate) async fn probe(client: &reqwest::Client, roots: &[String]) -> Verdict {
    let mut first_failure = None;
    for root in roots {
        let failure = match client.get(format!("{root}/")).send().await {
            Ok(r) if r.status() == StatusCode::TOO_MANY_REQUESTS => Failure::RateLimited,
            Ok(r) if r.status().is_server_error() => Failure::Status5xx,
            Ok(_) => return Verdict::Answering,
            Err(e) if e.is_timeout() => Failure::Timeout,
            Err(e) if e.is_connect() && refused(&e) => Failure::Refused,
            Err(_) => Failure::Error,
        };
        first_failure.get_or_insert(failure);
    }
    Verdict::NotAnswering(first_failure.unwrap_or(Failure::Error))
}

fn refused(e: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = s.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::routing::get;

    async fn registry(status: StatusCode) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route("/v2/", get(move || async move { status }));
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/v2")
    }

    /// A loopback port with nothing listening.
    async fn closed_port() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        format!("http://{addr}/v2")
    }

    #[tokio::test]
    async fn answers_are_answers_and_outages_are_not() {
        let client = client(Duration::from_millis(500)).expect("client");
        for (status, expected) in [
            (StatusCode::OK, Verdict::Answering),
            (StatusCode::UNAUTHORIZED, Verdict::Answering),
            (StatusCode::NOT_FOUND, Verdict::Answering),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Verdict::NotAnswering(Failure::Status5xx),
            ),
            (
                StatusCode::TOO_MANY_REQUESTS,
                Verdict::NotAnswering(Failure::RateLimited),
            ),
        ] {
            let root = registry(status).await;
            assert_eq!(probe(&client, &[root]).await, expected, "{status}");
        }
        let closed = closed_port().await;
        assert_eq!(
            probe(&client, std::slice::from_ref(&closed)).await,
            Verdict::NotAnswering(Failure::Refused)
        );
    }

    #[tokio::test]
    async fn a_registry_that_accepts_but_never_answers_times_out() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let client = client(Duration::from_millis(200)).expect("client");
        assert_eq!(
            probe(&client, &[format!("http://{addr}/v2")]).await,
            Verdict::NotAnswering(Failure::Timeout)
        );
    }

    #[tokio::test]
    async fn any_host_containerd_would_try_answering_is_enough() {
        let client = client(Duration::from_millis(500)).expect("client");
        let down = closed_port().await;
        let up = registry(StatusCode::UNAUTHORIZED).await;
        assert_eq!(
            probe(&client, &[down.clone(), up]).await,
            Verdict::Answering
        );
        let failing = registry(StatusCode::BAD_GATEWAY).await;
        assert_eq!(
            probe(&client, &[down, failing]).await,
            Verdict::NotAnswering(Failure::Refused),
            "the first failure is the reason"
        );
    }

    #[tokio::test]
    async fn the_watch_follows_the_registry_down_and_up_again() {
        let dir = tempfile::tempdir().expect("tmp");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let registry = format!("127.0.0.1:{}", addr.port());
        let metrics = Arc::new(Metrics::new());
        let token = CancellationToken::new();
        let watch = UpstreamWatch::start(
            UpstreamConfig {
                hosts_dir: dir.path().to_path_buf(),
                mirror_url: "http://127.0.0.1:5480".into(),
                watched: Vec::new(),
                interval: Duration::from_millis(50),
                timeout: Duration::from_millis(500),
            },
            metrics.clone(),
            token.clone(),
        )
        .expect("watch");
        // First use: treated as answering while its probe runs.
        assert_eq!(watch.verdict(&registry), Verdict::Unknown);
        let settle = |want: Verdict| {
            let watch = watch.clone();
            let registry = registry.clone();
            async move {
                for _ in 0..200 {
                    if watch.verdict(&registry) == want {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                panic!("verdict never became {want:?}");
            }
        };
        // Nothing listens there (a localhost registry is plain HTTP).
        settle(Verdict::NotAnswering(Failure::Refused)).await;
        assert!(
            metrics
                .encode()
                .contains(&format!("ferry_upstream_up{{registry=\"{registry}\"}} 0")),
            "{}",
            metrics.encode()
        );
        let listener = tokio::net::TcpListener::bind(addr).await.expect("rebind");
        let app = Router::new().route("/v2/", get(|| async { StatusCode::UNAUTHORIZED }));
        tokio::spawn(async move { axum::serve(listener, app).await });
        settle(Verdict::Answering).await;
        token.cancel();
    }
}
