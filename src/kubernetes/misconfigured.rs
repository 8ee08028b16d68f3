//! Configuration problems (`problems.rs`) as `FerryMisconfigured` Warning events on this node,
//! where an operator looks first. Invariant: readiness is not touched by a warning.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::events::{self, NodeEvent};
use crate::ops::problems::Problems;

/// How often the problems are looked at: they change at most every few seconds.
pub(crate) const POLL: Duration = Duration::from_secs(5);
/// A problem back this soon after its report is not reported again, so flapping is quiet.
pub(crate) const REPEAT_AFTER: Duration = Duration::from_secs(600);

/// Which problems to report: each when it appears, unless reported within `REPEAT_AFTER`.
#[derive(Debug, Default)]
pub(crate) struct Reporter {
    holding: BTreeSet<&'static str>,
    reported: BTreeMap<&'static str, Instant>,
}

impl Reporter {
    pub(crate) fn due(
        &mut self,
        current: &[(&'static str, String)],
        now: Instant,
    ) -> Vec<&'static str> {
        let holding: BTreeSet<&'static str> = current.iter().map(|(p, _)| *p).collect();
        let due = holding
            .iter()
            .filter(|p| !self.holding.contains(*p))
            .filter(|p| {
                self.reported
                    .get(*p)
                    .is_none_or(|t| now.duration_since(*t) >= REPEAT_AFTER)
            })
            .copied()
            .collect();
        self.holding = holding;
        due
    }

    pub(crate) fn reported(&mut self, problem: &'static str, now: Instant) {
        self.reported.insert(problem, now);
    }

    /// The event could not be written: try again at the next look.
    pub(crate) fn failed(&mut self, problem: &'static str) {
        self.holding.remove(problem);
    }
}

/// Reports each problem as it appears, until cancelled; on its own task, so a down API server
/// delays nothing but the event.
pub(crate) async fn report(
    client: kube::Client,
    node: String,
    problems: Arc<Problems>,
    token: CancellationToken,
) {
    let mut reporter = Reporter::default();
    loop {
        let current = problems.current();
        let now = Instant::now();
        for problem in reporter.due(&current, now) {
            let detail = current
                .iter()
                .find(|(p, _)| *p == problem)
                .map_or("", |(_, d)| d.as_str());
            let message = format!("{problem}: {detail}");
            let event = NodeEvent {
                reason: "FerryMisconfigured",
                type_: "Warning",
                message: &message,
            };
            match events::record(&client, &node, event).await {
                Ok(()) => reporter.reported(problem, now),
                Err(e) => {
                    tracing::warn!(%node, problem, error = %e, "cannot record the FerryMisconfigured event; trying again");
                    reporter.failed(problem);
                }
            }
        }
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(names: &[&'static str]) -> Vec<(&'static str, String)> {
        names.iter().map(|n| (*n, String::new())).collect()
    }

    #[test]
    fn a_problem_is_reported_when_it_appears_and_not_again_while_it_flaps() {
        let mut r = Reporter::default();
        let t0 = Instant::now();
        assert_eq!(r.due(&p(&["no_peers"]), t0), ["no_peers"]);
        r.reported("no_peers", t0);
        assert!(r.due(&p(&["no_peers"]), t0).is_empty(), "still holding");
        assert!(r.due(&p(&[]), t0).is_empty());
        assert!(r.due(&p(&["no_peers"]), t0 + POLL).is_empty());
        r.due(&p(&[]), t0 + POLL * 2);
        let later = t0 + REPEAT_AFTER;
        assert_eq!(
            r.due(&p(&["no_peers", "discard_unpacked_layers"]), later),
            ["discard_unpacked_layers", "no_peers"]
        );
    }

    #[test]
    fn a_report_that_failed_is_tried_again() {
        let mut r = Reporter::default();
        let t0 = Instant::now();
        assert_eq!(r.due(&p(&["no_peers"]), t0), ["no_peers"]);
        r.failed("no_peers");
        assert_eq!(r.due(&p(&["no_peers"]), t0 + POLL), ["no_peers"]);
    }
}
