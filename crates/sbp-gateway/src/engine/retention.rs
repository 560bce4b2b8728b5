//! Retention: a tracked task that sweeps, on the operator's schedule, what no longer serves anyone
//! (exports whose tokens cannot import any more and their bundles, old snapshots, and federation
//! rows past their own expiry). Every replica may run it: a sweep is a set of deletes by age, so two
//! at once remove each row once.

use std::sync::Arc;

use chrono::Utc;
use sbp_store::{Store, Sweep};

use super::tasks::Tasks;
use crate::config::GatewayConfig;
use crate::metrics::Metrics;

/// Starts the sweep, unless retention is off (no interval, or nothing to sweep).
pub(super) fn start(
    store: Arc<dyn Store>,
    config: Arc<GatewayConfig>,
    metrics: Arc<Metrics>,
    tasks: &Tasks,
) {
    let off = config.export_retention.is_none()
        && config.snapshot_retention.is_none()
        && config.federation.is_none();
    if config.retention_interval.is_zero() || off {
        return;
    }
    let stop = tasks.stopping();
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(config.retention_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            sweep_once(store.as_ref(), &config, &metrics).await;
        }
    });
}

async fn sweep_once(store: &dyn Store, config: &GatewayConfig, metrics: &Metrics) {
    let now = Utc::now();
    let before = |keep: Option<std::time::Duration>| {
        keep.and_then(|k| chrono::Duration::from_std(k).ok())
            .and_then(|k| now.checked_sub_signed(k))
    };
    let sweep = Sweep {
        exports_before: before(config.export_retention),
        snapshots_before: before(config.snapshot_retention),
        // Past their own expiry these rows (federation tokens seen, registry records,
        // announcements) serve no one, whatever the retention settings.
        expired_before: Some(now),
    };
    match store.sweep(sweep).await {
        Ok(swept) => {
            metrics.retention_sweeps.inc();
            metrics.retention_exports.inc_by(swept.exports);
            metrics.retention_bundles.inc_by(swept.bundles);
            metrics.retention_snapshots.inc_by(swept.snapshots);
            metrics.retention_jti.inc_by(swept.jti);
            metrics
                .retention_registry_records
                .inc_by(swept.registry_records);
            metrics.retention_announcements.inc_by(swept.announcements);
            if swept != Default::default() {
                tracing::info!(
                    exports = swept.exports,
                    bundles = swept.bundles,
                    snapshots = swept.snapshots,
                    jti = swept.jti,
                    registry_records = swept.registry_records,
                    announcements = swept.announcements,
                    "retention sweep"
                );
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "retention sweep failed; retrying at the next interval")
        }
    }
}
