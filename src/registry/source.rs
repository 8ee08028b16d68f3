//! Where an answer came from. Invariant: every answer to a manifest or blob by digest has
//! exactly one of these, set by the policy that chose it and counted in one place
//! (`request::handle`).

/// The source of one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// This node's content store.
    Local,
    /// A complete copy on another node.
    Peer,
    /// A download in progress: this node's own, or a leader's on another node.
    InFlight,
    /// Nobody had it: a 404, and containerd goes to the next host (usually the registry).
    Miss,
}

impl Source {
    pub const ALL: [Source; 4] = [Source::Local, Source::Peer, Source::InFlight, Source::Miss];

    /// Its name in metrics' `source` label and in `ferry status`.
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
