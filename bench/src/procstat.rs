//! CPU time and peak memory of processes, read from `/proc` (Linux).

use std::path::Path;

/// Clock ticks per second of `/proc/<pid>/stat` times (`getconf CLK_TCK`; 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// Fields of `/proc/<pid>/stat` after the command name.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = text.rsplit_once(')')?.1;
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// User + system CPU seconds of a live process (not its children).
pub(super) fn cpu_seconds(pid: u32) -> Option<f64> {
    let f = stat_fields(pid)?;
    // After ")": state(0) ppid(1) … utime(11) stime(12) cutime(13) cstime(14).
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / TICKS_PER_SECOND)
}

/// CPU seconds of a server: the parent, its live children, and its reaped children.
pub(super) fn server_cpu_seconds(parent: u32) -> Option<f64> {
    let f = stat_fields(parent)?;
    let mut ticks: f64 = (11..=14).map(|i| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)).sum();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Some(cf) = stat_fields(pid)
            && cf.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent)
        {
            ticks += cf.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            ticks += cf.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        }
    }
    Some(ticks / TICKS_PER_SECOND)
}

/// Peak resident memory (VmHWM) in bytes.
pub(super) fn peak_rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// The pid recorded by `scripts/services` for a service, if that process runs.
pub(super) fn service_pid(services_dir: &Path, service: &str) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(services_dir.join(service).join("pid")).ok()?.trim().parse().ok()?;
    stat_fields(pid).map(|_| pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_process() {
        let me = std::process::id();
        assert!(cpu_seconds(me).is_some());
        assert!(peak_rss_bytes(me).unwrap() > 0);
        assert!(server_cpu_seconds(me).is_some());
    }
}
