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
//! - [`routing`]: the content routing trait (libp2p Kademlia, in-memory), bootstrap, store sync.
//! - [`registry`]: the mirror and peer addresses (two routers), peer fetch, tag policy and
//!   the upstream reachability probe.
//! - [`coalesce`]: storm-proof rollouts: one leader per digest, followers streaming its
//!   download in progress (coordinator, lease table, this node's transfers).
//! - [`trust`]: the cluster secret, the private-network key, peer request tokens.
//! - [`ops`]: operator surfaces: `/metrics`, `/healthz`, `/readyz`, `ferry status`, the debug
//!   page, and the problems that make Ferry less useful on a node without making it unready.
//! - [`kubernetes`]: peer bootstrap from the DaemonSet's pods, the node-ready taint.
//! - [`net`]: plumbing: the HTTP accept loop, connection and request bounds, the advertised
//!   address.
//! - [`metrics`]: every metric family in one place, and the process collector.
//! - [`wire`]: the headers, paths and protocol names on the wire between nodes.
//!
//! The rooms and what each may import: `ARCHITECTURE.md`.

// `pub` only for what the public modules export; everything else is `pub(crate)`.
#![warn(unreachable_pub)]

pub mod app;
pub mod cli;
pub mod coalesce;
pub mod config;
pub mod containerd_config;
pub mod kubernetes;
pub mod metrics;
pub mod net;
pub mod oci;
pub mod ops;
pub mod registry;
pub mod routing;
pub mod store;
pub mod trust;
pub mod wire;
