//! When the mirror resolves a tag through peers. Invariant: while the registry answers, a pull
//! by tag gets the registry's answer; peers stand in only when it does not (a stale tag beats
//! a failed pod).

use std::str::FromStr;

use super::upstream::Verdict;

/// `--resolve-tags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResolveTags {
    /// Tags always go upstream; only digests come from peers.
    Never,
    /// Upstream while the registry answers; through peers while it does not.
    #[default]
    WhenUpstreamFails,
    /// Peers first, upstream when none has the tag: for air-gapped clusters.
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagRoute {
    /// 404 at once: containerd asks the next host, and so the registry.
    Upstream,
    /// Ask peers (404 if none has it).
    Peers,
}

impl ResolveTags {
    /// `verdict` is consulted only for `WhenUpstreamFails`.
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
