//! When the mirror resolves a tag through peers. A pull by tag must get what the registry
//! would give whenever the registry answers; peers only stand in when it does not, which is
//! when a stale tag is better than a failed pod. The node's own image store never answers a
//! tag on the mirror: containerd already has that record and asks only to hear the
//! registry's.

use std::str::FromStr;

use super::upstream::Verdict;

/// `--resolve-tags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResolveTags {
    /// Tags always go upstream (a 404 at once); only digests come from peers.
    Never,
    /// Upstream while the registry answers; through peers while it does not.
    #[default]
    WhenUpstreamFails,
    /// Through peers first, upstream when no peer has the tag: for air-gapped clusters that
    /// accept that a moved tag reaches them late.
    Always,
}

impl FromStr for ResolveTags {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "never" => Ok(ResolveTags::Never),
            "when-upstream-fails" => Ok(ResolveTags::WhenUpstreamFails),
            "always" => Ok(ResolveTags::Always),
            _ => Err(()),
        }
    }
}

/// What the mirror does with one tag request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagRoute {
    /// 404 at once: containerd asks the next host, and so the registry.
    Upstream,
    /// Ask peers (404 if none has it).
    Peers,
}

impl ResolveTags {
    /// `verdict` is only consulted for `WhenUpstreamFails`: an unprobed registry counts as
    /// answering, so a healthy pull never waits.
    pub fn route(self, verdict: impl FnOnce() -> Verdict) -> TagRoute {
        match self {
            ResolveTags::Never => TagRoute::Upstream,
            ResolveTags::Always => TagRoute::Peers,
            ResolveTags::WhenUpstreamFails => match verdict() {
                Verdict::NotAnswering(_) => TagRoute::Peers,
                Verdict::Answering | Verdict::Unknown => TagRoute::Upstream,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::upstream::Failure;

    #[test]
    fn peers_stand_in_only_while_the_registry_does_not_answer() {
        let when = ResolveTags::WhenUpstreamFails;
        assert_eq!(when.route(|| Verdict::Answering), TagRoute::Upstream);
        assert_eq!(when.route(|| Verdict::Unknown), TagRoute::Upstream);
        for f in [
            Failure::Refused,
            Failure::Timeout,
            Failure::Error,
            Failure::Status5xx,
            Failure::RateLimited,
        ] {
            assert_eq!(when.route(|| Verdict::NotAnswering(f)), TagRoute::Peers);
        }
        let down = || Verdict::NotAnswering(Failure::Refused);
        assert_eq!(ResolveTags::Never.route(down), TagRoute::Upstream);
        assert_eq!(
            ResolveTags::Always.route(|| Verdict::Answering),
            TagRoute::Peers
        );
    }

    #[test]
    fn the_setting_parses_its_three_values_only() {
        assert_eq!("never".parse(), Ok(ResolveTags::Never));
        assert_eq!(
            "when-upstream-fails".parse(),
            Ok(ResolveTags::WhenUpstreamFails)
        );
        assert_eq!("always".parse(), Ok(ResolveTags::Always));
        assert!("true".parse::<ResolveTags>().is_err());
        assert!("latest".parse::<ResolveTags>().is_err());
    }
}
