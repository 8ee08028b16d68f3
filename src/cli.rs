//! The command line, with the environment and the `--config` file under it: flag >
//! environment > file > default. Every setting (`config::Config`) is a flag `--<key>`, an
//! environment variable `FERRY_<KEY>` and a file key; a bad value from any of them is one line
//! naming its key.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{ArgAction, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{self, Config, ConfigError, err};

#[derive(Debug, Parser)]
#[command(
    name = "ferry",
    version,
    about = "Peer-to-peer OCI registry mirror for Kubernetes nodes",
    // A flag given twice takes its last value, as with most daemons: the chart's `extraArgs`
    // come after the flags it sets, so repeating one overrides it instead of crash-looping
    // the pod on "cannot be used multiple times".
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// TOML file with any of the settings as keys (flag beats env beats file beats default)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Replaced by --resolve-tags; kept only to say so
    #[arg(long, hide = true)]
    pub resolve_latest: Option<String>,
    #[command(flatten)]
    pub settings: Config,
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Run the daemon: write the mirror config, serve the registry API.
    Run,
    /// Write the containerd mirror config (hosts.toml) and exit.
    Configure,
    /// Remove exactly what ferry added to the hosts dir; restore the rest byte-for-byte.
    Cleanup,
    /// Print the version.
    Version,
    /// Show what the Ferry on this node is doing: readiness and each condition, problems,
    /// peers, what it advertises, where its containerd's pulls came from, its last pulls.
    /// Asks the running Ferry at its `--metrics-addr` (a wildcard means this host).
    Status {
        /// Print the JSON `/status` serves instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Wait until the uninstall hook's cleanup DaemonSet has run on every node (the chart's
    /// hook Job runs this); delete it if that does not happen in time.
    WaitCleanup(WaitCleanupArgs),
}

#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct WaitCleanupArgs {
    /// The cleanup DaemonSet's name.
    #[arg(long, value_name = "NAME")]
    pub daemonset: String,
    /// Its namespace [default: the client's, i.e. the pod's own in a cluster]
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// How long to wait before giving up (and deleting the DaemonSet).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = config::duration)]
    pub timeout: std::time::Duration,
}

/// Why the command line was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A bad value: one line, exit status 64.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Help, version, an unknown flag: clap prints it and picks the exit status.
    #[error(transparent)]
    Usage(clap::Error),
}

impl Cli {
    /// Parses `args` (the program name first) with the environment and the file under them.
    /// The file's values are handed to clap as flags placed before the real ones, for the
    /// settings that no flag or variable gave: one parser and one precedence for every source.
    pub fn load(args: impl IntoIterator<Item = impl Into<OsString>>) -> Result<Cli, LoadError> {
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        let first = command().try_get_matches_from(&args).map_err(value_error)?;
        if first.contains_id("resolve_latest") {
            let (key, message) = config::REPLACED;
            return Err(err(key, message).into());
        }
        let mut merged = args[..1.min(args.len())].to_vec();
        if let Some(path) = first.get_one::<PathBuf>("config") {
            let known: Vec<String> = Config::keys().into_iter().map(|(k, _)| k).collect();
            for (key, text) in config::read_file(path, &known)? {
                let source = first.value_source(&key.replace('-', "_"));
                if !matches!(
                    source,
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                ) {
                    merged.push(format!("--{key}={text}").into());
                }
            }
        }
        merged.extend(args.into_iter().skip(1));
        let matches = command()
            .try_get_matches_from(merged)
            .map_err(value_error)?;
        let mut cli = Cli::from_arg_matches(&matches).map_err(value_error)?;
        cli.settings = cli.settings.check()?;
        Ok(cli)
    }
}

/// The settings `ferry run <args>` would run with: for tests and tools.
pub fn settings<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Config, LoadError> {
    let argv = ["ferry", "run"].into_iter().chain(args);
    Ok(Cli::load(argv)?.settings)
}

/// Every setting takes a value (`--coalesce false`), booleans too; may come after the
/// subcommand; and has an environment variable.
fn command() -> clap::Command {
    Cli::command().mut_args(|arg| {
        let id = arg.get_id().as_str().to_string();
        if matches!(id.as_str(), "help" | "version") {
            return arg;
        }
        arg.global(true)
            .action(ArgAction::Set)
            .env(format!("FERRY_{}", id.to_uppercase()))
    })
}

/// A bad value becomes `<key>: <what is wrong>`; anything else stays clap's.
fn value_error(e: clap::Error) -> LoadError {
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return LoadError::Usage(e);
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return LoadError::Usage(e);
    };
    let key = arg
        .trim_start_matches('-')
        .split([' ', '='])
        .next()
        .unwrap_or_default();
    let message = match std::error::Error::source(&e) {
        Some(source) => source.to_string(),
        None => match e.get(ContextKind::InvalidValue) {
            Some(ContextValue::String(v)) => format!("{v:?} is not a valid value"),
            _ => "not a valid value".to_string(),
        },
    };
    LoadError::Config(err(key, message))
}
