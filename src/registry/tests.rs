//! The two routers over the in-memory store: the logic above the store, without containerd.

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::{MirrorState, PeerApiState, ResolveTags, mirror, peer_api};
use crate::metrics::Metrics;
use crate::oci::Digest;
use crate::oci::manifest::{DOCKER_MANIFEST, OCI_MANIFEST};
use crate::oci::registry::Registries;
use crate::routing::{digest_key, tag_key};
use crate::store::memory::MemoryStore;

struct Fixture {
    store: Arc<MemoryStore>,
    metrics: Arc<Metrics>,
    manifest: Digest,
    layer: Digest,
}

fn fixture() -> Fixture {
    let store = Arc::new(MemoryStore::new());
    let layer = store.put(Bytes::from(vec![7u8; 100_000]));
    let manifest = store.put(format!(
        r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST}","config":{{}},"layers":[{{"digest":"{layer}"}}]}}"#
    ));
    store.tag(
        "docker.io",
        "library/app",
        "1.0",
        &manifest,
        DOCKER_MANIFEST,
    );
    Fixture {
        store,
        metrics: Arc::new(Metrics::new()),
        manifest,
        layer,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Address {
    Mirror,
    /// Advertising everything in the fixture.
    Peer,
}

async fn call(
    f: &Fixture,
    registries: Registries,
    method: &str,
    uri: &str,
) -> (StatusCode, axum::http::HeaderMap, Bytes) {
    call_at(f, Address::Mirror, registries, method, uri).await
}

async fn call_at(
    f: &Fixture,
    address: Address,
    registries: Registries,
    method: &str,
    uri: &str,
) -> (StatusCode, axum::http::HeaderMap, Bytes) {
    let app = match address {
        Address::Mirror => mirror::router(MirrorState {
            store: f.store.clone(),
            registries,
            metrics: f.metrics.clone(),
            peers: None,
            tags: ResolveTags::Always,
            upstream: None,
            filters: Default::default(),
            coalesce: None,
            recent: Default::default(),
            keep: None,
        }),
        Address::Peer => {
            let keys: BTreeSet<String> = [
                digest_key(&f.manifest),
                digest_key(&f.layer),
                tag_key("docker.io", "library/app", "1.0"),
            ]
            .into_iter()
            .collect();
            let (_tx, exposed) = tokio::sync::watch::channel(Arc::new(keys));
            peer_api::router(PeerApiState {
                store: f.store.clone(),
                registries,
                metrics: f.metrics.clone(),
                secret: None,
                exposed,
                coalesce: None,
                integrity: None,
                zero_copy: true,
                upload_limit: None,
                keep: None,
            })
        }
    };
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::empty())
        .expect("request");
    let response = app.oneshot(request).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, headers, body)
}

fn code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).expect("json error body");
    v["errors"][0]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn the_mirror_never_answers_a_tag_from_the_nodes_own_store() {
    let f = fixture();
    // The node has app:1.0, yet the mirror says 404: containerd wants the registry's answer.
    for method in ["HEAD", "GET"] {
        let (status, _, _) = call(
            &f,
            Registries::All,
            method,
            "/v2/library/app/manifests/1.0?ns=docker.io",
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method}");
    }
    let text = f.metrics.encode();
    assert!(
        text.contains(r#"ferry_tag_requests_total{answer="upstream"} 2"#),
        "{text}"
    );
    // By digest, the same manifest is served from the store.
    let (status, _, body) = call(
        &f,
        Registries::All,
        "GET",
        &format!("/v2/library/app/manifests/{}?ns=docker.io", f.manifest),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(f.manifest.matches(&body));
}

#[tokio::test]
async fn the_peer_address_resolves_tags_with_the_registry_from_ns() {
    let f = fixture();
    let (status, headers, body) = call_at(
        &f,
        Address::Peer,
        Registries::All,
        "GET",
        "/v2/library/app/manifests/1.0?ns=docker.io",
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], DOCKER_MANIFEST);
    assert_eq!(
        headers["docker-content-digest"],
        f.manifest.to_string().as_str()
    );
    assert!(f.manifest.matches(&body));

    // Without ns the tag is ambiguous; with another registry it is unknown.
    for uri in [
        "/v2/library/app/manifests/1.0",
        "/v2/library/app/manifests/1.0?ns=ghcr.io",
    ] {
        let (status, _, body) = call_at(&f, Address::Peer, Registries::All, "GET", uri).await;
        assert_eq!(
            (status, code(&body).as_str()),
            (StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN"),
            "{uri}"
        );
    }
}

#[tokio::test]
async fn manifests_by_digest_take_their_type_from_their_bytes() {
    let f = fixture();
    let oci = f
        .store
        .put(r#"{"schemaVersion":2,"config":{},"layers":[]}"#);
    let (status, headers, _) = call(
        &f,
        Registries::All,
        "HEAD",
        &format!("/v2/x/manifests/{oci}"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], OCI_MANIFEST);

    // A layer is not a manifest and is not served as one.
    let (status, _, body) = call(
        &f,
        Registries::All,
        "GET",
        &format!("/v2/x/manifests/{}", f.layer),
    )
    .await;
    assert_eq!(
        (status, code(&body).as_str()),
        (StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN")
    );
}

#[tokio::test]
async fn a_corrupt_manifest_in_the_store_is_never_served() {
    let f = fixture();
    let claimed = Digest::sha256_of(b"what the bytes should have been");
    f.store
        .put_as(&claimed, r#"{"schemaVersion":2,"config":{},"layers":[]}"#);
    let (status, _, _) = call(
        &f,
        Registries::All,
        "GET",
        &format!("/v2/x/manifests/{claimed}"),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn head_of_a_blob_has_its_length_and_no_body() {
    let f = fixture();
    let (status, headers, body) = call(
        &f,
        Registries::All,
        "HEAD",
        &format!("/v2/x/blobs/{}", f.layer),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-length"], "100000");
    assert_eq!(headers["accept-ranges"], "bytes");
    assert!(body.is_empty());
    let (status, headers, body) = call(
        &f,
        Registries::All,
        "GET",
        &format!("/v2/x/blobs/{}", f.layer),
    )
    .await;
    assert_eq!(
        (status, headers["content-length"].to_str().ok()),
        (StatusCode::OK, Some("100000"))
    );
    assert!(f.layer.matches(&body));
}

#[tokio::test]
async fn registries_not_mirrored_are_not_served() {
    let f = fixture();
    let only = Registries::Only(vec!["ghcr.io".into()]);
    let (status, _, body) = call(
        &f,
        only.clone(),
        "GET",
        "/v2/library/app/manifests/1.0?ns=docker.io",
    )
    .await;
    assert_eq!(
        (status, code(&body).as_str()),
        (StatusCode::NOT_FOUND, "NAME_UNKNOWN")
    );
    let (status, _, _) = call(
        &f,
        only.clone(),
        "GET",
        &format!("/v2/x/blobs/{}?ns=ghcr.io", f.layer),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    // M2a: a reader that names no registry gets nothing by digest while --registries is set.
    let (status, _, _) = call(&f, only.clone(), "GET", &format!("/v2/x/blobs/{}", f.layer)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = call(&f, only, "GET", "/v2/").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn hits_misses_and_bytes_are_counted() {
    let f = fixture();
    call(
        &f,
        Registries::All,
        "GET",
        &format!("/v2/x/blobs/{}", f.layer),
    )
    .await;
    call(
        &f,
        Registries::All,
        "GET",
        &format!("/v2/x/blobs/{}", Digest::sha256_of(b"absent")),
    )
    .await;
    let text = f.metrics.encode();
    assert!(
        text.contains(r#"ferry_store_lookups_total{kind="blob",result="hit"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"ferry_store_lookups_total{kind="blob",result="miss"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"ferry_served_bytes_total{listener="mirror",kind="blob",source="local"} 100000"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"ferry_http_requests_total{listener="mirror",kind="blob",method="GET",status="404"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn each_listener_counts_its_own_answers_and_bytes() {
    let f = fixture();
    let blob = format!("/v2/library/app/blobs/{}", f.layer);
    // A peer asks twice (once a HEAD); the mirror is asked once, and once for an absent blob.
    call_at(&f, Address::Peer, Registries::All, "GET", &blob).await;
    call_at(&f, Address::Peer, Registries::All, "HEAD", &blob).await;
    call(&f, Registries::All, "GET", &blob).await;
    let absent = format!("/v2/x/blobs/{}", Digest::sha256_of(b"absent"));
    call(&f, Registries::All, "GET", &absent).await;
    let text = f.metrics.encode();
    for line in [
        r#"ferry_served_total{listener="peer",kind="blob",source="local"} 2"#,
        r#"ferry_served_bytes_total{listener="peer",kind="blob",source="local"} 100000"#,
        r#"ferry_served_total{listener="mirror",kind="blob",source="local"} 1"#,
        r#"ferry_served_bytes_total{listener="mirror",kind="blob",source="local"} 100000"#,
        r#"ferry_served_total{listener="mirror",kind="blob",source="miss"} 1"#,
        // Every series exists from the start: the first request shows in `rate()`.
        r#"ferry_served_total{listener="mirror",kind="blob",source="peer"} 0"#,
        r#"ferry_served_bytes_total{listener="peer",kind="manifest",source="inflight"} 0"#,
        r#"ferry_http_requests_total{listener="peer",kind="blob",method="HEAD",status="200"} 1"#,
        r#"ferry_build_info{version=""#,
        "process_resident_memory_bytes ",
        "process_open_fds ",
        "process_cpu_seconds_total ",
    ] {
        assert!(text.contains(line), "{line} in:\n{text}");
    }
    // A peer is never answered from another peer.
    assert!(!text.contains(r#"listener="peer",kind="blob",source="peer""#));
}
