//! The standard `process_*` metrics, read from `/proc/self` at each scrape (no task, no state).
//! Invariant: names and meanings are the Prometheus process collector's, so dashboards work.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// `USER_HZ`: 100 on every Linux architecture Ferry builds for, whatever the kernel's `HZ`.
const TICKS_PER_SECOND: f64 = 100.0;

#[derive(Debug, Default)]
pub(crate) struct ProcessCollector;

/// One reading of `/proc/self`; a field `None` where unreadable is left out, not reported as 0.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Reading {
    pub cpu_seconds: Option<f64>,
    pub start_time_seconds: Option<f64>,
    pub resident_bytes: Option<i64>,
    pub virtual_bytes: Option<i64>,
    pub open_fds: Option<i64>,
    pub max_fds: Option<i64>,
}

impl Reading {
    pub(crate) fn now() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let stat = read("/proc/self/stat");
        let (cpu_seconds, start_ticks) = stat.as_deref().map(parse_stat).unwrap_or_default();
        let boot = read("/proc/stat").as_deref().and_then(parse_btime);
        let status = read("/proc/self/status");
        let kib = |field| status.as_deref().and_then(|s| status_kib(s, field));
        Reading {
            cpu_seconds,
            start_time_seconds: boot
                .zip(start_ticks)
                .map(|(b, t)| b as f64 + t as f64 / TICKS_PER_SECOND),
            resident_bytes: kib("VmRSS:").map(|k| k * 1024),
            virtual_bytes: kib("VmSize:").map(|k| k * 1024),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|d| d.count() as i64),
            max_fds: read("/proc/self/limits").as_deref().and_then(parse_max_fds),
        }
    }
}

/// CPU seconds and start ticks from `/proc/self/stat`, with fields counted after the command
/// name's last `)`, since the name may contain spaces and parentheses.
fn parse_stat(stat: &str) -> (Option<f64>, Option<u64>) {
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return (None, None);
    };
    // After the name, field 3 (state) is index 0: utime is field 14, stime 15, starttime 22.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let cpu = field(14)
        .zip(field(15))
        .map(|(u, s)| (u + s) as f64 / TICKS_PER_SECOND);
    (cpu, field(22))
}

fn parse_btime(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn status_kib(status: &str, field: &str) -> Option<i64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

fn parse_max_fds(limits: &str) -> Option<i64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    // "Max open files   <soft>   <hard>   files": the soft limit is what the process gets.
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let r = Reading::now();
        if let Some(v) = r.cpu_seconds {
            let m = ConstCounter::new(v);
            m.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                m.metric_type(),
            )?)?;
        }
        let gauges = [
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                r.start_time_seconds,
            ),
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                r.resident_bytes.map(|v| v as f64),
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                r.virtual_bytes.map(|v| v as f64),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                r.open_fds.map(|v| v as f64),
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                r.max_fds.map(|v| v as f64),
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(v) = value {
                let m = ConstGauge::new(v);
                m.encode(encoder.encode_descriptor(name, help, None, m.metric_type())?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_counted_after_the_last_parenthesis() {
        // A command name with a space and a parenthesis, as a renamed thread can have.
        let stat = "1234 (fer ry) x) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 8 0 4200 123456 789 18446744073709551615";
        assert_eq!(parse_stat(stat), (Some(3.0), Some(4200)));
        assert_eq!(parse_stat("garbage"), (None, None));
    }

    #[test]
    fn limits_and_status_parsed() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
        assert_eq!(parse_max_fds(limits), Some(1_048_576));
        assert_eq!(
            status_kib("Name:\tferry\nVmRSS:\t   2048 kB\n", "VmRSS:"),
            Some(2048)
        );
        assert_eq!(
            parse_btime("cpu 1 2\nbtime 1700000000\n"),
            Some(1_700_000_000)
        );
    }

    #[test]
    fn this_process_reads_plausibly() {
        let r = Reading::now();
        assert!(r.resident_bytes.unwrap() > 1 << 20, "{r:?}");
        assert!(r.open_fds.unwrap() >= 3, "{r:?}");
        assert!(r.max_fds.unwrap() >= r.open_fds.unwrap(), "{r:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = r.start_time_seconds.unwrap();
        assert!(start <= now + 1.0 && start > now - 86_400.0, "{r:?}");
    }
}
