//! Every metric family Ferry exports, in one place. Invariant: every labelled series a reader
//! relies on is created at start, so it exists (at 0) from the first scrape.

pub(crate) mod process;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// mirror (this node's containerd asks), peer (another node asks)
    pub listener: &'static str,
    /// manifest, blob, base, other
    pub kind: &'static str,
    pub method: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub listener: &'static str,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// mirror, peer
    pub listener: &'static str,
    /// manifest, blob
    pub kind: &'static str,
    /// local, peer, inflight (a download in progress), miss (404)
    pub source: &'static str,
}

/// Every listener, kind and source `ferry_served_total` counts, created at start so `rate()`
/// sees the first request.
pub const LISTENERS: [&str; 2] = ["mirror", "peer"];
pub const SERVED_KINDS: [&str; 2] = ["manifest", "blob"];
pub const SOURCES: [&str; 4] = ["local", "peer", "inflight", "miss"];

/// A peer is answered from this node only.
pub fn sources(listener: &str) -> &'static [&'static str] {
    if listener == "peer" {
        &["local", "inflight", "miss"]
    } else {
        &SOURCES
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// found, none, timed_out
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// missing, malformed, expired, invalid
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// connect, status, body, verify
    pub stage: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LookupLabels {
    pub kind: &'static str,
    /// hit, miss, unavailable
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TagLabels {
    /// upstream (404 at once), peers, none (peers had nothing)
    pub answer: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegistryLabels {
    pub registry: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    /// answering, refused, timeout, error, status_5xx, status_429
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CoalesceLabels {
    /// leader, follower, relay, none
    pub role: &'static str,
    /// leader: upstream; follower: assigned, served, failed; relay: slow_follower (sent away);
    /// none: coordinator_unreachable
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProblemLabels {
    /// See `problems.rs`.
    pub problem: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    /// incoming, outgoing
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// walks: converged, timed_out; batches: delivered, failed; provider walks: found, none
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DhtLabels {
    /// find_node, get_providers, add_provider, provide_batch, other
    pub kind: &'static str,
}

/// Every outcome `ferry_announce_walks_total` and `ferry_announce_batches_total` count.
pub const WALK_OUTCOMES: [&str; 2] = ["converged", "timed_out"];
pub const BATCH_OUTCOMES: [&str; 3] = ["delivered", "retried", "failed"];
/// Every outcome `ferry_announce_hops_total` counts.
pub const HOP_OUTCOMES: [&str; 3] = ["planned", "confirmed", "walked"];

/// Every outcome `ferry_provider_walks_total` counts.
pub const PROVIDER_WALK_OUTCOMES: [&str; 2] = ["found", "none"];

/// Every kind of DHT request `ferry_dht_requests_received_total` counts.
pub const DHT_REQUEST_KINDS: [&str; 5] = [
    "find_node",
    "get_providers",
    "add_provider",
    "provide_batch",
    "other",
];

/// Seconds: a local hit takes under a millisecond, a large blob seconds.
const DURATION_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
];

/// Seconds, finer where a pull waits for a lookup (20-100 ms by default).
const LOOKUP_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0,
];

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: Family<KindLabels, Histogram>,
    pub served_bytes: Family<SourceLabels, Counter>,
    pub served: Family<SourceLabels, Counter>,
    pub peer_lookups: Family<ResultLabels, Counter>,
    pub peer_lookup_duration: Histogram,
    pub peer_lookups_found_late: Counter,
    pub peer_resolve_wait: Gauge<f64, AtomicU64>,
    pub peer_failures: Family<StageLabels, Counter>,
    pub peer_auth_failures: Family<ReasonLabels, Counter>,
    pub peers_connected: Gauge,
    pub peers_anchored: Family<DirectionLabels, Gauge>,
    pub keys_advertised: Gauge,
    pub sync_images_walked: Family<ReasonLabels, Counter>,
    pub announcements_pending: Gauge,
    pub announcements_rested: Counter,
    pub announce_rounds: Counter,
    pub announce_rounds_early: Counter,
    pub announce_interval: Gauge,
    pub announce_walks: Family<OutcomeLabels, Counter>,
    pub announce_batches: Family<OutcomeLabels, Counter>,
    pub announce_hops: Family<OutcomeLabels, Counter>,
    pub lookups: Family<LookupLabels, Counter>,
    pub containerd_up: Gauge,
    pub hosts_config_written: Gauge,
    pub tag_requests: Family<TagLabels, Counter>,
    pub upstream_up: Family<RegistryLabels, Gauge>,
    pub upstream_probes: Family<ProbeLabels, Counter>,
    pub coalesce: Family<CoalesceLabels, Counter>,
    pub inflight_bytes: Counter,
    pub relayed_bytes: Counter,
    pub zero_copy_bytes: Counter,
    pub kept_blobs: Gauge,
    pub kept_alone_bytes: Gauge,
    pub keep_budget_bytes: Gauge,
    pub keep_released: Counter,
    pub keep_copy_lookups: Counter,
    pub follow_wait: Histogram,
    pub corrupt_blobs: Counter,
    pub config_problems: Family<ProblemLabels, Gauge>,
    pub peer_handshake_failures: Family<DirectionLabels, Counter>,
    pub dht_requests: Family<DhtLabels, Counter>,
    pub bootstrap_dials: Counter,
    pub provider_walks: Family<OutcomeLabels, Counter>,
    pub provider_walk_requests: Family<OutcomeLabels, Counter>,
    pub provider_walk_dials: Family<OutcomeLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        // The standard process_* names carry no prefix (dashboards expect them as they are).
        root.register_collector(Box::new(crate::metrics::process::ProcessCollector));
        let registry = root.sub_registry_with_prefix("ferry");
        registry.register(
            "build",
            "Ferry's version (value 1)",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            }),
        );
        let requests = Family::<RequestLabels, Counter>::default();
        let request_duration = Family::<KindLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(DURATION_BUCKETS)
        });
        let served_bytes = Family::<SourceLabels, Counter>::default();
        let served = Family::<SourceLabels, Counter>::default();
        let peer_lookups = Family::<ResultLabels, Counter>::default();
        let peer_lookup_duration = Histogram::new(LOOKUP_BUCKETS);
        let peer_lookups_found_late = Counter::default();
        let peer_resolve_wait = Gauge::<f64, AtomicU64>::default();
        let peer_failures = Family::<StageLabels, Counter>::default();
        let peer_auth_failures = Family::<ReasonLabels, Counter>::default();
        let peers_connected = Gauge::default();
        let peers_anchored = Family::<DirectionLabels, Gauge>::default();
        for direction in ["incoming", "outgoing"] {
            let _ = peers_anchored.get_or_create(&DirectionLabels { direction });
        }
        let keys_advertised = Gauge::default();
        let sync_images_walked = Family::<ReasonLabels, Counter>::default();
        let announcements_pending = Gauge::default();
        let announcements_rested = Counter::default();
        let announce_rounds = Counter::default();
        let announce_rounds_early = Counter::default();
        let announce_interval = Gauge::default();
        let announce_walks = Family::<OutcomeLabels, Counter>::default();
        let announce_batches = Family::<OutcomeLabels, Counter>::default();
        let announce_hops = Family::<OutcomeLabels, Counter>::default();
        let lookups = Family::<LookupLabels, Counter>::default();
        let containerd_up = Gauge::default();
        let hosts_config_written = Gauge::default();
        let tag_requests = Family::<TagLabels, Counter>::default();
        let upstream_up = Family::<RegistryLabels, Gauge>::default();
        let upstream_probes = Family::<ProbeLabels, Counter>::default();
        let coalesce = Family::<CoalesceLabels, Counter>::default();
        let inflight_bytes = Counter::default();
        let relayed_bytes = Counter::default();
        let zero_copy_bytes = Counter::default();
        let (kept_blobs, kept_alone_bytes) = (Gauge::default(), Gauge::default());
        let (keep_budget_bytes, keep_released) = (Gauge::default(), Counter::default());
        let keep_copy_lookups = Counter::default();
        let follow_wait = Histogram::new(DURATION_BUCKETS);
        let corrupt_blobs = Counter::default();
        registry.register(
            "http_requests",
            "Registry API requests by listener (mirror, peer), kind, method and status",
            requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "Time to the response headers of registry API requests, by listener and kind",
            request_duration.clone(),
        );
        registry.register(
            "served_bytes",
            "Bytes of manifests and blobs sent, by listener (mirror: to this node's containerd; peer: to other nodes) and where they came from",
            served_bytes.clone(),
        );
        registry.register(
            "served",
            "Manifest and blob requests answered, by listener (mirror: this node's containerd asked; peer: another node asked) and source (local, peer, inflight, miss)",
            served.clone(),
        );
        registry.register(
            "peer_lookups",
            "DHT provider lookups by result: found, none (the walk ended with nobody), timed_out (nobody within the wait, peer_resolve_wait_seconds, while the walk went on: the pull went upstream), refused (as many walks were under way already: the pull went upstream)",
            peer_lookups.clone(),
        );
        for result in ["found", "none", "timed_out", "refused"] {
            let _ = peer_lookups.get_or_create(&ResultLabels { result });
        }
        registry.register(
            "peer_lookup_duration_seconds",
            "Time from a local miss to the first provider found (or giving up)",
            peer_lookup_duration.clone(),
        );
        registry.register(
            "peer_lookups_found_late",
            "Lookups (blobs, manifests, tags) the pull stopped waiting for whose walk found a provider afterwards: content a longer wait would have taken from a peer, fetched instead from the registry or a coalescing leader (their times lengthen the wait, up to --resolve-timeout-max)",
            peer_lookups_found_late.clone(),
        );
        registry.register(
            "peer_resolve_wait_seconds",
            "How long a pull waits now for a lookup's first provider: --resolve-timeout, or longer where this node's recent lookups of present keys were slower (at most --resolve-timeout-max)",
            peer_resolve_wait.clone(),
        );
        registry.register(
            "peer_failures",
            "Peer fetches that failed, by stage (connect, status, body, verify)",
            peer_failures.clone(),
        );
        registry.register(
            "peer_auth_failures",
            "Requests to the peer address refused for their token (missing, malformed, expired, invalid)",
            peer_auth_failures.clone(),
        );
        registry.register(
            "peers_connected",
            "Peers with an open libp2p connection",
            peers_connected.clone(),
        );
        registry.register(
            "peers_anchored",
            "Connections kept open past their idle timeout by an anchor stream (outgoing: held by this node, or asked for a moment ago; incoming: held by others)",
            peers_anchored.clone(),
        );
        registry.register(
            "keys_advertised",
            "Digests and tags this node announces in the DHT",
            keys_advertised.clone(),
        );
        registry.register(
            "sync_images_walked",
            "Images whose content was walked to find what this node serves, by reason: full (at start and on the re-announcement timer) or change (a store event touched them)",
            sync_images_walked.clone(),
        );
        registry.register(
            "announcements_pending",
            "Keys waiting to be announced in the DHT: queued for a walk, or planned for a node and not yet acknowledged",
            announcements_pending.clone(),
        );
        registry.register(
            "announcements_rested",
            "Key announcements skipped in a round because the key's storing nodes already held 20 other providers for it",
            announcements_rested.clone(),
        );
        registry.register(
            "announce_rounds",
            "Announcement rounds started after a node's first announcement, early ones included",
            announce_rounds.clone(),
        );
        registry.register(
            "announce_rounds_early",
            "Announcement rounds started before their time because the network had grown fourfold since the last one (records placed then would be missed by lookups)",
            announce_rounds_early.clone(),
        );
        registry.register(
            "announce_interval_seconds",
            "The re-announcement interval in effect: the configured one, spaced out in proportion beyond 4,000 nodes (never past 80% of the records' lifetime)",
            announce_interval.clone(),
        );
        registry.register(
            "announce_walks",
            "Closest-node walks of announcement rounds by outcome: converged, or timed_out (not converged within 10 s: its keys go to the nodes it reached, which may not be their closest, and lookups can miss them until the next round)",
            announce_walks.clone(),
        );
        registry.register(
            "announce_batches",
            "Batches of provider records sent to the nodes that store them, by outcome: delivered, retried (its connection closed as it went out: sent once more), or failed (not answered: the key's other nodes hold its records)",
            announce_batches.clone(),
        );
        registry.register(
            "announce_hops",
            "Announcement regions by how they were planned: planned (from the answer of a node near the region, a request or two instead of a walk of about 30), confirmed (while routing tables fill in, or in an early round: after the 3 nearest nodes known answered, a few requests) or walked (no answer stood for the region within 3 hops, or 8 when confirming: a walk of its own)",
            announce_hops.clone(),
        );
        registry.register(
            "store_lookups",
            "Content store lookups by kind and result (hit, miss, unavailable)",
            lookups.clone(),
        );
        registry.register(
            "containerd_up",
            "1 when containerd answers on its socket",
            containerd_up.clone(),
        );
        registry.register(
            "hosts_config_written",
            "1 once the containerd hosts.toml mirror entries are written",
            hosts_config_written.clone(),
        );
        registry.register(
            "tag_requests",
            "Tag lookups on the mirror address by answer (upstream: 404 so containerd asks the registry; peers; none)",
            tag_requests.clone(),
        );
        registry.register(
            "upstream_up",
            "1 while the registry's last reachability probe got an answer, 0 when it did not (registries in use only)",
            upstream_up.clone(),
        );
        registry.register(
            "upstream_probes",
            "Reachability probes of upstream registries (GET /v2/, no credentials) by result",
            upstream_probes.clone(),
        );
        registry.register(
            "coalesce",
            "Misses coordinated with other nodes, by role (leader: fetches upstream; follower: streams from the leader) and result",
            coalesce.clone(),
        );
        registry.register(
            "inflight_bytes",
            "Bytes served to followers out of this node's downloads in progress",
            inflight_bytes.clone(),
        );
        registry.register(
            "relayed_bytes",
            "Bytes served to followers out of this node's own download while it follows (relays)",
            relayed_bytes.clone(),
        );
        registry.register(
            "kept_blobs",
            "Blobs held in Ferry's containerd lease for peers",
            kept_blobs.clone(),
        );
        registry.register(
            "kept_alone_bytes",
            "Bytes of held blobs that only Ferry's lease keeps (no image does): the disk it costs",
            kept_alone_bytes.clone(),
        );
        registry.register(
            "keep_budget_bytes",
            "The most kept_alone_bytes may reach (--keep-budget)",
            keep_budget_bytes.clone(),
        );
        registry.register(
            "keep_released",
            "Held blobs let go to stay within the keep budget",
            keep_released.clone(),
        );
        registry.register(
            "keep_copy_lookups",
            "DHT lookups counting other nodes' copies of a blob before letting it go (--keep-copies)",
            keep_copy_lookups.clone(),
        );
        registry.register(
            "zero_copy_bytes",
            "Blob bytes sent to other nodes with sendfile, straight from the page cache (also counted in ferry_served_bytes_total)",
            zero_copy_bytes.clone(),
        );
        registry.register(
            "corrupt_blobs",
            "Blobs in this node's content store found not to match their digest before serving a peer",
            corrupt_blobs.clone(),
        );
        let config_problems = Family::<ProblemLabels, Gauge>::default();
        registry.register(
            "config_problems",
            "1 while a problem that makes Ferry less useful on this node holds (see /readyz), 0 once it is gone",
            config_problems.clone(),
        );
        let peer_handshake_failures = Family::<DirectionLabels, Counter>::default();
        registry.register(
            "peer_handshake_failures",
            "Peer connections that reached the other side but failed the handshake (usually a different cluster secret), by direction",
            peer_handshake_failures.clone(),
        );
        let bootstrap_dials = Counter::default();
        registry.register(
            "bootstrap_dials",
            "Dials of addresses named by the bootstrap sources (a few at a time, only while no peer is connected; Kademlia finds the rest)",
            bootstrap_dials.clone(),
        );
        let provider_walks = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "provider_walks",
            "DHT walks for a digest's providers that ended, by outcome: found (cut short at the first providers) or none (every closest node asked)",
            provider_walks.clone(),
        );
        let provider_walk_requests = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "provider_walk_requests",
            "Nodes those walks asked, by outcome: divided by ferry_provider_walks_total, the nodes one lookup asks (about 25 for a miss at 100 nodes, five at a time)",
            provider_walk_requests.clone(),
        );
        let provider_walk_dials = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "provider_walk_dials",
            "Connections this node dialled while those walks ran, by outcome: a walk that asks a node no longer connected pays a handshake (on a node in its announcement round the round's own dials count too)",
            provider_walk_dials.clone(),
        );
        for outcome in PROVIDER_WALK_OUTCOMES {
            let labels = OutcomeLabels { outcome };
            let _ = provider_walks.get_or_create(&labels);
            let _ = provider_walk_requests.get_or_create(&labels);
            let _ = provider_walk_dials.get_or_create(&labels);
        }
        let dht_requests = Family::<DhtLabels, Counter>::default();
        registry.register(
            "dht_requests_received",
            "DHT requests other nodes sent this node (each answered once), by kind: the per-node cost of the peer-to-peer network",
            dht_requests.clone(),
        );
        for kind in DHT_REQUEST_KINDS {
            let _ = dht_requests.get_or_create(&DhtLabels { kind });
        }
        for outcome in WALK_OUTCOMES {
            let _ = announce_walks.get_or_create(&OutcomeLabels { outcome });
        }
        for outcome in BATCH_OUTCOMES {
            let _ = announce_batches.get_or_create(&OutcomeLabels { outcome });
        }
        for outcome in HOP_OUTCOMES {
            let _ = announce_hops.get_or_create(&OutcomeLabels { outcome });
        }
        registry.register(
            "follow_wait_seconds",
            "Time a follower waited for its leader's first byte",
            follow_wait.clone(),
        );
        for listener in LISTENERS {
            for kind in SERVED_KINDS {
                for &source in sources(listener) {
                    let labels = SourceLabels {
                        listener,
                        kind,
                        source,
                    };
                    let _ = served.get_or_create(&labels);
                    if source != "miss" {
                        let _ = served_bytes.get_or_create(&labels);
                    }
                }
            }
        }
        Self {
            registry: root,
            requests,
            request_duration,
            served_bytes,
            served,
            peer_lookups,
            peer_lookup_duration,
            peer_lookups_found_late,
            peer_resolve_wait,
            peer_failures,
            peer_auth_failures,
            peers_connected,
            peers_anchored,
            keys_advertised,
            sync_images_walked,
            announcements_pending,
            announcements_rested,
            announce_rounds,
            announce_rounds_early,
            announce_interval,
            announce_walks,
            announce_batches,
            announce_hops,
            lookups,
            containerd_up,
            hosts_config_written,
            tag_requests,
            upstream_up,
            upstream_probes,
            coalesce,
            inflight_bytes,
            relayed_bytes,
            zero_copy_bytes,
            kept_blobs,
            kept_alone_bytes,
            keep_budget_bytes,
            keep_released,
            keep_copy_lookups,
            follow_wait,
            corrupt_blobs,
            config_problems,
            peer_handshake_failures,
            bootstrap_dials,
            provider_walks,
            provider_walk_requests,
            provider_walk_dials,
            dht_requests,
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String fails only on a formatter error.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
