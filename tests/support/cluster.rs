//! A node of a test cluster: its own network namespace, containerd and `ferry run`.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use super::netns::Net;
use super::{Containerd, Ferry, Proc, Registry, wait_for};

pub const P2P_PORT: u16 = 5482;
pub const PEER_PORT: u16 = 5481;
pub const METRICS_PORT: u16 = 5483;

#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub ns: String,
    pub ip: IpAddr,
    pub dir: PathBuf,
    pub containerd: Containerd,
    pub ferry: Proc,
    args: Vec<String>,
    /// Where its mirror listens (`127.0.0.1:5480`, as with the chart's host networking).
    mirror: SocketAddr,
    /// Flags added at the next (re)start, after `args` (later flags are not allowed to repeat
    /// earlier ones: pass only flags `args` lacks).
    extra: Vec<String>,
    starts: u32,
}

impl Node {
    /// A node whose hosts dir already has the operator's entry for the plain-HTTP `registry`.
    pub fn start(
        net: &mut Net,
        dir: &Path,
        name: &str,
        host: u8,
        registry: SocketAddr,
        args: &[&str],
    ) -> Node {
        let loopback = "127.0.0.1:5480".parse().expect("addr");
        Self::start_with_mirror(net, dir, name, host, registry, loopback, args)
    }

    /// As [`Node::start`], its mirror listening on `mirror` (the chart's pod-network mode
    /// listens on `[::]`; pass `--mirror-allow-remote` and `--mirror-target` in `args`).
    pub fn start_with_mirror(
        net: &mut Net,
        dir: &Path,
        name: &str,
        host: u8,
        registry: SocketAddr,
        mirror: SocketAddr,
        args: &[&str],
    ) -> Node {
        Self::start_full(net, dir, name, host, registry, mirror, args, false)
    }

    /// As [`Node::start`], its containerd discarding layers once unpacked.
    pub fn start_discarding(
        net: &mut Net,
        dir: &Path,
        name: &str,
        host: u8,
        registry: SocketAddr,
        args: &[&str],
    ) -> Node {
        let loopback = "127.0.0.1:5480".parse().expect("addr");
        Self::start_full(net, dir, name, host, registry, loopback, args, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn start_full(
        net: &mut Net,
        dir: &Path,
        name: &str,
        host: u8,
        registry: SocketAddr,
        mirror: SocketAddr,
        args: &[&str],
        discard: bool,
    ) -> Node {
        let ns = net.add_host(name, host);
        let ip = net.host_ip(host);
        let node_dir = dir.join(name);
        let containerd = Containerd::start_in_with(&node_dir, Some(&ns), discard);
        let own = containerd.hosts_dir.join(registry.to_string());
        std::fs::create_dir_all(&own).expect("hosts dir");
        // containerd 1.6 and 1.7 cannot read a `]` in a table header: there an IPv6 host is
        // written as a dotted key, as an operator on those versions must (2.x reads tables
        // only).
        let host = if registry.is_ipv6() && super::containerd_major() < 2 {
            format!("host.\"http://{registry}\".capabilities = [\"pull\", \"resolve\"]\n")
        } else {
            format!("\n[host.\"http://{registry}\"]\n  capabilities = [\"pull\", \"resolve\"]\n")
        };
        std::fs::write(
            own.join("hosts.toml"),
            format!("server = \"http://{registry}\"\n{host}"),
        )
        .expect("operator hosts.toml");
        let mut node = Node {
            name: name.to_string(),
            ns,
            ip,
            dir: node_dir,
            containerd,
            ferry: Proc {
                child: None,
                log: PathBuf::new(),
            },
            args: args.iter().map(|a| a.to_string()).collect(),
            mirror,
            extra: Vec::new(),
            starts: 0,
        };
        node.start_ferry();
        node
    }

    /// (Re)starts this node's Ferry and waits until it answers.
    pub fn start_ferry(&mut self) {
        self.ferry.stop();
        self.spawn_ferry();
        wait_for("ferry to answer in its namespace", || {
            self.metrics().contains("ferry_hosts_config_written 1")
        });
    }

    /// Restarts this node's Ferry with `extra` flags besides its own (none: as started).
    pub fn restart_ferry_with(&mut self, extra: &[&str]) {
        self.extra = extra.iter().map(|a| a.to_string()).collect();
        self.start_ferry();
    }

    /// Starts this node's Ferry (stopped before) and returns at once.
    pub fn spawn_ferry(&mut self) {
        let mirror = self.mirror;
        let metrics = self.metrics_addr();
        let ip = self.ip.to_string();
        // Generous for a loaded CI machine; the default (20 ms) is for real clusters.
        let mut extra = vec!["--advertise-addr", ip.as_str(), "--resolve-timeout", "1s"];
        extra.extend(self.args.iter().map(String::as_str));
        extra.extend(self.extra.iter().map(String::as_str));
        let cmd = Ferry::command(&self.dir, &self.containerd, mirror, metrics, &extra);
        // One log per start: a restarted Ferry must not overwrite what the last one said.
        self.starts += 1;
        let log = self.dir.join(format!("ferry-{}.log", self.starts));
        self.ferry = Proc::spawn(cmd, log);
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, METRICS_PORT)
    }

    pub fn metrics(&self) -> String {
        self.ops_get("/metrics")
    }

    /// What `ferry status` (`--json`: its JSON) prints about this node's Ferry, run on the node.
    pub fn status(&self, json: bool) -> String {
        let addr = self.metrics_addr().to_string();
        let mut cmd = super::in_netns(Some(&self.ns), super::Ferry::bin().to_str().expect("path"));
        cmd.args(["status", "--metrics-addr", &addr]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("run ferry status");
        assert!(out.status.success(), "ferry status: {out:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// `/readyz`'s body: the conditions and any problems.
    pub fn readyz(&self) -> String {
        self.ops_get("/readyz")
    }

    /// The body of `path` on the ops address ("" when it does not answer).
    /// `GET path` on the metrics address from a client on the node itself (python's urllib
    /// in the node's network namespace): the status code and the body.
    pub fn get_on_node(&self, path: &str) -> (u16, String) {
        let url = format!("http://{}{path}", self.metrics_addr());
        let script = "import sys, urllib.request, urllib.error\n\
try:\n    r = urllib.request.urlopen(sys.argv[1], timeout=60); code, body = r.status, r.read()\n\
except urllib.error.HTTPError as e:\n    code, body = e.code, e.read()\n\
sys.stdout.write(str(code) + '\\n' + body.decode())\n";
        let out = super::in_netns(Some(&self.ns), "python3")
            .args(["-c", script, &url])
            .output()
            .expect("run python3");
        assert!(out.status.success(), "GET {url} on the node: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (code, body) = text.split_once('\n').unwrap_or((&text, ""));
        (code.parse().expect("status code"), body.to_string())
    }

    fn ops_get(&self, path: &str) -> String {
        let url = format!("http://{}{path}", self.metrics_addr());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async { reqwest::get(&url).await.ok()?.text().await.ok() })
            .unwrap_or_default()
    }

    pub fn metric(&self, prefix: &str) -> u64 {
        self.metrics()
            .lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub fn image_digest(&self, reference: &str) -> String {
        let out = self.containerd.ctr(&["-n", "k8s.io", "images", "ls"]);
        out.lines()
            .find(|l| l.starts_with(reference))
            .and_then(|l| l.split_whitespace().nth(2))
            .unwrap_or_default()
            .to_string()
    }

    /// `ctr images pull` in the node's namespace: `Ok(output)` or `Err(output)`.
    pub fn try_pull(&self, reference: &str) -> Result<String, String> {
        self.try_pull_in("k8s.io", reference)
    }

    /// `ctr images pull` into another containerd namespace (`nerdctl`'s `default`, say).
    pub fn try_pull_in(&self, namespace: &str, reference: &str) -> Result<String, String> {
        self.containerd
            .try_pull(namespace, reference, &self.containerd.hosts_dir)
    }

    /// Removes the image and its content, as if never pulled (containerd's garbage collector
    /// does not reliably collect content right away, so it is deleted by digest).
    pub fn forget(&self, reference: &str, digests: &[String]) {
        self.containerd
            .ctr(&["-n", "k8s.io", "images", "rm", "--sync", reference]);
        let mut args = vec!["-n", "k8s.io", "content", "rm"];
        args.extend(digests.iter().map(String::as_str));
        // Already collected digests make `content rm` complain; what matters is they are gone.
        let _ = std::process::Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd.socket)
            .args(&args)
            .output();
        let left = self
            .containerd
            .ctr(&["-n", "k8s.io", "content", "ls", "-q"]);
        for d in digests {
            assert!(
                !left.contains(d.as_str()),
                "{}: {d} still in the content store",
                self.name
            );
        }
        // The files go when containerd's garbage collector runs: at once here (the test
        // config collects after every deletion), but a file that stayed would make the next
        // pull take it without fetching anything (containerd's "shared" content policy), and
        // the test would measure nothing. Say so instead.
        let content = self.containerd.content_dir();
        let on_disk = || {
            digests
                .iter()
                .filter(|d| {
                    content
                        .join("blobs/sha256")
                        .join(d.trim_start_matches("sha256:"))
                        .exists()
                })
                .cloned()
                .collect::<Vec<_>>()
        };
        let started = std::time::Instant::now();
        let mut swept = false;
        while !on_disk().is_empty() {
            // containerd sweeps content files only after a content record went: a file whose
            // record was deleted while a lease held it (Ferry's, released on the deletion)
            // can outlive the collections that followed. Make one record go and collect.
            if !swept && started.elapsed() > std::time::Duration::from_secs(2) {
                eprintln!(
                    "{}: files outlived their records: {:?}; sweeping",
                    self.name,
                    on_disk()
                );
                self.sweep();
                swept = true;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "{}: containerd never deleted the files of {:?}",
                self.name,
                on_disk()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// Writes and deletes a throwaway blob, then has containerd collect at once.
    fn sweep(&self) {
        let bytes = format!("sweep {:?}\n", std::time::SystemTime::now());
        let digest = super::sha256_hex(bytes.as_bytes());
        let mut ingest = std::process::Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd.socket)
            .args([
                "-n",
                "k8s.io",
                "content",
                "ingest",
                "--expected-digest",
                &digest,
            ])
            .arg("test-sweep")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("ctr content ingest");
        use std::io::Write as _;
        let mut stdin = ingest.stdin.take().expect("stdin");
        stdin.write_all(bytes.as_bytes()).expect("write");
        drop(stdin);
        assert!(
            ingest.wait().expect("ctr").success(),
            "ctr content ingest {digest}"
        );
        self.containerd
            .ctr(&["-n", "k8s.io", "content", "rm", &digest]);
        self.containerd
            .ctr(&["-n", "k8s.io", "leases", "create", "--id", "test-sweep"]);
        self.containerd
            .ctr(&["-n", "k8s.io", "leases", "rm", "--sync", "test-sweep"]);
    }

    /// Pulls `reference` the way the kubelet does (CRI `PullImage`, namespace `k8s.io`, the
    /// registry config from containerd's CRI `config_path`): `Err` with the output on failure.
    pub fn cri_pull(&self, reference: &str) -> Result<String, String> {
        self.cri(reference, &[])
    }

    /// Removes `reference` as the kubelet's image garbage collection does (CRI `RemoveImage`).
    pub fn cri_remove(&self, reference: &str) -> Result<String, String> {
        self.cri(reference, &["remove"])
    }

    fn cri(&self, reference: &str, extra: &[&str]) -> Result<String, String> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/cri_pull.py");
        let out = super::in_netns(Some(&self.ns), "python3")
            .arg(script)
            .arg(&self.containerd.socket)
            .arg(reference)
            .args(extra)
            .output()
            .expect("run cri_pull.py");
        let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
        if out.status.success() {
            Ok(text(&out.stdout).trim().to_string())
        } else {
            Err(format!("{}{}", text(&out.stdout), text(&out.stderr)))
        }
    }

    /// The blob as containerd committed it on this node matches its digest.
    pub fn committed_matches(&self, digest: &str) -> bool {
        self.committed_matches_in("k8s.io", digest)
    }

    /// As [`Node::committed_matches`], in containerd namespace `namespace`.
    pub fn committed_matches_in(&self, namespace: &str, digest: &str) -> bool {
        let out = std::process::Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd.socket)
            .args(["-n", namespace, "content", "get", digest])
            .output()
            .expect("run ctr");
        out.status.success() && super::sha256_hex(&out.stdout) == digest
    }

    /// Blobs and bytes Ferry's lease keeps on this node, read from containerd (the lease's
    /// resources that are in the content store), not from Ferry's own count.
    pub fn lease_bytes(&self) -> (usize, u64) {
        let held = self.lease_blobs();
        (held.len(), held.iter().map(|(_, size)| size).sum())
    }

    /// The digests (and sizes) of what Ferry's lease keeps, as containerd lists them.
    pub fn lease_blobs(&self) -> Vec<(String, u64)> {
        use containerd_client::services::v1::content_client::ContentClient;
        use containerd_client::services::v1::leases_client::LeasesClient;
        use containerd_client::services::v1::{InfoRequest, ListRequest, ListResourcesRequest};
        use containerd_client::tonic::Request;
        use containerd_client::with_namespace;

        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let channel = containerd_client::connect(&self.containerd.socket)
                .await
                .expect("connect to containerd");
            let mut leases = LeasesClient::new(channel.clone());
            let mut content = ContentClient::new(channel);
            let list = ListRequest { filters: vec![] };
            let all = leases
                .list(with_namespace!(list, "k8s.io"))
                .await
                .unwrap()
                .into_inner()
                .leases;
            let mut held = Vec::new();
            for lease in all
                .iter()
                .filter(|l| l.labels.contains_key("ferry.dev/holds"))
            {
                let list = ListResourcesRequest {
                    id: lease.id.clone(),
                };
                let resources = leases
                    .list_resources(with_namespace!(list, "k8s.io"))
                    .await
                    .unwrap()
                    .into_inner()
                    .resources;
                for r in resources.into_iter().filter(|r| r.r#type == "content") {
                    let info = InfoRequest {
                        digest: r.id.clone(),
                    };
                    if let Ok(i) = content.info(with_namespace!(info, "k8s.io")).await {
                        held.push((r.id, i.into_inner().info.map_or(0, |i| i.size as u64)));
                    }
                }
            }
            held
        })
    }

    pub fn peer_url(&self, path: &str) -> String {
        format!("http://{}{path}", SocketAddr::new(self.ip, PEER_PORT))
    }
}

/// A registry in its own namespace on the cluster's bridge (host number `host`), on port 5000;
/// its storage under `dir/name`.
pub fn registry_host(net: &mut Net, dir: &Path, name: &str, host: u8) -> (Registry, SocketAddr) {
    let ns = net.add_host(name, host);
    let addr = SocketAddr::new(net.host_ip(host), 5000);
    (Registry::start_at(&dir.join(name), Some(&ns), addr), addr)
}
