//! The run's memory bound: a run that cannot fit stops saying why, not by the kernel's OOM
//! killer an hour in. Before it starts, the nodes' heap alone must fit; while it runs, a thread
//! stops it once resident memory passes the bound (`--max-rss-mib`, default 90% of what the
//! machine has available at the start) or the machine runs short.

use std::sync::Mutex;
use std::time::Duration;

/// The steady heap a node holds, fitted to runs at 100-1,000 nodes and 100-10,000 digests
/// (docs/design/scale-sim.md): a base, each other node it has met, each digest it announces.
const HEAP_BASE_MIB: f64 = 2.18;
const HEAP_MIB_PER_NODE: f64 = 0.003_74;
const HEAP_MIB_PER_DIGEST: f64 = 0.000_874;

/// What the run is doing, for the message when it stops.
static PHASE: Mutex<&str> = Mutex::new("starting");

pub fn phase(now: &'static str) {
    *PHASE.lock().unwrap() = now;
}

/// The heap `nodes` nodes of `digests` digests hold between rollouts: less than the run needs.
pub fn heap_floor_mib(nodes: usize, digests: usize) -> f64 {
    let n = nodes as f64;
    n * (HEAP_BASE_MIB + HEAP_MIB_PER_NODE * n + HEAP_MIB_PER_DIGEST * digests as f64)
}

/// The most nodes whose heap floor fits `bound_mib`.
pub fn largest_fitting(bound_mib: f64, digests: usize) -> usize {
    let (mut low, mut high) = (0usize, 1_000_000usize);
    while low < high {
        let mid = (low + high).div_ceil(2);
        if heap_floor_mib(mid, digests) <= bound_mib {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}

/// A field of a `/proc` file listing sizes in kB (`/proc/meminfo`, `/proc/self/status`), in MiB.
pub fn proc_mib(file: &str, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

fn meminfo_mib(field: &str) -> Option<f64> {
    proc_mib("/proc/meminfo", field)
}

/// 90% of `MemAvailable`, in MiB.
pub fn default_bound_mib() -> f64 {
    meminfo_mib("MemAvailable:").map_or(f64::MAX, |mib| mib * 0.9)
}

/// What the machine must keep available whatever the bound: the run is not the only thing
/// that grows (beside a 1,000-node storm the rest of the machine took 3 GiB more).
fn machine_floor_mib(total_mib: f64) -> f64 {
    (total_mib * 0.05).max(512.0)
}

/// Refuses a run whose heap alone would pass `bound_mib`, naming the largest that fits.
pub fn check_fits(nodes: usize, digests: usize, bound_mib: f64) -> Result<(), String> {
    let floor = heap_floor_mib(nodes, digests);
    if floor <= bound_mib {
        return Ok(());
    }
    Err(format!(
        "{nodes} nodes x {digests} digests need at least {:.1} GiB (the nodes' heap alone, \
         {:.1} MiB a node), more than the bound of {:.1} GiB (--max-rss-mib): the largest run \
         of {digests} digests that could fit has about {} nodes",
        floor / 1024.0,
        floor / nodes as f64,
        bound_mib / 1024.0,
        largest_fitting(bound_mib, digests),
    ))
}

/// Stops the process once its resident memory passes `bound_mib`, or the machine's available
/// memory falls under its floor.
pub fn watch(bound_mib: f64, seed: u64) {
    let floor = machine_floor_mib(meminfo_mib("MemTotal:").unwrap_or(0.0));
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let rss = crate::status_mib("VmRSS:");
            let available = meminfo_mib("MemAvailable:").unwrap_or(f64::MAX);
            let why = if rss > bound_mib {
                format!(
                    "{rss:.0} MiB resident passed the bound of {bound_mib:.0} MiB (--max-rss-mib)"
                )
            } else if available < floor {
                format!(
                    "the machine had {available:.0} MiB available, under its floor of \
                     {floor:.0} MiB, with {rss:.0} MiB resident here"
                )
            } else {
                continue;
            };
            eprintln!(
                "the simulation stopped: {why} during {}; the lines above stand; replay it \
                 with --seed {seed} (and the same options)",
                PHASE.lock().unwrap()
            );
            std::process::exit(3);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_matches_the_runs_it_came_from() {
        // Measured steady heap a node (MiB): 100 x 1,000, 1,000 x 1,000, 100 x 10,000.
        for (nodes, digests, measured) in [(100, 1000, 3.43), (1000, 1000, 6.8), (100, 10000, 11.3)]
        {
            let fitted = heap_floor_mib(nodes, digests) / nodes as f64;
            assert!(
                (fitted - measured).abs() < 0.05,
                "{nodes} x {digests}: {fitted}"
            );
        }
    }

    #[test]
    fn the_largest_fitting_run_fits_and_one_more_node_does_not() {
        let bound = 20.0 * 1024.0;
        let n = largest_fitting(bound, 10_000);
        assert!(heap_floor_mib(n, 10_000) <= bound);
        assert!(heap_floor_mib(n + 1, 10_000) > bound);
        assert!(check_fits(n, 10_000, bound).is_ok());
        let refused = check_fits(5000, 10_000, bound).unwrap_err();
        assert!(refused.contains(&format!("about {n} nodes")), "{refused}");
    }

    #[test]
    fn the_machine_keeps_a_twentieth_and_at_least_512_mib() {
        assert!((machine_floor_mib(23_000.0) - 1150.0).abs() < 1e-6);
        assert_eq!(machine_floor_mib(4_000.0), 512.0);
    }
}
