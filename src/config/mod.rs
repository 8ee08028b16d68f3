//! Every setting, as one struct: a field is a flag `--<key>`, an environment variable
//! `FERRY_<KEY>` and a key in the `--config` file, parsed by the same function from each
//! (`values`). `cli` merges the sources (flag > environment > file > default); `check` holds the
//! rules between settings. No side effects: loading never reads anything but the file.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub use crate::oci::registry::{Registries, RegistryFilters, registry_host};
use crate::registry::ResolveTags;

mod file;
mod values;

pub use file::{REPLACED, read as read_file};
use values::*;
pub use values::{KeepBudget, Optional, duration, log_filter, size};

/// The settings. Defaults are clap's, so `--help` shows them.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct Config {
    /// containerd's gRPC socket
    #[arg(long, value_name = "PATH", default_value = "/run/containerd/containerd.sock", value_parser = path)]
    pub containerd_socket: PathBuf,
    /// containerd namespace whose images and content are served
    #[arg(long, value_name = "NAME", default_value = "k8s.io", value_parser = namespace)]
    pub containerd_namespace: String,
    /// containerd's content directory, read directly when readable
    #[arg(long, value_name = "PATH", value_parser = path,
        default_value = "/var/lib/containerd/io.containerd.content.v1.content")]
    pub containerd_content_dir: PathBuf,
    /// containerd's config file, read (never written) for a preflight check
    #[arg(long, value_name = "PATH", default_value = "/etc/containerd/config.toml", value_parser = path)]
    pub containerd_config: PathBuf,
    /// containerd's registry hosts directory
    #[arg(long, value_name = "PATH", default_value = "/etc/containerd/certs.d", value_parser = path)]
    pub hosts_dir: PathBuf,
    /// Comma-separated host[:port] registries to mirror [default: all registries]
    #[arg(long, value_name = "LIST", default_value = "", hide_default_value = true, value_parser = registries)]
    pub registries: Registries,
    /// Address containerd pulls through
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:5480", value_parser = addr)]
    pub mirror_addr: SocketAddr,
    /// URL hosts.toml points containerd at [default: http://<mirror-addr>]
    #[arg(long, value_name = "URL", default_value = "", hide_default_value = true, value_parser = optional(mirror_target))]
    pub mirror_target: Optional<String>,
    /// Allow a mirror address that is not loopback
    #[arg(long, value_name = "BOOL", default_value = "false", value_parser = boolean)]
    pub mirror_allow_remote: bool,
    /// Address of /metrics, /healthz and /readyz (`[::]`: IPv4 and IPv6)
    #[arg(long, value_name = "ADDR", default_value = "[::]:5483", value_parser = addr)]
    pub metrics_addr: SocketAddr,
    /// Serve a debug page at /debug on the metrics address, to clients on this host only
    /// (peers, what this node advertises, recent pulls, a test pull)
    #[arg(long, value_name = "BOOL", default_value = "false", value_parser = boolean)]
    pub debug_page: bool,
    /// Ferry's own state
    #[arg(long, value_name = "PATH", default_value = "/var/lib/ferry", value_parser = path)]
    pub data_dir: PathBuf,
    /// Peer-to-peer on or off; off serves this node's content only
    #[arg(long, value_name = "BOOL", default_value = "true", value_parser = boolean)]
    pub p2p: bool,
    /// Where other nodes fetch content from this one [default: <advertise-addr>:5481]
    #[arg(long, value_name = "ADDR", default_value = "", hide_default_value = true, value_parser = optional(addr))]
    pub peer_addr: Optional<SocketAddr>,
    /// libp2p (TCP) listen address
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:5482", value_parser = addr)]
    pub p2p_addr: SocketAddr,
    /// The IP other nodes reach this node at [default: the default route's interface's address]
    #[arg(long, value_name = "IP", default_value = "", hide_default_value = true, value_parser = optional(ip))]
    pub advertise_addr: Optional<IpAddr>,
    /// Comma-separated host:port (or multiaddrs) of other nodes' p2p addresses
    #[arg(long, value_name = "LIST", default_value = "", hide_default_value = true, value_parser = bootstrap_peers)]
    pub bootstrap_peers: BootstrapPeers,
    /// A DNS name whose A/AAAA records are nodes to dial (at the p2p port)
    #[arg(long, value_name = "NAME", default_value = "", hide_default_value = true, value_parser = optional(dns_name))]
    pub bootstrap_dns: Optional<String>,
    /// Bootstrap addresses dialled at once, drawn at random; Kademlia finds the rest
    #[arg(long, value_name = "N", default_value = "3", value_parser = bootstrap_dials)]
    pub bootstrap_dials: usize,
    /// Label selector of Ferry's pods: bootstrap peers from the Kubernetes API
    #[arg(long, value_name = "SELECTOR", default_value = "", hide_default_value = true, value_parser = optional(label_selector))]
    pub bootstrap_kubernetes: Optional<String>,
    /// How long a provider lookup may take before a miss goes upstream
    #[arg(long, value_name = "DUR", default_value = "20ms", value_parser = duration)]
    pub resolve_timeout: Duration,
    /// The longest a pull waits for a provider lookup, on a node whose recent lookups of
    /// present keys were slow (1.5x the time 95% of its last 100 took)
    #[arg(long, value_name = "DUR", default_value = "100ms", value_parser = duration)]
    pub resolve_timeout_max: Duration,
    /// When tags are resolved through peers: never, when-upstream-fails, always
    #[arg(long, value_name = "WHEN", default_value = "when-upstream-fails", value_parser = resolve_tags)]
    pub resolve_tags: ResolveTags,
    /// Coordinate simultaneous misses: one node fetches upstream, the others stream its download
    #[arg(long, value_name = "BOOL", default_value = "true", value_parser = boolean)]
    pub coalesce: bool,
    /// How long a follower waits for the leader's first byte
    #[arg(long, value_name = "DUR", default_value = "3s", value_parser = duration)]
    pub follow_timeout: Duration,
    /// Followers one node streams a blob to at once; more followers relay to each other in a
    /// tree. 0: every follower streams from the leader
    #[arg(long, value_name = "N", default_value = "2", value_parser = relay_fanout)]
    pub relay_fanout: usize,
    /// Bytes per second this node sends other nodes at most, all peer answers together
    /// (e.g. 50MiB); empty or 0: no limit
    #[arg(long, value_name = "SIZE", default_value = "", hide_default_value = true, value_parser = upload_limit)]
    pub peer_upload_limit: Optional<u64>,
    /// Disk this node's lease may keep for peers beyond what its images keep: a size (20GiB) or
    /// a share of the content filesystem (10%); 0: no lease
    #[arg(long, value_name = "SIZE|%", default_value = "10%", value_parser = keep_budget)]
    pub keep_budget: KeepBudget,
    /// Copies of a blob the cluster keeps: over the budget, this node lets a blob go first
    /// where this many other nodes ahead of it in the blob's order have it; 0: no lookups
    #[arg(long, value_name = "N", default_value = "2", value_parser = keep_copies)]
    pub keep_copies: usize,
    /// Lifetime of this node's provider records in the DHT
    #[arg(long, value_name = "DUR", default_value = "30m", value_parser = duration)]
    pub provide_ttl: Duration,
    /// How often records are re-announced, before they expire; beyond 4,000 nodes rounds are
    /// spaced out in proportion, never past 80% of the lifetime
    #[arg(long, value_name = "DUR", default_value = "10m", value_parser = duration)]
    pub reprovide_interval: Duration,
    /// File holding the cluster secret: a private libp2p network and signed peer requests
    #[arg(long, value_name = "FILE", default_value = "", hide_default_value = true, value_parser = optional(path))]
    pub cluster_secret_file: Optional<PathBuf>,
    /// Regexes on registry/repo[:tag] of images shared with peers; `!` in front excludes
    #[arg(long, value_name = "LIST", default_value = "", hide_default_value = true, value_parser = registry_filters)]
    pub registry_filters: RegistryFilters,
    /// Bound on connecting to a peer
    #[arg(long, value_name = "DUR", default_value = "500ms", value_parser = duration)]
    pub peer_connect_timeout: Duration,
    /// Bound from request to a peer's response headers
    #[arg(long, value_name = "DUR", default_value = "2s", value_parser = duration)]
    pub peer_first_byte_timeout: Duration,
    /// Longest silence in a peer's body before moving to the next provider
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = duration)]
    pub peer_idle_timeout: Duration,
    /// Blobs from peers up to this size are verified before the first byte is served
    #[arg(long, value_name = "SIZE", default_value = "4MiB", value_parser = size)]
    pub verify_before_serving: u64,
    /// Send large stored blobs to other nodes with sendfile
    #[arg(long, value_name = "BOOL", default_value = "true", value_parser = boolean)]
    pub zero_copy: bool,
    /// Namespace of Ferry's pods [default: the pod's own]
    #[arg(long, value_name = "NS", default_value = "", hide_default_value = true, value_parser = optional(kubernetes_name))]
    pub kubernetes_namespace: Optional<String>,
    /// This node's Kubernetes name (the chart sets it from the downward API)
    #[arg(long, value_name = "NAME", default_value = "", hide_default_value = true, value_parser = optional(kubernetes_name))]
    pub node_name: Optional<String>,
    /// Taint key removed from this node once Ferry is ready; empty: leave taints alone
    #[arg(long, value_name = "KEY", default_value = "ferry.dev/not-ready", value_parser = optional(taint_key))]
    pub ready_taint: Optional<String>,
    /// text or json
    #[arg(long, value_name = "FORMAT", default_value = "text", value_parser = log_format)]
    pub log_format: LogFormat,
    /// A level (info, debug, ...) or a tracing filter such as `ferry=debug`
    #[arg(long, value_name = "LEVEL", default_value = "info", value_parser = log_level)]
    pub log_level: String,
}

impl Config {
    /// Whether Ferry holds what it pulls in a lease of its own (`keep/`).
    pub fn keeps(&self) -> bool {
        !matches!(
            self.keep_budget,
            KeepBudget::Bytes(0) | KeepBudget::Share(0)
        )
    }
}

/// Other nodes' p2p addresses. (An alias, so that clap takes the list as one value.)
pub type BootstrapPeers = Vec<libp2p::Multiaddr>;

/// The default port of the peer address, next to the mirror's 5480.
pub const DEFAULT_PEER_PORT: u16 = 5481;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// A bad configuration value: printed as one line, `<key>: <what is wrong>`; exit status 64.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

pub(crate) fn err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.to_string(),
        message: message.into(),
    }
}

impl Config {
    /// Every key with its default, as the file spells them.
    pub fn keys() -> Vec<(String, String)> {
        Config::augment_args(clap::Command::new("ferry"))
            .get_arguments()
            .map(|a| {
                let default = a.get_default_values().first();
                let default = default.map(|d| d.to_string_lossy().into_owned());
                (
                    a.get_id().as_str().replace('_', "-"),
                    default.unwrap_or_default(),
                )
            })
            .collect()
    }

    /// The rules between settings, after each value parsed on its own.
    pub fn check(self) -> Result<Config, ConfigError> {
        if !self.mirror_addr.ip().is_loopback() && !self.mirror_allow_remote {
            return Err(err(
                "mirror-addr",
                format!(
                    "{} is not a loopback address; the mirror serves this node's images to whoever reaches it: set mirror-allow-remote = true to bind it there anyway",
                    self.mirror_addr
                ),
            ));
        }
        if self.p2p && self.reprovide_interval >= self.provide_ttl {
            return Err(err(
                "reprovide-interval",
                "must be shorter than provide-ttl, or records expire before they are renewed",
            ));
        }
        Ok(self)
    }

    /// The URL containerd is pointed at. A wildcard bind is reached over loopback.
    pub fn mirror_url(&self) -> String {
        if let Some(target) = &self.mirror_target {
            return target.clone();
        }
        let ip = match self.mirror_addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.mirror_addr.port()))
    }

    /// The follower's wait for a leader, when simultaneous misses are coordinated.
    pub fn coalescing(&self) -> Option<Duration> {
        self.coalesce.then_some(self.follow_timeout)
    }

    /// Whether Ferry talks to the Kubernetes API at all.
    pub fn uses_kubernetes(&self) -> bool {
        self.bootstrap_kubernetes.is_some() || self.node_name.is_some()
    }
}

#[cfg(test)]
mod tests;
