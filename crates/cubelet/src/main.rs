//! The `cubelet` node agent: parses flags and config, builds the app, serves
//! CRI until SIGTERM/SIGINT, and exits with a code that says what happened
//! (0 clean, 1 runtime failure, 2 bad configuration).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::EnvFilter;

/// Command-line flags.
#[derive(Debug, Parser)]
#[command(
    name = "cubelet",
    version,
    about = "Kubernetes node agent serving CRI over a workflow engine"
)]
struct Args {
    /// Configuration file.
    #[arg(long, default_value = "/etc/cubelet/config.yaml")]
    config: PathBuf,
    /// Drop-in directory (`*.yaml`, applied in name order); default `config.d`
    /// beside the configuration file.
    #[arg(long)]
    config_dir: Option<PathBuf>,
    /// Check the configuration, then the node against it (runtime
    /// binaries, the containerd socket, registry host configs, the bridge
    /// subnet), print one line per check and exit: 0 all passed, 1 one
    /// failed, 2 the configuration is invalid.
    #[arg(long)]
    check_config: bool,
    /// Log format: `text` (one line per event) or `json` (one object per
    /// line); default `CUBELET_LOG_FORMAT`, else `text`. Which events are
    /// logged: `CUBELET_LOG` (`info`, `debug`, `info,cubelet_runtime=debug`).
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// A subcommand instead of running the agent.
    #[command(subcommand)]
    command: Option<Command>,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines, coloured only on a terminal.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `--log-format`, else `CUBELET_LOG_FORMAT`, else text.
fn log_format(flag: Option<LogFormat>) -> Result<LogFormat, String> {
    if let Some(f) = flag {
        return Ok(f);
    }
    match std::env::var("CUBELET_LOG_FORMAT").as_deref() {
        Err(_) | Ok("") | Ok("text") => Ok(LogFormat::Text),
        Ok("json") => Ok(LogFormat::Json),
        Ok(other) => Err(format!(
            "CUBELET_LOG_FORMAT={other:?} is not a log format (text or json)"
        )),
    }
}

/// Installs the global subscriber: `CUBELET_LOG` (else `RUST_LOG`, else
/// `info`) filters, `CUBELET_LOG_SPANS=1` logs spans as they close.
fn init_logging(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("CUBELET_LOG")
                .or_else(|_| EnvFilter::try_from_default_env())
                .unwrap_or_else(|_| EnvFilter::new("info")),
        )
        // CUBELET_LOG_SPANS=1 logs each enabled span as it closes, with its
        // busy and idle time: where a CRI call's time goes (docs/performance.md,
        // "Where a call's time goes").
        .with_span_events(if std::env::var_os("CUBELET_LOG_SPANS").is_some() {
            FmtSpan::CLOSE
        } else {
            FmtSpan::NONE
        })
        .with_writer(std::io::stderr);
    match format {
        // Colour only on a terminal: journald, kubectl logs and log files
        // get plain text.
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

/// A single-threaded async runtime for a one-shot command; on failure the
/// error is printed under `who` and the exit code returned.
fn small_runtime(who: &str) -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("{who}: cannot start the async runtime: {e}");
            ExitCode::from(1)
        })
}

/// Runs `cubelet --check-config` against the node: one line per check.
fn check_node(config: &cubelet::config::Config) -> ExitCode {
    let runtime = match small_runtime("cubelet") {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let findings = runtime.block_on(cubelet::check::run(config));
    println!("configuration ok");
    for f in &findings {
        println!("{f}");
    }
    if findings.iter().all(|f| f.outcome.is_ok()) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Subcommands; without one, `cubelet` runs the agent.
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Talks to a running agent's admin API (flows, limits, sandboxes, gc).
    Ctl(cubelet::ctl::CtlArgs),
    /// Removes what Cubelet left on this host: its containerd namespace and
    /// every object in it, mounts under its state and root directories, the
    /// bridge and its nft table, the CRI socket, the state and root
    /// directories (`--config` says where; defaults if the file is gone).
    /// Files under /etc are left alone. Refuses while an agent is running.
    Uninstall(UninstallArgs),
}

/// Arguments of `cubelet uninstall`.
#[derive(Debug, clap::Args)]
struct UninstallArgs {
    /// Configuration file of the Cubelet to remove (default: the agent's
    /// `--config`, /etc/cubelet/config.yaml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Its drop-in directory (default `config.d` beside the file).
    #[arg(long)]
    config_dir: Option<PathBuf>,
}

/// Runs `cubelet uninstall`: prints what was removed and what failed
/// (exit code 1 if anything did, 2 for a bad configuration).
fn uninstall(args: &Args, own: &UninstallArgs) -> ExitCode {
    let file = own.config.as_deref().unwrap_or(&args.config);
    let dir = own.config_dir.as_deref().or(args.config_dir.as_deref());
    let config = match cubelet::uninstall::load_config(file, dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "cubelet uninstall: invalid configuration: {}",
                cubelet_engine::chain(&e)
            );
            return ExitCode::from(2);
        }
    };
    match cubelet::uninstall::run(&config) {
        Ok(report) => {
            for line in &report.removed {
                println!("removed {line}");
            }
            for e in &report.failed {
                eprintln!("cubelet uninstall: {}", cubelet_engine::chain(e));
            }
            if report.failed.is_empty() {
                println!("cubelet uninstall: done");
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("cubelet uninstall: {}", cubelet_engine::chain(&e));
            ExitCode::from(1)
        }
    }
}

/// Runs `cubelet ctl …`: prints the answer, or the error (exit code 1).
fn ctl(args: &cubelet::ctl::CtlArgs) -> ExitCode {
    let runtime = match small_runtime("cubelet ctl") {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(cubelet::ctl::run(args)) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cubelet ctl: {}", cubelet_engine::chain(&e));
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    // Before any thread exists (src/malloc.rs says why).
    let arenas_limited = cubelet::malloc::limit_arenas();
    let args = Args::parse();
    if let Some(Command::Ctl(ctl_args)) = &args.command {
        return ctl(ctl_args);
    }
    if let Some(Command::Uninstall(own)) = &args.command {
        return uninstall(&args, own);
    }
    match log_format(args.log_format) {
        Ok(f) => init_logging(f),
        Err(e) => {
            eprintln!("cubelet: {e}");
            return ExitCode::from(2);
        }
    }

    let config = match cubelet::config::Config::load(&args.config, args.config_dir.as_deref())
        .and_then(|c| {
            c.flows.validate(cubelet::PROVIDERS)?;
            Ok(c)
        }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "cubelet: invalid configuration: {}",
                cubelet_engine::chain(&e)
            );
            return ExitCode::from(2);
        }
    };
    if arenas_limited {
        tracing::debug!(
            arenas = cubelet::malloc::ARENAS,
            "malloc arenas limited (MALLOC_ARENA_MAX overrides)"
        );
    }
    if args.check_config {
        return check_node(&config);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cubelet: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(cubelet::run(config));
    // A blocking thread stuck in a system call (a read on something a pod
    // controls that no timeout could interrupt) must not keep the agent
    // from exiting: the runtime is given a moment, then left behind.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Each cause once: many errors print their source in their own
            // text, which `{e:#}` would print again.
            eprintln!("cubelet: {}", cubelet_engine::chain(&*e));
            ExitCode::from(1)
        }
    }
}
