//! A stand-in for the Kubernetes API server (none can run here): pods, nodes, events and
//! DaemonSets, answering the requests kube-rs sends, recording every request it gets.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

#[derive(Debug, Default)]
pub struct Cluster {
    pub pods: Vec<Value>,
    pub nodes: Vec<Value>,
    pub events: Vec<Value>,
    pub daemonsets: Vec<Value>,
    /// (method, path?query, content-type)
    pub requests: Vec<(String, String, String)>,
    pub resource_version: u64,
}

pub type Shared = Arc<Mutex<Cluster>>;

pub fn pod(name: &str, ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ferry", "labels": {"app.kubernetes.io/name": "ferry"}, "resourceVersion": "1", "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "ferry", "image": "ferry"}]},
        "status": {"phase": "Running", "podIP": ip}
    })
}

pub fn node(name: &str, taints: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "1", "uid": format!("uid-{name}")},
        "spec": {"taints": taints}
    })
}

/// Serves the fake API on a loopback port; returns its address.
pub async fn serve(cluster: Shared) -> SocketAddr {
    let app = Router::new()
        .route("/api/v1/namespaces/{ns}/pods", get(pods))
        .route("/api/v1/nodes/{name}", get(get_node).patch(patch_node))
        .route(
            "/apis/apps/v1/namespaces/{ns}/daemonsets/{name}",
            get(get_daemonset).delete(delete_daemonset),
        )
        .route(
            "/api/v1/namespaces/{ns}/events",
            axum::routing::post(create_event),
        )
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(axum::middleware::from_fn_with_state(
            cluster.clone(),
            record,
        ))
        .with_state(cluster);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn record(
    State(c): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let ct = request
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let uri = request
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    c.lock()
        .expect("lock")
        .requests
        .push((request.method().to_string(), uri, ct));
    next.run(request).await
}

async fn pods(
    State(c): State<Shared>,
    UrlPath(ns): UrlPath<String>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if q.get("watch").map(String::as_str) == Some("true") {
        // Hold the watch open with no news; kube-rs reconnects when it times out.
        let stream = futures::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .expect("response");
    }
    let c = c.lock().expect("lock");
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let items: Vec<Value> = c
        .pods
        .iter()
        .filter(|p| p["metadata"]["namespace"] == ns.as_str())
        .filter(|p| {
            selector.split(',').filter(|s| !s.is_empty()).all(|s| {
                let (k, v) = s.split_once('=').unwrap_or((s, ""));
                p["metadata"]["labels"][k] == v
            })
        })
        .cloned()
        .collect();
    axum::Json(json!({
        "apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": c.resource_version.to_string()},
        "items": items
    }))
    .into_response()
}

fn find<'a>(c: &'a mut Cluster, name: &str) -> Option<&'a mut Value> {
    c.nodes.iter_mut().find(|n| n["metadata"]["name"] == name)
}

async fn get_node(State(c): State<Shared>, UrlPath(name): UrlPath<String>) -> Response {
    let mut c = c.lock().expect("lock");
    match find(&mut c, &name) {
        Some(n) => axum::Json(n.clone()).into_response(),
        None => not_found(&name),
    }
}

/// A JSON merge patch, with the optimistic-concurrency check the real server does.
async fn patch_node(
    State(c): State<Shared>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response {
    if headers.get("content-type").and_then(|v| v.to_str().ok())
        != Some("application/merge-patch+json")
    {
        return StatusCode::UNSUPPORTED_MEDIA_TYPE.into_response();
    }
    let patch: Value = serde_json::from_slice(&body).expect("patch json");
    let mut c = c.lock().expect("lock");
    c.resource_version += 1;
    let rv = c.resource_version;
    let Some(node) = find(&mut c, &name) else {
        return not_found(&name);
    };
    if let Some(want) = patch["metadata"]["resourceVersion"].as_str()
        && node["metadata"]["resourceVersion"] != want
    {
        return (StatusCode::CONFLICT, axum::Json(json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "the object has been modified"}))).into_response();
    }
    if let Some(taints) = patch["spec"].get("taints") {
        node["spec"]["taints"] = taints.clone();
    }
    node["metadata"]["resourceVersion"] = json!(rv.to_string());
    axum::Json(node.clone()).into_response()
}

async fn create_event(
    State(c): State<Shared>,
    UrlPath(ns): UrlPath<String>,
    axum::Json(mut event): axum::Json<Value>,
) -> Response {
    event["metadata"]["namespace"] = json!(ns);
    event["metadata"]["name"] = json!(format!(
        "{}x",
        event["metadata"]["generateName"]
            .as_str()
            .unwrap_or("event.")
    ));
    c.lock().expect("lock").events.push(event.clone());
    (StatusCode::CREATED, axum::Json(event)).into_response()
}

/// A DaemonSet in namespace `ferry` whose pods are ready on `ready` of `desired` nodes.
pub fn daemonset(name: &str, desired: i32, ready: i32) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": "ferry", "generation": 1, "resourceVersion": "1", "uid": format!("uid-{name}")},
        "spec": {"selector": {"matchLabels": {"app": name}}, "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "done", "image": "ferry"}]}}},
        "status": {"observedGeneration": 1, "desiredNumberScheduled": desired, "currentNumberScheduled": desired, "updatedNumberScheduled": desired, "numberReady": ready, "numberMisscheduled": 0}
    })
}

fn find_daemonset(c: &Cluster, ns: &str, name: &str) -> Option<usize> {
    c.daemonsets
        .iter()
        .position(|d| d["metadata"]["namespace"] == ns && d["metadata"]["name"] == name)
}

async fn get_daemonset(
    State(c): State<Shared>,
    UrlPath((ns, name)): UrlPath<(String, String)>,
) -> Response {
    let c = c.lock().expect("lock");
    match find_daemonset(&c, &ns, &name) {
        Some(i) => axum::Json(c.daemonsets[i].clone()).into_response(),
        None => not_found(&name),
    }
}

async fn delete_daemonset(
    State(c): State<Shared>,
    UrlPath((ns, name)): UrlPath<(String, String)>,
) -> Response {
    let mut c = c.lock().expect("lock");
    match find_daemonset(&c, &ns, &name) {
        Some(i) => axum::Json(c.daemonsets.remove(i)).into_response(),
        None => not_found(&name),
    }
}

fn not_found(name: &str) -> Response {
    (StatusCode::NOT_FOUND, axum::Json(json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": format!("{name} not found")}))).into_response()
}

/// A kubeconfig pointing at `server` (plain HTTP, no credentials), namespace `ferry`.
pub fn kubeconfig(dir: &Path, server: &str) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {server}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: fake\n    user: u\n    namespace: ferry\ncurrent-context: c\n"
        ),
    )
    .expect("kubeconfig");
    path
}
