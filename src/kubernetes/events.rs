//! Events on this node's Node object, shown next to the kubelet's own.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::PostParams;

/// Nodes are cluster-scoped; their events live here, as the kubelet's do.
pub(crate) const EVENT_NAMESPACE: &str = "default";

#[derive(Debug, Clone, Copy)]
pub(crate) struct NodeEvent<'a> {
    /// `FerryReady`, `FerryMisconfigured`
    pub reason: &'a str,
    /// `Normal` or `Warning`
    pub type_: &'a str,
    pub message: &'a str,
}

pub(crate) async fn record(
    client: &kube::Client,
    node: &str,
    event: NodeEvent<'_>,
) -> Result<(), kube::Error> {
    let events: Api<Event> = Api::namespaced(client.clone(), EVENT_NAMESPACE);
    let now = Time(k8s_openapi::chrono::Utc::now());
    let object = Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{node}.{}.", event.reason.to_lowercase())),
            namespace: Some(EVENT_NAMESPACE.to_string()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_string()),
            // As the kubelet does: `kubectl describe node` finds events by this uid.
            uid: Some(node.to_string()),
            ..ObjectReference::default()
        },
        reason: Some(event.reason.into()),
        message: Some(event.message.into()),
        type_: Some(event.type_.into()),
        source: Some(EventSource {
            component: Some("ferry".into()),
            host: Some(node.to_string()),
        }),
        first_timestamp: Some(now.clone()),
        last_timestamp: Some(now),
        count: Some(1),
        ..Event::default()
    };
    events.create(&PostParams::default(), &object).await?;
    Ok(())
}
