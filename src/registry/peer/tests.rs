use super::*;
use crate::routing::{PeerStream, RoutingError};
use crate::store::memory::MemoryStore;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Lookups take a while and are counted: each finds `provider` after that long, or nobody
/// after 50 ms.
#[derive(Default)]
struct SlowRouter {
    lookups: AtomicUsize,
    provider: Option<Duration>,
}

#[async_trait::async_trait]
impl ContentRouting for SlowRouter {
    fn ready(&self) -> bool {
        true
    }
    fn local(&self) -> Peer {
        Peer {
            id: "me".into(),
            addr: "127.0.0.1:1".parse().unwrap_or_else(|_| unreachable!()),
        }
    }
    fn members(&self) -> Arc<Vec<Peer>> {
        Arc::new(Vec::new())
    }
    async fn lookup(&self, _key: &str) -> PeerStream {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let provider = self.provider;
        let me = self.local();
        tokio::spawn(async move {
            match provider {
                Some(after) => {
                    tokio::time::sleep(after).await;
                    let _ = tx.send(me).await;
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
            drop(tx);
        });
        rx
    }
    async fn advertise(&self, _keys: Vec<String>) -> Result<(), RoutingError> {
        Ok(())
    }
    async fn withdraw(&self, _keys: Vec<String>) -> Result<(), RoutingError> {
        Ok(())
    }
}

fn fetcher(
    router: Arc<dyn ContentRouting>,
    config: PeerFetchConfig,
    metrics: Arc<Metrics>,
) -> PeerFetcher {
    PeerFetcher::new(router, config, None, metrics, Arc::new(MemoryStore::new())).expect("client")
}

/// A blob GET from the mirror, whole.
const REQ: PeerRequest<'static> = PeerRequest {
    name: "team/app",
    ns: Some("registry.test"),
    head: false,
    range: None,
};

#[tokio::test]
async fn concurrent_misses_of_one_digest_share_one_lookup() {
    let router = Arc::new(SlowRouter::default());
    let fetcher = fetcher(
        router.clone(),
        PeerFetchConfig::with_resolve_timeout(Duration::from_secs(1)),
        Arc::new(Metrics::new()),
    );
    let digest = Digest::sha256_of(b"a layer nobody has");
    let req = REQ;
    let (a, b, c) = tokio::join!(
        fetcher.blob(req, digest.clone()),
        fetcher.blob(req, digest.clone()),
        fetcher.blob(req, Digest::sha256_of(b"another layer")),
    );
    for miss in [a, b, c] {
        assert_eq!(
            miss.err(),
            Some(PeerMiss::NoProvider),
            "nobody advertises it"
        );
    }
    assert_eq!(
        router.lookups.load(Ordering::SeqCst),
        2,
        "one lookup per digest, however many ask at once"
    );
    // A miss is remembered for NOT_FOUND_TTL; then the DHT is asked again.
    assert!(fetcher.blob(req, digest.clone()).await.is_err());
    assert_eq!(router.lookups.load(Ordering::SeqCst), 2);
    tokio::time::sleep(NOT_FOUND_TTL).await;
    assert!(fetcher.blob(req, digest).await.is_err());
    assert_eq!(router.lookups.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_lookup_still_walking_at_the_resolve_timeout_is_counted_apart_from_a_miss() {
    // The walk ends after 50 ms with nobody: a miss within a 1 s bound, a cut walk past a
    // 10 ms bound.
    for (bound, counted) in [
        (Duration::from_secs(1), "none"),
        (Duration::from_millis(10), "timed_out"),
    ] {
        let metrics = Arc::new(Metrics::new());
        let fetcher = fetcher(
            Arc::new(SlowRouter::default()),
            PeerFetchConfig::with_resolve_timeout(bound),
            metrics.clone(),
        );
        let req = REQ;
        let digest = Digest::sha256_of(b"a layer nobody has");
        assert_eq!(
            fetcher.blob(req, digest).await.err(),
            Some(PeerMiss::NoProvider)
        );
        for result in ["found", "none", "timed_out"] {
            let n = metrics
                .peer_lookups
                .get_or_create(&ResultLabels { result })
                .get();
            assert_eq!(n, u64::from(result == counted), "{result}, bound {bound:?}");
        }
    }
}

#[tokio::test]
async fn a_node_whose_lookups_are_slower_than_the_bound_learns_to_wait_for_them() {
    // Every lookup finds its provider after 200 ms, past the 20 ms floor: the first are cut
    // and read on, then the wait covers them (300 ms, under the 1 s ceiling).
    let after = Duration::from_millis(200);
    let router = Arc::new(SlowRouter {
        provider: Some(after),
        ..SlowRouter::default()
    });
    let metrics = Arc::new(Metrics::new());
    let config = PeerFetchConfig {
        resolve_timeout_max: Duration::from_secs(1),
        ..PeerFetchConfig::with_resolve_timeout(Duration::from_millis(20))
    };
    let fetcher = fetcher(router, config, metrics.clone());
    let count = |result: &'static str| {
        metrics
            .peer_lookups
            .get_or_create(&ResultLabels { result })
            .get()
    };
    assert_eq!(metrics.peer_resolve_wait.get(), 0.02);
    let mut cut = 0;
    for i in 0..40u32 {
        let key = format!("sha256:{i:064x}");
        let found = fetcher.providers(&key).await;
        if count("found") > 0 {
            assert_eq!(found.len(), 1, "a lookup waited for finds its provider");
            break;
        }
        assert!(found.is_empty());
        cut += 1;
        // Its walk goes on and finds the provider; the wait learns of it.
        let late = metrics.peer_lookups_found_late.get();
        tokio::time::timeout(Duration::from_secs(5), async {
            while metrics.peer_lookups_found_late.get() == late {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the walk cut short is read on to its provider");
    }
    assert_eq!(cut, 10, "the floor stands until 10 lookups say otherwise");
    assert_eq!(count("timed_out"), 10);
    let wait = metrics.peer_resolve_wait.get();
    assert!((0.3..1.0).contains(&wait), "waits {wait} s now");
    // A window of fast lookups brings the floor back (`bound`'s own tests).
}

/// A flood of misses of random digests starts at most `max_lookups` walks; the rest go to the
/// registry at once, counted, and are not remembered as found nowhere.
#[tokio::test]
async fn misses_past_the_walks_under_way_go_to_the_registry_at_once() {
    let router = Arc::new(SlowRouter::default());
    let mut config = PeerFetchConfig::with_resolve_timeout(Duration::from_secs(1));
    config.max_lookups = 4;
    let metrics = Arc::new(Metrics::new());
    let fetcher = fetcher(router.clone(), config, metrics.clone());
    let req = REQ;
    let misses = (0..20u8).map(|i| fetcher.blob(req, Digest::sha256_of(&[i])));
    for miss in futures::future::join_all(misses).await {
        assert!(miss.is_err());
    }
    assert_eq!(router.lookups.load(Ordering::SeqCst), 4);
    let refused = ResultLabels { result: "refused" };
    assert_eq!(metrics.peer_lookups.get_or_create(&refused).get(), 16);
    // Once the walks ended, a refused digest is looked up: it was never found nowhere.
    assert!(fetcher.blob(req, Digest::sha256_of(&[19])).await.is_err());
    assert_eq!(router.lookups.load(Ordering::SeqCst), 5);
}
