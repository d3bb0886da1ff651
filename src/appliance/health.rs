//! Health: `GET /healthz` on the HTTP listener, the admin method `health/get`, the clock checks
//! logged by the server, and `bca doctor` (the appliance checked from its own box).
//!
//! The clock matters more here than on most servers: renewals carry a signed client time that must
//! be within 60 s of the appliance's, so a wrong clock at an air-gapped rack is an outage of every
//! renewal. With no time source to ask, the appliance looks for three signs, each a warning:
//! a clock before this release's floor, a clock behind the newest row it wrote itself (time went
//! backwards), and agents' signed times that disagree with it by more than 30 s on the median.

use crate::appliance::app::App;
use crate::base::error::ApiResult;
use serde_json::{json, Value};

/// No appliance of this release ran before 2026-01-01T00:00:00Z.
pub const CLOCK_FLOOR: i64 = 1_767_225_600;
/// The median disagreement with agents' signed clocks that raises a warning.
pub const SKEW_WARN_SECONDS: i64 = 30;
/// How many agent samples a skew warning needs.
pub const SKEW_MIN_SAMPLES: usize = 5;
/// Tolerance for "the newest row is in the future" (a row's time is the writer's `now`).
const BACKWARDS_SLACK: i64 = 120;

/// A finding on the appliance's clock, as a sentence an operator can act on.
pub fn clock_findings(
    newest_row: Option<i64>,
    median_skew: Option<(i64, usize)>,
    now: i64,
) -> Vec<String> {
    let mut out = Vec::new();
    if now < CLOCK_FLOOR {
        out.push(format!(
            "the clock reads {}, before this release existed: set the time (renewals need clocks within 60 s)",
            crate::base::clock::rfc3339(now)
        ));
    }
    if let Some(t) = newest_row.filter(|t| *t > now + BACKWARDS_SLACK) {
        out.push(format!(
            "the clock went backwards: the newest record was written at {} and the clock reads {}",
            crate::base::clock::rfc3339(t),
            crate::base::clock::rfc3339(now)
        ));
    }
    if let Some((m, n)) =
        median_skew.filter(|(m, n)| m.abs() > SKEW_WARN_SECONDS && *n >= SKEW_MIN_SAMPLES)
    {
        out.push(format!(
            "agents' clocks are {} s {} the appliance's (median over {n} nodes' signed renewals): one of them is wrong, and past 60 s renewals fail",
            m.abs(),
            if m > 0 { "ahead of" } else { "behind" }
        ));
    }
    out
}

pub use crate::store::maintenance::newest_row;

/// Below this much free space the state directory's disk counts as full: SQLite's next
/// checkpoint or WAL growth may not fit.
pub const DISK_MIN_FREE: u64 = 1 << 20;

/// The state directory's disk: `(ok, free bytes, what is wrong)`. Failing when the last write
/// failed for the disk (full, or an I/O error), or when less than [`DISK_MIN_FREE`] is free.
pub fn disk(state_dir: &std::path::Path) -> (bool, Option<u64>, Option<String>) {
    let free = rustix::fs::statvfs(state_dir)
        .ok()
        .map(|s| s.f_bavail.saturating_mul(s.f_frsize));
    match crate::store::write_fault() {
        // Full, and still full (space freed counts at once; the next commit clears the fault).
        Some(crate::store::DISK_FULL) if free.is_some_and(|b| b >= DISK_MIN_FREE) => {}
        Some(f) => {
            return (
                false,
                free,
                Some(crate::store::fault_message(f).to_string()),
            )
        }
        None => {}
    }
    match free {
        Some(b) if b < DISK_MIN_FREE => (
            false,
            free,
            Some(format!(
                "the state directory's disk has {b} bytes free (under {DISK_MIN_FREE}): writes will fail; free space"
            )),
        ),
        _ => (true, free, None),
    }
}

/// The server's view of itself: `status` is `ok`, `degraded` (serving, with warnings) or
/// `failing` (the database does not answer, the JoinService is gone, or the disk takes no write).
pub fn report(app: &App) -> ApiResult<Value> {
    let now = crate::base::clock::now();
    let mut db_ok = crate::store::maintenance::ping(&app.store);
    // On PostgreSQL: whether it takes writes (not a standby), its schema, its standbys.
    let store = if app.store.engine() == "postgres" {
        match crate::store::maintenance::pg_status(&app.store) {
            Ok(st) => {
                db_ok &= st.writable;
                json!({"engine": "postgres", "writable": st.writable, "schemaVersion": st.schema_version,
                       "standbys": st.standbys, "replayLagBytes": st.lag_bytes})
            }
            Err(e) => {
                db_ok = false;
                json!({"engine": "postgres", "problem": e.message})
            }
        }
    } else {
        json!({"engine": "sqlite"})
    };
    let join_ok = app.join.get().is_some_and(|j| j.is_running());
    let (disk_ok, free, disk_problem) = disk(&app.site.state_dir);
    let m = crate::base::metrics::get();
    let warnings = clock_findings(newest_row(&app.store), m.median_skew(), now);
    let status = if !db_ok || !join_ok || !disk_ok {
        "failing"
    } else if warnings.is_empty() {
        "ok"
    } else {
        "degraded"
    };
    Ok(json!({
        "status": status,
        "time": crate::base::clock::rfc3339(now),
        "database": db_ok,
        "store": store,
        "joinService": join_ok,
        "disk": {"ok": disk_ok, "freeBytes": free, "problem": disk_problem},
        "sessions": app.sessions.len(),
        "queueDepth": m.queue_depth.load(std::sync::atomic::Ordering::Relaxed).max(0),
        "clockSkew": m.median_skew().map(|(s, n)| json!({"medianSeconds": s, "samples": n})),
        "warnings": warnings,
    }))
}

/// Logs the clock findings (at start and then periodically).
pub fn log_clock(app: &App) {
    let m = crate::base::metrics::get();
    for w in clock_findings(
        newest_row(&app.store),
        m.median_skew(),
        crate::base::clock::now(),
    ) {
        tracing::warn!("clock: {w}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_findings_name_the_sign() {
        let now = CLOCK_FLOOR + 1_000_000;
        assert!(clock_findings(Some(now - 5), Some((2, 50)), now).is_empty());
        let f = clock_findings(None, None, 1_000);
        assert!(f[0].contains("before this release existed"), "{f:?}");
        let f = clock_findings(Some(now + 3_600), None, now);
        assert!(f[0].contains("went backwards"), "{f:?}");
        let f = clock_findings(None, Some((-95, 12)), now);
        assert!(f[0].contains("95 s behind"), "{f:?}");
        // Too few samples: no verdict.
        assert!(clock_findings(None, Some((-95, 2)), now).is_empty());
    }
}
