//! containerd's side of the setup: Ferry's `hosts.toml` entries (merged, removed by cleanup)
//! and a read-only preflight of containerd's config.

pub mod dir;
pub mod hosts;
pub mod preflight;

pub use dir::{Action, Outcome, cleanup, configure};
