//! Thin: parse the command line, set up logging, call the library, map errors to exit codes.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use ferry::app::AppError;
use ferry::cli::{Cli, Command, LoadError, WaitCleanupArgs};
use ferry::config::{Config, LogFormat};
use ferry::containerd_config::{self, Action};

/// `EX_USAGE` from sysexits.h: a bad configuration value.
const EXIT_CONFIG: u8 = 64;
const EXIT_FAILURE: u8 = 1;

fn main() -> ExitCode {
    let cli = match Cli::load(std::env::args_os()) {
        Ok(cli) => cli,
        Err(LoadError::Usage(e)) => e.exit(),
        Err(LoadError::Config(e)) => {
            eprintln!("ferry: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if matches!(cli.command, Command::Version) {
        println!("ferry {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let config = cli.settings;
    init_logging(&config);
    let result = match &cli.command {
        Command::Run => run(config),
        Command::Configure => configure(&config),
        Command::Cleanup => cleanup(&config),
        Command::Version => Ok(()),
        Command::WaitCleanup(args) => wait_cleanup(args),
        Command::Status { json } => status(&config, *json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if matches!(e.downcast_ref(), Some(AppError::Secret(_))) => {
            eprintln!("ferry: invalid configuration: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("ferry: {e:#}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::new(ferry::config::log_filter(&config.log_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match config.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run(config: Config) -> anyhow::Result<()> {
    ferry::net::budget::raise_open_file_limit();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(ferry::app::run(config, shutdown_signal()))?;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers the default action (exit) still applies; wait forever.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn wait_cleanup(args: &WaitCleanupArgs) -> anyhow::Result<()> {
    use ferry::kubernetes::{self, cleanup_wait};
    let timeout = args.timeout;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let client = kubernetes::client().await?;
        let settings = cleanup_wait::WaitSettings {
            namespace: kubernetes::namespace(args.namespace.as_deref(), &client),
            daemonset: args.daemonset.clone(),
            timeout,
            poll: WAIT_CLEANUP_POLL,
        };
        match cleanup_wait::wait(client, &settings, shutdown_signal()).await? {
            cleanup_wait::Finished::Done => Ok(()),
            cleanup_wait::Finished::GaveUp => anyhow::bail!(
                "cleanup did not finish on every node within {}; its DaemonSet was deleted (nodes it did not reach keep Ferry's hosts.toml entries: run `ferry cleanup` there)",
                humantime::format_duration(timeout)
            ),
        }
    })
}

/// How often `wait-cleanup` looks at the DaemonSet: a GET per 2 s for a few minutes at most.
const WAIT_CLEANUP_POLL: std::time::Duration = std::time::Duration::from_secs(2);

/// `ferry status`: asks the running Ferry (its ops listener's `/status`).
fn status(config: &Config, json: bool) -> anyhow::Result<()> {
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let addr = config.metrics_addr;
    // A wildcard listener takes IPv4 whatever its family (`[::]` is dual-stack, or fell back
    // to 0.0.0.0 on a host without IPv6), and every host has 127.0.0.1.
    let ip = if addr.ip().is_unspecified() {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        addr.ip()
    };
    let url = format!("http://{}/status", SocketAddr::new(ip, addr.port()));
    let runtime = tokio::runtime::Runtime::new()?;
    let body = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(5))
            .no_proxy()
            .build()?;
        client
            .get(&url)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await
    });
    let body = body.map_err(|e| {
        anyhow::anyhow!("no Ferry answers at {url} ({e}): is it running on this node, and is --metrics-addr the one it uses?")
    })?;
    if json {
        println!("{body}");
        return Ok(());
    }
    let status: ferry::ops::status::Status = serde_json::from_str(&body)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    print!("{}", status.text(now));
    Ok(())
}

fn configure(config: &Config) -> anyhow::Result<()> {
    // The client needs a runtime even to be built; containerd is asked its version only for
    // an IPv6 mirror URL.
    let outcomes = tokio::runtime::Runtime::new()?.block_on(async {
        let store = ferry::store::containerd::ContainerdStore::new(
            config.containerd_socket.clone(),
            config.containerd_namespace.clone(),
            config.containerd_content_dir.clone(),
        );
        ferry::app::configure_hosts(config, &store).await
    })?;
    print_outcomes(&outcomes);
    for warning in containerd_config::preflight::check(&config.containerd_config, &config.hosts_dir)
    {
        eprintln!("warning: {warning}");
    }
    failures(&outcomes)
}

/// An error (exit 1) naming the files that could not be written, after all the others were
/// done.
fn failures(outcomes: &[containerd_config::Outcome]) -> anyhow::Result<()> {
    let failed: Vec<String> = outcomes
        .iter()
        .filter(|o| matches!(o.action, Action::Failed(_)))
        .map(|o| o.path.display().to_string())
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "{} hosts.toml file(s) could not be written (the others were): {}",
        failed.len(),
        failed.join(", ")
    )
}

fn cleanup(config: &Config) -> anyhow::Result<()> {
    let outcomes = containerd_config::cleanup(&config.hosts_dir)?;
    if outcomes.is_empty() {
        println!("nothing of ferry's in {}", config.hosts_dir.display());
    }
    print_outcomes(&outcomes);
    release_holds(config);
    failures(&outcomes)
}

/// Ends Ferry's containerd lease. containerd away is no failure: the lease expires on its own.
fn release_holds(config: &Config) {
    let ended = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|rt| {
            rt.block_on(async {
                // The channel is made inside the runtime, which it needs.
                let store = ferry::store::containerd::ContainerdStore::new(
                    config.containerd_socket.clone(),
                    config.containerd_namespace.clone(),
                    config.containerd_content_dir.clone(),
                );
                let end = ferry::store::Holder::end(&store);
                Ok(tokio::time::timeout(Duration::from_secs(10), end).await??)
            })
        });
    let socket = config.containerd_socket.display();
    let days = ferry::store::containerd::lease::EXPIRY.as_secs() / 86_400;
    match ended {
        Ok(0) => println!("containerd {socket}: no lease of ferry's"),
        Ok(n) => println!("containerd {socket}: ferry's lease removed ({n})"),
        Err(e) => println!(
            "containerd {socket}: not reached ({e}); ferry's lease, if any, expires on its own within {days} days"
        ),
    }
}

fn print_outcomes(outcomes: &[containerd_config::Outcome]) {
    for o in outcomes {
        let what = match &o.action {
            Action::Created => "created".to_string(),
            Action::Updated => "updated".to_string(),
            Action::Unchanged => "unchanged".to_string(),
            Action::OperatorEntry => "unchanged (already lists this mirror)".to_string(),
            Action::Restored => "restored".to_string(),
            Action::Removed => "removed".to_string(),
            Action::Skipped(reason) => format!("SKIPPED: {reason}"),
            Action::Failed(reason) => format!("FAILED: {reason}"),
        };
        println!("{}: {what}", o.path.display());
    }
}
