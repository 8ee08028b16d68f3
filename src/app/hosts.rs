//! containerd's `hosts.toml` entries from the settings: written at start, merged again every
//! minute, and containerd's own config checked for problems.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::containerd_config::hosts::Ipv6Hosts;
use crate::containerd_config::{self, Action, Outcome, preflight};
use crate::ops::problems::Problems;
use crate::store::ContentStore;

/// So host directories created after start get the mirror too; an unchanged merge writes nothing.
const HOSTS_REFRESH_INTERVAL: Duration = Duration::from_secs(60);

/// containerd config findings (`preflight`) as problems, never unreadiness; cleared once fixed.
pub(super) fn check_containerd_config(config: &Config, problems: &Problems) {
    let found = preflight::check(&config.containerd_config, &config.hosts_dir);
    for name in preflight::PROBLEMS {
        match found.iter().find(|w| w.problem == name) {
            // Ferry's lease keeps what it pulls: a fact to know, not a problem to fix.
            Some(w) if w.problem == preflight::DISCARD && config.keeps() => {
                tracing::debug!(
                    "{}; Ferry's lease keeps the layers pulled through it",
                    w.text
                );
                problems.clear(name)
            }
            Some(w) => problems.set(name, w.text.clone()),
            None => problems.clear(name),
        }
    }
}

/// Whether containerd deletes layers once unpacked (`discard_unpacked_layers`).
pub(super) fn discards_layers(config: &Config) -> bool {
    preflight::check(&config.containerd_config, &config.hosts_dir)
        .iter()
        .any(|w| w.problem == preflight::DISCARD)
}

pub(super) async fn refresh_hosts(
    config: Config,
    store: Arc<dyn ContentStore>,
    problems: Arc<Problems>,
    token: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(HOSTS_REFRESH_INTERVAL) => {}
        }
        check_containerd_config(&config, &problems);
        match configure_hosts(&config, store.as_ref()).await {
            Ok(outcomes) => report(&outcomes),
            Err(e) => tracing::warn!(error = %e, "re-merging the containerd hosts config failed"),
        }
    }
}

/// Writes Ferry's entries in the form the containerd behind `store` reads.
pub async fn configure_hosts(
    config: &Config,
    store: &dyn ContentStore,
) -> Result<Vec<Outcome>, containerd_config::dir::DirError> {
    let mirror_url = config.mirror_url();
    let ipv6 = ipv6_hosts(store, &mirror_url).await;
    containerd_config::configure(&config.hosts_dir, &config.registries, &mirror_url, ipv6)
}

/// containerd is asked its version only for an IPv6 URL; unanswered, the default form.
async fn ipv6_hosts(store: &dyn ContentStore, mirror_url: &str) -> Ipv6Hosts {
    if !mirror_url.contains('[') {
        return Ipv6Hosts::default();
    }
    store
        .containerd_major()
        .await
        .map_or(Ipv6Hosts::default(), Ipv6Hosts::for_containerd)
}

/// Logs what a configure or cleanup did.
pub fn report(outcomes: &[Outcome]) {
    for o in outcomes {
        let path = o.path.display();
        match &o.action {
            Action::Unchanged => tracing::debug!(%path, "hosts.toml already up to date"),
            Action::Skipped(reason) => tracing::warn!(%path, "hosts.toml skipped: {reason}"),
            Action::Failed(reason) => tracing::error!(
                %path,
                "hosts.toml could not be written, left as it was (the other registries are configured): {reason}"
            ),
            action => tracing::info!(%path, ?action, "hosts.toml"),
        }
    }
}
