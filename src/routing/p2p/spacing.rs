//! Rounds spaced out as the network grows. Every node receives about one batch from each
//! other node a round, so with a fixed interval what a node receives a second grows with N;
//! beyond [`ProvideTiming::nodes_per_interval`] nodes the interval grows in proportion.
//! Invariant: never shorter than the configured interval, and never longer than
//! [`MOST_OF_TTL`] of the records' lifetime, so records are renewed before they lapse on
//! any node, whatever its version.

use std::time::Duration;

use super::ProvideTiming;

/// Leaves a round a fifth of the records' lifetime to place them (6 minutes by default).
const MOST_OF_TTL: f64 = 0.8;

/// The interval until the next round, for a network last estimated at `size` nodes.
pub(super) fn round_interval(timing: &ProvideTiming, size: Option<f64>) -> Duration {
    let base = timing.interval;
    let (Some(size), n @ 1..) = (size, timing.nodes_per_interval) else {
        return base;
    };
    let longest = (timing.ttl.as_secs_f64() * MOST_OF_TTL).max(base.as_secs_f64());
    let spaced = base.as_secs_f64() * (size / n as f64).max(1.0);
    Duration::from_secs_f64(spaced.min(longest))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FERRY: ProvideTiming = ProvideTiming {
        ttl: Duration::from_secs(1800),
        interval: Duration::from_secs(600),
        replicas: 20,
        nodes_per_interval: 4_000,
    };

    fn minutes(size: Option<f64>) -> f64 {
        round_interval(&FERRY, size).as_secs_f64() / 60.0
    }

    #[test]
    fn the_interval_grows_with_the_network_beyond_its_size_and_stops_short_of_the_ttl() {
        assert_eq!(minutes(None), 10.0, "no estimate yet: the configured one");
        assert_eq!(minutes(Some(3.0)), 10.0);
        assert_eq!(minutes(Some(4_000.0)), 10.0);
        assert_eq!(
            minutes(Some(5_000.0)),
            12.5,
            "a fourth more nodes, a fourth longer"
        );
        assert_eq!(minutes(Some(8_000.0)), 20.0);
        assert_eq!(
            minutes(Some(15_000.0)),
            24.0,
            "80% of the 30-minute lifetime"
        );
        assert_eq!(minutes(Some(f64::INFINITY)), 24.0);
        assert_eq!(minutes(Some(f64::NAN)), 10.0);
    }

    #[test]
    fn a_configured_interval_is_never_shortened_and_zero_turns_spacing_off() {
        let close = ProvideTiming {
            interval: Duration::from_secs(1700),
            ..FERRY
        };
        assert_eq!(round_interval(&close, Some(50_000.0)), close.interval);
        let off = ProvideTiming {
            nodes_per_interval: 0,
            ..FERRY
        };
        assert_eq!(round_interval(&off, Some(50_000.0)), off.interval);
    }
}
