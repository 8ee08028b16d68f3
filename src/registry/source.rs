//! Where an answer came from. Invariant: every answer to a manifest or blob by digest has
//! exactly one, set by the policy that chose it and counted in `request::counted` alone.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Local,
    /// A complete copy on another node.
    Peer,
    /// A download in progress: this node's own, a leader's or a relay's.
    InFlight,
    /// A 404: containerd goes to the next host (usually the registry).
    Miss,
}

impl Source {
    pub const ALL: [Source; 4] = [Source::Local, Source::Peer, Source::InFlight, Source::Miss];

    /// Its `source` label in metrics and `ferry status`.
    pub fn label(self) -> &'static str {
        match self {
            Source::Local => "local",
            Source::Peer => "peer",
            Source::InFlight => "inflight",
            Source::Miss => "miss",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_list_every_source_by_its_label() {
        let labels: Vec<&str> = Source::ALL.iter().map(|s| s.label()).collect();
        assert_eq!(labels, crate::metrics::SOURCES);
    }
}
