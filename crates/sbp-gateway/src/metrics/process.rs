//! The standard `process_*` metrics (the names and meanings of Prometheus's own client libraries),
//! read from `/proc/self` at each scrape: prometheus-client ships no process collector. Where
//! `/proc` is missing (not Linux) the figures are left out rather than reported as zero.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug)]
pub struct ProcessCollector;

/// What `/proc/self/stat` says, in the units Prometheus uses.
#[derive(Debug, Default, PartialEq)]
struct Stat {
    cpu_seconds: f64,
    threads: i64,
    start_time_seconds: f64,
    virtual_bytes: i64,
    resident_bytes: i64,
}

/// Parses `/proc/self/stat` (proc(5)); `boot_time` is `btime` of `/proc/stat`.
fn parse_stat(text: &str, ticks: f64, page: i64, boot_time: f64) -> Option<Stat> {
    // The command name (field 2) may hold spaces and parentheses: fields are counted after the
    // last ')'. `after[0]` is field 3 (state).
    let after: Vec<&str> = text
        .get(text.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    let field = |n: usize| after.get(n - 3).and_then(|v| v.parse::<i64>().ok());
    let utime = field(14)?;
    let stime = field(15)?;
    Some(Stat {
        cpu_seconds: (utime + stime) as f64 / ticks,
        threads: field(20)?,
        start_time_seconds: boot_time + field(22)? as f64 / ticks,
        virtual_bytes: field(23)?,
        resident_bytes: field(24)?.saturating_mul(page),
    })
}

/// `btime` (boot time, seconds since the epoch) of `/proc/stat`.
fn boot_time(text: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft limit on open files of `/proc/self/limits`.
fn max_fds(text: &str) -> Option<i64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: ConstGauge<impl prometheus_client::encoding::EncodeGaugeValue + std::fmt::Debug>,
) -> Result<(), std::fmt::Error> {
    let m = encoder.encode_descriptor(name, help, None, value.metric_type())?;
    value.encode(m)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        let page = i64::try_from(rustix::param::page_size()).unwrap_or(4096);
        let boot = read("/proc/stat").and_then(|t| boot_time(&t));
        let stat = boot.and_then(|boot| parse_stat(&read("/proc/self/stat")?, ticks, page, boot));
        if let Some(s) = stat {
            let cpu = ConstCounter::new(s.cpu_seconds);
            let m = encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds.",
                None,
                cpu.metric_type(),
            )?;
            cpu.encode(m)?;
            gauge(
                &mut encoder,
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                ConstGauge::new(s.resident_bytes),
            )?;
            gauge(
                &mut encoder,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                ConstGauge::new(s.virtual_bytes),
            )?;
            gauge(
                &mut encoder,
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                ConstGauge::new(s.start_time_seconds),
            )?;
            gauge(
                &mut encoder,
                "process_threads",
                "Number of OS threads in the process.",
                ConstGauge::new(s.threads),
            )?;
        }
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            let open = i64::try_from(dir.count()).unwrap_or(i64::MAX);
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors.",
                ConstGauge::new(open),
            )?;
        }
        if let Some(max) = read("/proc/self/limits").and_then(|t| max_fds(&t)) {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                ConstGauge::new(max),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A command name with a space and a parenthesis, as proc(5) allows.
        let text = "4242 (sbp (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 \
                    7 0 12345 1000000 300 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0";
        let s = parse_stat(text, 100.0, 4096, 1_700_000_000.0).expect("parsed");
        assert_eq!(
            s,
            Stat {
                cpu_seconds: 3.0,
                threads: 7,
                start_time_seconds: 1_700_000_123.45,
                virtual_bytes: 1_000_000,
                resident_bytes: 300 * 4096,
            }
        );
        assert_eq!(parse_stat("garbage", 100.0, 4096, 0.0), None);
    }

    #[test]
    fn boot_time_and_open_files_limit_are_read() {
        assert_eq!(boot_time("cpu 1 2 3\nbtime 1700000000\n"), Some(1.7e9));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(max_fds(limits), Some(1024));
        assert_eq!(max_fds("Max open files unlimited unlimited files"), None);
    }
}
