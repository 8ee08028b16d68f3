//! The command line. Flag names are the user-facing contract: every flag is also a key in the
//! `--config` TOML file and an environment variable `FERRY_<FLAG_IN_CAPS>`. clap merges flag
//! over environment; `config` adds the file and the defaults below them and validates.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Peer-to-peer OCI registry mirror for Kubernetes nodes",
    // A flag given twice takes its last value, as with most daemons: the chart's `extraArgs`
    // come after the flags it sets, so repeating one overrides it instead of crash-looping
    // the pod on "cannot be used multiple times".
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub flags: Flags,
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Run the daemon: write the mirror config, serve the registry API.
    Run,
    /// Write the containerd mirror config (hosts.toml) and exit.
    Configure,
    /// Remove exactly what ferry added to the hosts dir; restore the rest byte-for-byte.
    Cleanup,
    /// Print the version.
    Version,
    /// Show what the Ferry on this node is doing: readiness and each condition, problems,
    /// peers, what it advertises, where its containerd's pulls came from, its last pulls.
    /// Asks the running Ferry at its `--metrics-addr` (a wildcard means this host).
    Status {
        /// Print the JSON `/status` serves instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Wait until the uninstall hook's cleanup DaemonSet has run on every node (the chart's
    /// hook Job runs this); delete it if that does not happen in time.
    WaitCleanup(WaitCleanupArgs),
}

#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct WaitCleanupArgs {
    /// The cleanup DaemonSet's name.
    #[arg(long, value_name = "NAME")]
    pub daemonset: String,
    /// Its namespace [default: the client's, i.e. the pod's own in a cluster]
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// How long to wait before giving up (and deleting the DaemonSet).
    #[arg(long, value_name = "DURATION", default_value = "5m")]
    pub timeout: String,
}

/// Values are kept as text here and parsed in `config`, so that a bad value from any source
/// gets the same one-line error naming its key.
#[derive(Debug, Clone, Default, Args)]
pub struct Flags {
    /// TOML file with any of these flags as keys (flag beats env beats file beats default).
    #[arg(long, global = true, env = "FERRY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// containerd's gRPC socket [default: /run/containerd/containerd.sock]
    #[arg(
        long,
        global = true,
        env = "FERRY_CONTAINERD_SOCKET",
        value_name = "PATH"
    )]
    pub containerd_socket: Option<String>,
    /// containerd namespace whose images and content are served [default: k8s.io]
    #[arg(
        long,
        global = true,
        env = "FERRY_CONTAINERD_NAMESPACE",
        value_name = "NAME"
    )]
    pub containerd_namespace: Option<String>,
    /// containerd's content directory, read directly when readable
    /// [default: /var/lib/containerd/io.containerd.content.v1.content]
    #[arg(
        long,
        global = true,
        env = "FERRY_CONTAINERD_CONTENT_DIR",
        value_name = "PATH"
    )]
    pub containerd_content_dir: Option<String>,
    /// containerd's config file, read (never written) for a preflight check
    /// [default: /etc/containerd/config.toml]
    #[arg(
        long,
        global = true,
        env = "FERRY_CONTAINERD_CONFIG",
        value_name = "PATH"
    )]
    pub containerd_config: Option<String>,
    /// containerd's registry hosts directory [default: /etc/containerd/certs.d]
    #[arg(long, global = true, env = "FERRY_HOSTS_DIR", value_name = "PATH")]
    pub hosts_dir: Option<String>,
    /// Comma-separated host[:port] registries to mirror [default: all registries]
    #[arg(long, global = true, env = "FERRY_REGISTRIES", value_name = "LIST")]
    pub registries: Option<String>,
    /// Address containerd pulls through [default: 127.0.0.1:5480]
    #[arg(long, global = true, env = "FERRY_MIRROR_ADDR", value_name = "ADDR")]
    pub mirror_addr: Option<String>,
    /// URL hosts.toml points containerd at [default: http://<mirror-addr>]
    #[arg(long, global = true, env = "FERRY_MIRROR_TARGET", value_name = "URL")]
    pub mirror_target: Option<String>,
    /// Address of /metrics, /healthz and /readyz (`[::]`: IPv4 and IPv6) [default: [::]:5483]
    #[arg(long, global = true, env = "FERRY_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// Ferry's own state [default: /var/lib/ferry]
    #[arg(long, global = true, env = "FERRY_DATA_DIR", value_name = "PATH")]
    pub data_dir: Option<String>,
    /// Where other nodes fetch content from this one [default: <advertise-addr>:5481]
    #[arg(long, global = true, env = "FERRY_PEER_ADDR", value_name = "ADDR")]
    pub peer_addr: Option<String>,
    /// libp2p (TCP) listen address [default: 0.0.0.0:5482]
    #[arg(long, global = true, env = "FERRY_P2P_ADDR", value_name = "ADDR")]
    pub p2p_addr: Option<String>,
    /// The IP other nodes reach this node at [default: the default route's interface's address]
    #[arg(long, global = true, env = "FERRY_ADVERTISE_ADDR", value_name = "IP")]
    pub advertise_addr: Option<String>,
    /// Comma-separated host:port (or multiaddrs) of other nodes' p2p addresses
    #[arg(
        long,
        global = true,
        env = "FERRY_BOOTSTRAP_PEERS",
        value_name = "LIST"
    )]
    pub bootstrap_peers: Option<String>,
    /// A DNS name whose A/AAAA records are nodes to dial (at the p2p port)
    #[arg(long, global = true, env = "FERRY_BOOTSTRAP_DNS", value_name = "NAME")]
    pub bootstrap_dns: Option<String>,
    /// Bootstrap addresses dialled at once, drawn at random; Kademlia finds the rest [default: 3]
    #[arg(long, global = true, env = "FERRY_BOOTSTRAP_DIALS", value_name = "N")]
    pub bootstrap_dials: Option<String>,
    /// How long a provider lookup may take before a miss goes upstream [default: 20ms]
    #[arg(long, global = true, env = "FERRY_RESOLVE_TIMEOUT", value_name = "DUR")]
    pub resolve_timeout: Option<String>,
    /// The longest a pull waits for a provider lookup, on a node whose recent lookups of
    /// present keys were slow (1.5x the time 95% of its last 100 took) [default: 100ms]
    #[arg(
        long,
        global = true,
        env = "FERRY_RESOLVE_TIMEOUT_MAX",
        value_name = "DUR"
    )]
    pub resolve_timeout_max: Option<String>,
    /// When tags are resolved through peers: never, when-upstream-fails, always
    /// [default: when-upstream-fails]
    #[arg(long, global = true, env = "FERRY_RESOLVE_TAGS", value_name = "WHEN")]
    pub resolve_tags: Option<String>,
    /// Coordinate simultaneous misses: one node fetches upstream, the others stream its
    /// download [default: true]
    #[arg(long, global = true, env = "FERRY_COALESCE", value_name = "BOOL")]
    pub coalesce: Option<String>,
    /// How long a follower waits for the leader's first byte [default: 3s]
    #[arg(long, global = true, env = "FERRY_FOLLOW_TIMEOUT", value_name = "DUR")]
    pub follow_timeout: Option<String>,
    /// Followers one node streams a blob to at once; more followers relay to each other in a
    /// tree. 0: every follower streams from the leader [default: 2]
    #[arg(long, global = true, env = "FERRY_RELAY_FANOUT", value_name = "N")]
    pub relay_fanout: Option<String>,
    /// Bytes per second this node sends other nodes at most, all peer answers together
    /// (e.g. 50MiB); empty or 0: no limit [default: no limit]
    #[arg(
        long,
        global = true,
        env = "FERRY_PEER_UPLOAD_LIMIT",
        value_name = "SIZE"
    )]
    pub peer_upload_limit: Option<String>,
    /// Replaced by --resolve-tags; kept only to say so
    #[arg(long, global = true, hide = true, env = "FERRY_RESOLVE_LATEST")]
    pub resolve_latest: Option<String>,
    /// Lifetime of this node's provider records in the DHT [default: 30m]
    #[arg(long, global = true, env = "FERRY_PROVIDE_TTL", value_name = "DUR")]
    pub provide_ttl: Option<String>,
    /// How often records are re-announced, before they expire [default: 10m]
    #[arg(
        long,
        global = true,
        env = "FERRY_REPROVIDE_INTERVAL",
        value_name = "DUR"
    )]
    pub reprovide_interval: Option<String>,
    /// Peer-to-peer on or off; off serves this node's content only [default: true]
    #[arg(long, global = true, env = "FERRY_P2P", value_name = "BOOL")]
    pub p2p: Option<String>,
    /// File holding the cluster secret: a private libp2p network and signed peer requests
    #[arg(
        long,
        global = true,
        env = "FERRY_CLUSTER_SECRET_FILE",
        value_name = "FILE"
    )]
    pub cluster_secret_file: Option<String>,
    /// Regexes on registry/repo[:tag] of images shared with peers; `!` in front excludes
    #[arg(
        long,
        global = true,
        env = "FERRY_REGISTRY_FILTERS",
        value_name = "LIST"
    )]
    pub registry_filters: Option<String>,
    /// Serve a debug page at /debug on the metrics address, to clients on this host only
    /// (peers, what this node advertises, recent pulls, a test pull) [default: false]
    #[arg(long, global = true, env = "FERRY_DEBUG_PAGE", value_name = "BOOL")]
    pub debug_page: Option<String>,
    /// Allow a mirror address that is not loopback [default: false]
    #[arg(
        long,
        global = true,
        env = "FERRY_MIRROR_ALLOW_REMOTE",
        value_name = "BOOL"
    )]
    pub mirror_allow_remote: Option<String>,
    /// Bound on connecting to a peer [default: 500ms]
    #[arg(
        long,
        global = true,
        env = "FERRY_PEER_CONNECT_TIMEOUT",
        value_name = "DUR"
    )]
    pub peer_connect_timeout: Option<String>,
    /// Bound from request to a peer's response headers [default: 2s]
    #[arg(
        long,
        global = true,
        env = "FERRY_PEER_FIRST_BYTE_TIMEOUT",
        value_name = "DUR"
    )]
    pub peer_first_byte_timeout: Option<String>,
    /// Longest silence in a peer's body before moving to the next provider [default: 5s]
    #[arg(
        long,
        global = true,
        env = "FERRY_PEER_IDLE_TIMEOUT",
        value_name = "DUR"
    )]
    pub peer_idle_timeout: Option<String>,
    /// Blobs from peers up to this size are verified before the first byte is served [default: 4MiB]
    #[arg(
        long,
        global = true,
        env = "FERRY_VERIFY_BEFORE_SERVING",
        value_name = "SIZE"
    )]
    pub verify_before_serving: Option<String>,
    /// Send large stored blobs to other nodes with sendfile [default: true]
    #[arg(long, global = true, env = "FERRY_ZERO_COPY", value_name = "BOOL")]
    pub zero_copy: Option<String>,
    /// Label selector of Ferry's pods: bootstrap peers from the Kubernetes API
    #[arg(
        long,
        global = true,
        env = "FERRY_BOOTSTRAP_KUBERNETES",
        value_name = "SELECTOR"
    )]
    pub bootstrap_kubernetes: Option<String>,
    /// Namespace of Ferry's pods [default: the pod's own]
    #[arg(
        long,
        global = true,
        env = "FERRY_KUBERNETES_NAMESPACE",
        value_name = "NS"
    )]
    pub kubernetes_namespace: Option<String>,
    /// This node's Kubernetes name (the chart sets it from the downward API)
    #[arg(long, global = true, env = "FERRY_NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// Taint key removed from this node once Ferry is ready; empty disables [default: ferry.dev/not-ready]
    #[arg(long, global = true, env = "FERRY_READY_TAINT", value_name = "KEY")]
    pub ready_taint: Option<String>,
    /// text or json [default: text]
    #[arg(long, global = true, env = "FERRY_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// A level (info, debug, ...) or a tracing filter such as `ferry=debug` [default: info]
    #[arg(long, global = true, env = "FERRY_LOG_LEVEL", value_name = "LEVEL")]
    pub log_level: Option<String>,
}

impl Flags {
    /// `(key, value)` for every flag given on the command line or in the environment, with
    /// the key spelled as in the TOML file.
    pub fn given(&self) -> Vec<(&'static str, &str)> {
        [
            ("containerd-socket", &self.containerd_socket),
            ("containerd-namespace", &self.containerd_namespace),
            ("containerd-content-dir", &self.containerd_content_dir),
            ("containerd-config", &self.containerd_config),
            ("hosts-dir", &self.hosts_dir),
            ("registries", &self.registries),
            ("mirror-addr", &self.mirror_addr),
            ("mirror-target", &self.mirror_target),
            ("metrics-addr", &self.metrics_addr),
            ("data-dir", &self.data_dir),
            ("peer-addr", &self.peer_addr),
            ("p2p-addr", &self.p2p_addr),
            ("advertise-addr", &self.advertise_addr),
            ("bootstrap-peers", &self.bootstrap_peers),
            ("bootstrap-dns", &self.bootstrap_dns),
            ("bootstrap-dials", &self.bootstrap_dials),
            ("resolve-timeout", &self.resolve_timeout),
            ("resolve-timeout-max", &self.resolve_timeout_max),
            ("resolve-tags", &self.resolve_tags),
            ("coalesce", &self.coalesce),
            ("follow-timeout", &self.follow_timeout),
            ("relay-fanout", &self.relay_fanout),
            ("peer-upload-limit", &self.peer_upload_limit),
            ("provide-ttl", &self.provide_ttl),
            ("reprovide-interval", &self.reprovide_interval),
            ("p2p", &self.p2p),
            ("cluster-secret-file", &self.cluster_secret_file),
            ("registry-filters", &self.registry_filters),
            ("mirror-allow-remote", &self.mirror_allow_remote),
            ("debug-page", &self.debug_page),
            ("peer-connect-timeout", &self.peer_connect_timeout),
            ("peer-first-byte-timeout", &self.peer_first_byte_timeout),
            ("peer-idle-timeout", &self.peer_idle_timeout),
            ("verify-before-serving", &self.verify_before_serving),
            ("zero-copy", &self.zero_copy),
            ("bootstrap-kubernetes", &self.bootstrap_kubernetes),
            ("kubernetes-namespace", &self.kubernetes_namespace),
            ("node-name", &self.node_name),
            ("ready-taint", &self.ready_taint),
            ("log-format", &self.log_format),
            ("log-level", &self.log_level),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
        .collect()
    }
}
