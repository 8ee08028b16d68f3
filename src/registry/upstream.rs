//! Is the upstream registry answering? Tags resolve through peers only while it is not
//! (`--resolve-tags when-upstream-fails`): a verdict per registry, refreshed in the background
//! (`docs/design/upstream-probe.md`). Invariant: a pull never waits for a probe.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use tokio_util::sync::CancellationToken;

use crate::containerd_config::dir::upstream_roots;
use crate::metrics::{Metrics, ProbeLabels, RegistryLabels};
use crate::oci::registry::Registries;
use crate::store::ContentStore;

/// At most 6 probes a minute per registry in use.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(10);
/// No answer within this: not answering (containerd dials for 30 s; this slow fails pulls).
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Beyond this many registries, a registry counts as answering.
const MAX_WATCHED: usize = 256;
/// `ns` comes from any local process: of the registries the node has no sign of using (no
/// host directory of their own, not `--registries`, no image from them), at most this many are
/// probed at once, and none is named in the metrics (no port-scan oracle, no crowding out).
const MAX_UNNAMED: usize = 8;
/// How often the registries of the node's images are read again.
const IMAGES_EVERY: Duration = Duration::from_secs(60);
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
    /// The node's images, for the registries they came from.
    store: Option<Arc<dyn ContentStore>>,
    /// The registries of the node's images, and when they were read.
    in_images: Mutex<(Option<Instant>, HashSet<String>)>,
}

struct Entry {
    verdict: Verdict,
    used: Instant,
    named: bool,
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
        store: Arc<dyn ContentStore>,
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
        match UpstreamWatch::start(config, Some(store), metrics, token) {
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
        store: Option<Arc<dyn ContentStore>>,
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
                store,
                in_images: Mutex::new((None, HashSet::new())),
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
        let named = self.inner.named(registry);
        let mut registries = self.lock();
        if let Some(entry) = registries.get_mut(registry) {
            entry.used = Instant::now();
            return entry.verdict;
        }
        let unnamed = registries.values().filter(|e| !e.named).count();
        if registries.len() >= MAX_WATCHED || (!named && unnamed >= MAX_UNNAMED) {
            return Verdict::Unknown;
        }
        registries.insert(
            registry.to_string(),
            Entry {
                verdict: Verdict::Unknown,
                used: Instant::now(),
                named,
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

impl Inner {
    /// Whether the node shows signs of using `registry`: listed, a host directory of its
    /// own, or an image from it. No I/O but two `stat`s: it is asked on the request path.
    fn named(&self, registry: &str) -> bool {
        let dir = &self.config.hosts_dir;
        let own_dir = registry
            .rsplit_once(':')
            .is_some_and(|(name, port)| dir.join(format!("{name}_{port}_")).is_dir())
            || dir.join(registry).is_dir();
        self.config.watched.iter().any(|r| r == registry)
            || own_dir
            || self.lock_images().1.contains(registry)
    }

    /// Reads the registries of the node's images again if the last read is old.
    async fn refresh_images(&self) {
        let Some(store) = &self.store else {
            return;
        };
        if self
            .lock_images()
            .0
            .is_some_and(|at| at.elapsed() < IMAGES_EVERY)
        {
            return;
        }
        self.lock_images().0 = Some(Instant::now());
        let Ok(images) = store.images().await else {
            return;
        };
        let found = images
            .iter()
            .filter_map(|i| i.name.split_once('/').map(|(r, _)| r.to_string()))
            .collect();
        self.lock_images().1 = found;
    }

    fn lock_images(&self) -> std::sync::MutexGuard<'_, (Option<Instant>, HashSet<String>)> {
        self.in_images.lock().unwrap_or_else(|e| e.into_inner())
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
        inner.refresh_images().await;
        let named = inner.named(&registry);
        if named {
            inner
                .metrics
                .upstream_up
                .get_or_create(&labels)
                .set(i64::from(verdict == Verdict::Answering));
        }
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
            entry.named = named;
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
        // A host directory of its own: a registry the node uses, named in the metrics.
        std::fs::create_dir(dir.path().join(format!("127.0.0.1_{}_", addr.port()))).expect("dir");
        let metrics = Arc::new(Metrics::new());
        let token = CancellationToken::new();
        let watch = quick_watch(dir.path(), Vec::new(), &metrics, &token);
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

    fn quick_watch(
        hosts_dir: &std::path::Path,
        watched: Vec<String>,
        metrics: &Arc<Metrics>,
        token: &CancellationToken,
    ) -> UpstreamWatch {
        UpstreamWatch::start(
            UpstreamConfig {
                hosts_dir: hosts_dir.to_path_buf(),
                mirror_url: "http://127.0.0.1:5480".into(),
                watched,
                interval: Duration::from_millis(50),
                timeout: Duration::from_millis(500),
            },
            None,
            metrics.clone(),
            token.clone(),
        )
        .expect("watch")
    }

    /// L1: `ns` is any local process's choice. Hundreds of made-up registries are neither
    /// named in the metrics nor probed beyond a few, and a registry the node uses still
    /// flips to not answering.
    #[tokio::test]
    async fn made_up_registries_are_not_named_and_cannot_crowd_out_real_ones() {
        let dir = tempfile::tempdir().expect("tmp");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let real = format!("127.0.0.1:{}", listener.local_addr().expect("addr").port());
        drop(listener);
        let metrics = Arc::new(Metrics::new());
        let token = CancellationToken::new();
        let watch = quick_watch(dir.path(), vec![real.clone()], &metrics, &token);
        for i in 0..300 {
            watch.verdict(&format!("127.0.0.{}:{}", 2 + i % 200, 1000 + i));
        }
        let probed = watch.lock().len();
        assert_eq!(
            probed,
            1 + MAX_UNNAMED,
            "the listed one and a few made-up ones"
        );
        let mut flipped = false;
        for _ in 0..200 {
            if matches!(watch.verdict(&real), Verdict::NotAnswering(_)) {
                flipped = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(flipped, "the registry in use is still probed");
        let text = metrics.encode();
        assert_eq!(
            text.matches("ferry_upstream_up{").count(),
            1,
            "only the listed registry is named: {text}"
        );
        token.cancel();
    }
}
