//! Test harness: real containerd, a real registry (Debian's `docker-registry`), images pushed
//! with `skopeo`, and the real `ferry` binary, each in a temporary directory with its own
//! sockets and state. Every process is stopped by its PID when its guard drops.
//!
//! Missing prerequisites fail the test with the command that installs them: these tests must
//! never pass by skipping.
#![allow(dead_code)]

pub mod cluster;
pub mod kube_api;
pub mod netns;
pub mod ports;
pub mod storm;

pub use ports::free_addr;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a freshly started daemon may take to answer before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// containerd's start, measured: under a second when idle, but CI once saw it take over 20 s
/// while the other test thread held thousands of connections on the 2 shared cores. A daemon
/// that dies is reported at once, so the long bound only costs time when it is merely slow.
const CONTAINERD_START_TIMEOUT: Duration = Duration::from_secs(90);
const POLL: Duration = Duration::from_millis(20);

pub const INSTALL_HINT: &str =
    "apt-get install -y containerd docker-registry skopeo (or run ./scripts/test.sh, which does)";

/// Fails the test (never skips) when a required program is missing.
pub fn require(program: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        found,
        "`{program}` is required for this test: {INSTALL_HINT}"
    );
}

pub fn wait_for(what: &str, ready: impl FnMut() -> bool) {
    wait_for_within(what, START_TIMEOUT, ready);
}

pub fn wait_for_within(what: &str, bound: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < bound, "timed out waiting for {what}");
        std::thread::sleep(POLL);
    }
}

/// A child process killed (SIGKILL) and reaped on drop.
#[derive(Debug)]
pub struct Proc {
    pub child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(mut cmd: Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = cmd
            .stdout(out)
            .stderr(err)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        Proc {
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// A memory figure of this process from /proc (KiB): `VmRSS` now, `VmHWM` the peak.
    pub fn memory_kib(&self, field: &str) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Sends `signal` (e.g. "TERM") to this process only, by PID.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([format!("-{signal}"), self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for exit and returns the exit code.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let start = Instant::now();
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return status.code();
            }
            if start.elapsed() > timeout {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// What of a process's log a failing test shows: its first lines (how it came up), its
/// warnings, errors and Ferry's own info lines in between (the last of them), and its end.
const LOG_HEAD_ON_FAILURE: usize = 10;
const LOG_NOTABLE_ON_FAILURE: usize = 40;
const LOG_TAIL_ON_FAILURE: usize = 30;

/// Lines worth a failing test's output wherever they are in a log (containerd's start alone
/// is a hundred lines of plugins loading).
fn notable(line: &str) -> bool {
    [
        " WARN ",
        " ERROR ",
        " INFO ferry",
        "level=warning",
        "level=error",
    ]
    .iter()
    .any(|m| line.contains(m))
}

/// The part of `log` a failing test shows (see above).
fn log_excerpt(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let (head, tail) = (LOG_HEAD_ON_FAILURE, LOG_TAIL_ON_FAILURE);
    if lines.len() <= head + tail {
        return lines.join("\n");
    }
    let middle = &lines[head..lines.len() - tail];
    let picked: Vec<&str> = middle.iter().copied().filter(|l| notable(l)).collect();
    let picked = &picked[picked.len().saturating_sub(LOG_NOTABLE_ON_FAILURE)..];
    format!(
        "{}\n[... {} lines, of which these {} are warnings, errors or Ferry's info ...]\n{}\n[...]\n{}",
        lines[..head].join("\n"),
        middle.len(),
        picked.len(),
        picked.join("\n"),
        lines[lines.len() - tail..].join("\n")
    )
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
        // A failing test's processes say why in its output (CI keeps no temporary files).
        if std::thread::panicking() {
            eprintln!(
                "--- {}:\n{}",
                self.log.display(),
                log_excerpt(&self.log_text())
            );
        }
    }
}

/// A containerd with its own root, state, sockets and hosts dir under `dir`.
#[derive(Debug)]
pub struct Containerd {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub hosts_dir: PathBuf,
    pub proc: Proc,
    /// The network namespace it (and its `ctr` pulls) run in; `None`: the host's.
    pub netns: Option<String>,
}

/// `program` to be run in `netns` (through `ip netns exec`, which execs it: same PID).
pub fn in_netns(netns: Option<&str>, program: &str) -> Command {
    match netns {
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns, program]);
            cmd
        }
        None => Command::new(program),
    }
}

/// The major version of the `containerd` on `PATH` (the test suite runs against 1.6, 1.7 and
/// 2.x: see scripts/test.sh).
pub fn containerd_major() -> u32 {
    static MAJOR: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *MAJOR.get_or_init(|| {
        let out = Command::new("containerd")
            .arg("--version")
            .output()
            .expect("containerd --version");
        // `containerd github.com/containerd/containerd/v2 2.1.9+unknown`
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .nth(2)
            .and_then(|v| v.trim_start_matches('v').split('.').next()?.parse().ok())
            .unwrap_or_else(|| panic!("cannot read containerd's version from {text:?}"))
    })
}

/// containerd 2.x moves this table to its images plugin only when it has runtimes.
const DISCARD: &str = r#"  discard_unpacked_layers = true
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
"#;

impl Containerd {
    pub fn start(dir: &Path) -> Containerd {
        Self::start_in(dir, None)
    }

    pub fn start_in(dir: &Path, netns: Option<&str>) -> Containerd {
        Self::start_in_with(dir, netns, false)
    }

    /// As [`Containerd::start_in`]; with `discard`, the CRI plugin deletes layers once
    /// unpacked (`discard_unpacked_layers`, as EKS's AL2023 nodes and Talos set it).
    pub fn start_in_with(dir: &Path, netns: Option<&str>, discard: bool) -> Containerd {
        require("containerd");
        require("ctr");
        std::fs::create_dir_all(dir).expect("containerd dir");
        let socket = dir.join("containerd.sock");
        let hosts_dir = dir.join("certs.d");
        let config = dir.join("containerd.toml");
        let text = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{d}/containerd-ttrpc.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "native"
{discard}# Collect garbage after every deletion. The default (0) leaves it to a timer that waits
# 50x the last collection's pause: seconds on a loaded machine, during which a removed blob's
# file stays and a new pull takes it without fetching (the "shared" content policy).
[plugins."io.containerd.gc.v1.scheduler"]
  deletion_threshold = 1
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "{hosts}"
# A socket of its own: containerd 2.x starts NRI by default at /var/run/nri/nri.sock, one file
# for every instance on the machine, and of two started at once one failed ("bind: address
# already in use"). 1.7 leaves NRI off; 1.6 has no such plugin and ignores the section.
[plugins."io.containerd.nri.v1.nri"]
  socket_path = "{d}/nri.sock"
"#,
            d = dir.display(),
            sock = socket.display(),
            hosts = hosts_dir.display(),
            discard = if discard { DISCARD } else { "" },
        );
        std::fs::write(&config, text).expect("containerd config");
        let mut c = Containerd {
            dir: dir.to_path_buf(),
            socket,
            config,
            hosts_dir,
            proc: Proc {
                child: None,
                log: dir.join("containerd.log"),
            },
            netns: netns.map(str::to_string),
        };
        c.restart();
        c
    }

    /// Starts (again) with the same root: content and images survive, as on a real restart.
    pub fn restart(&mut self) {
        self.proc.stop();
        let mut cmd = in_netns(self.netns.as_deref(), "containerd");
        cmd.arg("--config").arg(&self.config);
        self.proc = Proc::spawn(cmd, self.dir.join("containerd.log"));
        let socket = self.socket.clone();
        let start = Instant::now();
        while !ctr_ok(&socket, &["version"]) {
            assert!(
                self.proc.is_running(),
                "containerd exited at start; its log:\n{}",
                self.proc.log_text()
            );
            assert!(
                start.elapsed() < CONTAINERD_START_TIMEOUT,
                "containerd did not answer within {CONTAINERD_START_TIMEOUT:?}; its log:\n{}",
                self.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stop(&mut self) {
        self.proc.stop();
    }

    pub fn content_dir(&self) -> PathBuf {
        self.dir.join("root/io.containerd.content.v1.content")
    }

    /// `ctr images pull --hosts-dir` into `namespace`; panics with ctr's output on failure.
    pub fn pull(&self, namespace: &str, reference: &str, hosts_dir: &Path) -> String {
        self.try_pull(namespace, reference, hosts_dir)
            .unwrap_or_else(|text| panic!("ctr pull {reference} failed:\n{text}"))
    }

    /// `ctr images pull --hosts-dir`: `Ok(output)` or `Err(output)`.
    pub fn try_pull(
        &self,
        namespace: &str,
        reference: &str,
        hosts_dir: &Path,
    ) -> Result<String, String> {
        self.try_pull_as(namespace, reference, hosts_dir, None)
    }

    /// As [`Containerd::try_pull`], with `user:password` for the registry when given.
    pub fn try_pull_as(
        &self,
        namespace: &str,
        reference: &str,
        hosts_dir: &Path,
        user: Option<&str>,
    ) -> Result<String, String> {
        // ctr does the registry HTTP itself: it must run in the node's network namespace.
        let mut cmd = in_netns(self.netns.as_deref(), "ctr");
        cmd.arg("--address")
            .arg(&self.socket)
            .args(["-n", namespace, "images", "pull", "--hosts-dir"])
            .arg(hosts_dir);
        if let Some(user) = user {
            cmd.args(["--user", user]);
        }
        let out = cmd.arg(reference).output().expect("run ctr");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() {
            Ok(text)
        } else {
            Err(text)
        }
    }

    pub fn ctr(&self, args: &[&str]) -> String {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("run ctr");
        assert!(
            out.status.success(),
            "ctr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn ctr_ok(socket: &Path, args: &[&str]) -> bool {
    Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Debian's `docker-registry` on a loopback port; its log proves what upstream served.
#[derive(Debug)]
pub struct Registry {
    pub addr: SocketAddr,
    pub proc: Proc,
}

impl Registry {
    pub fn start(dir: &Path) -> Registry {
        Self::start_at(dir, None, free_addr())
    }

    /// In `netns` (reached from the test through the bridge), listening on `addr`.
    pub fn start_at(dir: &Path, netns: Option<&str>, addr: SocketAddr) -> Registry {
        Self::start_listening(dir, netns, addr, addr)
    }

    /// Listens on `listen` (a wildcard, say) and is reached at `addr`.
    pub fn start_listening(
        dir: &Path,
        netns: Option<&str>,
        listen: SocketAddr,
        addr: SocketAddr,
    ) -> Registry {
        Self::start_configured(dir, netns, listen, addr, "")
    }

    /// As [`Registry::start_at`], private: every request needs `user:password` (HTTP basic
    /// auth; `htpasswd` is the bcrypt line for it).
    pub fn start_private(
        dir: &Path,
        netns: Option<&str>,
        addr: SocketAddr,
        htpasswd: &str,
    ) -> Registry {
        std::fs::create_dir_all(dir).expect("registry dir");
        let file = dir.join("htpasswd");
        std::fs::write(&file, format!("{htpasswd}\n")).expect("htpasswd");
        let auth = format!(
            "auth:\n  htpasswd:\n    realm: ferry-test\n    path: {}\n",
            file.display()
        );
        Self::start_configured(dir, netns, addr, addr, &auth)
    }

    /// `extra`: more top-level sections of the registry's configuration.
    fn start_configured(
        dir: &Path,
        netns: Option<&str>,
        listen: SocketAddr,
        addr: SocketAddr,
        extra: &str,
    ) -> Registry {
        require("docker-registry");
        std::fs::create_dir_all(dir).expect("registry dir");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}/data\nhttp:\n  addr: \"{listen}\"\n{extra}",
                dir.display()
            ),
        )
        .expect("registry config");
        let mut cmd = in_netns(netns, "docker-registry");
        cmd.arg("serve").arg(&config);
        let proc = Proc::spawn(cmd, dir.join("registry.log"));
        wait_for("the registry to listen", || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        Registry { addr, proc }
    }

    /// A pull-through cache (`proxy.remoteurl`) in `netns`, proxying `upstream`.
    pub fn start_proxy(
        dir: &Path,
        netns: &str,
        addr: SocketAddr,
        upstream: SocketAddr,
    ) -> Registry {
        require("docker-registry");
        std::fs::create_dir_all(dir).expect("cache dir");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}/data\nhttp:\n  addr: \"{addr}\"\nproxy:\n  remoteurl: http://{upstream}\n",
                dir.display()
            ),
        )
        .expect("cache config");
        let mut cmd = in_netns(Some(netns), "docker-registry");
        cmd.arg("serve").arg(&config);
        let proc = Proc::spawn(cmd, dir.join("registry.log"));
        wait_for("the cache to listen", || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        Registry { addr, proc }
    }

    /// `(remote address, method, URI)` of every request the registry has answered, once its
    /// log has stopped growing: it logs a request just after the client has its response.
    pub fn requests(&self) -> Vec<(String, String, String)> {
        let mut last = self.requests_now();
        loop {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.requests_now();
            if now.len() == last.len() {
                return now;
            }
            last = now;
        }
    }

    fn requests_now(&self) -> Vec<(String, String, String)> {
        let field = |line: &str, name: &str| {
            line.split(&format!("{name}=\""))
                .nth(1)
                .and_then(|r| r.split('"').next())
                .map(str::to_string)
                .or_else(|| {
                    line.split(&format!("{name}="))
                        .nth(1)
                        .and_then(|r| r.split(' ').next())
                        .map(str::to_string)
                })
                .unwrap_or_default()
        };
        self.proc
            .log_text()
            .lines()
            .filter(|l| l.contains("response completed"))
            .map(|l| {
                (
                    field(l, "http.request.remoteaddr"),
                    field(l, "http.request.method"),
                    field(l, "http.request.uri"),
                )
            })
            .collect()
    }

    /// Request URIs the registry has served for manifests and blobs, in order.
    pub fn served(&self) -> Vec<String> {
        self.proc
            .log_text()
            .lines()
            .filter(|l| l.contains("response completed"))
            .filter_map(|l| l.split("http.request.uri=\"").nth(1))
            .filter_map(|rest| rest.split('"').next())
            .filter(|uri| uri.contains("/manifests/") || uri.contains("/blobs/"))
            .map(str::to_string)
            .collect()
    }
}

/// An image written as an OCI layout by `tests/support/make_image.py`.
#[derive(Debug, Clone)]
pub struct Image {
    pub layout: PathBuf,
    pub tag: String,
    pub manifest: String,
    pub config: String,
    pub layers: Vec<String>,
}

impl Image {
    /// Random layers seeded by `tag`: the same tag gives the same image.
    pub fn generate(dir: &Path, tag: &str, layers: usize, bytes_per_layer: usize) -> Image {
        Self::generate_seeded(dir, tag, layers, bytes_per_layer, tag)
    }

    /// As [`Image::generate`] with another seed: a different image under the same tag.
    pub fn generate_seeded(
        dir: &Path,
        tag: &str,
        layers: usize,
        bytes_per_layer: usize,
        seed: &str,
    ) -> Image {
        require("python3");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/make_image.py");
        let out = Command::new("python3")
            .arg(script)
            .arg(dir)
            .arg(tag)
            .arg(layers.to_string())
            .arg(bytes_per_layer.to_string())
            .arg(seed)
            .output()
            .expect("run make_image.py");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let manifest = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let image = Image {
            layout: dir.to_path_buf(),
            tag: tag.to_string(),
            config: String::new(),
            layers: Vec::new(),
            manifest,
        };
        let parsed = oci_spec::image::ImageManifest::from_reader(&image.blob(&image.manifest)[..])
            .expect("an OCI image manifest");
        let config = parsed.config().digest().to_string();
        let layers = parsed
            .layers()
            .iter()
            .map(|l| l.digest().to_string())
            .collect();
        Image {
            config,
            layers,
            ..image
        }
    }

    /// The bytes of a blob of this image, from the layout on disk.
    pub fn blob(&self, digest: &str) -> Vec<u8> {
        let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
        std::fs::read(self.layout.join("blobs/sha256").join(hex)).expect("blob in layout")
    }

    /// Every digest: manifest, config, layers.
    pub fn digests(&self) -> Vec<String> {
        let mut all = vec![self.manifest.clone(), self.config.clone()];
        all.extend(self.layers.iter().cloned());
        all
    }

    /// Pushes with skopeo to `<registry>/<repo>:<tag>`; digests are kept.
    pub fn push(&self, registry: SocketAddr, repo: &str) {
        self.push_as(registry, repo, None)
    }

    /// As [`Image::push`], with `user:password` for the registry when given.
    pub fn push_as(&self, registry: SocketAddr, repo: &str, user: Option<&str>) {
        require("skopeo");
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--all", "--dest-tls-verify=false"]);
        if let Some(user) = user {
            cmd.arg(format!("--dest-creds={user}"));
        }
        let out = cmd
            .arg(format!("oci:{}:{}", self.layout.display(), self.tag))
            .arg(format!("docker://{registry}/{repo}:{}", self.tag))
            .output()
            .expect("run skopeo");
        assert!(
            out.status.success(),
            "skopeo: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The real `ferry run` binary against a test containerd.
#[derive(Debug)]
pub struct Ferry {
    pub mirror: SocketAddr,
    pub metrics: SocketAddr,
    pub hosts_dir: PathBuf,
    pub proc: Proc,
}

impl Ferry {
    pub fn bin() -> PathBuf {
        PathBuf::from(env!("CARGO_BIN_EXE_ferry"))
    }

    /// `ferry run` against `containerd`, in its network namespace, state under `dir`, with
    /// `extra` flags (which may replace `--data-dir`).
    pub fn command(
        dir: &Path,
        containerd: &Containerd,
        mirror: SocketAddr,
        metrics: SocketAddr,
        extra: &[&str],
    ) -> Command {
        let mut cmd = in_netns(
            containerd.netns.as_deref(),
            Self::bin().to_str().expect("utf-8 path"),
        );
        cmd.arg("run")
            .arg("--containerd-socket")
            .arg(&containerd.socket)
            .arg("--containerd-content-dir")
            .arg(containerd.content_dir())
            .arg("--containerd-config")
            .arg(&containerd.config)
            .arg("--hosts-dir")
            .arg(&containerd.hosts_dir)
            .arg("--mirror-addr")
            .arg(mirror.to_string())
            .arg("--metrics-addr")
            .arg(metrics.to_string());
        // Tests read debug lines; a benchmark passes its own level (debug costs time).
        // `FERRY_TEST_LOG` (a filter, `debug,hyper=trace`) looks closer at a failing test.
        if !extra.contains(&"--log-level") {
            let level = std::env::var("FERRY_TEST_LOG").unwrap_or_else(|_| "debug".into());
            cmd.args(["--log-level", &level]);
        }
        if !extra.contains(&"--data-dir") {
            cmd.arg("--data-dir").arg(dir.join("ferry-data"));
        }
        cmd.args(extra);
        cmd
    }

    /// Starts `ferry run` for `containerd` (which may be stopped), waits until it listens.
    pub fn start(dir: &Path, containerd: &Containerd, extra: &[&str]) -> Ferry {
        Self::start_under(dir, containerd, extra, &[])
    }

    /// As [`Ferry::start`], run by `wrapper` (e.g. `prlimit --nofile=1024:1024 --`).
    pub fn start_under(
        dir: &Path,
        containerd: &Containerd,
        extra: &[&str],
        wrapper: &[&str],
    ) -> Ferry {
        let mirror = free_addr();
        let metrics = free_addr();
        let mut cmd = Self::command(dir, containerd, mirror, metrics, extra);
        if let Some((program, args)) = wrapper.split_first() {
            let mut wrapped = Command::new(program);
            wrapped
                .args(args)
                .arg(cmd.get_program())
                .args(cmd.get_args());
            cmd = wrapped;
        }
        let proc = Proc::spawn(cmd, dir.join("ferry.log"));
        // The ops address is bound after the mirror and the hosts.toml entries: once it
        // answers, both are in place.
        wait_for("ferry to listen", || {
            std::net::TcpStream::connect(mirror).is_ok()
                && std::net::TcpStream::connect(metrics).is_ok()
        });
        Ferry {
            mirror,
            metrics,
            hosts_dir: containerd.hosts_dir.clone(),
            proc,
        }
    }

    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://{}{path_and_query}", self.mirror)
    }

    pub fn ready(&self) -> bool {
        http_status(&format!("http://{}/readyz", self.metrics)) == Some(200)
    }
}

/// A blocking HTTP GET's status, `None` when the connection fails.
pub fn http_status(url: &str) -> Option<u16> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async { reqwest::get(url).await.ok().map(|r| r.status().as_u16()) })
}

/// A path with, for files, its bytes and mode (`None` for directories).
pub type Entry = (PathBuf, Option<(Vec<u8>, u32)>);

/// A snapshot of every file (path -> bytes and mode) and directory under `root`.
pub fn snapshot(root: &Path) -> Vec<Entry> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let path = entry.expect("entry").path();
            let rel = path.strip_prefix(root).expect("under root").to_path_buf();
            if path.is_dir() {
                stack.push(path);
                out.push((rel, None));
            } else {
                let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
                out.push((rel, Some((std::fs::read(&path).expect("read"), mode))));
            }
        }
    }
    out.sort();
    out
}

/// A finished HTTP exchange.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    }

    /// The `errors[0].code` of an OCI error body.
    pub fn error_code(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            panic!(
                "not a JSON error body: {:?}",
                String::from_utf8_lossy(&self.body)
            )
        });
        v["errors"][0]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// A blocking request with optional headers.
pub fn http(method: &str, url: &str, headers: &[(&str, &str)]) -> Resp {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let client = reqwest::Client::new();
        let mut req = client.request(method.parse().expect("method"), url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("{method} {url} body: {e}"))
            .to_vec();
        Resp {
            status,
            headers,
            body,
        }
    })
}

pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}

/// Sends a request line verbatim (no URL normalisation, unlike an HTTP client library) and
/// returns the status code and body.
pub fn raw_request(addr: SocketAddr, method: &str, target: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (status, body)
}
