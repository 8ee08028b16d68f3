//! Ferry: a peer-to-peer OCI registry mirror for Kubernetes nodes. It points containerd at
//! itself through `hosts.toml` and serves the OCI pull API from containerd's own content store.
//! The rooms of `src/`, what each may import and their invariants: `ARCHITECTURE.md`.

// `pub` only for what the public modules export; everything else is `pub(crate)`.
#![warn(unreachable_pub)]

pub mod app;
pub mod cli;
pub mod coalesce;
pub mod config;
pub mod containerd_config;
pub mod keep;
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
