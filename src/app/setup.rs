//! From settings to the values peer-to-peer runs with, and starting the router.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::coalesce::CoalesceConfig;
use crate::config::{Config, DEFAULT_PEER_PORT};
use crate::keep::{Copies, KeepConfig, Keeper, RoutedCopies};
use crate::kubernetes::{self, bootstrap::KubernetesBootstrap};
use crate::metrics::Metrics;
use crate::net::budget::Budgets;
use crate::ops::problems::Problems;
use crate::registry::ResolveTags;
use crate::registry::peer::PeerFetchConfig;
use crate::routing::ContentRouting;
use crate::routing::bootstrap::{Bootstrap, Bootstraps, DnsBootstrap, StaticBootstrap};
use crate::routing::p2p::{
    ConnectionCaps, IDLE_CONNECTION_TIMEOUT, NODES_PER_INTERVAL, P2pConfig, P2pRouter, PER_IP,
    ProvideTiming, REPLICAS,
};
use crate::routing::sync::SyncConfig;
use crate::store::{ContentStore, Holder};
use crate::trust::ClusterSecret;

/// The bound sockets, so that tests can bind port 0 and start-up order stays explicit.
#[derive(Debug)]
pub struct Listeners {
    pub mirror: TcpListener,
    /// `None` without peer-to-peer.
    pub peer: Option<TcpListener>,
    pub ops: TcpListener,
}

/// Where content is read, and where it is held for peers (`None`: nothing is held).
#[expect(missing_debug_implementations, reason = "trait objects without Debug")]
pub struct Stores {
    pub content: Arc<dyn ContentStore>,
    pub holder: Option<Arc<dyn Holder>>,
}

/// Ferry's lease, unless `--keep-budget 0`; a share is of the content filesystem's size.
pub(super) fn keeper(
    config: &Config,
    holder: Option<Arc<dyn Holder>>,
    store: Arc<dyn ContentStore>,
    copies: Option<Arc<dyn Copies>>,
    metrics: &Arc<Metrics>,
) -> Option<Keeper> {
    let holder = holder.filter(|_| config.keeps())?;
    let fs_bytes = match rustix::fs::statvfs(&config.containerd_content_dir) {
        Ok(fs) => fs.f_blocks.saturating_mul(fs.f_frsize),
        Err(e) => {
            tracing::warn!(dir = %config.containerd_content_dir.display(), error = %e, "cannot read the content filesystem's size; keeping at most 10 GiB");
            FALLBACK_FS_BYTES
        }
    };
    let budget = config.keep_budget.bytes(fs_bytes);
    tracing::info!(
        budget,
        "keeping what this node pulls shareable in a containerd lease"
    );
    let keep = KeepConfig {
        copies: config.keep_copies,
        ..KeepConfig::new(budget)
    };
    Some(Keeper::spawn(holder, store, copies, keep, metrics.clone()))
}

/// Other nodes' copies, counted through the DHT.
pub(super) fn copies(router: Arc<dyn ContentRouting>) -> Arc<dyn Copies> {
    Arc::new(RoutedCopies(router))
}

/// The filesystem taken to be this big when its size cannot be read: 10% of it is 10 GiB.
const FALLBACK_FS_BYTES: u64 = 100 << 30;

/// How this node finds content on other nodes.
#[expect(
    clippy::large_enum_variant,
    reason = "one value, built once at start-up"
)]
pub enum Peering {
    Off,
    P2p(Box<PeerSetup>),
    /// Any other content routing (tests).
    Given {
        router: Arc<dyn ContentRouting>,
        fetch: PeerFetchConfig,
        tags: ResolveTags,
        coalesce: Option<CoalesceConfig>,
        sync: SyncConfig,
        secret: Option<ClusterSecret>,
    },
}

impl std::fmt::Debug for Peering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peering::Off => f.write_str("Off"),
            Peering::P2p(setup) => f.debug_tuple("P2p").field(setup).finish(),
            Peering::Given { fetch, .. } => f
                .debug_struct("Given")
                .field("fetch", fetch)
                .finish_non_exhaustive(),
        }
    }
}

/// Everything peer-to-peer needs, resolved from the config.
pub struct PeerSetup {
    pub p2p: P2pConfig,
    /// Static and DNS sources; the Kubernetes one is added at start.
    pub bootstrap: Bootstraps,
    pub bootstrap_configured: bool,
    pub fetch: PeerFetchConfig,
    pub tags: ResolveTags,
    pub coalesce: Option<CoalesceConfig>,
    pub sync: SyncConfig,
    pub secret: Option<ClusterSecret>,
}

impl std::fmt::Debug for PeerSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSetup")
            .field("p2p", &self.p2p)
            .finish_non_exhaustive()
    }
}

impl PeerSetup {
    /// `None` (with a warning) when this host has no address other nodes could reach.
    pub fn from_settings(config: &Config, secret: Option<ClusterSecret>) -> Option<PeerSetup> {
        let data_dir = &config.data_dir;
        let picked = || {
            let chosen = crate::net::host_addr::reachable_ip()?;
            tracing::info!(ip = %chosen.ip, interface = %chosen.interface, why = chosen.why, "advertise address picked; set --advertise-addr to choose another");
            Some(chosen.ip)
        };
        let Some(advertise) = config.advertise_addr.or_else(picked) else {
            tracing::warn!(
                "no address other nodes could reach (only loopback or link-local): peer-to-peer is off; set --advertise-addr"
            );
            return None;
        };
        if advertise.is_loopback() {
            tracing::warn!(%advertise, "advertising a loopback address: only peers on this host can reach it");
        }
        let peer_http_addr = config
            .peer_addr
            .unwrap_or(SocketAddr::new(advertise, DEFAULT_PEER_PORT));
        let mut sources: Vec<Box<dyn Bootstrap>> = vec![Box::new(StaticBootstrap {
            addrs: config.bootstrap_peers.clone(),
        })];
        if let Some(name) = &config.bootstrap_dns {
            sources.push(Box::new(DnsBootstrap {
                name: name.clone(),
                port: config.p2p_addr.port(),
            }));
        }
        Some(PeerSetup {
            p2p: P2pConfig {
                data_dir: data_dir.to_path_buf(),
                // A wildcard listen would make Kademlia announce loopback too.
                listen: if config.p2p_addr.ip().is_unspecified() {
                    SocketAddr::new(advertise, config.p2p_addr.port())
                } else {
                    config.p2p_addr
                },
                advertise: Some(advertise),
                peer_http_addr,
                timing: ProvideTiming {
                    ttl: config.provide_ttl,
                    interval: config.reprovide_interval,
                    replicas: REPLICAS,
                    nodes_per_interval: NODES_PER_INTERVAL,
                },
                psk: secret.as_ref().map(|s| s.pnet_key()),
                #[cfg(feature = "test-support")]
                simulated_latency: None,
                #[cfg(feature = "test-support")]
                transport: None,
                bootstrap_dials: config.bootstrap_dials,
                idle_timeout: IDLE_CONNECTION_TIMEOUT,
                caps: connection_caps(Budgets::for_this_process()),
                draws_seed: None,
            },
            bootstrap: Bootstraps(sources),
            bootstrap_configured: !config.bootstrap_peers.is_empty()
                || config.bootstrap_dns.is_some()
                || config.bootstrap_kubernetes.is_some(),
            fetch: PeerFetchConfig {
                resolve_timeout: config.resolve_timeout,
                resolve_timeout_max: config.resolve_timeout_max,
                connect_timeout: config.peer_connect_timeout,
                first_byte_timeout: config.peer_first_byte_timeout,
                idle_timeout: config.peer_idle_timeout,
                verify_before_serving: config.verify_before_serving,
                buffer_budget: crate::registry::peer::BUFFER_BUDGET,
                zero_copy: config.zero_copy,
                max_lookups: crate::registry::peer::MAX_LOOKUPS,
            },
            tags: config.resolve_tags,
            coalesce: config.coalescing().map(|follow_timeout| CoalesceConfig {
                follow_timeout,
                relay_fanout: config.relay_fanout,
            }),
            sync: SyncConfig {
                registries: config.registries.clone(),
                filters: config.registry_filters.clone(),
                interval: config.reprovide_interval,
                held: None,
            },
            secret,
        })
    }
}

/// Ferry's pods as a bootstrap source, when `--bootstrap-kubernetes` is set.
fn kubernetes_bootstrap(
    config: &Config,
    client: Option<&kube::Client>,
    setup: &PeerSetup,
) -> Option<KubernetesBootstrap> {
    let selector = config.bootstrap_kubernetes.as_deref()?;
    let client = client?;
    let namespace = kubernetes::namespace(config.kubernetes_namespace.as_deref(), client);
    tracing::info!(%namespace, %selector, "bootstrapping peers from the Kubernetes API");
    Some(KubernetesBootstrap::new(
        client.clone(),
        &namespace,
        selector,
        setup.p2p.listen.port(),
    ))
}

/// Starts the libp2p node. A failure leaves Ferry serving this node's content alone: the
/// mirror matters more than the peers.
fn start_router(
    peers: &mut PeerSetup,
    kubernetes: Option<KubernetesBootstrap>,
    (metrics, problems): (&Arc<Metrics>, &Arc<Problems>),
    token: &CancellationToken,
    tracker: &TaskTracker,
) -> Option<Arc<dyn ContentRouting>> {
    let mut sources = std::mem::take(&mut peers.bootstrap);
    if let Some(k) = kubernetes {
        sources.0.push(Box::new(k));
    }
    let bootstrap: Arc<dyn Bootstrap> = Arc::new(sources);
    match P2pRouter::start(
        peers.p2p.clone(),
        bootstrap,
        peers.bootstrap_configured,
        metrics.clone(),
        problems.clone(),
        token.clone(),
    ) {
        Ok((router, task)) => {
            tracker.spawn(async move {
                let _ = task.await;
            });
            Some(Arc::new(router))
        }
        Err(e) => {
            tracing::error!(error = %e, "peer-to-peer is off: serving this node's content only");
            None
        }
    }
}

/// Peer-to-peer as this node runs it, once started.
pub(super) struct Peers {
    pub router: Arc<dyn ContentRouting>,
    pub fetch: PeerFetchConfig,
    pub tags: ResolveTags,
    pub coalesce: Option<CoalesceConfig>,
    pub sync: SyncConfig,
    pub secret: Option<ClusterSecret>,
}

impl Peering {
    /// `None`: this node's content only.
    pub(super) fn start(
        self,
        config: &Config,
        kube: Option<&kube::Client>,
        reporting: (&Arc<Metrics>, &Arc<Problems>),
        token: &CancellationToken,
        tracker: &TaskTracker,
    ) -> Option<Peers> {
        match self {
            Peering::Off => None,
            Peering::P2p(mut setup) => {
                let kubernetes = kubernetes_bootstrap(config, kube, &setup);
                let router = start_router(&mut setup, kubernetes, reporting, token, tracker)?;
                Some(Peers {
                    router,
                    fetch: setup.fetch,
                    tags: setup.tags,
                    coalesce: setup.coalesce,
                    sync: setup.sync,
                    secret: setup.secret,
                })
            }
            Peering::Given {
                router,
                fetch,
                tags,
                coalesce,
                sync,
                secret,
            } => Some(Peers {
                router,
                fetch,
                tags,
                coalesce,
                sync,
                secret,
            }),
        }
    }
}

/// libp2p's share of the open-file budget.
fn connection_caps(budgets: Budgets) -> ConnectionCaps {
    ConnectionCaps {
        pending_incoming: budgets.p2p.pending_incoming,
        established: budgets.p2p.established,
        per_ip: PER_IP,
    }
}
