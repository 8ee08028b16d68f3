//! Ferry: a peer-to-peer OCI registry mirror for Kubernetes nodes.
//!
//! Ferry runs on every node with host networking, so it does not wait for the CNI. At start it
//! points containerd at itself through `hosts.toml`, then serves the OCI pull API straight
//! from containerd's own content store; it keeps no cache of its own.
//!
//! # Layout
//! - [`cli`]: clap definitions; the flag names are the user-facing contract.
//! - [`config`]: defaults < file < env < flag merge and validation, no side effects.
//! - [`app`]: wiring: bind, write the mirror config, spawn, drain on shutdown.
//! - [`oci`]: pure domain code: digests, names, the `/v2/` path and Range parsers, errors.
//! - [`store`]: the `ContentStore` trait (committed content and downloads in progress), the
//!   containerd and in-memory stores, one conformance check; the only code that knows
//!   containerd's on-disk layout.
//! - [`containerd_config`]: the `hosts.toml` merge/cleanup and containerd config preflight.
//! - [`routing`]: the `Router` trait (libp2p Kademlia, in-memory), bootstrap, store sync.
//! - [`registry`]: the mirror and peer addresses (two routers), peer fetch, tag policy and
//!   the upstream reachability probe.
//! - [`coalesce`]: storm-proof rollouts: one leader per digest, followers streaming its
//!   download in progress (coordinator, lease table, this node's transfers).
//! - [`trust`]: the cluster secret, the private-network key, peer request tokens.
//! - [`ops`]: `/metrics`, `/healthz`, `/readyz`, `/status`.
//! - [`status`]: what `ferry status` shows (readiness, problems, peers, recent pulls).
//! - [`problems`]: what makes Ferry less useful on a node without making it unready (a split
//!   peer network, a changed cluster secret, no peers), shown in `/readyz` and a metric.
//! - [`kubernetes`]: peer bootstrap from the DaemonSet's pods, the node-ready taint.
//! - [`limits`]: connection and in-flight request bounds on the listeners.
//! - [`host_addr`]: the address other nodes reach this one at, when none is given.
//! - [`server`]: the HTTP accept loop (header read timeout, graceful drain).
//! - [`metrics`]: every metric family in one place.
//! - [`wire`]: the headers, paths and protocol names on the wire between nodes.

pub mod app;
pub mod cli;
pub mod coalesce;
pub mod config;
pub mod containerd_config;
pub mod debug_page;
pub mod host_addr;
pub mod kubernetes;
pub mod limits;
pub mod metrics;
pub mod oci;
pub mod ops;
pub mod problems;
pub mod process;
pub mod registry;
pub mod routing;
pub mod server;
pub mod status;
pub mod store;
pub mod trust;
pub mod wire;
